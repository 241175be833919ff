"""``StoreWriter``: a ``torch.distributed.checkpoint`` storage writer whose every save is a commit.

``dcp.save(state_dict, storage_writer=StoreWriter("store/", ref="main"))`` — and ``dcp.async_save``
in thread or process mode — work unchanged. DCP calls, and what each does here (SPEC.md §9.4, §15):

1. ``set_up_storage_writer`` (every rank): opens the store; the coordinator reads ``ref``, the
   new commit's parent and the value its compare-and-swap will expect.
2. ``prepare_local_plan`` (every rank): refuses, before anything is written, a chunk the format
   cannot hold (a dtype outside §5's list, a non-strided tensor).
3. ``prepare_global_plan`` (coordinator): refuses two chunks that would share a tensor entry name,
   and a key path the DCP document could not hold.
4. ``write_data`` (every rank): each tensor chunk becomes the blocks of its own canonical grid
   (§5.1: an unchanged chunk is the same objects, written again for nothing), each bytes item one
   object of its bytes; all hashed once, written create-only, then one durability barrier. It
   returns, per item, what it wrote; DCP gathers those on the coordinator only if every rank
   succeeded.
5. ``finish`` (coordinator, after every rank's ``write_data`` returned): the DCP document, one
   shard manifest per rank (its chunks), the commit manifest (read back and checked), and only
   then the ref moves by compare-and-swap from the value step 1 read.

A failure in any call on any rank stops DCP before ``finish`` (or inside it, before the ref
moves), so the ref stays where it was; the objects written are unreferenced and ``gc`` removes
them after its grace period. shardstore never unpickles a bytes item: it stores, hashes and
returns DCP's bytes as they are.
"""

from __future__ import annotations

import dataclasses
import io
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..checkpoint.info import CommitInfo, check_info, check_parent
from ..checkpoint.slots import shard_entries_manifest, write_commit
from ..errors import CommitProtocolError, InvalidName, ManifestError, TensorMismatch, UnsupportedState
from ..format.dcp import (
    DCP_EXTRA,
    BytesItem,
    DcpDocument,
    check_planner_strings,
    chunk_entry_name,
    document_problems,
    encode_document,
)
from ..format.grid import put_payloads
from ..format.manifest import Block, ExtraEntry, Payload, StateTensor, TensorEntry
from ..format.names import check_ref_name
from ..format.tensors import check_shape, check_storable, dtype_name
from ..state.module import tensor_profile
from ..store import Store, manifest_bytes
from ..store.tensors import WriteBatch
from .handle import StoreHandle
from .metadata import document_of, is_whole, storage_data_of

__all__ = ["StoreWriter", "Written"]

#: Tensor bytes handed to one ``put_payloads`` batch: bounds what a save of device tensors
#: holds in host memory at once (each block is copied to the host as it is hashed).
_BATCH_BYTES = 256 << 20


@dataclass(frozen=True)
class Written:
    """What ``write_data`` wrote for one item (a ``WriteResult``'s ``storage_data``): plain values,
    as DCP gathers them on the coordinator. ``payload``: one object id, or the blocks as
    (start, shape, object id); a bytes item is a 1-d ``uint8`` payload of one object."""

    kind: Literal["tensor", "bytes"]
    dtype: str
    shape: tuple[int, ...]
    payload: str | tuple[tuple[tuple[int, ...], tuple[int, ...], str], ...]

    def manifest_payload(self) -> Payload:
        if isinstance(self.payload, str):
            return self.payload
        return tuple(Block(start=s, shape=n, object=o) for s, n, o in self.payload)


def _plain(payload: Payload) -> str | tuple[tuple[tuple[int, ...], tuple[int, ...], str], ...]:
    if isinstance(payload, str):
        return payload
    return tuple((tuple(b.start), tuple(b.shape), b.object) for b in payload)


def _item_name(item: WriteItem) -> str:
    td = item.tensor_data
    assert td is not None  # a tensor item
    offsets, sizes = tuple(td.chunk.offsets), tuple(td.chunk.sizes)
    return chunk_entry_name(item.index.fqn, offsets, is_whole(offsets, sizes, tuple(td.size)))


