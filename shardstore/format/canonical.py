"""The canonical form of a value, the one rule every hashed document follows
(SPEC.md §Canonical encoding).

Hashed documents hold no floating-point JSON numbers: a real number is the 16 lowercase hex
digits of its IEEE-754 binary64 bits (``F64``), written as ``"f64:" + F64`` wherever a
value may also be an integer, a boolean or a string (model config, optimizer
hyperparameters and scalars, extras' state documents). Integers are those the canonical
JSON encoder writes as integers (−2^63 ≤ n < 2^64). A string may not begin with the
reserved prefix. Lists of names a document keeps sorted are strictly increasing.

The manifest encoder, the torch optimizer form and the extras' state documents all take
their scalars through :func:`encode_scalar` and :func:`decode_real` here.
"""

from __future__ import annotations

import struct
from typing import Any, Callable, Sequence

__all__ = [
    "REAL_PREFIX",
    "TENSOR_PREFIX",
    "INT_MIN",
    "INT_MAX",
    "f64_encode",
    "f64_decode",
    "encode_scalar",
    "decode_real",
    "is_real",
    "in_int_range",
    "sorted_unique",
]

#: Prefix of a real number inside a value that may also be a string.
REAL_PREFIX = "f64:"
#: Prefix of a reference to a tensor inside a state document (``"tensor:<i>"``, SPEC.md §Extras).
TENSOR_PREFIX = "tensor:"
#: The integers the canonical JSON encoder writes as integers (SPEC.md §Canonical encoding, §Limits).
INT_MIN, INT_MAX = -(2**63), 2**64 - 1
_HEX = frozenset("0123456789abcdef")


def f64_encode(x: float) -> str:
    """Canonical text of a real number: its IEEE-754 binary64 bits as 16 lowercase hex digits."""
    return struct.pack(">d", float(x)).hex()


def f64_decode(s: str) -> float:
    """Inverse of :func:`f64_encode`."""
    return struct.unpack(">d", bytes.fromhex(s))[0]


def encode_scalar(
    value: Any, where: str, error: Callable[[str], Exception], *, reserved: Sequence[str] = (REAL_PREFIX,)
) -> bool | int | str | None:
    """The canonical form of None, a bool, an int, a float or a str; anything else is refused.

    ``error`` builds the caller's typed error from a message naming ``where``; ``reserved``
    lists the string prefixes the document gives a meaning to (``"f64:"`` always).
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not INT_MIN <= value <= INT_MAX:
            raise error(
                f"{where}: integer {value} is outside the 64-bit range the canonical encoding holds "
                "(-2^63 <= n < 2^64; SPEC.md §Canonical encoding)"
            )
        return int(value)
    if isinstance(value, float):
        return REAL_PREFIX + f64_encode(value)
    if isinstance(value, str):
        hit = next((p for p in reserved if value.startswith(p)), None)
        if hit is not None:
            raise error(f"{where}: string {value[:24]!r} starts with the reserved prefix {hit!r}")
        return value
    raise error(f"{where}: a {type(value).__name__} is neither a number nor a string (SPEC.md §Canonical encoding)")


def is_real(value: Any) -> bool:
    """Whether a decoded value is a canonical real's text (``"f64:"`` and anything after it)."""
    return isinstance(value, str) and value.startswith(REAL_PREFIX)


def decode_real(value: str, what: str, error: Callable[[str], Exception]) -> float:
    """The real number a ``"f64:" + F64`` string holds; a malformed one is refused naming ``what``."""
    text = value[len(REAL_PREFIX) :]
    if len(text) != 16 or not _HEX.issuperset(text):
        raise error(f"{what}: malformed real {value!r}")
    return f64_decode(text)


def sorted_unique(names: Sequence[str]) -> bool:
    """Whether ``names`` is strictly increasing (sorted, no repeats), as canonical name lists are."""
    return all(a < b for a, b in zip(names, names[1:]))


def in_int_range(value: Any) -> bool:
    """Whether a decoded scalar (or a tuple of them) holds no integer outside ``INT_MIN..INT_MAX``:
    the writer's range, enforced when reading too (a reader is handed what any writer wrote)."""
    if isinstance(value, (tuple, list)):
        return all(in_int_range(v) for v in value)
    return not isinstance(value, int) or isinstance(value, bool) or INT_MIN <= value <= INT_MAX
