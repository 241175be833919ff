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

One save is in flight at a time: ``save`` first waits for the previous one (its arena is
about to be overwritten), and raises its error if it failed. ``wait`` returns the last
commit id or raises the last error. An error is raised once, by whichever of ``save``,
``wait`` or ``close`` comes first; it is never dropped silently (a saver collected with an
unreported error warns).

Memory bound: the arena holds one copy of the slot's tensors (parameters and both Adam
moments), at 64-byte-aligned offsets; RNG states are small bytes. Nothing else is copied.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .checkpoint import AUTO, CommitInfo, SlotState, capture, save_slots
from .dtensor import is_dtensor
from .errors import TensorMismatch
from .optim import OptimState, ParamOpt
from .store import Store

__all__ = ["AsyncSaver"]

_ALIGN = 64


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class AsyncSaver:
    """Saves commits to one store in a background thread, from a reused staging arena.

    ``threads``: the hashing/writing threads of the background save (as for ``save``).
    """

    def __init__(self, store: Store, *, threads: int = 2) -> None:
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
        flat: list[torch.Tensor] = []
        for n in names:
            flat.append(state.tensors[n])
            po = state.optim.params.get(n)
            if po is not None and po.exp_avg is not None and po.exp_avg_sq is not None:
                flat += [po.exp_avg, po.exp_avg_sq]
        if any(is_dtensor(t) for t in flat):  # its background thread cannot take part in collectives
            raise TensorMismatch("AsyncSaver saves one process's plain tensors; save DTensor state with save_distributed (SPEC.md §Block exchange)")
        sizes = [t.numel() * t.element_size() for t in flat]
        pin = torch.cuda.is_available() and any(t.device.type == "cuda" for t in flat)
        arena = self._reserve(sum(_round(s) for s in sizes), pin)
        staged: list[torch.Tensor] = []
        off = 0
        with torch.no_grad():
            for t, size in zip(flat, sizes):
                dst = arena[off : off + size].view(t.dtype).view(t.shape) if size else torch.empty(t.shape, dtype=t.dtype)
                if size:
                    dst.copy_(t.detach(), non_blocking=pin)
                staged.append(dst)
                off += _round(size)
        if pin:
            torch.cuda.synchronize()
        it = iter(staged)
        tensors: dict[str, torch.Tensor] = {}
        params: dict[str, ParamOpt] = {}
        for n in names:
            tensors[n] = next(it)
            po = state.optim.params.get(n)
            if po is not None and po.exp_avg is not None and po.exp_avg_sq is not None:
                params[n] = ParamOpt(po.group, po.age, next(it), next(it))
            elif po is not None:
                params[n] = ParamOpt(po.group, po.age, None, None)
        optim = OptimState(state.optim.algorithm, dict(state.optim.groups), params)
        births = None if state.births is None else dict(state.births)
        return SlotState(tensors, optim, dict(state.rng), births)

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

    def save(
        self,
        model: torch.nn.Module | Mapping[str, torch.Tensor],
        optimizer: Any = None,
        *,
        step: int,
        ref: str | None = "main",
        job: str = "default",
        config: Mapping[str, Any] | None = None,
        data_cursor: int | None = None,
        rng: bool = True,
        parent: str | None = AUTO,
        transition: str = "train",
        group_names: list[str] | None = None,
    ) -> None:
        """Snapshot ``model`` (and optimizer, RNG) now and commit it in the background.

        Same arguments as ``shardstore.save``. Returns once the snapshot is taken; the
        state may then change freely. Raises the previous save's error, if any.
        """
        self._collect()
        info = CommitInfo(step=step, job=job, config=config, data_cursor=data_cursor, transition=transition)
        snap = self._snapshot(capture(model, optimizer, rng=rng, group_names=group_names))
        self._future = self._pool.submit(save_slots, self.store, [snap], info=info, ref=ref, parent=parent, threads=self.threads)

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
        failed = getattr(self, "_error", None) is not None or (fut is not None and fut.done() and fut.exception() is not None)
        if failed:
            warnings.warn("AsyncSaver dropped with a failed background save that nobody waited for", RuntimeWarning, stacklevel=1)
