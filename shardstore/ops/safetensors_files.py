"""Safetensors files written by hand and read back (export's rules: SPEC.md §19.2); the format is an
8-byte little-endian header length, a JSON header, then the data.

``write_safetensors`` builds the header from the manifests alone, then appends each
tensor's verified object bytes (block by block for a chunked payload), one tensor at a
time, so peak memory stays near the largest block; tensors are ordered by item size, then
name, so every tensor is aligned, and the header is padded with spaces to 8 bytes. Every
file is written through ``replacing``: under a new temporary name created exclusively (a
planted link is never followed), synced, read back with ``safetensors.safe_open`` and only
then renamed into place.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import stat
import struct
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from safetensors import SafetensorError, safe_open

from ..errors import CorruptObject, ManifestError, ObjectNotFound, ObjectTooLarge, StorageError, TensorMismatch
from ..format.grid import payload_blocks
from ..format.manifest import Payload
from ..format.tensors import expected_nbytes
from ..store import Store

__all__ = [
    "TO_ST",
    "FROM_ST",
    "Item",
    "duplicate_keys",
    "open_safetensors",
    "replacing",
    "write_file",
    "write_safetensors",
    "itemsize",
]

TO_ST = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64",
    "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64",
}  # fmt: skip
FROM_ST = {v: k for k, v in TO_ST.items()}


@dataclass(frozen=True)
class Item:
    """One tensor of a file: its name there, dtype, shape and the object(s) holding its bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    oid: Payload  # one object, or the blocks of a chunked payload (streamed in order)

    @property
    def nbytes(self) -> int:
        return expected_nbytes(self.dtype, self.shape)


def open_safetensors(path: str) -> Any:
    """``safe_open`` with its errors as ManifestError naming the file; only a regular file.

    safetensors opens the file with a blocking ``open`` while holding the GIL: a FIFO (or a
    link to one) would stall the whole process, a device be mapped. Both are refused first,
    as ``read_regular_file`` refuses them for ``config.json``."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise ManifestError(f"{path}: not a readable safetensors file ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        raise ManifestError(f"{path} is not a regular file (a device, FIFO or directory); refusing to read it")
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:
        raise ManifestError(f"{path}: not a readable safetensors file ({e})") from None


#: safetensors' own limit on a header (``MAX_HEADER_SIZE``): it refuses a file with a larger one.
_MAX_HEADER = 100_000_000


def duplicate_keys(path: str) -> list[str]:
    """The keys a safetensors file's header holds more than once, in order (a regular file
    ``safe_open`` already accepted: its header is JSON of at most ``_MAX_HEADER`` bytes).

    safetensors reads the header's top level into a map and keeps the last of two entries of
    one name without a word; the other interpretation of the file would be lost on import."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            raw = f.read(min(n, _MAX_HEADER))
    except (OSError, struct.error) as e:
        raise ManifestError(f"{path}: not a readable safetensors file ({e})") from None
    seen: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        seen.extend(k for i, k in enumerate(keys) if k in keys[:i])
        return dict(items)

    try:
        json.loads(raw, object_pairs_hook=pairs)
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{path}: not a readable safetensors header ({e})") from None
    return seen


def _header(items: Sequence[Item]) -> bytes:
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for it in items:
        head[it.name] = {
            "dtype": TO_ST[it.dtype],
            "shape": list(it.shape),
            "data_offsets": [offset, offset + it.nbytes],
        }
        offset += it.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _check_written(path: str, items: Sequence[Item]) -> None:
    """Read a written file's header back with safetensors itself."""
    want = {it.name: (TO_ST[it.dtype], list(it.shape)) for it in items}
    with open_safetensors(path) as f:
        got = {k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())) for k in f.keys()}
    if got != want:
        raise StorageError(f"{path}: safetensors reads back a different header than was written")


@contextlib.contextmanager
def replacing(path: str) -> Iterator[tuple[BinaryIO, str]]:
    """Write a new file that replaces ``path`` when the block ends without error.

    The file is created beside ``path`` exclusively under a random name (O_EXCL never follows
    a planted link; a name that exists is skipped), synced, then renamed over ``path`` (a link
    at ``path`` is replaced, never followed). Yields the open file and its temporary name;
    on any error the temporary is removed and ``path`` is untouched.
    """
    tmp = ""
    try:
        fd, tmp = tempfile.mkstemp(
            dir=os.path.dirname(path) or ".", prefix=f".{os.path.basename(path)}.", suffix=".partial"
        )
        mask = os.umask(0)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)  # what open() would have given the file (mkstemp makes it 0600)
        with os.fdopen(fd, "wb") as f:
            yield f, tmp
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise StorageError(f"writing {path}: {e.strerror or e}") from None
    finally:
        if tmp and os.path.lexists(tmp):
            os.unlink(tmp)


def write_file(path: str, raw: bytes) -> None:
    """Write ``raw`` to ``path`` (see ``replacing``)."""
    with replacing(path) as (f, _tmp):
        f.write(raw)


def write_safetensors(store: Store, path: str, items: Sequence[Item], tick: Callable[[Item], None]) -> None:
    items = sorted(items, key=lambda it: (-itemsize(it.dtype), it.name))  # aligned: big items first
    header = _header(items)
    with replacing(path) as (f, tmp):
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for it in items:
            base = f.tell()
            for i, (oid, box, nbytes) in enumerate(blocks := payload_blocks(it.oid, it.dtype, it.shape)):
                try:
                    data = store.get(oid, limit=nbytes)  # re-hashed on read; bounded by the entry's size first
                except (CorruptObject, ObjectNotFound, ObjectTooLarge) as e:  # too large: appended bytes, corrupt
                    kind = CorruptObject if isinstance(e, ObjectTooLarge) else type(e)
                    raise kind(f"tensor {it.name!r}{f', block {i}' if len(blocks) > 1 else ''} ({path}): {e}") from None
                if len(data) != nbytes:
                    raise TensorMismatch(
                        f"tensor {it.name!r}: object {oid} holds {len(data)} bytes, entry needs {nbytes}"
                    )
                view = memoryview(data)
                for at, start, length in runs(
                    tuple(it.shape), box, itemsize(it.dtype)
                ):  # a row band: one run; a tile: its rows
                    if f.tell() != base + at:
                        f.seek(base + at)
                    f.write(view[start : start + length])
                del data, view
            f.seek(base + it.nbytes)
            tick(it)
        f.flush()
        _check_written(tmp, items)


def runs(
    shape: tuple[int, ...], box: tuple[tuple[int, ...], tuple[int, ...]], item: int
) -> Iterator[tuple[int, int, int]]:
    """(byte offset in the tensor, byte offset in the block, length) of each contiguous run of
    a block's bytes in the tensor's C-order bytes: one for a row band (SPEC.md §5.1, versions
    2-3) or a tile spanning every later dim, one per row of the tile's leading dims otherwise."""
    start, extent = box
    if not shape:
        yield 0, 0, item
        return
    if 0 in extent:
        return
    j = len(shape) - 1
    while j > 0 and extent[j] == shape[j]:
        j -= 1  # the dims after j are whole in the block: its runs are along dim j
    strides = [item] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    length = extent[j] * strides[j]
    first = sum(s * st for s, st in zip(start, strides))
    for k, idx in enumerate(itertools.product(*(range(n) for n in extent[:j]))):
        yield first + sum(i * st for i, st in zip(idx, strides)), k * length, length


def itemsize(dtype: str) -> int:
    return expected_nbytes(dtype, (1,))