class StoreWriter(StorageWriter):
    """Saves through ``torch.distributed.checkpoint`` as a commit of a shardstore store.

    ``store_or_url``: a store URL (a path, ``s3://...``; opened, and created if absent, in each
    process that writes, with ``storage_options``), or an open ``Store`` (in-process saves, and
    process-mode ``async_save`` for a local store only). ``ref``: the ref each save moves by
    compare-and-swap (None: move none; ``last_commit`` names the commit on the coordinator's
    writer); a ``checkpoint_id`` passed to ``dcp.save`` replaces it from then on. DCP does not
    tell a storage layer the training step: ``step``, ``job`` and ``data_cursor`` are recorded in
    every commit this writer makes. ``thread_count``: objects hashed and written at once.
    """

    def __init__(
        self,
        store_or_url: Store | str | os.PathLike[str],
        ref: str | None = "main",
        *,
        step: int = 0,
        job: str = "default",
        data_cursor: int | None = None,
        thread_count: int = 2,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.handle = StoreHandle(store_or_url, storage_options)
        self.ref = None if ref is None else check_ref_name(ref)
        self.info = CommitInfo(step=step, job=job, data_cursor=data_cursor, profile="none")
        check_info(self.info)  # arguments before writes: a bad step or job id is refused here
        self.thread_count = max(1, int(thread_count))
        self.last_commit: str | None = None
        self._parent: str | None = None

    # -- DCP's protocol ----------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save begins; a ``checkpoint_id`` names the ref it moves (SPEC.md §Names)."""
        if checkpoint_id is not None:
            self.ref = check_ref_name(os.fspath(checkpoint_id))
        self._parent = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` can name the ref a save moves."""
        try:
            check_ref_name(os.fspath(checkpoint_id))
        except (InvalidName, TypeError):
            return False
        return True

    def storage_meta(self) -> StorageMeta | None:
        return None  # nothing per save: a commit's identity holds no save id or time

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise CommitProtocolError(
                "dcp.save(use_collectives=False) writes each rank without the others; a commit moves its ref only "
                "after every rank's data is durable (SPEC.md §15), so StoreWriter needs the collectives"
            )
        store = self.handle.open(create=True)
        self._parent = None
        if is_coordinator:
            self._parent = store.ref(self.ref) if self.ref is not None else None
            check_parent(store, self._parent)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            td = item.tensor_data
            if td is None:
                raise TensorMismatch(f"DCP item {item.index.fqn!r}: a tensor item without its chunk")
            what = f"DCP tensor {item.index.fqn!r}"
            dtype_name(td.properties.dtype, what)  # a dtype outside SPEC.md §5's list: refused now
            if td.properties.layout != torch.strided:
                raise UnsupportedState(f"{what}: layout {td.properties.layout} is not strided")
            check_shape(td.size, what)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        seen: dict[str, str] = {}
        for plan in plans:
            if isinstance(plan.planner_data, Mapping):  # DefaultSavePlanner's flattening map
                check_planner_strings(
                    {k: v for k, v in plan.planner_data.items() if isinstance(k, str) and isinstance(v, (tuple, list))}
                )
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    continue
                name = _item_name(item)
                where = f"{item.index.fqn!r} at {list(item.index.offset or ())}"
                if seen.setdefault(name, where) != where:
                    raise UnsupportedState(
                        f"DCP chunks {seen[name]} and {where} would both be tensor entry {name!r} (SPEC.md §9.4)"
                    )
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        store = self.handle.open(create=True)
        results: list[WriteResult] = []
        batch: list[tuple[WriteItem, torch.Tensor]] = []
        size = 0
        writes = store.write_batch()  # every object of this rank durable together, at one barrier
        try:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    continue
                t = self._chunk(item, planner)
                batch.append((item, t))
                size += t.numel() * t.element_size()
                if size >= _BATCH_BYTES:
                    results += self._put_tensors(store, batch, writes)
                    batch, size = [], 0
            results += self._put_tensors(store, batch, writes)
            results += self._put_bytes(
                store, [i for i in plan.items if i.type == WriteItemType.BYTE_IO], planner, writes
            )
            writes.finish(store.storage, threads=self.thread_count)
        finally:
            writes.abandon(store.storage)  # a failed write leaves no tmp file behind (nothing once finished)
        store.sync()  # every object durable before write_data reports it (SPEC.md §15)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        store = self.handle.open(create=True)
        started = time.time()
        doc = document_of(metadata, chunk_entry_name)
        entries, tensors = _match(doc, _gather(results), len(results))
        cid = self._commit(store, doc, entries, tensors)
        if self.ref is not None:  # last: every rank's data is durable and the commit checked (SPEC.md §15)
            store.set_ref(self.ref, cid, expected=self._parent)
        self.last_commit = cid
        metadata.storage_data = storage_data_of(doc)
        store.write_journal(
            cid,
            {"time": started, "seconds": time.time() - started, "host": socket.gethostname(), "pid": os.getpid()},
        )

    def _commit(
        self, store: Store, doc: DcpDocument, entries: list[list[TensorEntry]], tensors: list[StateTensor]
    ) -> str:
        """The document and one shard manifest per slot (durable together, at one barrier), then
        the commit manifest (read back and checked)."""
        raw = encode_document(doc)  # UnsupportedState for a string no state document may hold
        by_name = {e.name: e for es in entries for e in es}
        problems = document_problems(doc, by_name, tensors)
        if problems or len(by_name) != sum(map(len, entries)):
            raise ManifestError(f"DCP document of this save: {(problems or ['two chunks share an entry name'])[0]}")
        info = dataclasses.replace(self.info, profile=tensor_profile(e.dtype for e in by_name.values()))
        shards = [
            shard_entries_manifest(
                store,
                es,
                groups=[],
                algorithm="none",
                rng={},
                info=info,
                parent=self._parent,
                slot=i,
                slots=len(entries),
            )
            for i, es in enumerate(entries)
        ]
        doc_id, *shard_ids = store.put_all([raw, *map(manifest_bytes, shards)], threads=self.thread_count)
        store.sync()  # all durable before the commit manifest names them (SPEC.md §15)
        extra = ExtraEntry(key=DCP_EXTRA, state=doc_id, tensors=tuple(tensors))
        return write_commit(store, shard_ids, info=info, parent=self._parent, extras=(extra,))

    # -- the pieces --------------------------------------------------------------------

    @staticmethod
    def _chunk(item: WriteItem, planner: SavePlanner) -> torch.Tensor:
        what = f"DCP tensor {item.index.fqn!r}"
        t = planner.resolve_data(item)
        if not isinstance(t, torch.Tensor):
            raise TensorMismatch(f"{what}: the planner resolved a tensor item to a {type(t).__name__}")
        td = item.tensor_data
        assert td is not None  # prepare_local_plan refused tensor items without one
        if tuple(t.shape) != tuple(td.chunk.sizes):
            raise TensorMismatch(
                f"{what}: the planner resolved shape {list(t.shape)} for a chunk of {list(td.chunk.sizes)}"
            )
        check_storable(t, what)
        return t.detach()

    def _put_tensors(
        self, store: Store, batch: Sequence[tuple[WriteItem, torch.Tensor]], writes: WriteBatch
    ) -> list[WriteResult]:
        if not batch:
            return []
        payloads = put_payloads(store, [t for _, t in batch], threads=self.thread_count, batch=writes)
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=t.numel() * t.element_size(),
                storage_data=Written("tensor", dtype_name(t.dtype), tuple(t.shape), _plain(p)),
            )
            for (item, t), p in zip(batch, payloads)
        ]

    def _put_bytes(
        self, store: Store, items: Sequence[WriteItem], planner: SavePlanner, writes: WriteBatch
    ) -> list[WriteResult]:
        blobs = []
        for item in items:
            data = planner.resolve_data(item)
            if isinstance(data, io.BytesIO):
                raw = data.getvalue()
            elif isinstance(data, (bytes, bytearray, memoryview)):
                raw = bytes(data)
            else:  # bytes() of an int, or of a 1-element tensor, is that many zero bytes: never stored
                raise UnsupportedState(
                    f"DCP bytes item {item.index.fqn!r}: the planner resolved it to a {type(data).__name__}, "
                    "not io.BytesIO or bytes"
                )
            blobs.append(
                torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            )
        ids = store.put_tensors(blobs, threads=self.thread_count, batch=writes) if blobs else []
        return [
            WriteResult(
                index=item.index, size_in_bytes=b.numel(), storage_data=Written("bytes", "uint8", (b.numel(),), oid)
            )
            for item, b, oid in zip(items, blobs, ids)
        ]


def _gather(results: list[list[WriteResult]]) -> dict[tuple[str, tuple[int, ...] | None], tuple[int, Written]]:
    """Every rank's results by (fqn, chunk offsets; None for a bytes item): one writer each."""
    out: dict[tuple[str, tuple[int, ...] | None], tuple[int, Written]] = {}
    for slot, rank_results in enumerate(results):
        for r in rank_results:
            if not isinstance(r.storage_data, Written):
                raise CommitProtocolError(f"rank {slot} returned a {type(r.storage_data).__name__} for {r.index.fqn!r}")
            w = r.storage_data
            key = (r.index.fqn, None if w.kind == "bytes" else tuple(int(o) for o in (r.index.offset or ())))
            if key in out:
                raise CommitProtocolError(
                    f"DCP item {key[0]!r} at {key[1]} was written by ranks {out[key][0]} and {slot}"
                )
            out[key] = (slot, w)
    return out


def _match(
    doc: DcpDocument, written: dict[tuple[str, tuple[int, ...] | None], tuple[int, Written]], slots: int
) -> tuple[list[list[TensorEntry]], list[StateTensor]]:
    """Every item of the document matched to what a rank wrote for it: each slot's tensor entries
    (its chunks) and the extra's tensors (the bytes items, in key order). An item no rank wrote,
    or a write no item lists, is refused: nothing is committed without its data, or dropped."""
    entries: list[list[TensorEntry]] = [[] for _ in range(slots)]
    for fqn, item in sorted(doc.items.items()):
        if isinstance(item, BytesItem):
            continue
        for c in item.chunks:
            slot, w = _take(written, fqn, tuple(c.offsets), "tensor")
            if (w.dtype, w.shape) != (item.dtype, tuple(c.sizes)):
                raise TensorMismatch(
                    f"DCP tensor {fqn!r}, chunk at {list(c.offsets)}: rank {slot} wrote {w.dtype}{list(w.shape)}, "
                    f"the plan says {item.dtype}{list(c.sizes)}"
                )
            entry = TensorEntry(
                name=c.entry, dtype=item.dtype, shape=tuple(c.sizes), param=w.manifest_payload(), optim=None
            )
            entries[slot].append(entry)
    keys = [fqn for fqn, item in sorted(doc.items.items()) if isinstance(item, BytesItem)]  # their "tensor:<i>" order
    tensors = [
        StateTensor(key=str(i), dtype="uint8", shape=w.shape, object=w.payload)  # type: ignore[arg-type]
        for i, (_, w) in enumerate(_take(written, fqn, None, "bytes") for fqn in keys)
    ]
    if written:
        (fqn, offsets), (slot, _) = next(iter(written.items()))
        raise UnsupportedState(f"rank {slot} wrote DCP item {fqn!r} at {offsets}, which the metadata does not list")
    return entries, tensors


def _take(
    written: dict[tuple[str, tuple[int, ...] | None], tuple[int, Written]],
    fqn: str,
    offsets: tuple[int, ...] | None,
    kind: str,
) -> tuple[int, Written]:
    got = written.pop((fqn, offsets), None)
    if got is None or got[1].kind != kind:
        raise CommitProtocolError(
            f"DCP {kind} item {fqn!r}{'' if offsets is None else f' at {list(offsets)}'} is in the metadata but no rank "
            "wrote it: refused rather than committed without it"
        )
    return got
