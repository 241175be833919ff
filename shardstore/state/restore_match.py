"""Which of a commit's tensors a restore fills, and which of the model's (SPEC.md §16.1).

A restore matches the model's tensors to the commit's entries by name. Three things make
the names of one state differ, and each has one rule here:

- **Compiled models.** ``torch.compile(model)`` wraps the module in an ``OptimizedModule``
  whose state names carry an ``_orig_mod.`` segment (``_orig_mod.0.weight``). As DCP's
  state-dict helpers do (``torch.distributed.checkpoint.state_dict._get_fqns`` skips the
  ``_orig_mod`` segment), a module's names are taken without it, at save and at restore:
  a compiled and a plain model save the same names, and either restores into the other.
  A commit written before this rule, holding ``_orig_mod.`` names, restores too: its
  entries are matched by their names without the segment.
- **Strictness.** ``strict=True`` (the default, as ``load_state_dict``'s): every tensor
  the model owns is in the commit, and every tensor of the commit the restore covers is in
  the model — torch's "missing" and "unexpected" keys. The restore covers the whole commit
  when the model is a module, or only slot ``slot``'s tensors when ``slot=`` is given; a
  name → tensor mapping is a declared share (a pipeline stage, a slot) and covers only its
  own names. ``strict=False`` restores what both hold and reports the rest by name.
- **Tied weights.** A tensor the model holds under two names (``lm_head.weight`` tied to
  ``model.embed_tokens.weight``) is saved once, under its ``named_parameters`` name. A
  commit that holds both names as two tensors (saved untied) would lose one of them in
  the tied model; a commit holding one name where the model unties two would leave the
  other as it was. Both are refused by name under ``strict=True``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import StateMismatch
from ..format.lazy import torch
from ..format.manifest import TensorEntry
from ..format.tensors import dtype_name

__all__ = ["COMPILED_SEGMENT", "canonical_name", "RestoreMatch", "match_names"]

#: The attribute ``torch.compile``'s ``OptimizedModule`` keeps the original module under.
COMPILED_SEGMENT = "_orig_mod"


def canonical_name(name: str) -> str:
    """A module state name without ``torch.compile``'s ``_orig_mod`` segments (as DCP's ``_get_fqns``)."""
    if COMPILED_SEGMENT not in name:
        return name
    return ".".join(part for part in name.split(".") if part != COMPILED_SEGMENT)


@dataclass
class RestoreMatch:
    """The model's tensors under the commit's names, and what a non-strict restore leaves out."""

    targets: dict[str, torch.Tensor]  # commit entry name -> the model's tensor to fill
    skipped: list[str] = field(default_factory=list)  # commit tensors the model does not hold
    missing: list[str] = field(default_factory=list)  # model tensors the commit does not hold


def _declared(
    model: torch.nn.Module | Mapping[str, torch.Tensor], owned: Mapping[str, torch.Tensor]
) -> tuple[set[str], dict[str, str]]:
    """(every name the model declares, meta tensors and second names included; the second names of
    tied tensors: alias -> the name the tensor is saved under), canonical names."""
    if not isinstance(model, torch.nn.Module):
        return set(owned), {}
    by_id = {id(t): n for n, t in owned.items()}
    declared, aliases = set(), {}
    for name, value in model.state_dict(keep_vars=True).items():
        name = canonical_name(name)
        declared.add(name)
        owner = by_id.get(id(value)) if isinstance(value, torch.Tensor) else None
        if owner is not None and owner != name:
            aliases[name] = owner
    return declared, aliases


def match_names(
    model: torch.nn.Module | Mapping[str, torch.Tensor],
    owned: Mapping[str, torch.Tensor],
    entries: Mapping[str, TensorEntry],
    covered: set[str] | None,
    *,
    strict: bool,
    commit_id: str,
) -> RestoreMatch:
    """Match ``owned`` (the model's tensors, canonical names) to ``entries`` (the commit's).

    ``covered``: the commit names this restore must fill (None: only those the model owns, a
    declared share). Raises StateMismatch under ``strict`` for missing, unexpected and tied
    versus untied tensors, before anything is read."""
    if any(COMPILED_SEGMENT in n for n in owned):  # a mapping's names are as given (a module's are canonical already)
        canon = {canonical_name(n): t for n, t in owned.items()}
        if len(canon) != len(owned):
            raise StateMismatch(
                f"two of the tensors given differ only by {COMPILED_SEGMENT!r} segments (SPEC.md §16.1)"
            )
        owned = canon
    spelled: dict[str, str] = {}
    for n in entries:
        c = canonical_name(n)
        if spelled.setdefault(c, n) != n:
            raise StateMismatch(
                f"commit {commit_id} holds both {spelled[c]!r} and {n!r}: one tensor once compiled "
                f"(the {COMPILED_SEGMENT!r} segment is not part of a name; SPEC.md §16.1)"
            )
    declared, aliases = _declared(model, owned)
    untied = sorted(a for a in aliases if a in spelled and aliases[a] in spelled)
    if untied and strict:
        a = untied[0]
        raise StateMismatch(
            f"the model ties {a!r} to {aliases[a]!r} (one tensor under both names), but commit {commit_id} "
            f"holds them as two tensors (saved untied): restoring would discard one of them "
            f"({len(untied)} such name(s)); untie the model, or pass strict=False to restore {aliases[a]!r} "
            "and skip the other (SPEC.md §16.1)"
        )
    targets = {spelled[c]: t for c, t in owned.items() if c in spelled}
    missing = sorted(c for c in owned if c not in spelled)
    mine = {canonical_name(n) for n in (covered if covered is not None else ())}
    # not declared at all (a tensor on the meta device is declared: another process owns it), or a tied second name
    skipped = sorted(spelled[c] for c in mine if c not in declared or c in untied)
    if strict and missing:
        hint = _tied_hint(missing, owned, entries, spelled)
        raise StateMismatch(
            f"commit {commit_id} has no tensors named {missing[:5]} ({len(missing)} missing){hint}; "
            "pass strict=False to restore the others and leave these as they are"
        )
    if strict and skipped:
        raise StateMismatch(
            f"commit {commit_id} holds tensors the model does not: {skipped[:5]} ({len(skipped)} unexpected); "
            "pass strict=False to skip them, or restore a piece of a model as a name -> tensor mapping "
            "(its declared share) or with slot= (SPEC.md §16.1)"
        )
    return RestoreMatch(targets, skipped, missing)


def _tied_hint(
    missing: list[str],
    owned: Mapping[str, torch.Tensor],
    entries: Mapping[str, TensorEntry],
    spelled: Mapping[str, str],
) -> str:
    """A clause for a missing tensor that a tied save would explain: another tensor of the model of
    the same dtype and shape is in the commit (``lm_head.weight`` beside ``model.embed_tokens.weight``)."""
    for m in missing[:5]:
        t = owned[m]
        for c, other in owned.items():
            e = entries.get(spelled.get(c, ""))
            if c != m and e is not None and e.dtype == dtype_name(t.dtype, m) and tuple(e.shape) == tuple(t.shape):
                return (
                    f" ({m!r} may have been saved tied to {c!r}, one tensor under both names: tie them in this model "
                    "before restoring, or pass strict=False to leave it as it is)"
                )
    return ""
