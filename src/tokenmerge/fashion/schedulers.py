"""The time grids the testbeds sample on: diffusers' schedulers as the real pipelines each testbed stands for set them.

Flow testbeds (the transformers): ``euler`` is flow-matching Euler (``FlowMatchEulerDiscreteScheduler``) on Flux's
grid, sigmas ``linspace(1, 1/N, N)`` bent by the shift ``s sigma / (1 + (s - 1) sigma)`` (Flux.1-dev at 1024 px:
dynamic shifting with mu 1.15, that is ``s = e^1.15``; SD3: 3); ``unipc`` is UniPC multistep on flow sigmas (Wan 2.1's
pipelines: ``flow_shift`` 3 at 480p, 5 at 720p). ``euler`` with shift 1 is the linear grid the testbeds sampled on
before (``linspace(1, 0, N + 1)``), kept for the history. UNet testbed: ``ddim`` (clipped samples, its default),
``dpm++2m`` (DPM-Solver++ 2M with Imagen's dynamic thresholding: pixel space), ``euler``, ``pndm``.

Each testbed's default is the pipeline it stands for (its class's ``grid``; the UNet's DDIM); ``swap(pipe, name,
shift)`` replaces a pipeline's scheduler, ``describe(scheduler)`` names one in the words the reports use.
"""

from __future__ import annotations

import math

__all__ = ["FLOW", "UNET", "FLUX_SHIFT", "flow_scheduler", "unet_scheduler", "swap", "describe",
           "flow_sigmas"]

FLUX_SHIFT = math.exp(1.15)  # Flux.1-dev at 1024 px: mu 1.15 (4,096 image tokens), an exponential shift of e^mu
FLOW = {"euler": "flow-matching Euler on Flux's grid (FlowMatchEulerDiscreteScheduler)",
        "unipc": "UniPC multistep on flow sigmas (Wan's pipelines: UniPCMultistepScheduler, flow_prediction)"}
UNET = {"ddim": "DDIM, samples clipped to [-1, 1] (the embedded UNet's default)",
        "dpm++2m": "DPM-Solver++ 2M, dynamic thresholding at 1 (pixel space)",
        "euler": "Euler (EulerDiscreteScheduler)",
        "pndm": "PNDM (PLMS steps, as Stable Diffusion's first pipelines)"}
def flow_sigmas(steps: int, shift: float) -> list[float]:
    """The sigmas of ``steps`` flow-matching Euler steps on Flux's grid bent by ``shift``, then 0 (``steps + 1``)."""
    base = [1.0 - k / steps for k in range(steps)]
    return [shift * s / (1.0 + (shift - 1.0) * s) for s in base] + [0.0]


def flow_scheduler(name: str = "euler", shift: float = 1.0):
    """diffusers' flow scheduler ``name`` (``FLOW``) with ``shift`` (1: no shift)."""
    import diffusers

    if not isinstance(shift, (int, float)) or isinstance(shift, bool) or not shift > 0 or not math.isfinite(shift):
        raise ValueError(f"shift must be a finite number > 0 (1: the linear grid); got {shift!r}")
    if name == "euler":
        return diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=float(shift))
    if name == "unipc":
        return diffusers.UniPCMultistepScheduler(num_train_timesteps=1000, prediction_type="flow_prediction",
                                                 use_flow_sigmas=True, flow_shift=float(shift))
    raise ValueError(f"scheduler must be one of {', '.join(FLOW)} for a flow testbed; got {name!r}")


def unet_scheduler(name: str = "ddim"):
    """diffusers' scheduler ``name`` (``UNET``) on the embedded UNet's training schedule (cosine betas)."""
    import diffusers

    common = dict(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2")
    if name == "ddim":
        return diffusers.DDIMScheduler(**common, clip_sample=True)
    if name == "dpm++2m":
        return diffusers.DPMSolverMultistepScheduler(**common, algorithm_type="dpmsolver++", solver_order=2,
                                                     thresholding=True, sample_max_value=1.0)
    if name == "euler":
        return diffusers.EulerDiscreteScheduler(**common)
    if name == "pndm":
        return diffusers.PNDMScheduler(**common, skip_prk_steps=True)
    raise ValueError(f"scheduler must be one of {', '.join(UNET)} for the embedded UNet; got {name!r}")


def swap(pipe, name: str | None = None, shift: float | None = None) -> None:
    """Give ``pipe`` (an embedded testbed) the scheduler ``name`` with ``shift`` (flow testbeds only); ``None``: its
    current one's name or shift."""
    current = describe_parts(pipe.scheduler)
    flow = hasattr(pipe, "transformer")
    if not flow:
        if shift is not None:
            raise ValueError("shift applies to the flow testbeds (the transformers); the embedded UNet samples on "
                             "its training schedule")
        pipe.scheduler = unet_scheduler(name or current[0])
        return
    pipe.scheduler = flow_scheduler(name or current[0], current[1] if shift is None else shift)


def describe_parts(scheduler) -> tuple[str, float | None]:
    """``(name, shift)`` of a scheduler this module makes (shift ``None`` for the UNet's)."""
    kind = type(scheduler).__name__
    if kind == "FlowMatchEulerDiscreteScheduler":
        return "euler", float(scheduler.config.shift)
    if kind == "UniPCMultistepScheduler" and scheduler.config.get("use_flow_sigmas"):
        return "unipc", float(scheduler.config.flow_shift)
    names = {"DDIMScheduler": "ddim", "DPMSolverMultistepScheduler": "dpm++2m", "EulerDiscreteScheduler": "euler",
             "PNDMScheduler": "pndm"}
    return names.get(kind, kind), None


def describe(scheduler) -> str:
    """``"euler shift 3.16"``, ``"unipc shift 3"``, ``"ddim"``: the scheduler in the words the reports use."""
    name, shift = describe_parts(scheduler)
    return name if shift is None else f"{name} shift {shift:.3g}"
