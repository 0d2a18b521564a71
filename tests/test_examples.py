"""The examples run: ``examples/quickstart.py`` (``tokenmerge.accelerate`` on the embedded mosaic DiT) prints the
patch, a PSNR to the unpatched images and the wall times, and ``remove_patch`` gives back the unpatched outputs."""

import importlib.util
import math
import re
from pathlib import Path

import pytest

diffusers = pytest.importorskip("diffusers")
ROOT = Path(__file__).parent.parent


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not hasattr(diffusers, "FluxTransformer2DModel"),
                    reason=f"the mosaic DiT is a FluxTransformer2DModel: diffusers {diffusers.__version__} has none")
def test_the_quickstart_accelerates_and_removal_restores(capsys):
    result = _example("quickstart").main(steps=12)  # 12 steps on Flux.1-dev's grid: the step cache skips some
    out = capsys.readouterr().out
    assert "step cache" in out and "accelerate(speed='balanced')" in out  # describe_patch: what was chosen, why
    values = re.search(r"PSNR to the unpatched images: (.+) dB", out).group(1).split(", ")
    assert len(values) == 2 and all(20 < float(v) < math.inf for v in values)  # close, not identical
    assert re.search(r"unpatched [\d.]+ s, accelerate [\d.]+ s", out)
    assert result["restored"] is True and "outputs equal the unpatched ones: True" in out
