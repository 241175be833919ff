"""RNG states as canonical bytes (SPEC.md §RNG objects).

Python's and NumPy's generator states are encoded as canonical JSON (integers and strings
only); torch's CPU and CUDA states are their raw byte tensors. Decoding is strict and
bounded, so a planted RNG object can never execute code or allocate without limit.

A reader accepts exactly the Python and NumPy states a writer produces (the decoders' field
constraints below, and ``_gauss``), before any generator is given one: neither generator
checks what it is given. NumPy's ``set_state`` takes a ``pos`` past the 624 key words (its next
draw then reads past the key: a crash, or words from outside the state), a 625-word key or a
``has_gauss`` of 2, and indexes a 623-word key out of range; Python's ``setstate`` takes version
2 and truncates words of 2^32 and more to 32 bits, a second spelling of one state.
"""

from __future__ import annotations

import random
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from ..errors import ManifestError
from .lazy import torch

__all__ = ["MAX_RNG_BYTES", "capture_rng", "check_rng", "restore_rng"]

_ENC = msgspec.json.Encoder(order="sorted")
MAX_RNG_BYTES = 1 << 20

#: The Mersenne Twister's state: 624 words of 32 bits, and a position 0..624 (624: the next draw
#: regenerates the words), in Python's ``random`` and NumPy's MT19937 alike (SPEC.md §10).
_MT_WORDS = 624
_Word = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


class _PyState(msgspec.Struct, forbid_unknown_fields=True):
    version: Literal[3]  # what random.getstate() reports (version 2 is Python 2's)
    state: Annotated[
        list[_Word], msgspec.Meta(min_length=_MT_WORDS + 1, max_length=_MT_WORDS + 1)
    ]  # the words, then the position
    gauss: str | None  # float.hex() text; None when no cached Gaussian


class _NpState(msgspec.Struct, forbid_unknown_fields=True):
    bit_generator: Literal["MT19937"]
    key: Annotated[list[_Word], msgspec.Meta(min_length=_MT_WORDS, max_length=_MT_WORDS)]
    pos: Annotated[int, msgspec.Meta(ge=0, le=_MT_WORDS)]
    has_gauss: Literal[0, 1]
    gauss: str  # float.hex() text ("0x0.0p+0" when no Gaussian is cached, unless a set_state left one)


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
    # Written as NumPy reports it: 0.0 when no Gaussian is cached, unless a caller's set_state
    # left a value beside has_gauss 0 (never read by NumPy). Rewriting that value would give
    # the same process state another object id than earlier writers gave it (SPEC.md §10).
    return {
        "bit_generator": name,
        "key": key.tolist(),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss).hex(),
    }


def _gauss(text: str) -> float:
    """The cached Gaussian from its ``float.hex()`` text: ValueError for any other spelling."""
    value = float.fromhex(text)
    if value.hex() != text:
        raise ValueError(f"gauss {text!r} is not float.hex() text")
    return value


def _python(raw: bytes) -> tuple[int, tuple[int, ...], float | None]:
    """A ``random.setstate`` argument that a writer produces (SPEC.md §10), or ValueError."""
    p = msgspec.json.decode(raw, type=_PyState)
    if p.state[_MT_WORDS] > _MT_WORDS:
        raise ValueError(f"position {p.state[_MT_WORDS]} is not within 0..{_MT_WORDS}")
    return p.version, tuple(p.state), None if p.gauss is None else _gauss(p.gauss)


def _numpy(raw: bytes) -> tuple[str, Any, int, int, float]:
    """A ``RandomState.set_state`` argument that a writer produces (SPEC.md §10), or ValueError."""
    n = msgspec.json.decode(raw, type=_NpState)
    gauss = _gauss(n.gauss)  # any value beside has_gauss 0: NumPy never reads it, and writers wrote it
    return n.bit_generator, np.array(n.key, dtype=np.uint32), n.pos, n.has_gauss, gauss


def _apply(kind: str, raw: bytes, py: Any, npr: Any, gen: Any) -> None:
    """Set ``kind``'s state from ``raw`` on the given generators (None for CUDA: the process's);
    a Python or NumPy state is checked in full before its generator is given it."""
    if kind == "python":
        py.setstate(_python(raw))
    elif kind == "numpy":
        npr.set_state(_numpy(raw))
    elif kind == "torch":
        gen.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    elif kind.startswith("cuda:"):
        if gen is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8), int(kind[5:]))
    else:
        raise ManifestError(f"unknown RNG kind {kind!r}")


def check_rng(states: dict[str, bytes | memoryview], *, raw_kinds: bool = True) -> None:
    """Refuse (ManifestError) RNG states that ``restore_rng`` could not set, without setting
    any: a Python or NumPy state unless it is one a writer produces (§10), then each is
    decoded into a fresh generator of its kind. Load paths call this before they
    write a byte into a caller's tensors (SPEC.md §16); verify calls it on every RNG object
    with ``raw_kinds=False``: the size limit and the Python and NumPy encodings (§10) only,
    since what torch accepts as a raw generator state depends on the torch build."""
    for kind, raw in states.items():
        if len(raw) > MAX_RNG_BYTES:
            raise ManifestError(
                f"RNG state {kind!r} is {len(raw)} bytes, over the {MAX_RNG_BYTES}-byte limit (SPEC.md §Limits)"
            )
        if not raw_kinds and (kind == "torch" or kind.startswith("cuda:")):
            continue
        try:
            gen = torch.Generator() if kind == "torch" else None  # only a torch state needs torch (and imports it)
            _apply(kind, bytes(raw), random.Random(), np.random.RandomState(), gen)
        except (msgspec.DecodeError, ValueError, TypeError, RuntimeError, OverflowError, UnicodeDecodeError) as e:
            raise ManifestError(f"RNG state {kind!r} is malformed: {e} (SPEC.md §10)") from None


def restore_rng(states: dict[str, bytes | memoryview]) -> None:
    """Set the process's RNGs from ``capture_rng`` output; ManifestError on malformed bytes,
    before any generator is changed."""
    check_rng(states)
    default = torch.default_generator
    for kind, raw in states.items():
        _apply(kind, bytes(raw), random, np.random, default)
