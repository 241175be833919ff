"""The DCP document: how a ``torch.distributed.checkpoint`` save is held as a commit (SPEC.md §9.4).

A save through ``shardstore.dcp.StoreWriter`` is an ordinary commit, so ``verify``, ``log``,
``diff``, ``copy`` and ``gc`` handle it like any other:

- every tensor chunk DCP's planner wrote (one ``WriteItem``: a DTensor's local shard, or a
  whole tensor) is a tensor entry of the shard manifest of the rank that wrote it, named by
  ``chunk_entry_name``, its payload on the canonical grid of the chunk's own shape (§5.1), so an
  unchanged chunk is the same objects at the next save and a read of part of a chunk reads
  only the blocks it overlaps;
- DCP's ``Metadata`` (``state_dict_metadata`` with its chunks, ``planner_data``,
  ``storage_meta``, ``version``; ``storage_data`` is the chunk → entry map and is rebuilt from
  it) is the state document (§9.3) of the commit-wide extra ``torch.distributed.checkpoint``:
  the canonical JSON of a ``DcpDocument``;
- every bytes item (what DCP's planner serialised with ``torch.save``: every non-tensor value
  of the state dict) is one tensor of that extra, a ``uint8`` tensor of exactly its bytes,
  referenced from the document as ``"tensor:<i>"``. shardstore stores, hashes and returns those
  bytes and never unpickles them; DCP's own ``load`` does, in the caller's process.

``document_problems`` ties the document to the commit's entries; ``verify`` and
``shardstore.dcp.StoreReader`` both apply it. This module knows nothing of torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta

from ..errors import ManifestError, UnsupportedState
from .canonical import REAL_PREFIX, TENSOR_PREFIX
from .manifest import (
    MAX_ENTRIES,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    Base,
    Block,
    Dim,
    DType,
    ExtraEntry,
    Payload,
    StateTensor,
    TensorEntry,
    TensorName,
    check_writable,
)
from .names import TENSOR_NAME_PATTERN
from .tensors import hash_bytes

__all__ = [
    "DCP_EXTRA",
    "DOCUMENT_VERSION",
    "Chunk",
    "TensorItem",
    "BytesItem",
    "StorageMetaDoc",
    "DcpDocument",
    "chunk_entry_name",
    "encode_document",
    "check_planner_strings",
    "list_items_problem",
    "MAX_LIST_ITEMS",
    "decode_document",
    "dcp_extra",
    "document_problems",
    "tiling_problem",
    "whole_payload",
]

#: The key of the commit-wide extra whose state document is a DCP commit's ``DcpDocument``.
DCP_EXTRA = "torch.distributed.checkpoint"
DOCUMENT_VERSION = 1

_ENCODER = msgspec.json.Encoder(order="sorted")
_HASHED = "dcp/"  # entry names of FQNs that are not tensor names: "dcp/" + 32 hex digits of BLAKE3(fqn)
_RESERVED = (REAL_PREFIX, TENSOR_PREFIX)
_TENSOR_NAME = re.compile(TENSOR_NAME_PATTERN)

Dims = Annotated[tuple[Dim, ...], Meta(max_length=MAX_NDIM)]


class Chunk(Base):
    """One chunk DCP wrote of a tensor (``ChunkStorageMetadata``) and the tensor entry holding it."""

    offsets: Dims
    sizes: Dims
    entry: TensorName


class TensorItem(Base, tag="tensor", tag_field="kind"):
    """A tensor of the state dict (``TensorStorageMetadata``): its properties, global size, chunks."""

    dtype: DType
    size: Dims
    chunks: Annotated[tuple[Chunk, ...], Meta(max_length=MAX_ENTRIES)]
    layout: Literal["strided"]
    memory_format: Literal["contiguous_format", "channels_last", "preserve_format"]
    requires_grad: bool
    pin_memory: bool


class BytesItem(Base, tag="bytes", tag_field="kind"):
    """A bytes item (``BytesStorageMetadata``): the extra's tensor holding its bytes."""

    object: Annotated[str, Meta(pattern=r"^tensor:(0|[1-9][0-9]{0,6})$")]


class StorageMetaDoc(Base):
    """DCP's ``StorageMeta``, when the planner recorded one."""

    checkpoint_id: str | None
    save_id: str | None
    load_id: str | None
    modules: Annotated[tuple[str, ...], Meta(max_length=MAX_ENTRIES)]


#: The most keys and indices one flattened key's path holds (a value nested 64 levels deep).
MAX_PATH = 64

#: A flattened state dict's key → the path of keys (strings) and list indices (ints) it came from.
PlannerData = dict[str, Annotated[tuple[Union[str, int], ...], Meta(max_length=MAX_PATH)]]


