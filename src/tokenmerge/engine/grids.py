"""Reading a denoiser call's token grid from its arguments, one reader per kind of grid source.

``CallHook`` (call.py) reads a grid only when the arguments it comes from change (``GridReader.key_args``): position
ids and coordinates are read on the host once per tensor (once per generation), never per step. Under torch.compile
such a host read runs at trace time on the real tensor (a function dynamo keeps as a constant of the graph), so a
model compiles from its first call; the compiled graph keeps the grid it traced for ids of that shape.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..families.predicates import params
from ..families.spec import Arg, ArgsGrid, IdsGrid, LatentGrid, ShapesGrid
from ..merge.plan import register, traced_constant
from .call import NoGrid
from .discover import bind

__all__ = ["GridReader", "NoGrid"]


def _default(module: nn.Module, arg: Arg) -> int | None:
    """The default of the ``forward`` parameter ``arg`` names (a patch size chosen per call)."""
    import inspect

    for p in params(module):
        if p.name in (arg.name, *arg.also) and p.default is not inspect.Parameter.empty:
            return p.default
    raise TypeError(f"tokenmerge: {type(module).__name__}.forward has no {arg.name} argument with a default to read "
                    "its patch size from")


def _raster_tail(coords: torch.Tensor) -> tuple[int, ...]:
    """The grid ``(n_0, ..., n_last)`` that the last tokens of ``coords`` ``(rank, S)`` list in raster order.

    Innermost axis first: the rows of the axes inside it (``span`` tokens each, counted back from the end) that
    share the last row's inner pattern and outer coordinates, hold one value of this axis and rise from each row
    to the next. The tokens before the grid (conditioning frames at later times) break the rise.
    """
    rank, total = coords.shape
    sizes, span = [], 1
    for axis in range(rank - 1, -1, -1):
        rows = total // span
        tail = coords[:, total - rows * span:].reshape(rank, rows, span)
        last = tail[:, -1:]  # (rank, 1, span)
        others = torch.cat([tail[:axis], tail[axis + 1:]])
        like_last = (others == torch.cat([last[:axis], last[axis + 1:]])).flatten(2).all(2).all(0)
        value = tail[axis]
        steady = (value == value[:, :1]).all(1)
        rises = torch.ones_like(steady)
        rises[:-1] = value[1:, 0] > value[:-1, 0]  # the next row's value is larger
        good = (like_last & steady & rises).flip(0).int().cumprod(0)
        sizes.append(int(good.sum()))
        span *= sizes[-1]
    return tuple(reversed(sizes))


def _describe(value) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


class GridReader:
    """Reads the finest token grid of one denoiser's calls: ``read(args, kwargs) -> (grid, device, trailing)``.

    ``key_args``: the bound arguments the grid depends on, each with whether by its shape alone.
    """

    @staticmethod
    def identity(value, shaped: bool):
        """What decides a grid source argument's grid: a tensor's shape (``shaped``) or its address and shape, a plain
        value, each element of a list."""
        if isinstance(value, torch.Tensor):
            return value.shape if shaped else (value.data_ptr(), value.shape, value.device)
        if isinstance(value, (list, tuple)):
            return tuple(GridReader.identity(v, shaped) for v in value)
        return value

    def __init__(self, source, module: nn.Module):
        self.source, self.owner = source, type(module).__name__
        self.bound = [bind(arg, module) for arg in self._args(source)]
        self.patch = source.patch_sizes(module) if isinstance(source, LatentGrid) else None
        # patch sizes chosen per call by an argument (Z-Image's ``patch_size``): (axis, bound, signature default)
        self._patch_args = [(axis, bind(p, module), _default(module, p)) for axis, p in enumerate(self.patch or ())
                            if isinstance(p, Arg)]
        self._coords_at = len(self.bound) - 1 if isinstance(source, ArgsGrid) and source.coords is not None else None
        # what a call's grid depends on: each argument, and whether by its shape alone (a latent, a count of tokens,
        # the tensor that tells the device) or by its identity and values (ids, coordinates, tags, integers, lists)
        shaped = {id(a) for a in self._args(source) if a is not None and (
            isinstance(source, LatentGrid) or (isinstance(source, IdsGrid) and a in (source.leading, source.refs))
            or (isinstance(source, ArgsGrid) and a is source.tokens))}
        self.key_args = [(b, id(a) in shaped) for a, b in zip(self._args(source), self.bound) if b is not None] + \
            [(bound, False) for _, bound, _ in self._patch_args if bound is not None]
        self.key = register(self)  # for the host reads at trace time
        optional = getattr(source, "coords", None)  # read only where the model takes it
        missing = [a.name for a, b in zip(self._args(source), self.bound) if b is None and a != optional]
        if missing:
            raise TypeError(f"tokenmerge: {self.owner}.forward takes no {', '.join(missing)} argument to read its "
                            "token grid from")

    def _host_read(self, method: str, tensor: torch.Tensor, *args):
        """``self.<method>(tensor, *args)``: a read of a tensor's values on the host (once per tensor: ``call.py``
        keeps what it gave). Under torch.compile, at trace time on the real tensor (``merge.plan.traced_constant``),
        so a model compiles from its first call; a ``NoGrid`` it raises is raised again in the traced code."""
        if not torch.compiler.is_compiling():
            return getattr(self, method)(tensor, *args)
        value = traced_constant(self.key, "_or_reason", method, tensor,
                                *["source" if a is self.source else a for a in args])  # Python constants only
        if isinstance(value, str):
            raise NoGrid(value)
        return value

    def _or_reason(self, method: str, tensor: torch.Tensor, *args):
        """What ``_host_read`` reads at trace time: the read's result, or the reason it found no grid."""
        try:
            return getattr(self, method)(tensor, *(self.source if a == "source" else a for a in args))
        except NoGrid as reason:
            return str(reason)

    @staticmethod
    def _coords_tail(coords: torch.Tensor) -> tuple[int, ...]:
        return _raster_tail(coords[0].detach().cpu())

    @staticmethod
    def _args(source):
        if isinstance(source, ArgsGrid):
            return [source.tokens] + [Arg(n) for n in source.names] + ([source.coords] if source.coords else [])
        if isinstance(source, IdsGrid):
            return [source.arg] + [a for a in (source.leading, source.refs, source.tag) if a is not None]
        if isinstance(source, LatentGrid) and source.refs is not None:
            return [source.arg, source.refs]
        return [source.arg]

    def read(self, args: tuple, kwargs: dict) -> tuple[tuple[int, ...], torch.device, int]:
        """``(grid, device, trailing)``: ``trailing`` reference tokens follow the image's (ids beyond its grid)."""
        values = [b.read(args, kwargs) if b is not None else None for b in self.bound]
        first = values[0]
        lead = first[0] if isinstance(first, (list, tuple)) and first else first
        device = lead.device if isinstance(lead, torch.Tensor) else torch.device("cpu")
        source = self.source
        if isinstance(source, LatentGrid):
            patch = self._patches(args, kwargs)
            refs = self._ref_tokens(values[1], source, patch) if source.refs is not None else 0
            return self._latent(first, source, patch), device, refs
        if isinstance(source, IdsGrid):
            counts = iter(values[1:])
            lead = self._count(next(counts), source.leading) if source.leading is not None else 0
            refs = self._count(next(counts), source.refs) if source.refs is not None else 0
            count = None
            if source.tag is not None:
                lead, count = self._tagged(next(counts), source)
            grid, trailing = self._ids(first, source, lead, count)
            return grid, device, trailing + refs
        if isinstance(source, ArgsGrid):
            ints = values[1: 1 + len(source.names)]
            if all(isinstance(v, int) and v > 0 for v in ints):
                return tuple(ints), device, 0
            coords = values[self._coords_at] if self._coords_at is not None else None
            if coords is not None:
                return self._coords(coords, source), device, 0
            raise TypeError(f"tokenmerge: {self.owner}.forward needs the integer arguments {', '.join(source.names)}"
                            + (f" (or {source.coords.name})" if source.coords is not None else "")
                            + f" to know its token grid; got {ints}")
        grid, trailing = self._shapes(first, source)
        return grid, device, trailing

    def _patches(self, args: tuple, kwargs: dict) -> tuple[int, ...]:
        if not self._patch_args:
            return self.patch
        patch = list(self.patch)
        for axis, bound, default in self._patch_args:
            value = bound.read(args, kwargs) if bound is not None else None
            patch[axis] = int(default if value is None else value)
        return tuple(patch)

    def _latent(self, sample, source: LatentGrid, patch: tuple[int, ...]) -> tuple[int, ...]:
        if isinstance(sample, (list, tuple)):  # per-sample latents (Z-Image): one grid for the batch
            shapes = {tuple(s.shape) if isinstance(s, torch.Tensor) else None for s in sample}
            if None in shapes or not shapes:
                raise TypeError(f"tokenmerge: {self.owner}.forward got a list '{source.arg.name}' that is not a list "
                                "of latent tensors (a list of lists: condition images beside each sample, the Omni "
                                "layout, is not supported)")
            if len(shapes) > 1:
                sizes = ", ".join("x".join(map(str, s)) for s in sorted(shapes))
                raise NoGrid(f"{self.owner}.forward got latents of different sizes in one call ({sizes}): the engine "
                             "merges one grid per call; call the model once per size to merge them")
            sample = sample[0][None]
        if not isinstance(sample, torch.Tensor) or sample.dim() < source.rank + 1 \
                or (source.axes is not None and sample.dim() <= max(source.axes)):
            axes = ("frames, " if source.rank == 3 else "") + "height, width"
            raise TypeError(f"tokenmerge: {self.owner}.forward got no latent tensor '{source.arg.name}' "
                            f"(batch, channels, {axes}); got {_describe(sample)}")
        dims = source.axes or tuple(range(sample.dim() - source.rank, sample.dim()))
        return tuple(int(sample.shape[d]) // p for d, p in zip(dims, patch))

    def _ref_tokens(self, refs, source: LatentGrid, patch: tuple[int, ...]) -> int:
        """The tokens of the reference latents ``refs`` (a list of latents, one latent, or ``None``)."""
        if refs is None:
            return 0
        latents = list(refs) if isinstance(refs, (list, tuple)) else [refs]
        return sum(math.prod(self._latent(r, LatentGrid(source.refs, source.rank, source.patch, source.axes), patch))
                   for r in latents)

    def _count(self, value, arg) -> int:
        """The token count of an argument named by ``IdsGrid.leading`` / ``refs`` (``None``: 0)."""
        if value is None:
            return 0
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            raise TypeError(f"tokenmerge: {self.owner}.forward got no tensor '{arg.name}' to count tokens of; got "
                            f"{_describe(value)}")
        return int(value.shape[0 if value.dim() == 2 else 1])

    def _tagged(self, tag, source: IdsGrid) -> tuple[int, int]:
        """``(lead, count)``: where the rows tagged ``source.tag_value`` start, and how many there are."""
        if not isinstance(tag, torch.Tensor) or tag.dim() != 2:
            raise TypeError(f"tokenmerge: {self.owner}.forward got no per-token '{source.tag.name}' tensor (batch, "
                            f"tokens) to find the image's tokens by; got {_describe(tag)}")
        return self._host_read("_find_tagged", tag, source)

    @staticmethod
    def _find_tagged(tag: torch.Tensor, source: IdsGrid) -> tuple[int, int]:
        image = tag == source.tag_value
        what = f"the image's tokens ({source.tag.name} == {source.tag_value})"
        if not bool((image == image[:1]).all()):
            raise NoGrid(f"{what} sit at different places in the samples of one call, which one merge cannot "
                         "follow; pack the samples with one layout (as the model's pipeline does) to merge them")
        where = image[0].nonzero().flatten()
        if where.numel() == 0:
            raise NoGrid(f"{source.tag.name} tags no token as the image's ({source.tag_value})")
        lead, count = int(where[0]), int(where.numel())
        if int(where[-1]) - lead + 1 != count:
            raise NoGrid(f"{what} are not one contiguous run of the sequence, a layout that cannot be merged")
        return lead, count

    def _ids(self, ids, source: IdsGrid, lead: int = 0, count: int | None = None) -> tuple[tuple[int, ...], int]:
        """``(grid, trailing)`` from position ids: the image is the first rows (after ``lead`` rows of other
        tokens) whose ``source.image_axis`` id is the first one's, or the ``count`` rows after ``lead`` when the
        caller tags them; the rows after them (another id there: reference images) are ``trailing``."""
        width = max(source.axes) + 1
        if not isinstance(ids, torch.Tensor) or ids.dim() not in (2, 3) or ids.shape[-1] < width:
            raise TypeError(f"tokenmerge: {self.owner}.forward got no '{source.arg.name}' tensor (tokens, {width}) "
                            f"to read the image grid from; got {_describe(ids)}")
        return self._host_read("_read_ids", ids, source, lead, count)

    @staticmethod
    def _read_ids(ids: torch.Tensor, source: IdsGrid, lead: int, count: int | None) -> tuple[tuple[int, ...], int]:
        """``(grid, trailing)`` from ``ids`` (read on the host)."""
        name = source.arg.name
        end = ids.shape[-2] if count is None else lead + count
        rows = ids.reshape(-1, ids.shape[-1])[lead: end]
        if rows.shape[0] == 0:
            raise NoGrid(f"{name} of {ids.shape[-2]} rows hold no image rows after the {lead} leading ones")
        total = ids.shape[-2] - lead
        if source.image_axis is not None and count is None:
            same = rows[:, source.image_axis] == rows[0, source.image_axis]
            count = int(same.sum())
            if not bool(same[:count].all()):
                raise NoGrid(f"the image's {name} do not come first, before the reference tokens', a layout that "
                             "cannot be merged")
            rows = rows[:count]
        grid = tuple(int(rows[:, a].max() - rows[:, a].min()) + 1 for a in source.axes)
        if math.prod(grid) != rows.shape[0]:
            raise NoGrid(f"{name} of {rows.shape[0]} tokens do not form a {'x'.join(map(str, grid))} grid")
        return grid, total - rows.shape[0]

    def _coords(self, coords, source: ArgsGrid) -> tuple[int, ...]:
        """The grid of the last tokens of per-token coordinates ``(B, rank, S)`` (see ``ArgsGrid.coords``)."""
        rank = len(source.names)
        if not isinstance(coords, torch.Tensor) or coords.dim() != 3 or coords.shape[1] != rank:
            raise TypeError(f"tokenmerge: {self.owner}.forward got no '{source.coords.name}' tensor (batch, {rank}, "
                            f"tokens) to read the token grid from; got {_describe(coords)}")
        return self._host_read("_coords_tail", coords)

    def _shapes(self, shapes, source: ShapesGrid) -> tuple[tuple[int, ...], int]:
        """``(grid, trailing)``: the first image's grid, and the tokens of the images after it (references).

        The list holds one entry per sample: a list of shapes (the generated image's, then references'), or one
        shape (NucleusMoE's ``[(F, H, W)] * batch``); a bare shape is the generated image's."""
        try:
            first = shapes[0]
            sample = [shapes] if not isinstance(first, (list, tuple)) else \
                first if isinstance(first[0], (list, tuple)) else [first]
            grids = [tuple(int(n) for n in s[-source.rank:]) for s in sample]
        except (TypeError, IndexError, ValueError):
            raise TypeError(f"tokenmerge: {self.owner}.forward got no '{source.arg.name}' list of per-sample shapes "
                            f"to read the image grid from; got {type(shapes).__name__}") from None
        if source.last:  # the images before it are in the tokens before the image's, not after
            return grids[-1], 0
        return grids[0], sum(math.prod(g) for g in grids[1:])
