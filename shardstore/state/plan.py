"""A restore plan: what a restore reads, and what it then installs (SPEC.md §16, §19.2).

The one vocabulary every part of a restore speaks, as torch.distributed.checkpoint's
``LoadPlan`` of ``ReadItem``\\ s is DCP's. A restore (``checkpoint.restore``) runs in three phases:

1. **plan**: each part of the caller's state — its tensors, Adam's canonical form
   (``optim.plan_adam_restore``), any other torch optimizer's torch form
   (``torch_optim.plan_torch_restore``), extras (``extras.plan_extras_restore``), RNG — is
   matched against the commit and checked (names, dtypes, shapes, classes, groups, state
   documents), and every destination it needs is chosen or allocated (a size taken from a
   manifest only once the objects are known to hold that many bytes). Anything that does not
   fit is refused here with a typed error: nothing of the caller's has been written yet.
2. **read**: every ``ReadItem``'s payload is read into its destination, every object's size
   checked before the first byte lands, every block verified as it lands.
3. **install**: each plan's installs make what was read the caller's state (torch's
   ``load_state_dict``, an optimizer's ``state``, an extra's ``load_state_dict``, the RNG).

A plan is a value: the parts' plans add up (``RestorePlan.of``) to the restore's one plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..format.lazy import torch
from ..format.manifest import Payload

__all__ = ["ReadItem", "RestorePlan"]


@dataclass(frozen=True)
class ReadItem:
    """One destination and the stored payload that fills it (DCP's ``ReadItem``).

    ``payload``: an object id, or a chunked payload's blocks; ``dest``: the tensor the bytes go
    into (a DTensor: its local slices, from the blocks they overlap, SPEC.md §5.1); ``what``:
    the destination's name in errors (``tensor 'w'``, ``exp_avg of 'w'``).
    """

    payload: Payload
    dest: torch.Tensor
    what: str


@dataclass(frozen=True)
class RestorePlan:
    """A checked restore of some part of a commit: the reads that fill its destinations, then
    the installs that make them the caller's state, in order. Planning one writes nothing."""

    reads: tuple[ReadItem, ...] = ()
    installs: tuple[Callable[[], None], ...] = ()

    def __add__(self, other: RestorePlan) -> RestorePlan:
        return RestorePlan(self.reads + other.reads, self.installs + other.installs)

    @classmethod
    def of(cls, plans: Iterable[RestorePlan]) -> RestorePlan:
        """One plan of several: their reads, then their installs, each in the order given."""
        out = cls()
        for p in plans:
            out += p
        return out

    def install(self) -> None:
        """Run the installs (after every read has landed)."""
        for fn in self.installs:
            fn()
