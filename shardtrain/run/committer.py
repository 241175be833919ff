"""Committer: a run's commits, made synchronously or in the background while training goes on.

Synchronous (``asynchronous=False``): `commit` runs the whole protocol of
``shardstore.save_distributed`` before it returns; the step loop waits for the objects,
the shard manifests, every slot's acknowledgement and the ref move.

Asynchronous (the default): `commit` copies this slot's state (weights, both Adam
moments, RNG states) into one staging arena that ``shardstore.AsyncSaver`` reuses for
every commit, and returns; a background thread then writes the objects and the shard
manifest, takes part in the commit manifest, the acknowledgement and the ref move, exactly
as the synchronous protocol does. So:

- the ref moves only when every slot's write is durable and acknowledged, as before; a
  commit is recorded (`landed`, the run's result, the progress line) only then;
- at most one commit is in flight per slot: the next `commit` first waits for the
  previous one, whose id is the next commit's parent, so the chain of commits and their
  ids are those of a synchronous run;
- the protocol's collectives run on a process group of their own, made on every rank
  when the committer is built, so the background thread's all-gathers never interleave
  with the pipeline's messages and the trainer's collectives on the default group (two
  threads on one group could issue their operations in different orders on different
  ranks and match the wrong messages);
- a worker lost while a commit is in flight makes the survivors' protocol fail
  (``CommitProtocolError`` within the group's timeout): the ref stays on the previous
  commit; `settle` reports which commit is the last durable one for the abort message.

Once a commit is durable, ``after(commit id, group)`` runs (in the background thread, on the
protocol's group, for background commits): the worker's memory tier holds the commit and sends
the slot's new objects to its buddies (``shardtrain.run.tiers``). The commit is recorded as
landed after it.

``SHARDTRAIN_COMMIT_FAULT=slot=S,step=N,phase=P`` makes slot S exit abruptly from the
background thread as phase P (``write shard``, ``write commit``, ``acknowledge``, ``move
ref``; SPEC.md §15) of the commit at step N begins (the tests' fault injection).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist

import shardstore
from shardstore import CommitInfo, Store
from shardtrain.errors import JobError
from shardtrain.reshape import admission

__all__ = ["COMMIT_FAULT_ENV", "CommitBook", "CommitRecord", "Committer", "commit_fault_from_env"]

COMMIT_FAULT_ENV = "SHARDTRAIN_COMMIT_FAULT"
_PHASES = ("read parent", "write shard", "write commit", "acknowledge", "move ref")


def commit_fault_from_env() -> tuple[int, int, str] | None:
    """(slot, step, phase) from SHARDTRAIN_COMMIT_FAULT, or None."""
    raw = os.environ.get(COMMIT_FAULT_ENV)
    if not raw:
        return None
    try:
        parts = dict(p.split("=", 1) for p in raw.split(","))
        fault = int(parts["slot"]), int(parts["step"]), parts["phase"]
    except (ValueError, KeyError) as exc:
        raise JobError(f"{COMMIT_FAULT_ENV}={raw!r}: expected slot=S,step=N,phase=P") from exc
    if fault[2] not in _PHASES:
        raise JobError(f"{COMMIT_FAULT_ENV}={raw!r}: phase must be one of {', '.join(_PHASES)}")
    return fault


class Committer:
    """Makes one slot's share of a run's commits; `last` is the last durable (step, commit id)."""

    def __init__(
        self,
        store: Store,
        stage: torch.nn.Module,
        optimizer: Any,
        *,
        rank: int,
        ref: str,
        last: tuple[int, str | None],
        asynchronous: bool = True,
        timeout: timedelta = timedelta(seconds=60),
        after: Callable[[str, Any], None] | None = None,
    ) -> None:
        self.store, self.stage, self.optimizer, self.ref = store, stage, optimizer, ref
        self.after = after  # (commit id, the protocol's group) once a commit is durable: the memory tier's fill
        self.rank = rank
        self.last = last
        self.asynchronous = asynchronous
        self.group: Any = None
        if asynchronous:
            if not dist.is_initialized():
                raise JobError("asynchronous commits need an initialised process group")
            # Collective over the default group: every rank builds its committer at the same point.
            self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.saver = shardstore.AsyncSaver(store) if asynchronous else None
        self._in_flight: int | None = None  # the step of the commit being written, if any
        self._failed: int | None = None  # the step of a commit whose protocol raised, until `settle`
        self._landed: list[tuple[int, str]] = []
        fault = commit_fault_from_env()
        self._fault = fault if fault is not None and fault[0] == rank else None

    def commit(self, info: CommitInfo) -> None:
        """Commit this slot's current state as `info` (collective: every slot, same commits)."""
        if self.saver is None:
            try:
                cid = shardstore.save_distributed(
                    self.store, self.stage, self.optimizer, info=info, ref=self.ref, parent=self.last[1]
                )
            except BaseException:
                self._failed = info.step  # `settle` reads the ref to learn whether it landed anyway
                raise
            if self.after is not None:
                self.after(cid, None)  # every rank, right after the same commit: the default group
            self._land(info.step, cid)
            return
        self._collect()  # at most one in flight: the previous commit lands first and is the parent
        fault = self._fault

        def on_phase(name: str, at: int = info.step) -> None:
            if fault is not None and (fault[1], fault[2]) == (at, name):
                os._exit(3)  # a worker lost while its commit is being written

        self.saver.save_distributed(
            self.stage,
            self.optimizer,
            info=info,
            group=self.group,
            ref=self.ref,
            parent=self.last[1],
            on_phase=on_phase,
            then=None if self.after is None else (lambda cid, after=self.after: after(cid, self.group)),
        )
        self._in_flight = info.step

    def landed(self) -> list[tuple[int, str]]:
        """The commits that became durable since the last call, as (step, commit id); never blocks."""
        if self.saver is not None and self._in_flight is not None and not self.saver.pending:
            self._collect()
        out, self._landed = self._landed, []
        return out

    def drain(self) -> list[tuple[int, str]]:
        """Wait for the commit in flight; return what landed since the last call (raises its error)."""
        self._collect()
        return self.landed()

    def settle(self) -> tuple[int, str | None]:
        """After a failure: wait for the commit in flight and return the last durable commit.

        A commit whose protocol failed may still have moved the ref: the coordinator moves
        it before the last phase's barrier, which a peer lost just then makes fail. So the
        ref is read: if it names a commit of the in-flight step whose parent is the last
        durable one, that commit landed.
        """
        try:
            self._collect()
        except Exception:  # the in-flight commit failed; its error is not the run's cause
            pass
        at, self._failed = self._failed, None
        if at is not None:
            try:
                cid = self.store.ref(self.ref)
                if cid is not None and cid != self.last[1]:
                    c = self.store.commit(cid)
                    if c.step == at and c.parent == self.last[1]:
                        self._land(at, cid)
            except Exception:  # the store cannot say: report the last commit known durable
                pass
        return self.last

    def close(self) -> None:
        """Drain, then stop the background thread and free the staging arena."""
        try:
            self._collect()
        finally:
            if self.saver is not None:
                self.saver.close()

    def _collect(self) -> None:
        if self.saver is None or self._in_flight is None:
            return
        at, self._in_flight = self._in_flight, None
        try:
            cid = self.saver.wait()
        except BaseException:
            self._failed = at
            raise
        assert cid is not None
        self._land(at, cid)

    def _land(self, at: int, cid: str) -> None:
        self.last = (at, cid)
        self._landed.append((at, cid))


