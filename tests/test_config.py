import pytest

import tokenmerge
from tokenmerge import ToMeConfig


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(ratio=-0.1), ["ratio", "[0, 0.75]"]),
        (dict(ratio=0.76), ["ratio", "[0, 0.75]"]),
        (dict(ratio=0.9, sx=4, sy=4), None),  # 1 - 1/16 allows it
        (dict(ratio=0.95, sx=4, sy=4), ["ratio", "0.9375"]),
        (dict(ratio="0.5"), ["ratio"]),
        (dict(ratio=True), ["ratio"]),
        (dict(ratio=float("nan")), ["ratio"]),
        (dict(sx=0), ["sx", ">= 1"]),
        (dict(sy=1.5), ["sy"]),
        (dict(sx=1, sy=1), ["sx * sy"]),
        (dict(max_downsample=0), ["max_downsample"]),
        (dict(max_downsample=2.0), ["max_downsample"]),
        (dict(max_downsample=True), ["max_downsample"]),
        (dict(use_rand=1), ["use_rand", "True or False"]),
        (dict(merge_attn=False), ["merge nothing"]),
        (dict(seed=-1), ["seed"]),
        (dict(seed="x"), ["seed"]),
        (dict(match_radius=-1), ["match_radius", ">= 0"]),
        (dict(match_radius=1.5), ["match_radius"]),
        (dict(match_radius=True), ["match_radius"]),
        (dict(match_radius=0), None),
    ],
)
def test_validation(kwargs, words):
    if words is None:
        ToMeConfig(**kwargs)
        return
    with pytest.raises(ValueError) as err:
        ToMeConfig(**kwargs)
    for word in words:
        assert word in str(err.value)


def test_defaults_match_tomesd_except_the_level_rule():
    c = ToMeConfig()
    assert (c.ratio, c.sx, c.sy, c.use_rand, c.merge_attn, c.merge_crossattn, c.merge_mlp) == (
        0.5, 2, 2, True, True, False, False)
    assert c.max_downsample is None and c.effective_seed == 0
    assert ToMeConfig(seed=7).effective_seed == 7


def test_config_is_frozen():
    with pytest.raises(Exception):
        ToMeConfig().ratio = 0.3


def test_bad_arguments_leave_the_model_untouched():
    from tiny_models import make_unet

    unet = make_unet()
    with pytest.raises(ValueError):
        tokenmerge.apply_patch(unet, ratio=2.0)
    assert tokenmerge.describe_patch(unet) is None
    assert not unet._forward_pre_hooks
