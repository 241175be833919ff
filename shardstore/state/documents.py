"""State documents: a state's values as canonical JSON, its tensors referenced rather than
inlined (SPEC.md §9.3, §9.6). One walk writes and reads both grammars:

- an **extra's state** (§9.3, ``encode_state`` / ``read_state``): string keys; null, booleans,
  64-bit integers, strings, lists and objects; reals as ``"f64:" + F64``; tensors as
  ``"tensor:<i>"`` into the extra's own tensor list. Tuples come back as lists and NumPy
  scalars as Python numbers (one wider than 64 bits, ``np.longdouble``, is refused: ``float``
  would round it); a subclass of a scalar type (an ``IntEnum``) is refused, as it would come
  back as its base type; strings starting ``f64:`` or ``tensor:`` are refused.
- a **state dict's tree** (§9.6, ``encode_tree`` / ``read_tree``): the same, plus *typed
  values* that come back as exactly what they were, each a list whose first item is a tag
  string ``"type:<kind>"`` (a user's string never is one: strings starting with a reserved
  prefix are themselves a typed value): ``tuple``, ``size`` (``torch.Size``), ``dict`` (keys
  that are not all strings: integers, as a torch optimizer's ``state`` has, as ``[key,
  value]`` pairs in canonical key order), ``odict`` (an ``OrderedDict``: pairs in its order),
  ``str`` (a string with a reserved prefix, as the hex of its UTF-8), ``dtype``, ``device``,
  ``path`` (a ``pathlib`` path: class and text) and ``tensor`` (a tensor entry of the
  commit, by the name its key path gives: ``tree_name``). Anything else — a set, a NumPy
  scalar, an ``int`` subclass, a custom class — is refused by its key path.

A tree is also a well-formed §9.3 document with no tensors, so a reader that knows only §9.3
reads it without error (and shows the tags as they are).
"""

from __future__ import annotations

import pathlib
import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import msgspec

from ..errors import ManifestError, UnsupportedState
from ..format.bounded import check_json_nesting
from ..format.canonical import REAL_PREFIX, TENSOR_PREFIX, decode_real, encode_scalar, in_int_range, is_real
from ..format.lazy import torch
from ..format.manifest import MAX_MANIFEST_BYTES, check_writable
from ..format.names import TENSOR_NAME_PATTERN
from ..format.tensors import check_storable, hash_bytes, is_dtensor

__all__ = [
    "MAX_DEPTH",
    "TensorRef",
    "encode_state",
    "read_state",
    "encode_tree",
    "read_tree",
    "fill_tree",
    "tensor_refs",
    "tree_name",
]