class CommitRecord(msgspec.Struct, frozen=True):
    """A commit a worker saw land: the step it holds and its id."""

    step: int
    id: str


class CommitBook:
    """A worker's commit bookkeeping around its `Committer`: every commit's usage gathered from
    all workers when it is asked for, and, once it lands, its record and its journal entry.

    The journal (unhashed, advisory; SPEC.md §19.2) says when a commit landed, its step's loss, each
    worker's actual peak and parameter coverage, and how long the commit took from the call
    to its landing: the save itself for synchronous commits, the time in flight (overlapping
    training) for background ones. Only rank 0 writes it.
    """

    def __init__(
        self, committer: Committer, store: Store, *, rank: int, world: int, usage: Callable[[], admission.Usage]
    ) -> None:
        self.committer, self.store, self.rank, self.world, self.usage = committer, store, rank, world, usage
        self.commits: list[CommitRecord] = []  # what landed, in order
        self.losses: dict[int, float] = {}  # step -> its loss (slot 0 computes it)
        self._usage_at: dict[int, tuple[list[admission.Usage], float]] = {}  # per commit step: usages, when

    def commit(self, info: CommitInfo) -> None:
        """Ask for a commit of `info` (collective: every worker commits at the same steps)."""
        started = time.perf_counter()
        self.committer.commit(info)
        self._usage_at[info.step] = admission.gather_usage(self.usage(), self.rank, self.world), started

    def landed(self, wait: bool = False) -> tuple[int, str] | None:
        """Record and journal what landed since the last call (waiting for the commit in flight
        if `wait`); return the last (step, commit id) that landed, or None."""
        new = self.committer.drain() if wait else self.committer.landed()
        self.commits.extend(CommitRecord(at, cid) for at, cid in new)
        if self.rank == 0:
            for at, cid in new:
                self._journal(at, cid)
        return new[-1] if new else None

    def _journal(self, at: int, cid: str) -> None:
        record: dict[str, object] = {"time": time.time(), "step": at, "loss": self.losses.get(at)}
        if at in self._usage_at:
            usages, started = self._usage_at.pop(at)
            record.update(
                admission.journal_record(usages),
                commit_seconds=time.perf_counter() - started,
                commit_mode="background" if self.committer.asynchronous else "synchronous",
            )
        self.store.write_journal(cid, record)  # shardstore log --oneline shows its time and loss
