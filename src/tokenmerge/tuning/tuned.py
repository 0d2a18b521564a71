"""``Tuned``: what ``tokenmerge.tune`` chose and verified, what it was tuned for, and its file (readable, versioned
JSON: ``save`` / ``load``), which ``accelerate(pipe, setting=...)`` applies."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

from ..engine.techniques import StepCacheConfig, UNetCacheConfig
from ..engine.tuned_for import TunedFor

__all__ = ["Tuned", "fingerprint", "FORMAT", "VERSION"]

FORMAT, VERSION = "tokenmerge-tuned-setting", 1
_CONFIGS = {"step cache": StepCacheConfig, "UNet cache": UNetCacheConfig}


def fingerprint(module) -> str:
    """A short hash of a denoiser's class and config (diffusers' ``config``: its architecture; fields starting with
    ``_`` aside), or of its parameters' names and shapes where it has no config."""
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "items"):
        text = json.dumps({k: v for k, v in dict(config).items() if not str(k).startswith("_")}, sort_keys=True,
                          default=str)
    else:
        text = json.dumps([(n, list(p.shape)) for n, p in module.named_parameters()])
    return hashlib.sha256(f"{type(module).__name__}:{text}".encode()).hexdigest()[:16]


def stats(values: list) -> dict:
    """``{"mean", "worst", "ci95", "n"}`` of PSNR values (``ci95``: the half-width of the mean's 95% interval)."""
    from ..measure import mean_ci

    mean, half = mean_ci(values)
    return {"mean": round(mean, 3), "worst": round(min(values), 3),
            "ci95": None if not math.isfinite(half) else round(half, 3), "n": len(values)}


@dataclasses.dataclass
class Tuned:
    """A tuned cache setting and how it was measured.

    Attributes:
        technique: ``"step cache"`` or ``"UNet cache"``; ``config``: its config's fields (``config()`` makes it).
        tuned_for: the model (``model``: the denoiser's class, ``fingerprint``: its config's), the pipeline, the
            scheduler (its class and the settings that move the time grid), ``steps``, ``sample`` (the denoiser's
            input without the batch: the size, and a video's frames), ``output`` (the output's shape), ``guidance``
            and the call's other arguments.
        target: ``{"psnr": dB}`` or ``{"speed": x}``: what was asked.
        computed: the steps computed of ``tuned_for["steps"]`` (per call of a step); ``step_speedup``: their
            inverse share; ``wall_speedup``: vanilla's seconds over the setting's, interleaved medians on ``device``.
        calibration, held_out: PSNR (dB, float) to the unpatched output from the same noise, on the search's
            items and on items (prompts and seeds) it never used: ``mean``, ``worst``, ``ci95``, ``n``, per item.
        holds: whether the held-out mean met the target (``None`` for a speed).
        candidates: every candidate evaluated (setting, computed steps, PSNR); ``generations``: all the tune ran;
            ``budget``: its budget of generations; ``seconds``: its wall time.
    """

    technique: str
    config: dict
    tuned_for: dict
    target: dict
    computed: int
    step_speedup: float
    wall_speedup: float | None
    calibration: dict
    held_out: dict
    holds: bool | None
    candidates: list
    generations: int
    budget: int
    device: str = "cpu"
    tokenmerge: str = ""
    created: str = ""
    seconds: float | None = None  # the tune's wall time

    def make_config(self):
        """The setting's config (a ``StepCacheConfig`` or ``UNetCacheConfig``)."""
        return _CONFIGS[self.technique](**self.config)

    def expects(self) -> TunedFor:
        """What a generation should be to run as verified (checked at each generation: ``engine/tuned_for.py``)."""
        f = self.tuned_for
        sample = tuple(f["sample"]) if f.get("sample") else None
        return TunedFor(f["steps"], f["scheduler"], sample, TunedFor.describe(f["steps"], f["scheduler"], sample))

    def words(self) -> str:
        """What it was tuned for and what was verified, in one sentence (``describe_patch`` gives it)."""
        f, held = self.tuned_for, self.held_out
        asked = f"target_psnr={self.target['psnr']:g}" if "psnr" in self.target else f"speed={self.target['speed']:g}"
        wall = f", {self.wall_speedup:.2f}x wall on {self.device}" if self.wall_speedup else ""
        verdict = "" if self.holds is None else " (holds the target)" if self.holds else " (BELOW the target)"
        return (f"tuned by tokenmerge.tune for {asked} on {f['model']} ({self.expects().words}); verified on "
                f"{held['n']} held-out items: {held['mean']:.2f} dB mean, {held['worst']:.2f} worst{verdict}; "
                f"{self.computed} of {f['steps']} steps computed ({self.step_speedup:.2f}x in steps{wall})")

    # ---- the file ----------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, **dataclasses.asdict(self)}

    def save(self, path) -> Path:
        """Write the setting as readable JSON to ``path`` (a new file: an existing one is never overwritten)."""
        path = Path(path)
        text = json.dumps(self.to_json(), indent=1) + "\n"
        with open(path, "x", encoding="utf-8") as f:  # "x": fails where the file exists
            f.write(text)
        return path

    @classmethod
    def load(cls, path) -> Tuned:
        """Read a setting file ``save`` wrote; ``ValueError`` naming the file for a damaged or foreign one."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"setting: {path} is not a tuned setting file tokenmerge can read "
                             f"({type(err).__name__}: {str(err)[:200]})") from None
        return cls.from_json(data, str(path))

    @classmethod
    def from_json(cls, data, where: str = "the setting") -> Tuned:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"setting: {where} is not a tuned setting of tokenmerge (no \"format\": \"{FORMAT}\"; "
                             "make one with tokenmerge.tune or `tokenmerge tune`)")
        if data.get("version") != VERSION:
            raise ValueError(f"setting: {where} is a tuned setting of version {data.get('version')!r}; this "
                             f"tokenmerge reads version {VERSION}: tune again")
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            tuned = cls(**{k: v for k, v in data.items() if k in names})
            if tuned.technique not in _CONFIGS:
                raise ValueError(f"technique {tuned.technique!r} is none of {', '.join(_CONFIGS)}")
            tuned.make_config()  # its fields validated as the config validates them
            tuned.expects()
            for key in ("model", "fingerprint", "steps", "scheduler"):
                if key not in tuned.tuned_for:
                    raise ValueError(f"tuned_for has no {key!r}")
        except (TypeError, ValueError, KeyError) as err:
            raise ValueError(f"setting: {where} is damaged: {type(err).__name__}: {str(err)[:300]}") from None
        return tuned

    def check_model(self, site) -> None:
        """``ValueError`` where the denoiser at ``site`` is not the model this setting was tuned for."""
        f = self.tuned_for
        name = type(site.module).__name__
        if name != f["model"] or fingerprint(site.module) != f["fingerprint"]:
            what = "another class" if name != f["model"] else "another config (fingerprint " \
                f"{fingerprint(site.module)}, tuned {f['fingerprint']})"
            raise ValueError(f"setting: this setting was tuned for a {f['model']} and this model's denoiser is "
                             f"{name} of {what}: its fidelity was verified on that model only; tune this one "
                             "(tokenmerge.tune or `tokenmerge tune`)")
