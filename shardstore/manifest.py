"""Manifest schemas and their canonical encoding (SPEC.md §Manifests, §Canonical encoding).

Every manifest is a frozen msgspec Struct tagged by a ``type`` field. The canonical
encoding is compact JSON with keys sorted, every field present, and no floating-point
numbers at all: real numbers travel as the 16 lowercase hex digits of their IEEE-754
binary64 bit pattern (``F64``), so their text never depends on a language's float repr.
Decoding is strict: the byte size is bounded before parsing, unknown types, versions and
fields are refused, every constrained field is checked, and the bytes must re-encode to
themselves (a manifest has exactly one valid spelling).

Options on ``Base`` and why:
- ``frozen=True``: manifests are values; their ids are hashes of their bytes.
- ``forbid_unknown_fields=True``: a reader never silently drops data it does not understand.
- ``kw_only=True``: fields are named at every construction site.
- ``tag_field="type"``: one decoder reads any manifest and says which kind it is.
"""
from __future__ import annotations

import struct
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

from .bounded import check_json_nesting
from .errors import ManifestError, ObjectTooLarge
from .names import GROUP_NAME_PATTERN, JOB_ID_PATTERN, OID_PATTERN, TENSOR_NAME_PATTERN
from .payloads import CHUNKED_VERSION, FORMAT_VERSION, STATE_CHUNKED_VERSION, is_chunked, shard_version, state_payloads, tensor_payloads

__all__ = [
    "FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "DTYPE_NAMES",
    "TRANSITIONS",
    "CHUNKED_VERSION",
    "STATE_CHUNKED_VERSION",
    "SUPPORTED_VERSIONS",
    "MAX_BLOCKS",
    "Oid",
    "F64",
    "Block",
    "Payload",
    "is_chunked",
    "tensor_payloads",
    "state_payloads",
    "shard_version",
    "Base",
    "StoreConfig",
    "PinManifest",
    "GroupSpec",
    "OptimEntry",
    "TensorEntry",
    "StateTensor",
    "StateScalar",
    "ParamState",
    "HyperGroup",
    "TorchOptimizer",
    "ExtraEntry",
    "RngEntry",
    "Slice",
    "ShardManifest",
    "SlotLayout",
    "OptimizerSpec",
    "CommitManifest",
    "LearnedState",
    "Manifest",
    "f64_encode",
    "f64_decode",
    "encode",
    "check_writable",
    "decode",
    "decode_manifest",
    "encode_config",
    "decode_config",
]

#: Versions of shard manifests and commits this reader accepts (the version rule: ``payloads.py``).
SUPPORTED_VERSIONS = (1, 2, 3)
#: Most blocks one chunked payload may list (4 TiB of 4 MiB blocks); checked by the decoder.
MAX_BLOCKS = 1 << 20
#: Largest manifest (shard, commit, config) a reader will parse; checked before decoding.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_ENTRIES = 1_000_000
MAX_SLOTS = 65_536
MAX_NDIM = 16
MAX_DIM = 2**48

DTYPE_NAMES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")
TRANSITIONS = ("init", "train", "repartition", "grow", "import")

