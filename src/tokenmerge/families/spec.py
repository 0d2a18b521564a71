"""A model family as data: how it is recognised, where its token grid comes from, which blocks and sub-modules
are merged and how their tokens are laid out. The engine (``tokenmerge.engine``) reads these records and has no
family-specific code; ``register_family`` adds a user's own.

A family is matched by structure (attributes, forward argument names, config keys), never by importing diffusers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from .predicates import Predicate, block_has, config, config_has, config_is, has, has_list, takes  # noqa: F401

__all__ = [
    "Arg", "Whole", "PerToken", "ArgsGrid", "ShapesGrid", "GridSource", "grid_rank", "Family", "Refused", "Blocks",
    "Target", "Rotary", "Mask", "LatentGrid", "IdsGrid", "BlockSite",
    "SELF", "CROSS", "MLP", "JOINT", "has", "has_list", "takes", "config_has", "block_has", "Predicate",
    "TEXT_NONE", "TEXT_BEFORE", "TEXT_AFTER", "TEXT_STREAM",
]

# What a sub-module of a block is (the kind decides how its input is merged and its output unmerged):
SELF = "self"    # self-attention over the image tokens (keys/values may be pooled by ToDo)
CROSS = "cross"  # cross-attention: its queries are image tokens, its keys/values text
MLP = "mlp"      # a token-wise feed-forward
JOINT = "joint"  # attention over image and text tokens in one call (SD3, Flux): image merged, text whole

# Where the text tokens sit in a joint sequence (a block's input or a joint target's ``hidden_states``):
TEXT_NONE = "none"      # no text in this sequence
TEXT_BEFORE = "before"  # [text, image] (Flux single-stream)
TEXT_AFTER = "after"    # [image, text] (HunyuanVideo single-stream)
TEXT_STREAM = "stream"  # a separate argument (``encoder_hidden_states``): the sequence is the image's alone


@dataclass(frozen=True)
class Arg:
    """A ``forward`` argument: by keyword ``name``, else at its position in the signature (the engine resolves it
    against a module: ``engine.discover.bind``).

    ``scale``: for a timestep, the factor that brings it to the 0..``num_train_timesteps`` scale (1000 for
    models called with timesteps in 0..1). ``log_sigma``: for a timestep that is ``log_sigma * log(sigma)`` (EDM's
    preconditioned noise ``c_noise``, 0.25: Cosmos 1.0), whose fraction of the way to noise is then
    ``sigma / (1 + sigma)`` (the 0..1 timestep of the flow models); ``scale`` is not used then.
    """

    name: str
    scale: float = 1.0
    fallback_index: int | None = None  # position to use when no parameter has these names (e.g. LDM's ``x``)
    also: tuple[str, ...] = ()  # other names it goes by, tried in order after ``name``
    reverse: bool = False  # a timestep that rises as denoising goes on (Mochi is called with 1000 - t)
    log_sigma: float = 0.0  # nonzero: the timestep is log_sigma * log(sigma) (EDM's c_noise: 0.25)


# ---- token layout -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rotary:
    """Rotary position embeddings passed to a joint target as keyword ``kwarg``.

    Args:
        kwarg: the keyword (``image_rotary_emb``, ``rotary_emb``, ``freqs_cis``...).
        layout: ``"tensor"`` (one tensor, or a tuple/list of tensors such as (cos, sin), every one indexed the
            same way), ``"image_text_pair"`` (``(image_freqs, text_freqs)``: only the first is the image's) or
            ``"tables_positions"`` (``(tables, positions)``: per-axis frequency tables, which pass whole, and
            per-token position ids, indexed along ``token_axis``: Allegro's ``((t, h, w) (cos, sin) tables,
            (t, h, w) positions (1, N))``, ``token_axis=-1``).
        token_axis: the axis of the token rows in each tensor (``-2`` for diffusers' (S, D) and (B, H, S, D)).
        text: where the text rows are in the tensor(s): ``TEXT_BEFORE``, ``TEXT_AFTER`` or ``TEXT_NONE`` (the
            rotary covers the image tokens only). The text rows are whatever rows are not the image's.
    """

    kwarg: str
    layout: str = "tensor"
    token_axis: int = -2
    text: str = TEXT_BEFORE
    also: tuple[str, ...] = ()  # other names the argument goes by (tried after ``kwarg``)
    same: tuple[str, ...] = ()  # other arguments that carry the very same table (Lumina-Next's key_rotary_emb)


@dataclass(frozen=True)
class Mask:
    """An attention mask passed to a target as ``kwarg``, over its query rows and/or key columns: the image part
    of every axis that spans the tokens follows the merge (a merged token keeps its first token's row/column).

    Exact when the tokens merged together have the same mask entries (padding masks over text, masks that are
    constant within a frame when each frame merges within itself). ``text``: where the text rows are.
    """

    kwarg: str = "attention_mask"
    text: str = TEXT_NONE
    image: bool = True  # False: the mask covers the text only (Mochi) and passes whole
    same: tuple[str, ...] = ()  # other masks over the same tokens, which follow alike (Qwen-Image 2.1's key_valid)
    tokens: bool = False  # one entry per token that the block's own code reads (Bria FIBO 2's noise_mask picks each
    # token's modulation), not an attention mask: token reuse with keys="kept" takes the recomputed tokens' entries


@dataclass(frozen=True)
class Target:
    """A sub-module of a block to merge around.

    Args:
        attr: its attribute name on the block.
        kind: ``SELF``, ``CROSS``, ``MLP`` or ``JOINT``.
        text: for ``JOINT``: where the text is in its ``hidden_states`` (``TEXT_STREAM``: a separate argument).
        rotary: the rotary embeddings the sub-module takes, whose image rows follow the merged tokens.
        mask: the attention mask the sub-module may take, which then follows the merged tokens (a target
            without one refuses a mask over merged tokens).
        keys: for ToDo, where the text sits in the key sequence of the attention call (``TEXT_BEFORE``,
            ``TEXT_AFTER``, ``TEXT_NONE``): ToDo then pools the image keys/values inside that call, after the
            rotary embedding (``engine/inside.py``). ``None``: a ``SELF`` target takes pooled tokens as its
            ``encoder_hidden_states``; a ``JOINT`` one refuses ToDo.
        output_image: for ``JOINT`` returning a tuple: the index of the image output (the rest passes whole).
        same: arguments that carry the very tokens of its input (Lumina's attention is called with
            ``encoder_hidden_states=hidden_states``): they are given the merged input too.
        refuse: a reason this sub-module cannot take merged tokens (e.g. a feed-forward that reshapes tokens
            to the grid); asking to merge it is an error that gives the reason.
        per_head: its output is per attention head, ``(B, N, heads, head_dim)`` (Lumina-Next's attention): unmerged
            as ``(B, N, heads * head_dim)``.
        reuse: a reason token reuse (``apply_reuse``) cannot run this sub-module on some tokens' rows alone (e.g.
            an attention that computes a feed-forward of every token inside its call); such a block is refused.
        query: for ``SELF``/``JOINT``: the attention's query projection, a sub-module (``to_q`` in diffusers) called
            on the rows of its ``hidden_states``: token reuse computes it for the recomputed tokens only (their
            queries are the only ones attended). Where the module has none (fused projections), nothing changes.
    """

    attr: str
    kind: str
    text: str = TEXT_STREAM
    rotary: Rotary | None = None
    mask: Mask | None = None
    keys: str | None = None
    output_image: int = 0
    same: tuple[str, ...] = ()
    refuse: str | None = None
    per_head: bool = False
    reuse: str | None = None
    query: str | None = "to_q"


@dataclass(frozen=True)
class Blocks:
    """A list of transformer blocks (``attr``: a ``ModuleList`` on the denoiser) and their targets.

    Args:
        attr: the block list's attribute name, or a dotted path to it (``mode_blocks.image``: a ``ModuleDict``
            entry).
        targets: the sub-modules to merge around; one that a block lacks is skipped for that block.
        text: where text sits in the block's input ``hidden_states`` when it is longer than the image grid
            (older diffusers gave Flux's single-stream blocks [text, image]).
        requires: sub-modules every block must have for this family (a block without them: not this family).
        whole: how the block's call is laid out, for ``scope="block"`` (merging the whole block); ``None``: that
            scope is refused for these blocks.
        refuse_if: ``(argument, reason)`` pairs: a call of the block that gets the argument (not ``None``) is
            refused with the reason, in every scope (Lumina2's joint blocks get a mask only when the samples'
            captions differ in length, and then each sample's image sits at its own offset).
        seq_first: the block's ``hidden_states`` are sequence-first ``(S, B, D)`` (ERNIE-Image), its targets'
            batch-first; only targets that take batch-first tokens may be declared, and ``whole`` must be None.
        inner: each entry of the list wraps its block in this attribute (HiDream's ``HiDreamBlock.block``).
        chunk_attr: the block attribute that chunks its feed-forward over the tokens (diffusers'
            ``BasicTransformerBlock._chunk_size``): while ``ff`` is merged, the block runs it whole (chunks of merged
            tokens cannot be merged on their own).
        pointwise: token-wise sub-modules of the block outside its targets, each as a ``Target`` of kind ``MLP``
            (its ``text``: where text rows sit in its input), e.g. Flux's single-stream ``proj_mlp`` and
            ``proj_out``. ToMe leaves them alone; token reuse runs them on the recomputed tokens' rows only.
    """

    attr: str
    targets: tuple[Target, ...]
    text: str = TEXT_NONE
    requires: tuple[str, ...] = ()
    whole: "Whole | None" = None
    refuse_if: tuple[tuple[str, str], ...] = ()
    seq_first: bool = False
    inner: str = ""
    chunk_attr: str | None = None
    pointwise: tuple[Target, ...] = ()

    def __post_init__(self):
        if self.seq_first and self.whole is not None:
            raise ValueError(f"Blocks({self.attr!r}): whole-block merging of sequence-first blocks is not supported")


@dataclass(frozen=True)
class PerToken:
    """A block argument that may carry one entry per token (Wan 2.2 TI2V's ``temb``): a tensor of at least
    ``min_dim`` dimensions whose ``axis`` spans the tokens (the image's, or the whole sequence's)."""

    name: str
    axis: int = 1
    min_dim: int = 2

    def holds(self, value, image: int, total: int) -> bool:
        """Whether ``value`` carries one entry per token."""
        return isinstance(value, torch.Tensor) and value.dim() >= max(self.min_dim, self.axis + 1) and \
            value.shape[self.axis] in (image, total)


@dataclass(frozen=True)
class Whole:
    """A block's call, for whole-block merging (``scope="block"``): where its output holds the image tokens and
    which of its arguments are per-token and must follow the merge.

    Args:
        output: the index of the image stream when the block returns a tuple (a block that returns a tensor
            returns the sequence itself).
        rotary: the block's rotary argument, whose image rows follow the merged tokens.
        mask: the block's attention mask argument, likewise.
        per_token: other arguments that may carry one entry per token (``PerToken``, or a name: token axis 1),
            such as Wan 2.2 TI2V's ``temb``: a call where they do is refused (their merge is not declared).
        refuse_if: arguments that, when given, make the call refuse it (HunyuanVideo's token-replace
            ``first_frame_num_tokens``: a count of tokens the merge would change).
        text: the block's separate text-stream argument (Flux.1's ``encoder_hidden_states``), whose tokens token
            reuse's ``text=True`` recomputes in part; its rows lead the attention's keys and the rotary table.
        text_output: the index of that stream in the block's output tuple.
    """

    output: int | None = None
    rotary: "Rotary | None" = None
    mask: "Mask | None" = None
    per_token: tuple = ()
    refuse_if: tuple[str, ...] = ()  # arguments whose presence (not None) refuses it (counts of tokens, ...)
    text: str | None = None
    text_output: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "per_token", tuple(p if isinstance(p, PerToken) else PerToken(p)
                                                    for p in self.per_token))


@dataclass
class BlockSite:
    """A block found in a denoiser. ``level`` counts the 2x downsamplings above its resolution (0 = full)."""

    path: str
    module: nn.Module
    level: int
    targets: tuple[Target, ...]
    text: str = TEXT_NONE
    whole: Whole | None = None
    refuse_if: tuple[tuple[str, str], ...] = ()
    seq_first: bool = False
    chunk_attr: str | None = None
    pointwise: tuple[Target, ...] = ()

    @property
    def downsample(self) -> int:
        return 2**self.level


# ---- where the token grid comes from ------------------------------------------------------------------------
@dataclass(frozen=True)
class LatentGrid:
    """The grid from a latent tensor's trailing ``rank`` axes, divided by the patch size per axis.

    ``patch``: per axis, an int, a config key (its value an int, or a tuple indexed by axis from the end;
    ``None`` reads 1) or an ``Arg``: a forward argument that chooses the patch size per call (Z-Image's
    ``patch_size``; its signature's default when not given). For video, ``rank=3`` over (frames, height, width).
    The latent may be a list of per-sample tensors of one shape (Z-Image).

    ``refs``: an argument holding reference latents (a list of tensors, or one tensor, each patched like the
    latent; ``None`` or empty: none) whose tokens follow the image's in the sequence (Bria FIBO 2's
    ``context_latents``): they pass whole, as ``trailing`` tokens.
    """

    arg: Arg = Arg("hidden_states", fallback_index=0)
    rank: int = 2
    patch: tuple = (1, 1)
    axes: tuple[int, ...] | None = None  # the latent's grid dims; None: its trailing ``rank`` dims
    refs: Arg | None = None

    def patch_sizes(self, module: nn.Module) -> tuple:
        cfg = config(module)
        sizes = []
        for axis, p in enumerate(self.patch):
            if isinstance(p, Arg):  # read per call (engine/grids.py)
                sizes.append(p)
                continue
            if isinstance(p, str):
                value = cfg.get(p)
                if isinstance(value, (tuple, list)):
                    value = value[axis - len(self.patch)] if len(value) >= len(self.patch) else value[-1]
                p = 1 if value is None else int(value)
            sizes.append(int(p))
        return tuple(sizes)


@dataclass(frozen=True)
class IdsGrid:
    """The grid from position ids ``(tokens, k)`` (Flux's ``img_ids``): the span of columns ``axes`` over the
    image's rows. Rows after them with another ``image_axis`` id are reference-image tokens (Flux Kontext, Flux.2
    edits): they, and their rotary rows, pass whole.

    Read on the host once per new ids tensor (once per generation), never per step.

    ``leading``: the ids start with rows of other tokens (Krea 2's text rows, all zero), as many as this argument
    has tokens; ``refs``: reference-image tokens follow the image's in the blocks but their ids are another
    argument (Flux 3's ``image_cond_ids``), as many as it has tokens. The token count of a tensor argument is its
    axis 0 if it has 2 dimensions (ids), else its axis 1 (batch first); a missing (``None``) one counts 0.

    ``tag``: the image's rows are where this per-token ``(B, S)`` argument equals ``tag_value`` (Ideogram 4's
    ``indicator == 2``): one contiguous run at the same place in every sample of the call; rows before it are text
    (or padding) and pass whole, rows after it are ``trailing``. Read on the host once per new tag tensor.
    """

    arg: Arg = Arg("img_ids")
    axes: tuple[int, ...] = (1, 2)
    image_axis: int | None = 0  # the image's rows share this id (reference images after them have others)
    leading: Arg | None = None
    refs: Arg | None = None
    tag: Arg | None = None
    tag_value: int = 0


@dataclass(frozen=True)
class ArgsGrid:
    """The grid from integer forward arguments, in tokens (LTX-Video: ``num_frames``, ``height``, ``width``).

    ``tokens``: the argument holding the (packed) tokens, which tells the device. ``coords``: a call that gives
    no integers may give per-token coordinates ``(B, rank, S)`` instead (LTXConditionPipeline's ``video_coords``):
    the video's tokens are then the last ones of the sequence, in raster order, and the tokens before them
    (conditioning frames appended by the pipeline) pass whole; read on the host once per coordinates tensor.
    """

    names: tuple[str, ...] = ("num_frames", "height", "width")
    tokens: Arg = Arg("hidden_states", fallback_index=0)
    coords: Arg | None = None

    @property
    def arg(self) -> Arg:
        return self.tokens


@dataclass(frozen=True)
class ShapesGrid:
    """The grid from per-sample shape lists (Qwen-Image's ``img_shapes``: ``[[(F, H, W), ...], ...]``, one list
    per sample): the generated image's shape (the first of the first sample, or its last with ``last``: Qwen-Image
    2.1 puts condition images before it), its last ``rank`` entries."""

    arg: Arg = Arg("img_shapes")
    rank: int = 2
    last: bool = False  # the generated image is the last shape (after condition images that sit before it)


GridSource = LatentGrid | IdsGrid | ArgsGrid | ShapesGrid


def grid_rank(source: GridSource) -> int:
    """The number of axes of the token grid a source gives."""
    return {IdsGrid: lambda: len(source.axes), ArgsGrid: lambda: len(source.names)}.get(
        type(source), lambda: source.rank)()


# ---- the family ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """Everything the engine needs to know about one model family.

    Args:
        name: shown by ``describe_patch`` (e.g. ``"diffusers-unet"``).
        match: a ``Predicate`` on the denoiser module; exactly one registered family matches a given model.
        grid: where the token grid comes from: ``LatentGrid``, ``IdsGrid``, ``ArgsGrid`` or ``ShapesGrid``.
        blocks: the block lists and their targets (transformers: one resolution, blocks chosen by index).
        levels: for models with resolution levels (UNets): ``levels(module, path) -> list[BlockSite]``;
            replaces ``blocks``.
        timestep: the timestep argument (with its scale to 0..1000).
        batch_pattern: one merge pattern for every sample of a call's batch (needed when tokens carry rotary
            positions or masks: a merged token has one position for all samples).
        todo_refused: ``None`` if ToDo applies to its ``SELF`` targets, else the reason it does not.
        kind: ``"unet"`` (resolution levels, attention a large share of the step) or ``"transformer"``.
        description: one line for the README's support table.
    """

    name: str
    match: Predicate
    grid: GridSource = LatentGrid()
    blocks: tuple[Blocks, ...] = ()
    levels: Callable[[nn.Module, str], list[BlockSite]] | None = None
    timestep: Arg = Arg("timestep")
    batch_pattern: bool = False
    todo_refused: str | None = None
    kind: str = "transformer"
    description: str = ""
    examples: tuple[str, ...] = field(default=())

    def find_blocks(self, module: nn.Module, path: str) -> list[BlockSite] | None:
        """The blocks of ``module`` this family patches, or ``None`` if a listed block is not of this family."""
        if self.levels is not None:
            return self.levels(module, path)
        sites = []
        for spec in self.blocks:
            seq = module
            for part in spec.attr.split("."):
                seq = getattr(seq, part, None)
            if not isinstance(seq, nn.ModuleList):
                continue
            for i, entry in enumerate(seq):
                block = getattr(entry, spec.inner, None) if spec.inner else entry
                if not isinstance(block, nn.Module) or not has(*spec.requires)(block):
                    return None
                where = f"{spec.attr}.{i}" + (f".{spec.inner}" if spec.inner else "")
                targets = tuple(t for t in spec.targets if isinstance(getattr(block, t.attr, None), nn.Module))
                sites.append(BlockSite(f"{path}.{where}" if path else where, block, 0, targets, spec.text, spec.whole,
                                       spec.refuse_if, spec.seq_first, spec.chunk_attr,
                                       tuple(t for t in spec.pointwise
                                             if isinstance(getattr(block, t.attr, None), nn.Module))))
        return sites


@dataclass(frozen=True)
class Refused:
    """A model tokenmerge recognises and refuses, with the reason (instead of the generic "cannot patch")."""

    name: str
    match: Predicate
    reason: str
