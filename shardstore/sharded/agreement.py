"""Whether the ranks of a save agree on each tensor they describe, and errors that say who
disagrees (SPEC.md §Block exchange, step 2).

Every rank sees the same descriptions (all-gathered), so every rank raises the same error:
it names the tensor and role, the ranks on each side and what each side holds (dtype,
global shape, slices), so that the rank whose model is set up differently can be found
from any rank's log. This module knows nothing of processes: it reads descriptions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..errors import StateMismatch, TensorMismatch

__all__ = ["check_agreement", "coverage_problem"]

#: Most slices an error lists (a 64-rank split names the first ones and says how many more).
_SHOWN = 8


def _ranks(rs: Sequence[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {list(rs)}"


def check_agreement(peers: Sequence[Sequence[Any]]) -> None:
    """``peers[r]``: rank r's descriptions (``name``, ``role``, ``dtype``, ``shape``; role
    ``plain`` for a plain tensor). Raise StateMismatch if ranks give one DTensor different
    global dtypes or shapes, or TensorMismatch if some rank holds as a plain tensor what
    others hold as DTensor slices, naming the ranks and the shapes on each side."""
    sharded: dict[tuple[str, str], dict[tuple[str, tuple[int, ...]], list[int]]] = {}
    plain: dict[str, dict[tuple[str, tuple[int, ...]], list[int]]] = {}
    for r, items in enumerate(peers):
        for it in items:
            kind = (it.dtype, tuple(it.shape))
            if it.role == "plain":
                plain.setdefault(it.name, {}).setdefault(kind, []).append(r)
            else:
                sharded.setdefault((it.name, it.role), {}).setdefault(kind, []).append(r)
    for (name, role), kinds in sorted(sharded.items()):
        if len(kinds) > 1:
            sides = "; ".join(
                f"{_ranks(rs)}: {dt}{list(sh)}" for (dt, sh), rs in sorted(kinds.items(), key=lambda kv: kv[1])
            )
            raise StateMismatch(
                f"{role} of tensor {name!r}: ranks disagree on its global dtype and shape ({sides}); every rank "
                "holding a DTensor must describe the same global tensor (SPEC.md §Block exchange)"
            )
        if role == "param" and name in plain:
            (dt, sh), rs = next(iter(kinds.items()))
            flat = sorted((r, pdt, psh) for (pdt, psh), prs in plain[name].items() for r in prs)
            holders = "; ".join(f"rank {r}: plain {pdt}{list(psh)}" for r, pdt, psh in flat)
            raise TensorMismatch(
                f"tensor {name!r}: {_ranks(rs)} hold DTensor slices of a {dt}{list(sh)} tensor, but {holders}; "
                "a tensor is either sharded (a DTensor on every rank holding part of it) or plain everywhere "
                "(SPEC.md §Block exchange)"
            )


def coverage_problem(
    name: str, role: str, dtype: str, shape: tuple[int, ...], held: dict, world: int, what: str
) -> str:
    """The message for slices of one tensor that do not tile it (``what``: slice_regions'
    finding): which ranks hold which slices, and which ranks of the group hold none."""
    holders = sorted({r for rs in held.values() for r in rs})
    boxes = sorted(held.items())
    shown = ", ".join(
        f"{_ranks(rs)} at {list(b[0])} of extent {list(b[1])}" for b, rs in boxes[:_SHOWN] if math.prod(b[1])
    )
    more = f" and {len(boxes) - _SHOWN} more" if len(boxes) > _SHOWN else ""
    none = [r for r in range(world) if r not in holders]
    verb = "holds" if len(none) == 1 else "hold"
    missing = (
        f"; {_ranks(none)} of the group {verb} no part of it (not passed, or passed under another name)" if none else ""
    )
    return f"{role} of {what} ({dtype}{list(shape)}); slices held: {shown or 'none'}{more}{missing} (SPEC.md §Block exchange)"
