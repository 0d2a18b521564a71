"""Run-time records of a patch: what one denoiser call tells its blocks, and the plans kept across calls."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..merge.bipartite import _MASK32

__all__ = ["CallState", "BlockCall", "KeptPlan", "SharedPlan", "host_timestep", "step_key"]


@dataclass
class BlockCall:
    """One block's call in flight: its plan, its token grid and, per target, the text length set aside."""

    plan: object
    grid: tuple[int, ...]
    text: dict[int, tuple[int, int]] = field(default_factory=dict)  # target index -> tokens before/after the image
    inside: dict[int, object] = field(default_factory=dict)  # target index -> its active ToDo mode (inside.py)
    entry: tuple | None = None  # scope="block": (image input, merged input, tokens before, tokens after)

    def close(self) -> None:
        """Leave any ToDo mode still active (its target's call raised before its forward hook ran)."""
        while self.inside:
            self.inside.popitem()[1].__exit__(None, None, None)


@dataclass
class KeptPlan:
    """A plan kept for reuse: by the other blocks of a level (``share_plans``) or by later calls (``reuse_steps``)."""

    plan: object
    batch: int
    tokens: int
    call: int = 0
    ratio: float = 0.0


class CallState:
    """What one denoiser call tells its blocks. ``reset()`` forgets the call (its end, or an error).

    One per thread (``DenoiserPatch.state``), and one for code that ``torch.compile`` traces: dynamo follows
    mutations of a plain object, not of a ``threading.local``. ``kept``, ``calls`` and ``last_t`` (the last
    call's denoising progress) survive ``reset()``.
    """

    def __init__(self) -> None:
        self.reset()
        self.calls = 0  # denoiser calls, counted when plans are kept across them (reuse_steps)
        self.last_t: float | None = None
        self.kept: dict[int, KeptPlan] = {}

    def reset(self, blocks=None) -> None:
        """Forget the call; give back any feed-forward chunking a block set aside (``blocks``: the patch's)."""
        for index, chunk_size in getattr(self, "unchunked", {}).items():
            if blocks is not None:
                blocks[index].module._chunk_size = chunk_size
        for call in getattr(self, "blocks", {}).values():
            call.close()
        self.grid: tuple[int, ...] | None = None
        self.trailing = 0  # reference tokens the call carries after the image's (Flux Kontext, Flux.2 edits)
        self.shard = None  # context parallelism: this rank's slice of the call's grid (parallel.Shard)
        self.step_key = None
        self.active = True  # the schedule's verdict for this call
        self.ratio = 0.0
        self.blocks: dict[int, BlockCall] = {}
        self.shared: dict[int, KeptPlan] = {}  # share_plans: reuse key -> plan of this call
        self.unchunked: dict[int, int] = {}  # feed-forward chunk sizes set aside during a block call
        self.draws: dict[tuple[int, ...], torch.Tensor] = {}  # grid -> (blocks, windows) random choices of this call


class SharedPlan:
    """One batch-1 merge pattern applied to every element of the batch (expanded once per batch size), so that
    a merged token has one position for all of them (tokens that carry rotary positions need this)."""

    def __init__(self, plan):
        self.plan = plan
        self.num_tokens, self.num_slots, self.num_merged = plan.num_tokens, plan.num_slots, plan.num_merged
        self._by_batch: dict[int, object] = {}
        self._reps = None
        self._taken: list[tuple] = []  # (value, spec, trailing, taken): per-token tables already taken

    def take(self, take, spec, value, trailing: int):
        """``take(spec, value, num_tokens, representatives, trailing)`` (a rotary table or mask at the merged
        tokens), once per table: the blocks that share this plan get the same tables (Flux passes one rotary
        tuple to all of its blocks), so each is taken at its first block only. Under torch.compile the graph's
        common subexpressions are merged anyway: no lookup there."""
        if torch.compiler.is_compiling():
            return take(spec, value, self.num_tokens, self.representatives(), trailing)
        for v, s, t, taken in self._taken:
            if v is value and s is spec and t == trailing:
                return taken
        taken = take(spec, value, self.num_tokens, self.representatives(), trailing)
        self._taken = self._taken[-7:] + [(value, spec, trailing, taken)]  # a plan kept across calls (reuse_steps)
        return taken  # meets new tables at each call: the last few only

    def _for(self, batch: int):
        plan = self._by_batch.get(batch)
        if plan is None:
            plan = self._by_batch[batch] = self.plan.expand(batch)
        return plan

    def representatives(self) -> torch.Tensor:
        """``(M,)``: per merged token, the lowest index of the tokens merged into it (whose position it keeps)."""
        if self._reps is None:
            self._reps = self.plan.representatives()[0]
        return self._reps

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        return self._for(x.shape[0]).merge(x)

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        return self._for(x.shape[0]).unmerge(x)


# A timestep tensor may hold one value per token (Wan 2.2 TI2V, LTX I2V: 0 on the clean conditioning frame's
# tokens): the step's noise level is its largest value, which is also the value of a plain (B,) timestep.
def host_timestep(timestep) -> float | None:
    if timestep is None:
        return None
    return float(timestep.max()) if isinstance(timestep, torch.Tensor) else float(timestep)


def step_key(timestep, device: torch.device):
    """An integer identifying the denoising step, without reading device memory on the host."""
    if timestep is None:  # no timestep to key on: one fixed pattern, still reproducible
        return 0
    if isinstance(timestep, torch.Tensor):
        t = timestep.reshape(-1).amax(0, keepdim=True).to(device=device, dtype=torch.float32)
        return (t * 64).round().to(torch.int64) & _MASK32
    return int(round(float(timestep) * 64)) & _MASK32
