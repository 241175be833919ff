"""Manifest schemas: the frozen msgspec Structs every manifest is, their field types and
constraints, and the format's limits and versions (SPEC.md §Manifests, §Limits, §Versioning).

Options on ``Base`` and why:
- ``frozen=True``: manifests are values; their ids are hashes of their bytes.
- ``forbid_unknown_fields=True``: a reader never silently drops data it does not understand.
- ``kw_only=True``: fields are named at every construction site.
- ``tag_field="type"``: one decoder reads any manifest and says which kind it is.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta

from ..names import GROUP_NAME_PATTERN, JOB_ID_PATTERN, OID_PATTERN, TENSOR_NAME_PATTERN
from ..tensors import MAX_DIM, MAX_NDIM

#: The base format version: the store config, pins, and every shard manifest, commit and
#: learned-state document without a chunked payload. A manifest carries the lowest version
#: that can express it (SPEC.md §Versioning): ``CHUNKED_VERSION`` only where a tensor payload
#: is chunked (SPEC.md §Chunked payloads), so single-block state encodes exactly as before.
FORMAT_VERSION = 1
CHUNKED_VERSION = 2
#: Shard manifests, commits and learned-state documents where a torch-form optimizer state
#: tensor is chunked (SPEC.md §Chunked payloads, state tensors): in versions 1 and 2 a state
#: tensor is one object whatever its size, so chunking them changed ids and needed a version.
#: Shard manifests recording slices (SPEC.md §Slices held) too: recording them changed DTensor saves' ids.
STATE_CHUNKED_VERSION = 3
#: Shard manifests, commits and learned-state documents with any chunked payload, on the tile
#: grid (SPEC.md §Chunked payloads): what every writer produces since. Versions 2 and 3 put
#: their chunked payloads on the row-band grid; they are still read and verified, never written.
TILE_VERSION = 4

#: Versions of shard manifests and commits this reader accepts (the version rule: ``manifest/payloads.py``).
SUPPORTED_VERSIONS = (1, 2, 3, 4)
#: Most blocks one chunked payload may list (about 2 TiB of tiles, 4 TiB of row bands); checked by the decoder.
MAX_BLOCKS = 1 << 20
#: Largest manifest (shard, commit, config) a reader will parse; checked before decoding.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_ENTRIES = 1_000_000
MAX_SLOTS = 65_536

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
#: An RNG kind; a CUDA device's number in decimal without leading zeros, as writers write it (one spelling per kind).
RngKind = Annotated[str, Meta(pattern=r"^(python|numpy|torch|cuda:(0|[1-9][0-9]{0,3}))$")]


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
