"""Asynchronous save: snapshot into reused host memory, return to training, commit in the background.

A training loop blocks only while the state one slot owns is copied into a staging arena
(one flat host buffer, allocated on first use and reused by every later save; it grows
only if the state does)::

    saver = shardstore.AsyncSaver(store)
    for step in ...:
        train_one_step()
        if step % 100 == 0:
            saver.save(model, optimizer, step=step)   # returns after the copy
    commit_id = saver.wait()                           # or saver.close()

The background thread then does exactly what ``save`` does, from the snapshot: hash and
write the objects, make them durable, write the shard manifest and the commit, and only
then move the ref by compare-and-swap. A crash at any point leaves the ref where it was.

In a process group, ``saver.save_distributed(model, optimizer, info=..., group=g)`` does the
same for ``save_distributed``: DTensors (FSDP2, tensor parallelism) are staged as their
local slices and the block exchange and commit protocol run in the background, over a
group ``g`` of the saver's own (``dist.new_group()``, made once), never the group training
uses, so that the two threads' collectives cannot interleave.

One save is in flight at a time: ``save`` first waits for the previous one (its arena is
about to be overwritten), and raises its error if it failed. ``wait`` returns the last
commit id or raises the last error. An error is raised once, by whichever of ``save``,
``wait`` or ``close`` comes first; it is never dropped silently (a saver collected with an
unreported error warns).

Memory bound: the arena holds one copy of the slot's tensors (parameters, buffers, both
Adam moments or any other optimizer's state tensors), at 64-byte-aligned offsets; RNG
states and extras' documents are small bytes, and extras' tensors (a scaler's, a
loader's: small) are cloned. Nothing else is copied.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from ..errors import StateMismatch, TensorMismatch
from ..format.tensors import is_dtensor
from ..sharded.placement import local_parts
from ..state.extras import CapturedExtra, capture_extras
from ..state.optim import ParamOpt
from ..state.slot import SlotState, capture, slot_tensors
from ..store import Store
from ..store.tensors import WRITE_THREADS
from .distributed import commit_state, torch_form_anywhere
from .info import CommitInfo
from .slots import AUTO, SaveCall, save_slots

__all__ = ["AsyncSaver"]

_ALIGN = 64


def _rewrap(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A DTensor split like ``like`` whose local slice is ``local`` (no communication)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )  # type: ignore[attr-defined]


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _copy_extras(extra: dict[str, CapturedExtra]) -> dict[str, CapturedExtra]:
    """Extras' documents are already bytes; their tensors (small: a scaler's, a loader's) are cloned."""
    return {
        k: CapturedExtra(c.key, c.document, [t.detach().to("cpu", copy=True) for t in c.tensors])
        for k, c in extra.items()
    }