class DcpDocument(Base, tag="dcp-metadata", tag_field="type"):
    """DCP's ``Metadata`` in canonical form: the state document of the ``DCP_EXTRA`` extra."""

    version: Literal[1]
    items: Annotated[dict[str, Union[TensorItem, BytesItem]], Meta(max_length=MAX_ENTRIES)]
    planner_data: Annotated[PlannerData, Meta(max_length=MAX_ENTRIES)] | None
    storage_meta: StorageMetaDoc | None
    dcp_version: str | None


_DECODER = msgspec.json.Decoder(DcpDocument)


def _is_tensor_name(name: str) -> bool:
    return _TENSOR_NAME.fullmatch(name) is not None and not name.startswith(_RESERVED)


def chunk_entry_name(fqn: str, offsets: Sequence[int], whole: bool) -> str:
    """The tensor entry name of a chunk: the FQN for a chunk that is the whole tensor, else the
    FQN and ``:<offset>`` per dim (``model.w:5:0``); an FQN that is not a tensor name (SPEC.md
    §Names), or too long for its suffix, is replaced by ``dcp/`` and 32 hex digits of its BLAKE3."""
    suffix = "" if whole else "".join(f":{int(o)}" for o in offsets)
    if _is_tensor_name(fqn + suffix):
        return fqn + suffix
    try:
        raw = fqn.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsupportedState(f"DCP key {fqn!r} is not Unicode text (a lone surrogate); it cannot be stored") from None
    return _HASHED + hash_bytes(raw)[:32] + suffix


def _user_strings(doc: DcpDocument) -> Iterator[tuple[str, str]]:
    """(where, value) of every string value of ``doc`` a caller chose (the rest are names this
    module writes): as a state document (§9.3) none may begin with a reserved prefix."""
    if doc.dcp_version is not None:
        yield "version", doc.dcp_version
    for fqn, path in (doc.planner_data or {}).items():
        for i, part in enumerate(path):
            if isinstance(part, str):
                yield f"planner_data[{fqn!r}][{i}]", part
    if doc.storage_meta is not None:
        m = doc.storage_meta
        for field in ("checkpoint_id", "save_id", "load_id"):
            value = getattr(m, field)
            if value is not None:
                yield f"storage_meta.{field}", value
        for i, value in enumerate(m.modules):
            yield f"storage_meta.modules[{i}]", value


def _refuse_reserved(where: str, value: str) -> None:
    if value.startswith(_RESERVED):
        raise UnsupportedState(
            f"DCP metadata {where}: string {value[:24]!r} starts with a prefix state documents reserve "
            f"({REAL_PREFIX!r}, {TENSOR_PREFIX!r}; SPEC.md §Extras)"
        )


#: List items a document's flattening map may have a load make: DCP's load grows each list a key path
#: indexes to the largest index it is given (filling the rest with None), so a forged index would
#: drive an allocation. Counted per list (its largest index + 1) and summed; a save beyond it is refused.
MAX_LIST_ITEMS = MAX_ENTRIES


def list_items_problem(planner_data: Mapping[str, Sequence[str | int]]) -> str | None:
    """What keeps the lists of a flattening map within ``MAX_LIST_ITEMS`` (None: they are): a
    negative index, or more list items in all than the limit. Arithmetic on the paths alone."""
    largest: dict[tuple[str | int, ...], int] = {}
    for fqn, path in planner_data.items():
        for i, part in enumerate(path):
            if type(part) is not int:
                continue
            if part < 0:
                return f"planner_data[{fqn[:64]!r}][{i}]: list index {part} is negative"
            if part >= MAX_LIST_ITEMS:
                return f"planner_data[{fqn[:64]!r}][{i}]: list index {part} is over the limit of {MAX_LIST_ITEMS} list items"
            key = tuple(path[:i])
            if part > largest.get(key, -1):
                largest[key] = part
    items = sum(n + 1 for n in largest.values())
    if items > MAX_LIST_ITEMS:
        return f"planner_data's lists hold {items} items on load, over the limit of {MAX_LIST_ITEMS}"
    return None


