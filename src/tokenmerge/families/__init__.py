"""The registry of model families: the built-in ones and those a user adds with ``register_family``.

Example:
    >>> from tokenmerge.families import Family, Blocks, Target, LatentGrid, SELF, MLP, has
    >>> MY = Family("my-dit", match=has("my_blocks", "patchify"), grid=LatentGrid(patch=(2, 2)),
    ...             blocks=(Blocks("my_blocks", (Target("attn", SELF), Target("mlp", MLP))),))
    >>> tokenmerge.register_family(MY)   # doctest: +SKIP
"""

from __future__ import annotations

from torch import nn

from . import (
    allegro,
    cogview,
    cosmos,
    dit,
    dual_stream,
    easyanimate,
    hunyuan_image,
    image,
    kandinsky,
    refused,
    sana_video,
    unet,
    unified_stream,
    video,
)
from .spec import (
    CROSS,
    JOINT,
    MLP,
    SELF,
    TEXT_AFTER,
    TEXT_BEFORE,
    TEXT_NONE,
    TEXT_STREAM,
    Arg,
    Blocks,
    BlockSite,
    Family,
    IdsGrid,
    LatentGrid,
    Mask,
    PerToken,
    Predicate,
    Refused,
    Rotary,
    Target,
    Whole,
    block_has,
    config_has,
    config_is,
    has,
    has_list,
    takes,
)

__all__ = [
    "Arg", "Blocks", "BlockSite", "Family", "IdsGrid", "LatentGrid", "Mask", "PerToken", "Predicate", "Rotary",
    "Target", "Whole",
    "SELF", "CROSS", "MLP", "JOINT", "TEXT_NONE", "TEXT_BEFORE", "TEXT_AFTER", "TEXT_STREAM",
    "has", "has_list", "takes", "config_has", "config_is", "block_has",
    "register_family", "unregister_family", "registered_families", "match_family", "refusal_for", "BUILTIN",
    "REFUSED", "Refused",
]

# Each group module lists its families (FAMILIES) and the models it recognises and refuses (REFUSED, optional).
_GROUPS = (unet, dit, image, cogview, hunyuan_image, dual_stream, unified_stream, video, easyanimate, cosmos,
           sana_video, kandinsky, allegro, refused)
BUILTIN: tuple[Family, ...] = tuple(f for group in _GROUPS for f in group.FAMILIES)
# Models recognised and refused with their own reason (checked before the families).
REFUSED: tuple[Refused, ...] = tuple(r for group in _GROUPS for r in getattr(group, "REFUSED", ()))
_USER: list[Family] = []


def register_family(family: Family, *, replace: bool = False) -> Family:
    """Add a model family (a ``Family`` record) so that ``apply_patch`` recognises its models.

    A registered family is tried before the built-in ones, so it may also take over a model a built-in family
    would match. Registering a name again raises ``ValueError`` unless ``replace=True``.

    Args:
        family: the record (see ``tokenmerge.families.spec.Family``).
        replace: replace a registered family of the same name.

    Returns:
        ``family``.

    Example:
        >>> tokenmerge.register_family(Family("my-dit", match=has("my_blocks"), blocks=(...)))  # doctest: +SKIP
    """
    if not isinstance(family, Family):
        raise TypeError(f"register_family takes a tokenmerge.families.Family; got {type(family).__name__}")
    names = [f.name for f in _USER]
    if family.name in names:
        if not replace:
            raise ValueError(f"a family named {family.name!r} is registered already; pass replace=True to replace it")
        _USER.pop(names.index(family.name))
    if family.levels is None and not family.blocks:
        raise ValueError(f"family {family.name!r} names no blocks (blocks=...) and no level walk (levels=...)")
    _USER.insert(0, family)
    return family


def unregister_family(name: str) -> None:
    """Remove a family added with ``register_family`` (built-in families cannot be removed)."""
    for i, family in enumerate(_USER):
        if family.name == name:
            del _USER[i]
            return
    raise KeyError(f"no registered family named {name!r} (registered: {[f.name for f in _USER]})")


def registered_families() -> tuple[Family, ...]:
    """Every family, in the order they are tried: the user's (newest first), then the built-in ones."""
    return tuple(_USER) + BUILTIN


def match_family(module: nn.Module) -> Family | None:
    """The family of a denoiser module: the first user family that matches, else the one built-in that does.

    Built-in families are written to be mutually exclusive; two matching is a bug, reported as such.
    """
    for family in _USER:
        if family.match(module):
            return family
    found = [f for f in BUILTIN if f.match(module)]
    if len(found) > 1:
        raise RuntimeError(f"tokenmerge: {type(module).__name__} matches several families "
                           f"({', '.join(f.name for f in found)}); please report this")
    return found[0] if found else None


def refusal_for(module: nn.Module) -> Refused | None:
    """The refusal record that matches ``module`` (a model recognised as not supported), if any; a user's
    registered family that matches takes precedence."""
    if any(family.match(module) for family in _USER):
        return None
    return next((r for r in REFUSED if r.match(module)), None)


def _declares_whole(family: Family) -> bool:
    """Whether every block of the family declares its layout for ``scope="block"``."""
    if family.blocks:
        return all(b.whole is not None for b in family.blocks)
    return family.levels in (unet.DIFFUSERS_UNET.levels, unet.LDM_UNET.levels)  # basic blocks: unet.WHOLE


def support_table() -> str:
    """The README's support table, made from the registry (a test checks that the README holds this text)."""
    rows = ["| family | models | ToMe | ToDo | `scope=\"block\"` | tested configurations |",
            "|---|---|---|---|---|---|"]
    for family in BUILTIN:
        whole = "yes" if _declares_whole(family) else "no"
        inside = any(t.keys is not None for b in family.blocks for t in b.targets)
        todo = ("yes" + (", in the attention call (PyTorch SDPA)" if inside else "")) if family.todo_refused is None \
            else "no: " + family.todo_refused.split(",")[0].removeprefix("ToDo ")
        rows.append(f"| `{family.name}` | {family.description} | yes | {todo} | {whole} | {len(family.examples)} |")
    for record in REFUSED:
        rows.append(f"| `{record.name}` | recognised and refused: {record.reason} | no | no | no | |")
    return "\n".join(rows)
