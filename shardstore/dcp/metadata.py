"""DCP's ``Metadata`` to and from the canonical DCP document (SPEC.md §9.4; ``format.dcp``).

The document holds every field of ``Metadata`` but ``storage_data``, which is the storage
layer's own (here: which tensor entry holds each chunk, which extra tensor each bytes item);
``metadata_of`` rebuilds it as a dict from ``MetadataIndex`` to the entry name or the
``"tensor:<i>"`` reference, and the writer gives the ``Metadata`` that ``dcp.save`` returns the
same, so a save's ``Metadata`` and a later ``read_metadata`` compare equal.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import UnsupportedState
from ..format.canonical import TENSOR_PREFIX
from ..format.dcp import DOCUMENT_VERSION, BytesItem, Chunk, DcpDocument, StorageMetaDoc, TensorItem
from ..format.tensors import dtype_name, torch_dtype

__all__ = ["EntryNamer", "document_of", "metadata_of", "storage_data_of", "is_whole"]

#: (fqn, chunk offsets, whole?) -> the tensor entry name of that chunk.
EntryNamer = Callable[[str, tuple[int, ...], bool], str]

_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve_format": torch.preserve_format,
}
_KNOWN_FIELDS = {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"}


def is_whole(offsets: tuple[int, ...], sizes: tuple[int, ...], size: tuple[int, ...]) -> bool:
    """Whether a chunk is its whole tensor."""
    return not any(offsets) and tuple(sizes) == tuple(size)


def _format_name(fmt: torch.memory_format, fqn: str) -> str:
    for name, value in _FORMATS.items():
        if value == fmt:
            return name
    raise UnsupportedState(f"DCP tensor {fqn!r}: memory format {fmt} has no name in the DCP document (SPEC.md §9.4)")


def _tensor_item(fqn: str, md: TensorStorageMetadata, name: EntryNamer) -> TensorItem:
    p = md.properties
    if p.layout != torch.strided:
        raise UnsupportedState(f"DCP tensor {fqn!r}: layout {p.layout} is not strided; only dense tensors are stored")
    size = tuple(int(d) for d in md.size)
    chunks = []
    for c in md.chunks:
        offsets, sizes = tuple(int(o) for o in c.offsets), tuple(int(n) for n in c.sizes)
        chunks.append(Chunk(offsets=offsets, sizes=sizes, entry=name(fqn, offsets, is_whole(offsets, sizes, size))))
    return TensorItem(
        dtype=dtype_name(p.dtype, f"DCP tensor {fqn!r}"),  # type: ignore[arg-type]
        size=size,
        chunks=tuple(chunks),
        layout="strided",
        memory_format=_format_name(p.memory_format, fqn),  # type: ignore[arg-type]
        requires_grad=bool(p.requires_grad),
        pin_memory=bool(p.pin_memory),
    )


def _planner_data(data: Any) -> dict[str, tuple[str | int, ...]] | None:
    """DefaultSavePlanner's flattening map (key -> path of str keys and int indices), or None."""
    if data is None:
        return None
    ok = isinstance(data, Mapping) and all(
        isinstance(k, str)
        and isinstance(v, (tuple, list))
        and all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in v)
        for k, v in data.items()
    )
    if not ok:
        raise UnsupportedState(
            f"DCP planner_data of type {type(data).__name__} is not a flattening map (key -> tuple of str and int) "
            "and cannot be stored without pickle (SPEC.md §9.4)"
        )
    return {k: tuple(v) for k, v in data.items()}


def _storage_meta(meta: StorageMeta | None) -> StorageMetaDoc | None:
    if meta is None:
        return None
    cid = meta.checkpoint_id
    return StorageMetaDoc(
        checkpoint_id=None if cid is None else os.fspath(cid),
        save_id=meta.save_id,
        load_id=meta.load_id,
        modules=tuple(meta.modules),
    )


def document_of(metadata: Metadata, name: EntryNamer) -> DcpDocument:
    """The canonical document of a save's ``Metadata``: bytes items numbered in key order, each
    chunk naming the entry ``name`` gives it. UnsupportedState for anything it cannot hold."""
    unknown = sorted(
        f.name for f in dataclasses.fields(metadata) if f.name not in _KNOWN_FIELDS and getattr(metadata, f.name)
    )
    if unknown:
        raise UnsupportedState(f"DCP Metadata fields {unknown} are unknown to this version (SPEC.md §9.4)")
    items: dict[str, TensorItem | BytesItem] = {}
    nbytes = 0
    for fqn in sorted(metadata.state_dict_metadata):
        md = metadata.state_dict_metadata[fqn]
        if isinstance(md, BytesStorageMetadata):
            items[fqn] = BytesItem(object=f"{TENSOR_PREFIX}{nbytes}")
            nbytes += 1
        elif isinstance(md, TensorStorageMetadata):
            items[fqn] = _tensor_item(fqn, md, name)
        else:
            raise UnsupportedState(f"DCP item {fqn!r}: storage metadata {type(md).__name__} is unknown (SPEC.md §9.4)")
    return DcpDocument(
        version=DOCUMENT_VERSION,
        items=items,
        planner_data=_planner_data(metadata.planner_data),
        storage_meta=_storage_meta(metadata.storage_meta),
        dcp_version=metadata.version,
    )


def storage_data_of(doc: DcpDocument) -> dict[MetadataIndex, str]:
    """``Metadata.storage_data`` of a document: each chunk's index to its entry name, each bytes
    item's to its ``"tensor:<i>"`` reference."""
    out: dict[MetadataIndex, str] = {}
    for fqn, item in doc.items.items():
        if isinstance(item, BytesItem):
            out[MetadataIndex(fqn)] = item.object
        else:
            for c in item.chunks:
                out[MetadataIndex(fqn, c.offsets)] = c.entry
    return out


def metadata_of(doc: DcpDocument) -> Metadata:
    """The ``Metadata`` a document holds, as DCP's planners read it."""
    md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, item in doc.items.items():
        if isinstance(item, BytesItem):
            md[fqn] = BytesStorageMetadata()
            continue
        props = TensorProperties(
            dtype=torch_dtype(item.dtype),
            layout=torch.strided,
            requires_grad=item.requires_grad,
            memory_format=_FORMATS[item.memory_format],
            pin_memory=item.pin_memory,
        )
        chunks = [ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in item.chunks]
        md[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(item.size), chunks=chunks)
    m = doc.storage_meta
    return Metadata(
        state_dict_metadata=md,
        planner_data=None if doc.planner_data is None else dict(doc.planner_data),
        storage_data=storage_data_of(doc),
        storage_meta=None if m is None else StorageMeta(m.checkpoint_id, m.save_id, m.load_id, list(m.modules)),
        version=doc.dcp_version,
    )
