"""Index tables of a token grid of any rank cut into windows, one destination token per window.

A grid ``shape = (n_0, ..., n_{d-1})`` holds its tokens in raster order (row-major: for a video grid
``(F, H, W)`` token ``(f, y, x)`` is ``(f * H + y) * W + x``). ``windows = (s_0, ..., s_{d-1})`` cuts it into
``n_i // s_i`` windows per axis, numbered in raster order over the window grid; a window's ``S = prod(s_i)``
tokens (its *choices*) are numbered row-major over the window's axes (2-D ``(sy, sx)``: ``k = dy * sx + dx``).
The tokens past the last whole window on some axis (a coordinate ``>= (n_i // s_i) * s_i``) belong to no
window: they are always sources.

Everything here is pure shape logic, built once per (shape, windows, ..., device) and kept on the device
(``table``): under torch.compile the tables are constants of the compiled graph, computed when it is traced and
loaded from memory when it runs, so no index arithmetic of theirs is left for the compiler to fuse into a kernel's
int32 index (a hash multiplying an ``arange`` by 0x9E3779B1 does not fit there).
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["num_windows", "window_grid", "window_split", "window_destinations", "random_offsets", "table",
           "arange"]

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1  # the window index's multiplier in the random choice
_TABLES: dict = {}  # name -> the cached builder of a table (``table``)


def _symbolic(args) -> bool:
    """Whether ``args`` hold a symbolic size (torch.compile with dynamic shapes): then a table is traced."""
    return any(_symbolic(a) if isinstance(a, (tuple, list)) else isinstance(a, torch.SymInt) for a in args)


def _constant(name: str, *args):
    """The table ``name`` of ``args``, from its cache, when torch.compile traces a call: the function is marked
    as ``torch.compiler.assume_constant_result`` (by hand, so that importing tokenmerge does not import dynamo),
    so dynamo runs it while tracing and keeps its result as a constant of the graph (a get_attr: loaded from
    memory, a static address for CUDA graphs).

    Dynamo names each such constant after the function, and two constants of one graph may not share a name:
    each call renames the function's code for the next one (a Python counter, run at trace time, that no guard
    reads).
    """
    global _fetches
    _fetches += 1
    _constant.__code__ = _constant.__code__.replace(co_name=f"_tokenmerge_table_{_fetches}")
    return _TABLES[name](*args)


_fetches = 0
_constant._dynamo_marked_constant = True


def table(fn=None, *, maxsize: int = 256):
    """``fn`` (pure shape logic returning tensors on a device) cached per arguments (the ``maxsize`` latest), and a
    constant of the graph under torch.compile (see ``_constant``). ``fn.__wrapped__`` builds without the cache."""
    if fn is None:
        return functools.partial(table, maxsize=maxsize)
    name = f"{fn.__module__}.{fn.__qualname__}"
    cached = _TABLES[name] = functools.lru_cache(maxsize=maxsize)(fn)

    @functools.wraps(fn)
    def get(*args):
        if not torch.compiler.is_compiling():
            return cached(*args)
        return fn(*args) if _symbolic(args) else _constant(name, *args)

    get.cache_clear, get.cache_info = cached.cache_clear, cached.cache_info
    return get


def _mix32(x):
    """A 32-bit integer hash (lowbias32) on int64 tensors or Python ints: uniform, device-independent."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


