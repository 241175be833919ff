"""The canonical encoding of manifests and of the model config (SPEC.md §Canonical encoding).

The canonical encoding is compact JSON with keys sorted, every field present, and no
floating-point numbers at all: real numbers travel as the 16 lowercase hex digits of their
IEEE-754 binary64 bit pattern (``F64``), so their text never depends on a language's float
repr. Decoding is strict: the byte size is bounded before parsing, unknown types, versions
and fields are refused, every constrained field is checked, and the bytes must re-encode to
themselves (a manifest has exactly one valid spelling).
"""

from __future__ import annotations

from typing import Any

import msgspec

from ...errors import ManifestError, ObjectTooLarge
from ..bounded import check_json_nesting
from ..canonical import decode_real, encode_scalar, is_real
from .payloads import legal_versions
from .schema import (
    MAX_MANIFEST_BYTES,
    SUPPORTED_VERSIONS,
    Base,
    CommitManifest,
    Manifest,
    PinManifest,
    ShardManifest,
    StoreConfig,
)

__all__ = ["encode", "check_writable", "decode", "decode_manifest", "encode_config", "decode_config"]


class _Header(msgspec.Struct):
    """Lenient first pass: just enough to refuse unknown types and versions with a clear message."""

    type: str
    version: int


_ENCODER = msgspec.json.Encoder(order="sorted")
_HEADER = msgspec.json.Decoder(_Header)
_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    "store": msgspec.json.Decoder(StoreConfig),
    "shard": msgspec.json.Decoder(ShardManifest),
    "commit": msgspec.json.Decoder(CommitManifest),
    "pin": msgspec.json.Decoder(PinManifest),
}


def encode(obj: Base) -> bytes:
    """The canonical bytes of a manifest: compact JSON, sorted keys, every field present."""
    return _ENCODER.encode(obj)


def check_writable(data: bytes, what: str) -> bytes:
    """``data`` if a reader will accept its size; else ObjectTooLarge, so that a writer refuses
    before writing what it (and every reader) could never read back (SPEC.md §Limits, §15.1)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ObjectTooLarge(
            f"{what}: {len(data):,} bytes, over the {MAX_MANIFEST_BYTES:,}-byte limit every reader enforces "
            "(SPEC.md §Limits); refused before it is written"
        )
    return data


def _check_bytes(data: bytes | memoryview, what: str) -> bytes:
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"{what}: {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte manifest limit (SPEC.md §Limits)"
        )
    return bytes(data)


def decode(data: bytes | memoryview, what: str = "manifest") -> Manifest:
    """Strictly decode any manifest; raise ManifestError naming ``what`` on any deviation."""
    raw = _check_bytes(data, what)
    try:
        header = _HEADER.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # msgspec raises the latter for invalid UTF-8 in a string
        raise ManifestError(f"{what}: not a manifest ({e}) (SPEC.md §Canonical encoding)") from None
    decoder = _DECODERS.get(header.type)
    if decoder is None:
        raise ManifestError(f"{what}: unknown manifest type {header.type!r}")
    allowed = SUPPORTED_VERSIONS if header.type in ("shard", "commit") else (1,)
    if header.version not in allowed:
        raise ManifestError(
            f"{what}: {header.type} format version {header.version} is not supported by this reader "
            f"(supports {', '.join(map(str, allowed))}; SPEC.md §Versioning)"
        )
    try:
        obj = decoder.decode(raw)
    except msgspec.ValidationError as e:
        raise ManifestError(f"{what}: invalid {header.type} manifest: {e}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{what}: malformed {header.type} manifest: {e}") from None
    if encode(obj) != raw:
        raise ManifestError(
            f"{what}: {header.type} manifest is not in canonical encoding (SPEC.md §Canonical encoding)"
        )
    if isinstance(obj, ShardManifest) and obj.version not in (legal := legal_versions(obj.entries, obj.slices)):
        raise ManifestError(
            f"{what}: shard manifest of version {obj.version} must be version {' or '.join(map(str, legal))}: version 4 "
            "exactly when a payload is chunked (the tile grid), else 3 exactly when slices are recorded; versions 2 and 3 "
            "wrote chunked payloads on the row-band grid: 3 when a state tensor is chunked or slices are recorded, else 2 "
            "(SPEC.md §Versioning)"
        )
    return obj


def decode_manifest(data: bytes | memoryview, kind: type[Any], what: str = "manifest") -> Any:
    """Decode and require a specific manifest class (e.g. CommitManifest)."""
    obj = decode(data, what)
    if not isinstance(obj, kind):
        raise ManifestError(f"{what}: expected a {kind.__name__}, found a {type(obj).__name__}")
    return obj


_MAX_CONFIG_DEPTH = 32


def _config_to_canonical(value: Any, path: str, depth: int = 0) -> Any:
    if depth > _MAX_CONFIG_DEPTH:
        raise ManifestError(f"model config: nesting deeper than {_MAX_CONFIG_DEPTH} at {path}")
    if isinstance(value, (list, tuple)):
        return [_config_to_canonical(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            # an integer key is its decimal text, as JSON (and so Hugging Face's config.json, whose
            # loader turns id2label's keys back into integers) writes it; a bool or any other key is refused
            if type(k) is int:
                k = str(k)
                if k in value:
                    raise ManifestError(f"model config: keys {int(k)} and {k!r} at {path} are both written {k!r}")
            elif not isinstance(k, str):
                raise ManifestError(f"model config: key {k!r} at {path} is neither a string nor an integer")
            out[k] = _config_to_canonical(v, f"{path}.{k}", depth + 1)
        return out
    return encode_scalar(value, f"model config: value at {path}", ManifestError)


def _config_from_canonical(value: Any) -> Any:
    if is_real(value):
        return decode_real(value, "model config", ManifestError)
    if isinstance(value, list):
        return [_config_from_canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: _config_from_canonical(v) for k, v in value.items()}
    return value


def encode_config(config: dict[str, Any]) -> bytes:
    """Canonical bytes of a model config: sorted compact JSON, reals as ``"f64:<16 hex>"`` strings."""
    if not isinstance(config, dict):
        raise ManifestError("model config must be a dict")
    try:
        return check_writable(_ENCODER.encode(_config_to_canonical(config, "$")), "model config")
    except UnicodeEncodeError as e:  # a lone surrogate in a key or string: not representable as UTF-8
        raise ManifestError(f"model config: a string is not valid Unicode text ({e.reason} at {e.start})") from None


def decode_config(data: bytes | memoryview, what: str = "model config") -> dict[str, Any]:
    """Strict inverse of :func:`encode_config` (bounded, canonical, no floats)."""
    raw = _check_bytes(data, what)
    check_json_nesting(raw, _MAX_CONFIG_DEPTH + 1, what)  # before any recursive parser or walker sees it
    try:
        value = msgspec.json.decode(raw, type=dict[str, Any])
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{what}: malformed ({e})") from None
    if _has_float(value):
        raise ManifestError(f"{what}: holds plain JSON reals; reals must be f64 strings (SPEC.md §Canonical encoding)")
    out = _config_from_canonical(value)
    if encode_config(out) != raw:
        raise ManifestError(f"{what}: not in canonical encoding (SPEC.md §Canonical encoding)")
    return out


def _has_float(value: Any) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, list):
        return any(_has_float(v) for v in value)
    if isinstance(value, dict):
        return any(_has_float(v) for v in value.values())
    return False
