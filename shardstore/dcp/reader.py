"""``StoreReader``: a ``torch.distributed.checkpoint`` storage reader of commits a ``StoreWriter`` made.

``dcp.load(state_dict, storage_reader=StoreReader("store/", target="main"))`` works unchanged, into
any split DCP's planner can plan (FSDP2 on another number of ranks, tensor parallelism, one
process). DCP calls, and what each does here (SPEC.md §9.4, §16):

1. ``read_metadata`` (every rank): resolves ``target`` to a commit, reads and checks the commit,
   its shard manifests and its DCP document (structure, binding, learned-state root, the
   document against the entries), and returns the document's ``Metadata``. With ``group=``
   (collective), group rank 0 resolves ``target`` and the manifests are read once in the group
   (§16.3).
2. ``prepare_local_plan`` / ``prepare_global_plan``: each rank's plan carries the commit id it
   resolved, and the coordinator refuses the load if two ranks resolved the target differently
   (a ref moved between their reads): every rank loads one commit or none.
3. ``read_data`` (every rank): before any byte lands in a caller's tensor, checks every read
   against its chunk and the sizes of the objects it needs; then reads only the blocks of each
   chunk its read items overlap (§5.1), each verified against its id as it lands, and hands
   bytes items to the planner as they are (DCP's planner ``torch.load``s them, in the caller's
   process: shardstore never unpickles anything). With ``group=`` (the process group
   ``dcp.load`` runs over, every rank of which calls ``read_data``), each block is read once
   in the group and its pieces sent to the ranks whose reads overlap it (§16.2).
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import CommitProtocolError, InvalidName, ManifestError, StateMismatch, TensorMismatch
from ..format.dcp import BytesItem, dcp_extra, decode_document, document_problems
from ..format.grid import BlockRead, check_reads, read_parts, run_reads
from ..format.manifest import MAX_MANIFEST_BYTES, StateTensor, TensorEntry
from ..format.names import check_oid_prefix, check_ref_name
from ..format.tensors import torch_dtype
from ..sharded.read_exchange import grouped, read_group
from ..store import Store
from ..verification.commits import load_commit
from .handle import StoreHandle
from .metadata import metadata_of

__all__ = ["StoreReader"]


class StoreReader(StorageReader):
    """Loads a commit made by ``StoreWriter`` through ``torch.distributed.checkpoint``.

    ``store_or_url``: a store URL (opened, never created, with ``storage_options``) or an open
    ``Store``. ``target``: a ref, a commit id or an id prefix, resolved once per load by each rank
    (the ranks must agree); a ``checkpoint_id`` passed to ``dcp.load`` replaces it from then on.
    ``thread_count``: objects read at once, each hashed as it lands. ``commit`` names the commit
    the last ``read_metadata`` resolved. ``group``: the process group ``dcp.load`` runs over, to
    read each block once in the group and exchange the pieces (SPEC.md §16.2; a collective: every
    rank of it loads); None (the default), or a group of one, reads each rank's blocks itself.
    """

    def __init__(
        self,
        store_or_url: Store | str | os.PathLike[str],
        target: str = "main",
        *,
        thread_count: int = 4,
        storage_options: Mapping[str, Any] | None = None,
        group: Any = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.handle = StoreHandle(store_or_url, storage_options)
        self.target = str(target)
        self.thread_count = max(1, int(thread_count))
        self.commit: str | None = None
        self._chunks: dict[tuple[str, tuple[int, ...]], TensorEntry] = {}
        self._bytes: dict[str, StateTensor] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new load begins; a ``checkpoint_id`` names its target (a ref, commit id or prefix)."""
        if checkpoint_id is not None:
            self.target = os.fspath(checkpoint_id)
        self.commit, self._chunks, self._bytes = None, {}, {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` can name a target: a ref name or an id prefix."""
        for check in (check_ref_name, check_oid_prefix):
            try:
                check(os.fspath(checkpoint_id))
                return True
            except (InvalidName, TypeError):
                continue
        return False

    def read_metadata(self) -> Metadata:
        store = self.handle.open(create=False)
        # every structural rule, before anything else is read; with a group, its manifests read once in it
        # (SPEC.md §16.3), the commit resolved by group rank 0 (so prepare_global_plan's check always agrees)
        lc = load_commit(store, self.target, group=self.group)
        x = dcp_extra(lc.commit.extras)
        if x is None:
            raise StateMismatch(
                f"commit {lc.id} (target {self.target!r}) was not written through torch.distributed.checkpoint: "
                "it has no DCP document (SPEC.md §9.4); restore it with shardstore.restore"
            )
        what = f"DCP document {x.state} of commit {lc.id}"
        doc = decode_document(store.get(x.state, limit=MAX_MANIFEST_BYTES), what)
        entries = lc.entries()
        problems = document_problems(doc, entries, x.tensors)
        if problems:
            raise ManifestError(f"{what}: {problems[0]} (SPEC.md §9.4)")
        refs = {t.key: t for t in x.tensors}
        self._chunks = {
            (fqn, tuple(c.offsets)): entries[c.entry]
            for fqn, item in doc.items.items()
            if not isinstance(item, BytesItem)
            for c in item.chunks
        }
        self._bytes = {
            fqn: refs[item.object.split(":")[1]] for fqn, item in doc.items.items() if isinstance(item, BytesItem)
        }
        self.commit = lc.id
        return metadata_of(doc)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.commit is None:
            raise StateMismatch("StoreReader: read_metadata must run before a load is set up")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=self.commit)  # the coordinator compares them

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        ids = [p.storage_data for p in plans]
        if len(set(ids)) > 1:
            ranks = ", ".join(f"rank {r}: {c}" for r, c in enumerate(ids))
            raise CommitProtocolError(
                f"the ranks resolved target {self.target!r} to different commits ({ranks}); every rank must load "
                "the same commit (SPEC.md §15): name one commit id"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        store = self.handle.open(create=False)
        tensors = [r for r in plan.items if r.type != LoadItemType.BYTE_IO]
        exchange = grouped(self.group)
        jobs: list[BlockRead] = []
        items: list[Any] = []  # by exchange: (payload, dtype, shape, parts, label) of each read
        done: list[tuple[ReadItem, torch.Tensor, torch.Tensor | None]] = []
        blobs: list[tuple[ReadItem, bytes]] = []
        failure: Exception | None = None
        try:
            for r in tensors:
                e = self._check(r)  # every read item against its chunk, before any byte lands
                target = planner.resolve_tensor(r).detach()
                if tuple(target.shape) != tuple(r.lengths):
                    raise TensorMismatch(
                        f"DCP tensor {r.dest_index.fqn!r}: the planner's target has shape {list(target.shape)} "
                        f"for a read of {list(r.lengths)}"
                    )
                direct = target.dtype == torch_dtype(e.dtype) and target.device.type == "cpu"
                dest = target if direct else torch.empty(tuple(r.lengths), dtype=torch_dtype(e.dtype))
                # only the blocks this read overlaps, each read whole, once (SPEC.md §5.1)
                parts = [(dest, tuple(int(o) for o in r.storage_offsets))]
                if exchange:
                    items.append((e.param, e.dtype, tuple(e.shape), parts, f"DCP chunk {e.name!r}"))
                else:
                    jobs += read_parts(store, e.param, e.dtype, e.shape, parts, f"DCP chunk {e.name!r}")
                done.append((r, target, None if direct else dest))
            if not exchange:
                check_reads(store, jobs, threads=self.thread_count)  # every object these reads need, of its size
            blobs = [(r, self._read_bytes(store, r)) for r in plan.items if r.type == LoadItemType.BYTE_IO]  # verified
        except Exception as e:  # noqa: BLE001 - by exchange: still take part, so every rank raises, none waits
            if not exchange:
                raise
            failure = e
        if exchange:  # sizes checked on every rank before any byte lands, each block read once (SPEC.md §16.2)
            read_group(store, items, self.thread_count, self.group, failure=failure)
        for r, data in blobs:
            planner.load_bytes(r, io.BytesIO(data))
        if not exchange:
            run_reads(jobs, threads=self.thread_count)  # each block verified as it lands (SPEC.md §16)
        for r, target, staged in done:
            if staged is not None:
                target.copy_(staged)  # another dtype or device: torch converts, as FileSystemReader's copy_ does
            planner.commit_tensor(r, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _check(self, r: ReadItem) -> TensorEntry:
        """The entry holding the chunk ``r`` reads; TensorMismatch unless the read lies inside it."""
        e = self._chunks.get((r.storage_index.fqn, tuple(int(o) for o in (r.storage_index.offset or ()))))
        if e is None:
            raise StateMismatch(
                f"commit {self.commit} holds no chunk of {r.storage_index.fqn!r} at {list(r.storage_index.offset or ())}"
            )
        start, extent = _region(r)
        if not len(start) == len(extent) == len(e.shape) or any(
            o < 0 or o + n > d for o, n, d in zip(start, extent, e.shape)
        ):
            raise TensorMismatch(
                f"DCP chunk {e.name!r}: a read at {list(start)} of extent {list(extent)} leaves its shape {list(e.shape)}"
            )
        return e

    def _read_bytes(self, store: Store, r: ReadItem) -> bytes:
        t = self._bytes.get(r.storage_index.fqn)
        if t is None:
            raise StateMismatch(f"commit {self.commit} holds no bytes item {r.storage_index.fqn!r}")
        n = int(t.shape[0])
        data = bytes(store.get(t.object, limit=n))  # type: ignore[arg-type]  (one object: SPEC.md §9.3)
        if len(data) != n:
            raise TensorMismatch(
                f"DCP bytes item {r.storage_index.fqn!r}: object {t.object} holds {len(data)} bytes, not {n}"
            )
        return data


def _region(r: ReadItem) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(int(o) for o in r.storage_offsets), tuple(int(n) for n in r.lengths)