def check_planner_strings(planner_data: Mapping[str, Sequence[str | int]]) -> None:
    """UnsupportedState for a key path of a flattening map (a ``SavePlan``'s ``planner_data``)
    that the document could not hold (a reserved string, more than ``MAX_PATH`` parts, lists of more
    than ``MAX_LIST_ITEMS`` items): checked while planning, before anything is written."""
    problem = list_items_problem(planner_data)
    if problem is not None:
        raise UnsupportedState(f"DCP state dict: {problem} (SPEC.md §9.4, §Limits)")
    for fqn, path in planner_data.items():
        if len(path) > MAX_PATH:
            raise UnsupportedState(
                f"DCP key {fqn[:64]!r}: its value is nested {len(path)} levels deep; the DCP document holds "
                f"key paths of at most {MAX_PATH} (SPEC.md §9.4, §Limits)"
            )
        for i, part in enumerate(path):
            if isinstance(part, str):
                _refuse_reserved(f"planner_data[{fqn!r}][{i}]", part)


def encode_document(doc: DcpDocument) -> bytes:
    """The canonical bytes of ``doc`` (a valid §9.3 state document); UnsupportedState naming the
    field for a string it cannot hold or for anything else ``decode_document`` would refuse (the
    encoder does not apply the schema's limits: a document every reader refuses is never
    written), ObjectTooLarge past the manifest limit."""
    for where, value in _user_strings(doc):
        _refuse_reserved(where, value)
    try:
        raw = _ENCODER.encode(doc)
    except (msgspec.EncodeError, UnicodeEncodeError) as e:
        raise UnsupportedState(f"DCP metadata cannot be encoded: {e}") from None
    check_writable(raw, "DCP metadata document")
    try:
        _DECODER.decode(raw)
    except msgspec.ValidationError as e:
        raise UnsupportedState(
            f"DCP metadata is over a limit of the DCP document: {e} (SPEC.md §9.4, §Limits)"
        ) from None
    return raw


def decode_document(raw: bytes | memoryview, what: str) -> DcpDocument:
    """Strictly decode a DCP document: bounded, every field checked, canonical, version 1."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{what}: {len(raw)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit (SPEC.md §Limits)")
    raw = bytes(raw)
    try:
        doc = _DECODER.decode(raw)
    except msgspec.ValidationError as e:
        raise ManifestError(f"{what}: not a DCP document of version {DOCUMENT_VERSION}: {e} (SPEC.md §9.4)") from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(f"{what}: malformed DCP document: {e} (SPEC.md §9.4)") from None
    if _ENCODER.encode(doc) != raw:
        raise ManifestError(f"{what}: DCP document is not in canonical encoding (SPEC.md §Canonical encoding)")
    return doc


def dcp_extra(extras: Sequence[ExtraEntry]) -> ExtraEntry | None:
    """The commit-wide extra holding a DCP document, or None: the commit is not a DCP commit."""
    return next((x for x in extras if x.key == DCP_EXTRA), None)


def document_problems(
    doc: DcpDocument, entries: Mapping[str, TensorEntry], tensors: Sequence[StateTensor]
) -> list[str]:
    """What ties ``doc`` to its commit and does not hold (empty: all of it holds): its bytes
    items are the extra's ``tensors`` in order, each a 1-d ``uint8`` tensor; every chunk lies
    in its tensor and names an entry of the chunk's dtype and shape with no optimizer state;
    every entry of the commit is named by exactly one chunk; no user string is reserved; the flattening
    map's lists stay within ``MAX_LIST_ITEMS``."""
    out: list[str] = []
    refs = [(fqn, item.object) for fqn, item in sorted(doc.items.items()) if isinstance(item, BytesItem)]
    for i, (fqn, ref) in enumerate(refs):
        if ref != f"{TENSOR_PREFIX}{i}":
            out.append(f"bytes item {fqn!r} references {ref!r}; in key order it is {TENSOR_PREFIX}{i}")
    if len(refs) != len(tensors):
        out.append(f"{len(refs)} bytes items but the extra has {len(tensors)} tensors")
    for t in tensors:
        if t.dtype != "uint8" or len(t.shape) != 1:
            out.append(f"tensor {t.key} of the extra is {t.dtype}{list(t.shape)}, not the 1-d uint8 bytes of an item")
    out += [f"{where}: string {value[:24]!r} starts with a reserved prefix" for where, value in _user_strings(doc)
            if value.startswith(_RESERVED)]  # fmt: skip
    listed = list_items_problem(doc.planner_data or {})
    if listed is not None:
        out.append(listed)
    named: dict[str, str] = {}
    for fqn, item in sorted(doc.items.items()):
        if isinstance(item, TensorItem):
            out += _item_problems(fqn, item, entries, named)
    stray = sorted(set(entries) - set(named))
    if stray:
        out.append(f"{len(stray)} tensor entries are no chunk of the DCP document, first {stray[0]!r}")
    return out


