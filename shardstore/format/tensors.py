"""Tensor payloads: raw little-endian C-order bytes, and the dtype allow-list (SPEC.md §Tensor objects).

A tensor object holds exactly ``numel * itemsize`` bytes and nothing else; dtype and shape
live in the tensor entry. Conversions here never copy unless the input is not already a
contiguous CPU tensor.
"""

from __future__ import annotations

import math
import sys
import threading
import warnings
from typing import Any

import blake3

from ..errors import TensorMismatch
from .lazy import torch

__all__ = [
    "ITEMSIZES",
    "FLOAT_DTYPES",
    "dtype_name",
    "torch_dtype",
    "expected_nbytes",
    "tensor_bytes",
    "tensor_from_bytes",
    "hash_bytes",
    "new_hasher",
    "is_dtensor",
    "same_split",
    "Staging",
    "MAX_NDIM",
    "MAX_DIM",
    "check_shape",
]

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI machine
    raise ImportError("shardstore stores tensors as little-endian bytes and supports little-endian hosts only")

#: The dtype allow-list (SPEC.md §Tensor objects): each name and its item size in bytes.
ITEMSIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
_TORCH: dict[str, Any] = {}  # name -> torch.dtype, filled on first use (torch is imported then)
_NAMES: dict[Any, str] = {}


def _torch_dtypes() -> dict[str, Any]:
    if not _TORCH:
        _TORCH.update((n, getattr(torch, n)) for n in ITEMSIZES)
        _NAMES.update((v, k) for k, v in _TORCH.items())
    return _TORCH


#: Above this size hashing uses BLAKE3's own threads.
_THREADED_HASH_BYTES = 8 * 1024 * 1024


def dtype_name(dtype: torch.dtype, what: str = "tensor") -> str:
    """The canonical name of an allowed torch dtype; TensorMismatch for any other."""
    _torch_dtypes()
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TensorMismatch(
            f"{what}: dtype {dtype} is not in the allow-list {sorted(ITEMSIZES)} (SPEC.md §Tensor objects)"
        ) from None


#: The most dims a stored tensor has, and the largest size of one (SPEC.md §Limits): no manifest holds more.
MAX_NDIM = 16
MAX_DIM = 2**48


def check_shape(shape: Any, what: str = "tensor") -> tuple[int, ...]:
    """``shape`` as a tuple of ints, or TensorMismatch naming ``what`` for one no manifest can hold
    (over ``MAX_NDIM`` dims, or a dim over ``MAX_DIM``): refused before anything of it is written."""
    dims = tuple(int(d) for d in shape)
    if len(dims) > MAX_NDIM or any(d > MAX_DIM for d in dims):
        raise TensorMismatch(
            f"{what}: shape {list(dims)} is over the limits of {MAX_NDIM} dims of at most {MAX_DIM} (SPEC.md §Limits)"
        )
    return dims


def check_storable(t: torch.Tensor, what: str = "tensor") -> str:
    """``dtype_name`` of a tensor that has bytes to store: strided (dense), not on ``meta``, of a shape
    a manifest can hold; TensorMismatch naming it for a sparse, quantized or nested tensor, one with
    no data, or one of too many or too large dims (``check_shape``)."""
    if t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta":
        kind = (
            "a meta"
            if t.device.type == "meta"
            else f"a {t.layout}" + (" quantized" if t.is_quantized else "") + (" nested" if t.is_nested else "")
        )
        raise TensorMismatch(
            f"{what}: {kind} tensor has no dense bytes to store; only dense tensors are stored (SPEC.md §Tensor objects)"
        )
    check_shape(t.shape, what)
    return dtype_name(t.dtype, what)


def torch_dtype(name: str) -> torch.dtype:
    return _torch_dtypes()[name]


def expected_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * ITEMSIZES[dtype]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as a flat byte view: no copy for a contiguous CPU tensor.

    The view keeps the (possibly new, contiguous) tensor alive through numpy's base.
    """
    check_storable(t)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def tensor_from_bytes(
    buf: bytes | bytearray | memoryview, dtype: str, shape: tuple[int, ...], what: str
) -> torch.Tensor:
    """A tensor viewing ``buf`` (no copy); TensorMismatch if the size is wrong."""
    want = expected_nbytes(dtype, shape)
    if len(buf) != want:
        raise TensorMismatch(
            f"{what}: object holds {len(buf)} bytes, but {dtype}{list(shape)} needs {want} (SPEC.md §Tensor objects)"
        )
    tdtype = torch_dtype(dtype)
    if want == 0:
        return torch.empty(shape, dtype=tdtype)
    with warnings.catch_warnings():
        # Read-only buffers (bytes from remote backends) make torch warn; callers copy out.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(tdtype).reshape(shape)


def hash_bytes(data: bytes | bytearray | memoryview, *, threads: int | None = None) -> str:
    """BLAKE3 of ``data`` as 64 hex digits, multi-threaded for large buffers.

    ``threads``: BLAKE3's own threads (None: all cores above 8 MiB). Callers that already
    hash several buffers in a thread pool pass 1, so the cores are not oversubscribed.
    """
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    if threads is None:
        threads = blake3.blake3.AUTO if len(view) >= _THREADED_HASH_BYTES else 1
    return blake3.blake3(view, max_threads=max(1, threads) if threads != blake3.blake3.AUTO else threads).hexdigest()


def new_hasher(threads: int = 1) -> "blake3.blake3":
    """A fresh BLAKE3 hasher (``threads`` of its own), for bytes that arrive in chunks or a file it maps."""
    return blake3.blake3(max_threads=max(1, threads))


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (one process's slice of a tensor)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def same_split(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether two DTensors live on the same mesh with the same placements."""
    return b is not None and a.device_mesh == b.device_mesh and tuple(a.placements) == tuple(b.placements)  # type: ignore[attr-defined]


class Staging(threading.local):
    """Each thread's reusable buffer for tensor bytes on their way between an object and a
    tensor that cannot take them in place: a block read whole and verified before it is copied
    into its destination's boxes, or a strided tile gathered before it is hashed and written.

    One allocation per thread (grown to the largest request, never beyond ``limit`` bytes)
    instead of one per block: a fresh buffer costs its page faults on every block, which
    made such reads and writes slower than the copy itself (benchmarks/RESULTS.md, bench_dcp).
    A request over ``limit`` (a whole-tensor object of format version 1) gets None: the caller
    allocates for it, so no thread keeps more than ``limit`` bytes. The views ``take`` returns
    are valid until that thread's next ``take``; nothing may keep one.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buf: torch.Tensor | None = None

    def take(self, dtype: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """A contiguous ``dtype`` tensor of ``shape`` over this thread's buffer, or None when it
        holds no bytes or more than ``limit``."""
        n = expected_nbytes(dtype, shape)
        if n == 0 or n > self.limit:
            return None
        if self.buf is None or self.buf.numel() < n:
            self.buf = torch.empty(n, dtype=torch.uint8)
        return self.buf[:n].view(torch_dtype(dtype)).view(shape)