Oid = Annotated[str, Meta(pattern=OID_PATTERN)]
F64 = Annotated[str, Meta(pattern=r"^[0-9a-f]{16}$")]
TensorName = Annotated[str, Meta(pattern=TENSOR_NAME_PATTERN)]
GroupName = Annotated[str, Meta(pattern=GROUP_NAME_PATTERN)]
JobId = Annotated[str, Meta(pattern=JOB_ID_PATTERN)]
Label = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.:+-]{0,127}$")]
Count = Annotated[int, Meta(ge=0, le=2**62)]
Dim = Annotated[int, Meta(ge=0, le=MAX_DIM)]
DType = Literal["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
Transition = Literal["init", "train", "repartition", "grow", "import"]
Algorithm = Literal["adamw", "adam", "none", "torch"]
TensorKind = Literal["param", "buffer"]
#: Keys of optimizer state, of hyperparameters and of extras (SPEC.md §Optimizer state, any torch optimizer; §Extras).
StateKey = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")]
#: A real number where a value may also be an integer, a boolean or a string: ``"f64:" + F64``.
Real = Annotated[str, Meta(pattern=r"^f64:[0-9a-f]{16}$")]
HyperScalar = Union[bool, int, str, None]  # a str starting "f64:" is a real (SPEC.md §Canonical encoding)
HyperValue = Union[bool, int, str, None, tuple[HyperScalar, ...]]
RngKind = Annotated[str, Meta(pattern=r"^(python|numpy|torch|cuda:[0-9]{1,4})$")]


def f64_encode(x: float) -> str:
    """Canonical text of a real number: its IEEE-754 binary64 bits as 16 lowercase hex digits."""
    return struct.pack(">d", float(x)).hex()


def f64_decode(s: str) -> float:
    """Inverse of :func:`f64_encode`."""
    return struct.unpack(">d", bytes.fromhex(s))[0]


class Base(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Common options of every schema struct (see the module docstring for why)."""


class StoreConfig(Base, tag="store", tag_field="type"):
    """The store's config object (``config`` at the store root). Readers refuse unknown versions."""

    version: int
    hash: Literal["blake3"] = "blake3"
    fanout: Literal[2] = 2


class GroupSpec(Base):
    """One named optimizer group and its hyperparameters, in canonical (F64) form."""

    name: GroupName
    lr: F64
    beta1: F64
    beta2: F64
    eps: F64
    weight_decay: F64


class Block(Base):
    """One block of a chunked payload: where it starts in the tensor, its extent, its object."""

    start: Annotated[tuple[Dim, ...], Meta(max_length=MAX_NDIM)]
    shape: Annotated[tuple[Dim, ...], Meta(max_length=MAX_NDIM)]
    object: Oid


#: A tensor payload: one object id (format 1 and small tensors), or the blocks of the
#: tensor's canonical grid in C order of their starts (format 2; SPEC.md §Chunked payloads).
#: Every tensor a manifest names (parameters, moments, and any kind added later) is a Payload.
Payload = Union[Oid, Annotated[tuple[Block, ...], Meta(min_length=2, max_length=MAX_BLOCKS)]]


class OptimEntry(Base):
    """A parameter's optimizer state: group, Adam cursor (birth, age) and both moments."""

    group: GroupName
    birth: Count
    age: Count
    exp_avg: Payload | None
    exp_avg_sq: Payload | None
    moment_dtype: DType | None


class StateTensor(Base):
    """One tensor of a parameter's optimizer state (or of an extra): key, dtype, shape, payload.

    ``object`` is one object id, or (format 3, torch-form state only) the blocks of the
    tensor's canonical grid; an extra's tensor is always one object (SPEC.md §Chunked payloads)."""

    key: StateKey
    dtype: DType
    shape: Annotated[tuple[Dim, ...], Meta(max_length=MAX_NDIM)]
    object: Payload


class StateScalar(Base, omit_defaults=True):
    """One number of a parameter's optimizer state; ``dtype`` is set when it was a 0-d tensor."""

    key: StateKey
    value: Union[bool, int, Real, None] = None
    dtype: DType | None = None


class ParamState(Base):
    """A parameter's state under any torch optimizer (algorithm ``torch``): group, tensors, numbers."""

    group: GroupName
    tensors: Annotated[tuple[StateTensor, ...], Meta(max_length=256)]
    scalars: Annotated[tuple[StateScalar, ...], Meta(max_length=256)]


class TensorEntry(Base, omit_defaults=True):
    """One named tensor: dtype, shape, payload object id, and its optimizer state if trained.

    ``kind`` and ``state`` are omitted from the encoding at their defaults (a parameter;
    no state of a non-Adam optimizer), so entries written before they existed keep their ids.
    """

    name: TensorName
    dtype: DType
    shape: Annotated[tuple[Dim, ...], Meta(max_length=MAX_NDIM)]
    param: Payload
    optim: OptimEntry | None
    kind: TensorKind = "param"
    state: ParamState | None = None


class HyperGroup(Base):
    """One named param group of any torch optimizer: every hyperparameter but ``params``, canonical."""

    name: GroupName
    hyper: Annotated[dict[StateKey, HyperValue], Meta(max_length=256)]


class TorchOptimizer(Base):
    """Any torch optimizer (algorithm ``torch``): its class and named param groups."""

    class_name: Label
    groups: Annotated[tuple[HyperGroup, ...], Meta(max_length=4096)]


class ExtraEntry(Base):
    """A stateful object's state (SPEC.md §Extras): canonical JSON object, and the tensors it names."""

    key: StateKey
    state: Oid
    tensors: Annotated[tuple[StateTensor, ...], Meta(max_length=MAX_ENTRIES)]


class Slice(Base):
    """The box of a sharded tensor one slot held when it saved (SPEC.md §Slices held): layout, not learned state."""

    name: TensorName
    start: Annotated[tuple[Dim, ...], Meta(max_length=MAX_NDIM)]
    shape: Annotated[tuple[Dim, ...], Meta(max_length=MAX_NDIM)]


class RngEntry(Base):
    """One RNG state object of a slot (Python, NumPy, torch CPU, or a CUDA device)."""

    kind: RngKind
    object: Oid


class ShardManifest(Base, tag="shard", tag_field="type", omit_defaults=True):
    """One slot's tensors, optimizer groups and RNG, bound to its job, step, parent and layout size.

    ``torch_optimizer``, ``extras`` and ``slices`` (format 3) are omitted from the encoding when unused.
    """

    version: int
    job: JobId
    step: Count
    parent: Oid | None
    config: Oid | None
    slot: Annotated[int, Meta(ge=0, lt=MAX_SLOTS)]
    slots: Annotated[int, Meta(ge=1, le=MAX_SLOTS)]
    algorithm: Algorithm
    groups: Annotated[tuple[GroupSpec, ...], Meta(max_length=4096)]
    entries: Annotated[tuple[TensorEntry, ...], Meta(max_length=MAX_ENTRIES)]
    rng: Annotated[tuple[RngEntry, ...], Meta(max_length=64)]
    torch_optimizer: TorchOptimizer | None = None
    extras: Annotated[tuple[ExtraEntry, ...], Meta(max_length=4096)] = ()
    slices: Annotated[tuple[Slice, ...], Meta(max_length=MAX_ENTRIES)] = ()


class SlotLayout(Base):
    """Which tensors a slot owns and the shard manifest that holds them."""

    slot: Annotated[int, Meta(ge=0, lt=MAX_SLOTS)]
    shard: Oid
    tensors: Annotated[tuple[TensorName, ...], Meta(max_length=MAX_ENTRIES)]


class OptimizerSpec(Base, omit_defaults=True):
    """The optimizer in canonical form: algorithm and named groups (not torch's param_group dicts).

    Algorithm ``torch`` (any other torch optimizer) has no Adam ``groups`` and names its
    class and groups in ``torch_optimizer``, omitted from the encoding otherwise.
    """

    algorithm: Algorithm
    groups: Annotated[tuple[GroupSpec, ...], Meta(max_length=4096)]
    torch_optimizer: TorchOptimizer | None = None


class CommitManifest(Base, tag="commit", tag_field="type", omit_defaults=True):
    """A commit: everything that names one checkpoint. Its object id is the full root.

    ``extras`` (commit-wide stateful objects) is omitted from the encoding when empty.
    """

    version: int
    job: JobId
    schedule: Label | None
    profile: Label
    config: Oid | None
    optimizer: OptimizerSpec
    step: Count
    data_cursor: Count | None
    layout: Annotated[tuple[SlotLayout, ...], Meta(min_length=1, max_length=MAX_SLOTS)]
    learned_root: Oid
    parent: Oid | None
    transition: Transition
    extras: Annotated[tuple[ExtraEntry, ...], Meta(max_length=4096)] = ()


class LearnedState(Base, tag="learned", tag_field="type", omit_defaults=True):
    """The document whose hash is the learned-state root (never stored; SPEC.md §Roots)."""

    version: int
    step: Count
    data_cursor: Count | None
    config: Oid | None
    optimizer: OptimizerSpec
    tensors: tuple[TensorEntry, ...]
    extras: tuple[ExtraEntry, ...] = ()


class PinManifest(Base, tag="pin", tag_field="type"):
    """The value of a pin (``pins/<name>``): objects that gc keeps although no commit names
    them (SPEC.md §Pins). Ids sorted, no repeats; the objects themselves, nothing they name."""

    version: int
    objects: Annotated[tuple[Oid, ...], Meta(max_length=MAX_ENTRIES)]


Manifest = Union[StoreConfig, ShardManifest, CommitManifest, PinManifest]


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
    before writing what it (and every reader) could never read back (SPEC.md §Limits, §15a)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ObjectTooLarge(f"{what}: {len(data):,} bytes, over the {MAX_MANIFEST_BYTES:,}-byte limit every reader enforces "
                             "(SPEC.md §Limits); refused before it is written")
    return data


def _check_bytes(data: bytes | memoryview, what: str) -> bytes:
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{what}: {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte manifest limit (SPEC.md §Limits)")
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
        raise ManifestError(f"{what}: {header.type} manifest is not in canonical encoding (SPEC.md §Canonical encoding)")
    if isinstance(obj, ShardManifest) and obj.version != shard_version(obj.entries, obj.slices):
        raise ManifestError(
            f"{what}: shard manifest of version {obj.version} must be version {shard_version(obj.entries, obj.slices)}: "
            "version 3 exactly when a torch-form state tensor is chunked or slices are recorded, else 2 exactly when a "
            "tensor payload is chunked (SPEC.md §Versioning)"
        )
    return obj


def decode_manifest(data: bytes | memoryview, kind: type[Any], what: str = "manifest") -> Any:
    """Decode and require a specific manifest class (e.g. CommitManifest)."""
    obj = decode(data, what)
    if not isinstance(obj, kind):
        raise ManifestError(f"{what}: expected a {kind.__name__}, found a {type(obj).__name__}")
    return obj


_F64_TAG = "f64:"
_MAX_CONFIG_DEPTH = 32


def _config_to_canonical(value: Any, path: str, depth: int = 0) -> Any:
    if depth > _MAX_CONFIG_DEPTH:
        raise ManifestError(f"model config: nesting deeper than {_MAX_CONFIG_DEPTH} at {path}")
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return _F64_TAG + f64_encode(value)
    if isinstance(value, str):
        if value.startswith(_F64_TAG):
            raise ManifestError(f"model config: string at {path} starts with the reserved prefix {_F64_TAG!r}")
        return value
    if isinstance(value, (list, tuple)):
        return [_config_to_canonical(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ManifestError(f"model config: key {k!r} at {path} is not a string")
            out[k] = _config_to_canonical(v, f"{path}.{k}", depth + 1)
        return out
    raise ManifestError(f"model config: value at {path} has unsupported type {type(value).__name__}")


def _config_from_canonical(value: Any) -> Any:
    if isinstance(value, str) and value.startswith(_F64_TAG):
        text = value[len(_F64_TAG):]
        if len(text) != 16 or any(c not in "0123456789abcdef" for c in text):
            raise ManifestError(f"model config: malformed real number {value!r}")
        return f64_decode(text)
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
