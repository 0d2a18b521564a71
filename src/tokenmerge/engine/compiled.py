"""torch.compile and the patch: compiled code follows the patch; blocks compiled in place are followed by the caches
across steps and refused by the other techniques.

Dynamo does not guard on empty hook dicts, so code compiled before a patch would keep running unpatched, and code
compiled after a removal would ignore a later patch. Installing and removing a patch drop the code compiled for the
denoiser's modules' ``forward`` (``forget_compiled``): the next compiled call is traced again, with the hooks as
they are. Blocks (or their sub-modules) compiled in place (``Module.compile()``, regional compilation, diffusers'
``compile_repeated_blocks``) run ToMe's, ToDo's and token reuse's hooks apart from the denoiser's call, whose token
grid and plans they need: refused, at apply time or at the first call after such a compile (``call.Watch``). The
caches across steps stand them (``techniques.across.CompiledBypass``: the decision made eagerly around the compiled
block).

Compiled whole, a denoiser runs its hooks inside the compiled frame. The caches decide on the host: before the call
where the denoiser's ``cache_context`` tells it (``across.DecidingContext``: diffusers' pipelines enter it; the compiled
frame reads one bool, a computed and a skipped variant, ``fullgraph=True`` works), else in the call's hooks, run eagerly
(``on_host``: a graph break at each end of the call; refused under ``fullgraph=True`` with ``HOST_REASON``).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

__all__ = ["forget_compiled", "compiled_in_place", "holding", "regional_message", "on_host"]

HOST_REASON = ("tokenmerge: token reuse (apply_reuse) and the step cache (apply_step_cache) or the UNet cache "
               "decide at each denoiser call, on the host, what the step computes (a full, partial or skipped step); "
               "this call was not decided before it: the caches decide before the call inside the denoiser's "
               "cache_context(name), which diffusers' pipelines of Flux.1, Wan, HunyuanVideo, LTX, Qwen-Image... "
               "enter around each call (their scheduler telling the step), and compile whole with fullgraph=True "
               "there; else compile the denoiser without fullgraph=True (this decision is its one graph break, at the "
               "call's start), compile its blocks (compile_repeated_blocks(fullgraph=True) works with the caches), or "
               "run it eagerly")


def forget_compiled(module: nn.Module, *codes) -> None:
    """Drop what torch.compile compiled for the ``forward`` of ``module`` and of every module it holds (and for
    ``codes``, the patch's own hook code), with their continuations after graph breaks: the next compiled call is
    traced again, with the hooks as they are now.

    Other models of these classes recompile at their next compiled call too; no other code is touched. Nothing to
    do where dynamo was never imported.
    """
    if "torch._dynamo" not in sys.modules:
        return
    from torch._dynamo import eval_frame

    reset = getattr(eval_frame, "reset_code", None)
    if reset is None:  # a torch without it: every compiled graph of the process, so that none runs stale
        torch.compiler.reset()
        return
    try:
        from torch._dynamo.resume_execution import ContinueExecutionCache

        resumed = ContinueExecutionCache.cache
    except (ImportError, AttributeError):  # pragma: no cover - the continuations of another torch
        resumed = {}
    todo = [c for c in {getattr(type(m).forward, "__code__", None) for m in module.modules()} | set(codes) if c]
    seen = set()
    while todo:
        code = todo.pop()
        if id(code) in seen:
            continue
        seen.add(id(code))
        reset(code)
        todo.extend((resumed.get(code) or {}).values())


def compiled_in_place(modules) -> str | None:
    """The path of the first of ``(path, module)`` compiled in place (``Module.compile()``), or ``None``."""
    for path, module in modules:
        if module.__dict__.get("_compiled_call_impl") is not None:
            return path
    return None


def holding(denoiser: nn.Module, blocks) -> list:
    """``(path, module)`` of each of ``blocks`` (``BlockSite``s of ``denoiser``) and of each module that holds one
    inside the denoiser (a UNet's ``down_blocks.0``): compiled in place, any of them runs the blocks' hooks in its
    compiled code."""
    found = {}
    for block in blocks:
        parts = block.path.split(".")
        for k in range(1, len(parts) + 1):
            path = ".".join(parts[:k])
            if path not in found:
                try:
                    found[path] = denoiser.get_submodule(path)
                except AttributeError:  # a path not of the denoiser's modules (an LDM-style wrapper's)
                    found[path] = block.module if k == len(parts) else None
    return [(path, module) for path, module in found.items() if module is not None]


def regional_message(path: str, later: bool, technique: str = "the patch") -> str:
    return (f"tokenmerge: {path} {'was compiled in place after the patch' if later else 'is compiled in place'} "
            f"(Module.compile(), as diffusers' compile_repeated_blocks does): its compiled code runs {technique}'s "
            "hooks apart from the denoiser's call, whose token grid and merge plans they need, so it cannot work "
            "there. Compile the whole denoiser instead (pipe.transformer.compile() or torch.compile(pipe."
            "transformer)), before or after the patch; the step cache and the UNet cache (tokenmerge.accelerate) "
            "work with blocks compiled in place")


def on_host(fn):
    """``fn`` run eagerly under torch.compile: a graph break with ``HOST_REASON`` as its reason."""
    try:
        return torch.compiler.disable(fn, reason=HOST_REASON)
    except TypeError:  # a torch without the reason argument
        return torch.compiler.disable(fn)