TENSOR = TENSOR_PREFIX  # a tensor placeholder in a state document (format.canonical)
TYPE = "type:"
MAX_DEPTH = 64
_ENC = msgspec.json.Encoder(order="sorted")
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_TENSOR_NAME = re.compile(TENSOR_NAME_PATTERN)
_DEVICE = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,6})?")
_PATHS = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
_SHORT_KEY = 32  # a key of up to this many UTF-8 bytes is named by its hex, a longer one by a hash


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a tree, by its entry name (what ``read_tree`` gives before ``fill_tree``)."""

    name: str


def tree_name(keys: tuple[Any, ...]) -> str:
    """The tensor entry name of the value at key path ``keys`` (SPEC.md §9.6): segments joined by
    ``/``; a string key as itself when it is a plain name (not all digits), else ``_:`` and the
    hex of its UTF-8 (``_:b3-`` and 32 hex digits of its BLAKE3 past 32 bytes); an integer key or
    a list index in decimal, a negative one ``_:-`` and its digits. Distinct paths, distinct names."""
    segments = []
    for k in keys:
        if isinstance(k, int):
            segments.append(str(k) if k >= 0 else f"_:-{-k}")
        elif _PLAIN_KEY.fullmatch(k) and not k.isdigit():
            segments.append(k)
        else:
            raw = k.encode()
            segments.append("_:" + (raw.hex() if len(raw) <= _SHORT_KEY else "b3-" + hash_bytes(raw)[:32]))
    return "/".join(segments)


def _display(path: str, key: Any) -> str:
    return f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]"


class _Encoder:
    """One walk over a value; ``typed``: the tree grammar (§9.6), else an extra's (§9.3)."""

    def __init__(self, label: str, typed: bool) -> None:
        self.label, self.typed = label, typed
        self.tensors: list[Any] = []  # §9.3: the extra's tensors, by index
        self.named: dict[str, Any] = {}  # §9.6: the tree's tensors, by entry name

    def fail(self, path: str, msg: str) -> UnsupportedState:
        return UnsupportedState(f"{self.label} at {path}: {msg}")

    def value(self, v: Any, path: str, keys: tuple[Any, ...], depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise self.fail(path, f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(v, torch.Tensor) or isinstance(v, TensorRef):
            return self.tensor(v, path, keys)
        if self.typed:
            return self.typed_value(v, path, keys, depth)
        if isinstance(v, (list, tuple)):
            return [self.value(x, f"{path}[{i}]", (*keys, i), depth + 1) for i, x in enumerate(v)]
        if isinstance(v, Mapping):
            for k in v:
                if not isinstance(k, str):
                    raise self.fail(
                        path, f"key {k!r} is a {type(k).__name__}; state keys must be strings (SPEC.md §9.3)"
                    )
            return {k: self.value(v[k], f"{path}.{k}", (*keys, k), depth + 1) for k in sorted(v)}
        np_value = _numpy_scalar(v)
        if np_value is not None:
            return self.value(np_value, path, keys, depth)
        # exactly these types: a subclass (an IntEnum, a str Enum) would come back as its base, not itself
        if v is None or type(v) in (bool, int, float, str):
            return encode_scalar(v, f"{self.label} at {path}", UnsupportedState, reserved=(REAL_PREFIX, TENSOR))
        raise self.fail(
            path,
            f"a {type(v).__module__}.{type(v).__qualname__} is not storable without pickle "
            "(allowed: null, bool, int, float, str, list, dict with str keys, tensor; SPEC.md §9.3)",
        )

    def tensor(self, t: Any, path: str, keys: tuple[Any, ...]) -> Any:
        if not self.typed:
            if is_dtensor(t):  # one process's slice of it: storing that as the whole would be wrong
                raise self.fail(
                    path,
                    "a DTensor holds only this process's slice; an extra's tensors are stored whole, "
                    "by one process (pass full_tensor() or a plain tensor; SPEC.md §9.3)",
                )
            check_storable(t, f"{self.label} at {path}")
            self.tensors.append(t)
            return f"{TENSOR}{len(self.tensors) - 1}"
        name = tree_name(keys)
        if not _TENSOR_NAME.fullmatch(name):
            raise self.fail(
                path, f"the tensor's entry name {name[:80]!r}... is not a tensor name (over 512 characters?)"
            )
        if isinstance(t, TensorRef):  # re-encoding a tree read back: its names must be its paths' (canonical)
            if t.name != name:
                raise ManifestError(f"{self.label} at {path}: names tensor {t.name!r}, its path gives {name!r}")
        else:
            check_storable(t, f"{self.label} at {path}")
        self.named[name] = t
        return [f"{TYPE}tensor", name]

    def typed_value(self, v: Any, path: str, keys: tuple[Any, ...], depth: int) -> Any:
        kind = type(v)
        if v is None or kind is bool:
            return v
        if kind is int or kind is float:
            return encode_scalar(v, f"{self.label} at {path}", UnsupportedState)
        if kind is str:
            if v.startswith((REAL_PREFIX, TENSOR, TYPE)):
                return [f"{TYPE}str", v.encode().hex()]
            return v
        if kind is list:
            return [self.value(x, f"{path}[{i}]", (*keys, i), depth + 1) for i, x in enumerate(v)]
        if kind is torch.Size:
            return [f"{TYPE}size", *(int(d) for d in v)]
        if kind is tuple:
            return [f"{TYPE}tuple", *(self.value(x, f"{path}[{i}]", (*keys, i), depth + 1) for i, x in enumerate(v))]
        if kind is dict or kind is OrderedDict:
            return self.mapping(v, path, keys, depth, ordered=kind is OrderedDict)
        if isinstance(v, torch.dtype):
            return [f"{TYPE}dtype", str(v).removeprefix("torch.")]
        if isinstance(v, torch.device):
            return [f"{TYPE}device", str(v)]
        if isinstance(v, pathlib.PurePath) and kind.__name__ in _PATHS and kind.__module__ == "pathlib":
            return [f"{TYPE}path", kind.__name__, str(v)]
        raise self.fail(
            path,
            f"a {kind.__module__}.{kind.__qualname__} is not storable without pickle (allowed: None, bool, int, "
            "float, str, list, tuple, dict, OrderedDict, tensor, torch.Size, torch.dtype, torch.device, a pathlib "
            "path; exactly those types, so that each comes back as itself; SPEC.md §9.6)",
        )

    def mapping(self, v: Mapping[Any, Any], path: str, keys: tuple[Any, ...], depth: int, ordered: bool) -> Any:
        for k in v:
            if type(k) is not str and type(k) is not int:
                raise self.fail(path, f"key {k!r} is a {type(k).__name__}; keys must be str or int (SPEC.md §9.6)")
        if not ordered and all(type(k) is str for k in v):
            return {k: self.value(v[k], _display(path, k), (*keys, k), depth + 1) for k in sorted(v)}
        items = list(v) if ordered else sorted(v, key=_key_order)
        pairs = [
            [self.typed_value(k, path, keys, depth + 1), self.value(v[k], _display(path, k), (*keys, k), depth + 1)]
            for k in items
        ]
        return [f"{TYPE}odict" if ordered else f"{TYPE}dict", *pairs]


def _key_order(k: Any) -> tuple[int, Any]:
    """Canonical key order of a ``type:dict``: integers by value, then strings by their UTF-8 bytes."""
    return (0, k, b"") if type(k) is int else (1, 0, k.encode())


def _numpy_scalar(value: Any) -> bool | int | float | str | None:
    """A NumPy scalar as the Python value equal to it; None for anything else, and for a real wider
    than 64 bits (``np.longdouble``), which ``float`` would round (refused, never rounded)."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return None
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value) if value.dtype.itemsize <= 8 else None
    if isinstance(value, np.str_):
        return str(value)
    return None


def encode_state(state: Mapping[str, Any], label: str) -> tuple[bytes, list[Any]]:
    """An extra's state document (§9.3) and the tensors it references, by index (not copied)."""
    enc = _Encoder(label, typed=False)
    doc = enc.value(state, "$", (), 0)
    return check_writable(_json(doc, label), f"state document of {label}"), enc.tensors


def encode_tree(state: Mapping[Any, Any], label: str) -> tuple[bytes, dict[str, Any]]:
    """A state dict's tree (§9.6) and its tensors by entry name (referenced, not copied)."""
    if type(state) is not dict and type(state) is not OrderedDict:
        raise UnsupportedState(f"{label}: a state dict is a dict or an OrderedDict, not a {type(state).__name__}")
    enc = _Encoder(label, typed=True)
    doc = {"tree": enc.value(state, "$", (), 0)}  # a JSON object whatever the state dict's type (§9.3)
    return check_writable(_json(doc, label), f"tree of {label}"), enc.named


def _json(doc: Any, label: str) -> bytes:
    try:
        return _ENC.encode(doc)
    except UnicodeEncodeError as e:  # a lone surrogate in a key or string: not representable as UTF-8
        raise UnsupportedState(f"{label}: a string is not valid Unicode text ({e.reason} at {e.start})") from None


# -- reading ---------------------------------------------------------------------------------------


def _parse(raw: bytes | memoryview, what: str) -> Any:
    """A document's JSON, bounded, nesting checked before parsing, and in canonical encoding."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{what}: {len(raw)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit (SPEC.md §Limits)")
    raw = bytes(raw)
    # (an extra's own bound, 65 brackets, is checked by read_state first); a tree's typed values
    # add up to one JSON level per level of the state, and the tree sits inside {"tree": ...}
    check_json_nesting(raw, 2 * MAX_DEPTH + 3, what)
    try:
        doc = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(f"{what}: not a state document ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{what}: a state document is a JSON object")
    if _ENC.encode(doc) != raw:
        raise ManifestError(f"{what}: not in canonical encoding (SPEC.md §Canonical encoding)")
    return doc


def _scalar(value: Any, what: str) -> Any:
    if isinstance(value, float):
        raise ManifestError(f"{what}: holds a plain JSON real; reals must be f64 strings (SPEC.md §9.3)")
    if isinstance(value, int) and not in_int_range(value):
        # the writer refuses these; a reader that let them through would hand load_state_dict a
        # number no saved state could hold (SPEC.md §9.3, §Limits)
        raise ManifestError(f"{what}: integer {value} is outside the 64-bit range -2^63 <= n < 2^64 (SPEC.md §9.3)")
    if is_real(value):
        return decode_real(value, what, ManifestError)
    return value


def _decode_state(value: Any, tensors: list[Any], seen: list[int], what: str, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:  # the encoder's rule, value for value (a leaf too)
        raise ManifestError(f"{what}: nested deeper than {MAX_DEPTH} levels (SPEC.md §Limits)")
    if isinstance(value, str) and value.startswith(TENSOR):
        i = len(seen)
        if value != f"{TENSOR}{i}" or i >= len(tensors):
            raise ManifestError(
                f"{what}: tensor reference {value!r} is not the next of {len(tensors)} ({TENSOR}{i} expected)"
            )
        seen.append(i)
        return tensors[i]
    if isinstance(value, list):
        return [_decode_state(v, tensors, seen, what, depth + 1) for v in value]
    if isinstance(value, dict):
        return {k: _decode_state(value[k], tensors, seen, what, depth + 1) for k in sorted(value)}
    return _scalar(value, what)


def read_state(raw: bytes | memoryview, tensors: list[Any], what: str) -> dict[str, Any]:
    """Strictly decode an extra's state document (§9.3): bounded, canonical, every tensor referenced once, in order."""
    if len(raw) <= MAX_MANIFEST_BYTES:
        check_json_nesting(bytes(raw), MAX_DEPTH + 1, what)
    doc = _parse(raw, what)
    seen: list[int] = []
    try:
        out = _decode_state(doc, tensors, seen, what)
    except RecursionError:
        raise ManifestError(f"{what}: nested too deeply") from None
    if len(seen) != len(tensors):
        raise ManifestError(f"{what}: references {len(seen)} of its {len(tensors)} tensors")
    return out


def read_tree(raw: bytes | memoryview, what: str) -> Any:
    """Strictly decode a tree (§9.6): its tensors as ``TensorRef``s. The value must re-encode to
    exactly ``raw`` (one state, one document: key order, tags, names all canonical)."""
    doc = _parse(raw, what)
    if set(doc) != {"tree"}:
        raise ManifestError(f'{what}: a tree document is {{"tree": ...}}')
    try:
        value = _decode_typed(doc["tree"], what, 0)
        again, _ = encode_tree(value, what)
    except RecursionError:
        raise ManifestError(f"{what}: nested too deeply") from None
    except UnsupportedState as e:
        raise ManifestError(f"{what}: {e}") from None
    if again != bytes(raw):
        raise ManifestError(f"{what}: not the canonical tree of its value (SPEC.md §9.6)")
    return value


def _decode_typed(value: Any, what: str, depth: int) -> Any:
    if depth > 2 * MAX_DEPTH + 1:
        raise ManifestError(f"{what}: nested deeper than {MAX_DEPTH} levels (SPEC.md §Limits)")
    if isinstance(value, dict):
        return {k: _decode_typed(v, what, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        if value and isinstance(value[0], str) and value[0].startswith(TYPE):
            return _decode_tag(value[0][len(TYPE) :], value[1:], what, depth)
        return [_decode_typed(v, what, depth + 1) for v in value]
    if isinstance(value, str) and value.startswith((TENSOR, TYPE)):
        raise ManifestError(f"{what}: string {value[:24]!r} starts with a reserved prefix outside a typed value")
    return _scalar(value, what)


def _decode_tag(kind: str, args: list[Any], what: str, depth: int) -> Any:
    def bad(msg: str) -> ManifestError:
        return ManifestError(f"{what}: malformed type:{kind[:24]} value: {msg}")

    if kind == "tuple":
        return tuple(_decode_typed(v, what, depth + 1) for v in args)
    if kind == "size":
        if not all(type(d) is int and 0 <= d <= 2**62 for d in args):
            raise bad("sizes are integers >= 0")
        return torch.Size(args)
    if kind in ("dict", "odict"):
        out: dict[Any, Any] = OrderedDict() if kind == "odict" else {}
        for pair in args:
            if not isinstance(pair, list) or len(pair) != 2:
                raise bad("items are [key, value] pairs")
            key = _decode_typed(pair[0], what, depth + 1)
            if type(key) is not str and type(key) is not int or key in out:
                raise bad("keys are distinct strings or integers")
            out[key] = _decode_typed(pair[1], what, depth + 1)
        return out
    one = args[0] if len(args) == 1 else None
    if kind == "str" and isinstance(one, str):
        try:
            return bytes.fromhex(one).decode()
        except (ValueError, UnicodeDecodeError):
            raise bad("not the hex of UTF-8 text") from None
    if kind == "dtype" and isinstance(one, str):
        dt = getattr(torch, one, None) if one.isidentifier() else None
        if not isinstance(dt, torch.dtype) or str(dt) != f"torch.{one}":
            raise bad(f"{one[:32]!r} is not a torch dtype")
        return dt
    if kind == "device" and isinstance(one, str):
        if not _DEVICE.fullmatch(one):
            raise bad(f"{one[:32]!r} is not a device")
        try:
            return torch.device(one)
        except RuntimeError:
            raise bad(f"{one[:32]!r} is not a device") from None
    if kind == "path" and len(args) == 2 and args[0] in _PATHS and isinstance(args[1], str):
        try:
            return getattr(pathlib, args[0])(args[1])
        except (NotImplementedError, TypeError, ValueError):  # a WindowsPath on this system, or a NUL in it
            raise bad(f"a {args[0]} cannot be made here") from None
    if kind == "tensor" and isinstance(one, str):
        if not _TENSOR_NAME.fullmatch(one):
            raise bad("not a tensor name")
        return TensorRef(one)
    raise bad("unknown kind or wrong arguments")


def fill_tree(value: Any, tensors: Callable[[str], Any], depth: int = 0) -> Any:
    """``value`` with each ``TensorRef`` replaced by ``tensors(name)`` (containers rebuilt, same types)."""
    if isinstance(value, TensorRef):
        return tensors(value.name)
    if type(value) is dict or type(value) is OrderedDict:
        return type(value)((k, fill_tree(v, tensors, depth + 1)) for k, v in value.items())
    if type(value) is list:
        return [fill_tree(v, tensors, depth + 1) for v in value]
    if type(value) is tuple:
        return tuple(fill_tree(v, tensors, depth + 1) for v in value)
    return value


def tensor_refs(value: Any) -> list[str]:
    """The entry names a tree read back references, in walk order."""
    out: list[str] = []
    fill_tree(value, lambda n: out.append(n))
    return out
