"""Kernels launched per call: the cost that decides speed on a GPU in eager mode (each launch costs the host
about 5-10 us whatever its size, so a call of many small kernels is bound by Python, not by the GPU).

Two counts of one call:

- ``ops``: the aten operators the call dispatches to a backend, seen by a ``TorchDispatchMode`` (after
  composite operators are decomposed, as on every device), without views and bare allocations, which launch
  nothing. One such operator is one kernel on CUDA for nearly every operator (elementwise ops, reductions,
  gathers, matmuls, SDPA), so this count, taken on a CPU, shows what a change does to a CUDA call's launches.
- on CUDA, ``launches``: the kernel launches, memsets and copies ``torch.profiler`` records, and
  ``kernel_time_s``: the summed duration of the kernels, memsets and copies on the device (``profile_launches``;
  for a compiled function, whose operators a dispatch mode would not see, the bench takes only these).

Operators that read device memory on the host (``.item()``, ``nonzero``, ``equal``...: a sync on CUDA) are
counted apart as ``syncs``.

Example:
    >>> import torch
    >>> count_kernels(lambda: torch.ones(3).add(1).sum(), "cpu")["kernels"]
    3
"""

from __future__ import annotations

import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["count_kernels", "profile_launches", "host_device_times", "NO_KERNEL", "SYNCS"]

# operators that launch no kernel besides the views (``OpOverload.is_view``): allocations and metadata
NO_KERNEL = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
                       "detach", "alias", "lift_fresh", "_reshape_alias", "set_", "resize_", "sym_size",
                       "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
                       "_has_compatible_shallow_copy_type", "record_stream"})
# operators that read device memory on the host: a synchronisation on CUDA
SYNCS = frozenset({"_local_scalar_dense", "item", "nonzero", "equal", "is_nonzero", "allclose", "unique",
                   "_unique2", "masked_select", "repeat_interleave"})
_LAUNCHES = frozenset({"cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                       "cudaMemsetAsync", "cudaMemcpyAsync", "cudaGraphLaunch", "cudaLaunchCooperativeKernel"})


class _Counter(TorchDispatchMode):
    """Counts the backend operators dispatched while active (by name, views and allocations left out)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not getattr(func, "is_view", False) and name not in NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def count_kernels(fn, device, *args, **kwargs) -> dict:
    """Run ``fn(*args, **kwargs)`` once (under ``torch.no_grad``) and count what it launches.

    Returns a dict: ``kernels`` (the kernel-launching operators dispatched, syncs left out), ``syncs``
    (operators that read device memory on the host), ``ops`` (a Counter by operator name) and, on CUDA,
    ``launches`` and ``kernel_time_s`` (``profile_launches``, a second call; None elsewhere).
    """
    device = torch.device(device)
    counter = _Counter()
    with torch.no_grad(), counter:
        fn(*args, **kwargs)
    ops = counter.ops
    syncs = sum(n for name, n in ops.items() if name in SYNCS)
    launched = profile_launches(fn, device, *args, **kwargs)
    return dict(kernels=sum(ops.values()) - syncs, syncs=syncs, ops=ops, **launched)


def profile_launches(fn, device, *args, **kwargs) -> dict:
    """``launches`` (kernel launches, memsets, copies, CUDA graph launches) and ``kernel_time_s`` (their summed
    duration on the device) of one call of ``fn`` under ``torch.profiler``, on CUDA; both None elsewhere.

    A compiled function's kernels are counted here (a ``TorchDispatchMode`` would make dynamo run it another way);
    a CUDA graph replay (``mode="reduce-overhead"``) is one launch.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return dict(launches=None, kernel_time_s=None)
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(*args, **kwargs)
        torch.cuda.synchronize(device)
    events = prof.events()
    launches = sum(1 for e in events if e.name in _LAUNCHES)
    try:  # the device-side events: kernels, memsets and copies as the GPU ran them
        busy_us = sum(e.time_range.elapsed_us() for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:  # noqa: BLE001 - a profiler whose event fields changed: no busy time, the counts stand
        busy_us = None
    return dict(launches=launches, kernel_time_s=None if busy_us is None else busy_us / 1e6)


def host_device_times(fn, device, *args, **kwargs) -> tuple[float, float]:
    """``(host_s, device_s)`` of one call: the time the host takes to issue it (until ``fn`` returns, nothing
    synchronised inside) and the time until the device has run it (CUDA events). A call whose host time is
    about its device time is launch-bound: the device waits for Python. Elsewhere both are the wall time."""
    device = torch.device(device)
    if device.type != "cuda":
        start = time.perf_counter()
        fn(*args, **kwargs)
        seconds = time.perf_counter() - start
        return seconds, seconds
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = time.perf_counter()
    begin.record()
    fn(*args, **kwargs)
    end.record()
    host = time.perf_counter() - start
    end.synchronize()
    return host, begin.elapsed_time(end) / 1000.0
