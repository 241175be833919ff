"""RNG states as canonical bytes (SPEC.md §RNG objects).

Python's and NumPy's generator states are encoded as canonical JSON (integers and strings
only); torch's CPU and CUDA states are their raw byte tensors. Decoding is strict and
bounded, so a planted RNG object can never execute code or allocate without limit.
"""
from __future__ import annotations

import random
from typing import Any

import msgspec
import numpy as np

from ..errors import ManifestError
from .lazy import torch

__all__ = ["MAX_RNG_BYTES", "capture_rng", "check_rng", "restore_rng"]

_ENC = msgspec.json.Encoder(order="sorted")
MAX_RNG_BYTES = 1 << 20


class _PyState(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    state: list[int]
    gauss: str | None  # float.hex() text; None when no cached Gaussian


class _NpState(msgspec.Struct, forbid_unknown_fields=True):
    bit_generator: str
    key: list[int]
    pos: int
    has_gauss: int
    gauss: str  # float.hex() text


def capture_rng(cuda: bool = True) -> dict[str, bytes]:
    """The process's RNG states by kind: python, numpy, torch, and cuda:N when CUDA is present."""
    v, st, gauss = random.getstate()
    out = {
        "python": _ENC.encode(_PyState(version=v, state=list(st), gauss=None if gauss is None else float(gauss).hex())),
        "numpy": _ENC.encode(_NpState(**_np_state())),
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    if cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            out[f"cuda:{i}"] = torch.cuda.get_rng_state(i).numpy().tobytes()
    return out


def _np_state() -> dict[str, Any]:
    name, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return {"bit_generator": name, "key": key.tolist(), "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss).hex()}


def _apply(kind: str, raw: bytes, py: Any, npr: Any, gen: Any) -> None:
    """Set ``kind``'s state from ``raw`` on the given generators (None for CUDA: the process's)."""
    if kind == "python":
        p = msgspec.json.decode(raw, type=_PyState)
        py.setstate((p.version, tuple(p.state), None if p.gauss is None else float.fromhex(p.gauss)))
    elif kind == "numpy":
        n = msgspec.json.decode(raw, type=_NpState)
        key = np.array(n.key, dtype=np.uint32)
        npr.set_state((n.bit_generator, key, n.pos, n.has_gauss, float.fromhex(n.gauss)))
    elif kind == "torch":
        gen.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    elif kind.startswith("cuda:"):
        if gen is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8), int(kind[5:]))
    else:
        raise ManifestError(f"unknown RNG kind {kind!r}")


def check_rng(states: dict[str, bytes | memoryview], *, raw_kinds: bool = True) -> None:
    """Refuse (ManifestError) RNG states that ``restore_rng`` could not set, without setting
    any: each is decoded into a fresh generator of its kind. Load paths call this before they
    write a byte into a caller's tensors (SPEC.md §16); verify calls it on every RNG object
    with ``raw_kinds=False``: the size limit and the Python and NumPy encodings (§10) only,
    since what torch accepts as a raw generator state depends on the torch build."""
    for kind, raw in states.items():
        if len(raw) > MAX_RNG_BYTES:
            raise ManifestError(f"RNG state {kind!r} is {len(raw)} bytes, over the {MAX_RNG_BYTES}-byte limit (SPEC.md §Limits)")
        if not raw_kinds and (kind == "torch" or kind.startswith("cuda:")):
            continue
        try:
            gen = torch.Generator() if kind == "torch" else None  # only a torch state needs torch (and imports it)
            _apply(kind, bytes(raw), random.Random(), np.random.RandomState(), gen)
        except (msgspec.DecodeError, ValueError, TypeError, RuntimeError, OverflowError, UnicodeDecodeError) as e:
            raise ManifestError(f"RNG state {kind!r} is malformed: {e}") from None  # OverflowError: a key past uint32


def restore_rng(states: dict[str, bytes | memoryview]) -> None:
    """Set the process's RNGs from ``capture_rng`` output; ManifestError on malformed bytes,
    before any generator is changed."""
    check_rng(states)
    default = torch.default_generator
    for kind, raw in states.items():
        _apply(kind, bytes(raw), random, np.random, default)
