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

Modules: `schema` (the Structs, field constraints and limits), `payloads` (which fields hold
tensor objects; the version rule) and `encoding` (canonical bytes and strict decoding). Inside
`shardstore.format`, above `tensors` and `canonical` and below `grid`: imports only those,
`names`, `bounded` and `shardstore.errors` (checked by import-linter).
"""

from __future__ import annotations

from ..canonical import f64_decode, f64_encode
from .encoding import check_writable, decode, decode_config, decode_manifest, encode, encode_config
from .payloads import (
    TREE_KEY,
    banded,
    extra_objects,
    is_chunked,
    legal_versions,
    shard_version,
    state_payloads,
    tensor_payloads,
)
from .schema import (
    CHUNKED_VERSION,
    DTYPE_NAMES,
    F64,
    FORMAT_VERSION,
    MAX_BLOCKS,
    MAX_DIM,
    MAX_ENTRIES,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    MAX_SLOTS,
    STATE_CHUNKED_VERSION,
    SUPPORTED_VERSIONS,
    TILE_VERSION,
    TRANSITIONS,
    Algorithm,
    Base,
    Block,
    CommitManifest,
    Count,
    Dim,
    DType,
    ExtraEntry,
    GroupName,
    GroupSpec,
    HyperGroup,
    HyperScalar,
    HyperValue,
    JobId,
    Label,
    LearnedState,
    Manifest,
    Oid,
    OptimEntry,
    OptimizerSpec,
    ParamState,
    Payload,
    PinManifest,
    Real,
    RngEntry,
    RngKind,
    ShardManifest,
    Slice,
    SlotLayout,
    StateKey,
    StateScalar,
    StateTensor,
    StoreConfig,
    TensorEntry,
    TensorKind,
    TensorName,
    TorchOptimizer,
    Transition,
)

__all__ = [
    "MAX_ENTRIES",
    "MAX_SLOTS",
    "MAX_NDIM",
    "MAX_DIM",
    "FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "DTYPE_NAMES",
    "TRANSITIONS",
    "CHUNKED_VERSION",
    "STATE_CHUNKED_VERSION",
    "TILE_VERSION",
    "SUPPORTED_VERSIONS",
    "MAX_BLOCKS",
    "Oid",
    "F64",
    "Block",
    "Payload",
    "extra_objects",
    "TREE_KEY",
    "is_chunked",
    "tensor_payloads",
    "state_payloads",
    "shard_version",
    "legal_versions",
    "banded",
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
    "TensorName",
    "GroupName",
    "JobId",
    "Label",
    "Count",
    "Dim",
    "DType",
    "Transition",
    "Algorithm",
    "TensorKind",
    "StateKey",
    "Real",
    "HyperScalar",
    "HyperValue",
    "RngKind",
]