class AsyncSaver:
    """Saves commits to one store in a background thread, from a reused staging arena.

    ``threads``: the hashing/writing threads of the background save (as for ``save``).
    """

    def __init__(self, store: Store, *, threads: int = WRITE_THREADS) -> None:
        self.store = store
        self.threads = threads
        self._arena: torch.Tensor | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardstore-async-save")
        self._future: Future[str] | None = None
        self._last: str | None = None
        self._error: BaseException | None = None

    # -- staging -------------------------------------------------------------------------

    def _reserve(self, nbytes: int, pin: bool) -> torch.Tensor:
        arena = self._arena
        if arena is None or arena.numel() < nbytes or (pin and not arena.is_pinned()):
            self._arena = None  # release the old one before allocating the new
            arena = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
            self._arena = arena
        return arena

    def _snapshot(self, state: SlotState) -> SlotState:
        """A copy of ``state`` whose tensors live in the arena (one memcpy each)."""
        names = sorted(state.tensors)
        flat = slot_tensors(state)  # payloads in manifest order (torch-form state like parameters', format 3)
        # A DTensor is staged as its local slice and re-wrapped with the same mesh and placements.
        dts = [t if is_dtensor(t) else None for t in flat]
        flat = [local_parts(t)[0] if d is not None else t for t, d in zip(flat, dts)]
        sizes = [t.numel() * t.element_size() for t in flat]
        pin = torch.cuda.is_available() and any(t.device.type == "cuda" for t in flat)
        arena = self._reserve(sum(_round(s) for s in sizes), pin)
        staged: list[torch.Tensor] = []
        off = 0
        with torch.no_grad():
            for t, size in zip(flat, sizes):
                dst = (
                    arena[off : off + size].view(t.dtype).view(t.shape) if size else torch.empty(t.shape, dtype=t.dtype)
                )
                if size:
                    dst.copy_(t.detach(), non_blocking=pin)
                staged.append(dst)
                off += _round(size)
        if pin:
            torch.cuda.synchronize()
        staged = [_rewrap(x, d) if d is not None else x for x, d in zip(staged, dts)]
        it = iter(staged)
        tensors: dict[str, torch.Tensor] = {}
        params: dict[str, ParamOpt] = {}
        for n in names:
            tensors[n] = next(it)
            po = state.optim.params.get(n)
            torch_state = None
            if po is not None and po.torch_state is not None:
                tp = po.torch_state
                torch_state = replace(
                    tp, tensors={k: t for k, t in sorted(tp.tensors.items())}, scalars=dict(tp.scalars)
                )
            if po is not None and po.exp_avg is not None and po.exp_avg_sq is not None:
                params[n] = ParamOpt(po.group, po.age, next(it), next(it))
            elif po is not None:
                params[n] = ParamOpt(po.group, po.age, None, None, torch_state)
            if torch_state is not None:
                torch_state.tensors = {k: next(it) for k in torch_state.tensors}
        optim = replace(
            state.optim, groups=dict(state.optim.groups), params=params, torch_groups=dict(state.optim.torch_groups)
        )
        births = None if state.births is None else dict(state.births)
        return SlotState(tensors, optim, dict(state.rng), births, set(state.buffers), _copy_extras(state.extra))

    # -- the public surface ----------------------------------------------------------------

    def _collect(self) -> None:
        """Wait for the save in flight; raise its error (once) if it failed."""
        fut, self._future = self._future, None
        if fut is not None:
            try:
                self._last = fut.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below, to the caller
                self._error = e
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def save(self, model: torch.nn.Module | Mapping[str, torch.Tensor], optimizer: Any = None, **options: Any) -> None:
        """Snapshot ``model`` (and optimizer, RNG, extras) now and commit it in the background.

        Takes ``shardstore.save``'s keywords (``step``, ``ref``, ``job``, ``config``, ...;
        ``threads`` defaults to the saver's own). Returns once the snapshot is taken; the
        state may then change freely. Raises the previous save's error, if any.
        """
        self._collect()
        options.setdefault("threads", self.threads)
        call = SaveCall.bind(self.store, model, optimizer, **options)
        if any(is_dtensor(t) for t in call.state.tensors.values()):
            raise TensorMismatch(
                "AsyncSaver.save saves one process's plain tensors; save DTensor state with save_distributed (SPEC.md §Block exchange)"
            )
        snap = self._snapshot(call.state)
        wide = _copy_extras(capture_extras(call.extra))
        self._future = self._pool.submit(
            save_slots,
            self.store,
            [snap],
            info=call.info,
            ref=call.ref,
            parent=call.parent,
            threads=call.threads,
            extra=wide,
        )

    def save_distributed(
        self,
        model: torch.nn.Module | Mapping[str, torch.Tensor],
        optimizer: Any = None,
        *,
        info: CommitInfo,
        group: Any,
        ref: str | None = "main",
        parent: str | None = AUTO,
        rng: bool = True,
        group_names: list[str] | None = None,
        on_phase: Callable[[str], None] | None = None,
        then: Callable[[str], None] | None = None,
    ) -> None:
        """Snapshot this rank's state now (DTensors as their local slices) and run
        ``save_distributed`` on it in the background; every rank of ``group`` must call this.

        ``group`` MUST be a process group used by nothing else while the save runs (e.g.
        ``dist.new_group(backend="gloo")``, made once): the background thread's collectives
        would otherwise interleave with training's. ``wait`` returns the commit id.
        Stateful extras are not taken here (pass them to ``shardstore.save_distributed``).
        ``on_phase`` is called in the background thread as each protocol phase begins
        (``commit_state``). ``then(commit id)``, if given, runs in the background thread once the
        commit is durable, before ``wait`` returns it (e.g. copies of the commit's objects sent
        to peers over ``group``: the same thread, so in the same order on every rank); an error
        it raises is the save's error.
        """
        if group is None:
            raise StateMismatch(
                "AsyncSaver.save_distributed needs a process group of its own (dist.new_group), not the default group"
            )
        self._collect()
        torch_form = torch_form_anywhere(group, optimizer)  # every rank's Adam in one form
        snap = self._snapshot(capture(model, optimizer, rng=rng, group_names=group_names, torch_form=torch_form))

        def run() -> str:
            cid = commit_state(
                self.store,
                lambda: snap,
                info=info,
                group=group,
                ref=ref,
                parent=parent,
                threads=self.threads,
                on_phase=on_phase,
            )
            if then is not None:
                then(cid)
            return cid

        self._future = self._pool.submit(run)

    @property
    def pending(self) -> bool:
        """Whether a background save is still running."""
        return self._future is not None and not self._future.done()

    def wait(self) -> str | None:
        """Wait for the background save; return the last commit id (None if none yet), or raise its error."""
        self._collect()
        return self._last

    def close(self) -> str | None:
        """Wait, then stop the background thread and free the arena."""
        try:
            return self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self._arena = None

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:  # already raising: do not mask it, but do not leave the thread behind
            self._pool.shutdown(wait=True)
            self._arena = None

    def __del__(self) -> None:
        fut = getattr(self, "_future", None)
        failed = getattr(self, "_error", None) is not None or (
            fut is not None and fut.done() and fut.exception() is not None
        )
        if failed:
            warnings.warn(
                "AsyncSaver dropped with a failed background save that nobody waited for", RuntimeWarning, stacklevel=1
            )
