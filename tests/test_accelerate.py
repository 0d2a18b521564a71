"""``tokenmerge.accelerate``: one call that picks the faithful setting, on every family of the catalogue.

A UNet gets ToMe, an image transformer token reuse with kept keys (and text where its blocks have a text stream), a
video transformer token reuse; where token reuse cannot follow a transformer's blocks the model is left unpatched with
one warning. ``describe_patch`` says what was chosen and why; the knob is checked; removal gives the model back.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_denoisers import CATALOGUE, all_tensors, available
from tiny_models import later_step

import tokenmerge
from tokenmerge import faithful
from tokenmerge.config import ReuseConfig, ToMeConfig
from tokenmerge.families import BUILTIN, match_family
from tokenmerge.families.spec import grid_rank

pytestmark = pytest.mark.usefixtures("fast_cpu")
ENTRIES = sorted({example for f in BUILTIN for example in f.examples} & set(CATALOGUE))


def _run(model, calls):
    with torch.no_grad():
        return [torch.cat([t.flatten().float() for t in all_tensors(model(**c))]) for c in calls]


@pytest.mark.parametrize("name", ENTRIES)
def test_accelerate_picks_the_faithful_setting_or_says_why_not(name):
    if available(name) is not None:
        pytest.skip(available(name))
    entry = CATALOGUE[name]
    model = entry.build()
    family = match_family(getattr(model, "_orig_mod", model))
    calls = [entry.inputs(batch=2)]
    try:
        calls.append(later_step(model, calls[0]))
    except ValueError:  # a model whose timestep cannot move on: one call
        pass
    vanilla = _run(model, calls)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokenmerge.accelerate(model)
    info = tokenmerge.describe_patch(model)
    if info is None:  # left unpatched: one warning with the reason
        said = [str(w.message) for w in caught if "accelerate left" in str(w.message)]
        assert family.kind == "transformer" and len(said) == 1, [str(w.message) for w in caught]
        assert all(torch.equal(a, b) for a, b in zip(_run(model, calls), vanilla))
        return
    assert info.notes[0].startswith("accelerate(speed='balanced'): ")
    if family.kind == "unet":
        assert isinstance(info.config, ToMeConfig) and info.config.ratio == 0.5
    else:  # the frontier's point (keys cached where the blocks can run on some tokens' rows)
        cfg, want = info.config, (faithful._VIDEO if grid_rank(family.grid) >= 3 else faithful._IMAGE)["balanced"]
        assert isinstance(cfg, ReuseConfig) and cfg.extrapolate == 1.0 and cfg.keys in ("cached", "fresh")
        assert {k: getattr(cfg, k) for k in want} == want
    out = _run(model, calls)
    assert all(torch.isfinite(t).all() for t in out)
    tokenmerge.remove_patch(model)
    assert all(torch.equal(a, b) for a, b in zip(_run(model, calls), vanilla))


def test_the_knob_and_the_text_stream():
    if available("flux") is not None:
        pytest.skip(available("flux"))
    model = CATALOGUE["flux"].build()
    with pytest.raises(ValueError, match="speed must be one of faithful, balanced, fast"):
        tokenmerge.accelerate(model, speed="max")
    assert tokenmerge.describe_patch(model) is None
    for speed in faithful.SPEEDS:
        tokenmerge.accelerate(model, speed=speed)
        cfg = tokenmerge.describe_patch(model).config
        assert {k: getattr(cfg, k) for k in faithful._IMAGE[speed]} == faithful._IMAGE[speed]
        assert (cfg.keys, cfg.text, cfg.extrapolate) == ("cached", True, 1.0)
    assert "text too" in str(tokenmerge.describe_patch(model))
    tokenmerge.remove_patch(model)
    pixart = CATALOGUE["pixart"].build()  # no separate text stream: keys cached, text recomputed
    tokenmerge.accelerate(pixart)
    assert tokenmerge.describe_patch(pixart).config.text is False
    tokenmerge.remove_patch(pixart)


def test_the_method_spec():
    from tokenmerge.tools.methods import parse_spec

    spec = parse_spec("auto,speed=fast")
    assert spec.stateful
    with pytest.raises(ValueError, match="speed= one of"):
        parse_spec("auto,speed=slow")


def test_the_arguments_page_gives_each_speeds_settings():
    """docs/arguments.md's table of accelerate's speeds is the code's (each row: the UNet ratio, the image and the
    video transformers' token reuse settings)."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "arguments.md").read_text()
    for speed in faithful.SPEEDS:
        image, video = faithful._IMAGE[speed], faithful._VIDEO[speed]
        row = next(line for line in page.splitlines() if line.startswith(f'| `"{speed}"`'))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == f"{faithful._UNET[speed]:g}", row
        assert cells[2] == _cell(image), row
        assert cells[3] == _cell(video), row


def _cell(setting: dict) -> str:
    return "`" + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in setting.items()) + "`"