@table
def arange(n: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(n)`` (int64) kept on ``device``: a constant of the hot path, never written to."""
    return torch.arange(n, dtype=torch.int64).to(device)


@table
def _window_hashes(num_windows: int, device: torch.device) -> torch.Tensor:
    """``(W,)`` int64: ``window * 0x9E3779B1 mod 2**32``, the window's part of the random choice."""
    return ((torch.arange(num_windows, dtype=torch.int64) * _GOLDEN) & _MASK32).to(device)


def random_offsets(num_windows: int, choices: int, key, device: torch.device) -> torch.Tensor:
    """One offset in ``[0, choices)`` per window, a pure function of ``key``:
    ``lowbias32((window * 0x9E3779B1 + key) mod 2**32) % choices``.

    Args:
        key: a Python int or an int64 tensor (on ``device``) identifying the draw (seed, block and timestep mixed
            together): one element, or ``(..., 1)`` for several draws at once (the result is then ``(..., W)``).
    """
    return _mix32((_window_hashes(num_windows, torch.device(device)) + key) & _MASK32) % choices


def check_grid(shape, windows, what: str = "windows") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``shape`` and ``windows`` as tuples of ints of the same rank (``windows`` entries at least 1)."""
    shape, windows = tuple(int(n) for n in shape), tuple(int(s) for s in windows)
    if len(shape) != len(windows) or not shape:
        raise ValueError(f"token grid {shape} and {what} {windows} must have the same rank (at least 1)")
    if min(windows) < 1 or min(shape) < 0:
        raise ValueError(f"token grid {shape} and {what} {windows}: sizes must be >= 0 and {what} >= 1")
    return shape, windows


def window_grid(shape, windows) -> tuple[int, ...]:
    """Whole windows per axis: ``n_i // s_i``."""
    return tuple(n // s for n, s in zip(shape, windows))


def num_windows(shape, windows) -> int:
    """The number of windows (and so of destinations): ``prod(shape[i] // windows[i])``."""
    return math.prod(window_grid(shape, windows))


def strides(shape) -> tuple[int, ...]:
    """Token index step of each axis (row-major)."""
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def coords(index: torch.Tensor, shape) -> list[torch.Tensor]:
    """The grid coordinates of flat token indices, one tensor per axis."""
    return [index // t % n for t, n in zip(strides(shape), shape)]


def _raster(sizes, steps) -> torch.Tensor:
    """``sum_i arange(sizes[i]) * steps[i]`` over the product of the ranges, flattened in row-major order."""
    out = torch.zeros((), dtype=torch.int64)
    for size, step in zip(sizes, steps):
        out = out.unsqueeze(-1) + torch.arange(size) * step
    return out.reshape(-1)


def _rest(shape, covered) -> torch.Tensor:
    """The tokens outside every window, in raster order: along axis 0, the rest of each covered slice's
    sub-grid, then every token of the slices past the covered ones (no data-dependent ops)."""
    rest = torch.arange(covered[-1], shape[-1])
    size = shape[-1]
    for n, c in zip(reversed(shape[:-1]), reversed(covered[:-1])):
        rest = torch.cat([(torch.arange(c).unsqueeze(1) * size + rest).reshape(-1), torch.arange(c * size, n * size)])
        size *= n
    return rest


@table
def _grid(shape: tuple[int, ...], windows: tuple[int, ...], device: torch.device):
    """``(origin, offset, other_offsets, rest)``: each window's first token ``(W,)``, the token offset of each
    choice ``(S,)``, of the other choices of each choice ``(S, S - 1)``, the tokens outside every window."""
    grid, step = window_grid(shape, windows), strides(shape)
    choices = math.prod(windows)
    origin = _raster(grid, [s * t for s, t in zip(windows, step)])
    offset = _raster(windows, step)
    j = torch.arange(choices - 1).unsqueeze(0)
    others = j + (j >= torch.arange(choices).unsqueeze(1)).long()  # (S, S-1): the choices but k, in order
    rest = _rest(shape, [g * s for g, s in zip(grid, windows)])
    to = functools.partial(torch.Tensor.to, device=device)
    return to(origin), to(offset), to(offset[others]), to(rest)


@table
def _top_left(shape: tuple[int, ...], windows: tuple[int, ...], device: torch.device):
    origin, offset, other_offsets, rest = _grid.__wrapped__(shape, windows, device)
    src = (origin.unsqueeze(1) + other_offsets[0]).reshape(-1)
    return origin + offset[0], torch.cat([src, rest])


def window_split(shape, windows, offsets: torch.Tensor | None, device):
    """Token indices ``(dst, src)`` of the grid for the given per-window choice (``None``: choice 0).

    ``dst`` ``(W,)``: each window's destination, in window order. ``src`` ``(N - W,)``: the other tokens of
    each window (window by window, in choice order), then the tokens outside every window in raster order.
    ``offsets`` may have leading dimensions ``(..., W)`` (one draw per folded grid): then so do both.
    """
    device = torch.device(device)
    shape, windows = tuple(shape), tuple(windows)
    if offsets is None:
        return _top_left(shape, windows, device)
    tokens, others, rest = _choices(shape, windows, device)
    tokens = tokens.expand(*offsets.shape, tokens.shape[1])
    dst = tokens.gather(-1, offsets.unsqueeze(-1)).squeeze(-1)
    src = tokens.gather(-1, others[offsets]).flatten(-2)
    return dst, (torch.cat([src, rest.expand(*src.shape[:-1], -1)], -1) if rest.shape[0] else src)


@table
def _choices(shape: tuple[int, ...], windows: tuple[int, ...], device: torch.device):
    """``(tokens, others, rest)``: the token of each window's each choice ``(W, S)``, the other choices of each
    choice ``(S, S - 1)``, the tokens outside every window."""
    origin, offset, _, rest = _grid.__wrapped__(shape, windows, torch.device("cpu"))
    j = torch.arange(offset.shape[0] - 1).unsqueeze(0)
    others = j + (j >= torch.arange(offset.shape[0]).unsqueeze(1)).long()  # (S, S-1): the choices but k, in order
    return (origin.unsqueeze(1) + offset).to(device), others.to(device), rest.to(device)


def window_dst(shape, windows, offsets: torch.Tensor | None, device) -> torch.Tensor:
    """``window_split(...)[0]`` alone: each window's destination token (``(..., W)``)."""
    device = torch.device(device)
    shape, windows = tuple(shape), tuple(windows)
    if offsets is None:
        return _top_left(shape, windows, device)[0]
    tokens = _choices(shape, windows, device)[0]
    return tokens.expand(*offsets.shape, tokens.shape[1]).gather(-1, offsets.unsqueeze(-1)).squeeze(-1)


def window_destinations(h: int, w: int, sx: int, sy: int, offsets: torch.Tensor | None, device):
    """``window_split`` of an ``h`` x ``w`` grid with ``sy`` x ``sx`` windows (the 2-D API)."""
    return window_split((h, w), (sy, sx), offsets, device)