def _item_problems(fqn: str, item: TensorItem, entries: Mapping[str, TensorEntry], named: dict[str, str]) -> list[str]:
    out: list[str] = []
    offsets: set[tuple[int, ...]] = set()
    for c in item.chunks:
        where = f"tensor {fqn!r}, chunk at {list(c.offsets)}"
        if not len(c.offsets) == len(c.sizes) == len(item.size):
            out.append(f"{where}: {len(c.offsets)}/{len(c.sizes)} dims for a {len(item.size)}-d tensor")
            continue
        if any(o + n > d for o, n, d in zip(c.offsets, c.sizes, item.size)):
            out.append(f"{where} of extent {list(c.sizes)} lies outside size {list(item.size)}")
        if tuple(c.offsets) in offsets:
            out.append(f"{where}: two chunks at one offset")
        offsets.add(tuple(c.offsets))
        if c.entry in named:
            out.append(f"{where}: entry {c.entry!r} is also the chunk of {named[c.entry]}")
        named[c.entry] = where
        e = entries.get(c.entry)
        if e is None:
            out.append(f"{where}: names entry {c.entry!r}, which the commit does not hold")
        elif (e.dtype, tuple(e.shape)) != (item.dtype, tuple(c.sizes)):
            out.append(f"{where}: entry {c.entry!r} is {e.dtype}{list(e.shape)}, the chunk {item.dtype}{list(c.sizes)}")
        elif e.optim is not None or e.state is not None or e.kind != "param":
            out.append(f"{where}: entry {c.entry!r} carries optimizer state or is a buffer; a chunk is plain bytes")
    return out


#: Pairs of chunks ``tiling_problem`` compares at most for one tensor: a forged document's
#: chunk list (up to MAX_ENTRIES) must not make the check quadratic without bound.
MAX_TILING_PAIRS = 1 << 24


def _volume(sizes: Sequence[int]) -> int:
    n = 1
    for d in sizes:
        n *= int(d)
    return n


def tiling_problem(item: TensorItem) -> str | None:
    """What keeps ``item``'s chunks from tiling its tensor exactly (None: they tile it): every
    chunk of its dims and inside its size, no two sharing an element, their elements together
    its size's. Pure arithmetic on the document: nothing is allocated by the tensor's size."""
    size = tuple(item.size)
    boxes = []
    for c in item.chunks:
        if not len(c.offsets) == len(c.sizes) == len(size):
            return f"the chunk at {list(c.offsets)} has {len(c.sizes)} dims, the tensor {len(size)}"
        if any(o + n > d for o, n, d in zip(c.offsets, c.sizes, size)):
            return f"the chunk at {list(c.offsets)} of extent {list(c.sizes)} lies outside size {list(size)}"
        if _volume(c.sizes):
            boxes.append((tuple(c.offsets), tuple(c.sizes)))
    covered, total = sum(_volume(n) for _, n in boxes), _volume(size)
    if covered != total:
        return f"its chunks hold {covered} elements, the tensor {total}: {'a gap' if covered < total else 'an overlap'}"
    if not size:
        return None  # a 0-d tensor: one element, in the one chunk that holds it
    # equal volumes: the chunks tile the tensor exactly if no two overlap; swept along dim 0
    boxes.sort()
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    pairs = 0
    for start, extent in boxes:
        active = [b for b in active if b[0][0] + b[1][0] > start[0]]
        for o, n in active:
            pairs += 1
            if pairs > MAX_TILING_PAIRS:
                return f"its {len(boxes)} chunks need more than {MAX_TILING_PAIRS} comparisons (SPEC.md §Limits)"
            if all(a < b + m and b < a + k for a, k, b, m in zip(start, extent, o, n)):
                return f"the chunks at {list(o)} and {list(start)} overlap (and so leave a gap)"
        active.append((start, extent))
    return None


def whole_payload(item: TensorItem, entries: Mapping[str, TensorEntry]) -> Payload:
    """The payload of ``item``'s whole tensor: each chunk's blocks (its entry's payload, on the
    chunk's own grid) moved to the chunk's offsets, in the document's chunk order. The caller
    has checked ``tiling_problem`` and ``document_problems``: the blocks tile the tensor."""
    if len(item.chunks) == 1 and tuple(item.chunks[0].sizes) == tuple(item.size):
        return entries[item.chunks[0].entry].param  # the whole tensor in one chunk: its own grid
    out: list[Block] = []
    for c in item.chunks:
        param = entries[c.entry].param
        if isinstance(param, str):
            out.append(Block(start=tuple(c.offsets), shape=tuple(c.sizes), object=param))
            continue
        for b in param:
            out.append(
                Block(start=tuple(o + s for o, s in zip(c.offsets, b.start)), shape=tuple(b.shape), object=b.object)
            )
    return tuple(out)
