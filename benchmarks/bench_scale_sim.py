"""Simulated scale: the metadata path of one commit of Llama-3 8B, 70B and 405B with AdamW state,
under FSDP2 (dp) x tensor parallelism (tp), at 64 to 16,384 ranks — shardstore side by side with
torch.distributed.checkpoint (DCP) — in one process, with no tensor bytes. Not a test.

The shapes are the published configs (``MODELS``, Hugging Face parameter names, untied head),
float32 weights and both Adam moments; the tp plan is torchtitan's for Llama (attention q/k/v and
MLP gate/up column-parallel, ``Shard(0)``; o/down row-parallel, ``Shard(1)``; embedding ``Shard(0)``;
head column-parallel; RMSNorm weights replicated), FSDP2 over ``dp`` on top (a column-parallel
weight is ``(_StridedShard(0, sf=tp), Shard(0))``, a row-parallel one ``(Shard(0), Shard(1))``, a
norm weight ``(Shard(0), Replicate())``; tp = 1 is ``Shard(0)`` on a 1-d mesh). The restore goes
into N/2 ranks, dp only (every tensor ``Shard(0)``). Rank r of a dp x tp mesh is (r // tp, r % tp).

**shardstore**, the real code of each step, with what stands in where bytes would be needed:

1. describe: for the sampled ranks the real ``describe`` and ``describe_layout`` of a slot of
   meta-device DTensors on a fake process group (one per rank, ``torch.testing``'s
   ``FakeStore``), their descriptions checked byte for byte against ones generated from
   ``sharded.placement.mesh_parts`` and their layout digests against the model's
   (``make_layout``); every rank all-gathers its 33-byte digest (counted), and since they are
   all the same no description is all-gathered (SPEC §15.2 step 1);
2. plan: ``derive_union`` (every rank's boxes from the layout; identical on every rank, so
   computed once and charged to every rank) and ``plan_local`` (the rank's own part of the
   plan: what ``write_dtensors`` runs), on each sampled rank; beside it, for comparison, the
   whole plan (``plan_union``) every rank computed before;
3. the exchange moves bytes: each block's id stands in as the hash of (model, tensor, role,
   block index), registered with its size in the counting storage; the id table every rank
   all-reduces (32 bytes a block) and the replicas' check (one 64-byte all-reduce) are counted, not run;
4. ``write_shard`` for every rank, from the ``StoredPayload`` entries ``ExchangePlan.recorders``
   gives it and the slices it held (``format.slices.make_slices``): real manifests, written;
5. ``write_commit`` on the coordinator (reads every shard manifest, the learned-state root, the
   commit manifest, then ``load_commit``: every rule of SPEC §17);
6. ``acknowledge`` on the sampled ranks (and, for comparison, ``load_commit``: what every rank
   ran to acknowledge before this benchmark's branch); the protocol's 33-byte all-gathers counted;
7. ``verify(deep=False)`` (structure, and every object's size from the stand-ins) in one process;
8. ``restore`` on sampled ranks of the N/2-rank dp mesh into meta DTensors (and an optimizer
   that takes the moments by ``state_import``): ``load_commit``, name and shape checks, and the
   read plan of every block; the store stands in for the reads (``read_into`` / ``get_tensor``
   check the object's size and move no byte).

Every manifest, ref and config byte is real, in a counting storage (``CountingStorage``) that
holds them and records requests and bytes; tensor objects exist there as (id, size) only.

**DCP** at the same N, with its own types and functions: ``DefaultSavePlanner.create_local_plan``
on the sampled ranks (the state dict ``get_state_dict`` gives for FSDP2 + AdamW: DTensors,
a 0-d ``step`` per parameter, two param groups), and for every rank a plan of the same
``WriteItem``s built from the same boxes (checked equal, item for item and with the planner's
flatten mapping, to the real plans of the sampled ranks); ``create_global_plan`` (dedup, the
global plan, validation) and ``FileSystemWriter.prepare_global_plan`` on the coordinator; the
``WriteResult``s ``FileSystemWriter`` would return (one ``__r_0.distcp`` file per rank) and its
``finish``: ``storage_data`` and the pickled ``Metadata`` (the ``.metadata`` file's bytes); for
the resharded load, on sampled target ranks, ``pickle.loads`` of that file and
``DefaultLoadPlanner.create_local_plan`` (``create_default_local_load_plan``). Pickled sizes are
what DCP's ``gather_object`` / ``scatter_object_list`` carry.

**Times** are CPU seconds of this process (``time.process_time``), so other users of a shared
machine change them less than wall time. Per-rank times are means over the sampled ranks (ranks
of one mesh do the same work on different boxes); the shardstore plan is computed once. Totals:
per-rank x N where only a sample ran.

**Layers.** A model is simulated twice, with 0 and with K of its L decoder layers (every layer
has the same shapes and placements; K at most ``--max-layers``, and N x tensors at most
``--budget``, so K = 1 at 16,384 ranks), and each figure is extrapolated linearly in layers,
v(L) = v(0) + (v(K) - v(0)) * L / K; rows say "0 and K of L". But a rank's plan (``plan_local``)
is not linear in layers: the tensors of one shape and placement share the work on their
slices, so it is timed on the whole model's layout (all L layers; the union of one class is
shared, so this costs O(classes x N) memory) and added to the rank's time after the
extrapolation. The whole
plan every rank computed before (``plan_union``, shown beside it) is timed on one tensor of each
shape and placement and charged to every tensor of it (tensors are planned independently). The
run checks the layer extrapolation on 8B at 64 ranks (from 2 layers, against the whole model,
the rank's time without its plan) and prints the difference.

    python benchmarks/bench_scale_sim.py [--results benchmarks/RESULTS.md]   # ~11 min CPU on 2 cores
    python benchmarks/bench_scale_sim.py --quick                             # ~10 s: 8B at 64 and 512 ranks
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import pickle
import platform
import random
import subprocess
import sys
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

import shardstore as ss
from shardstore.checkpoint.distributed import acknowledge
from shardstore.checkpoint.slots import put_config, write_commit, write_shard
from shardstore.errors import ObjectNotFound
from shardstore.format.grid import StoredPayload, grid, intersect, make_payload
from shardstore.format.manifest import encode_config
from shardstore.format.rng import capture_rng
from shardstore.format.slices import make_slices
from shardstore.format.tensors import expected_nbytes, hash_bytes, torch_dtype
from shardstore.sharded.dtensor import (
    Described,
    ExchangePlan,
    derive_union,
    describe,
    describe_layout,
    encode_description,
    make_layout,
    plan_local,
    plan_union,
)
from shardstore.sharded.placement import mesh_parts
from shardstore.state.optim import Hyper, OptimState, ParamOpt
from shardstore.state.slot import SlotState
from shardstore.store import Store, object_key, ref_key
from shardstore.verification.commits import load_commit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_block  # noqa: E402
from _s3_requests import (  # noqa: E402
    GET_RATE,
    PUT_RATE,
    READ,
    SAVE_OVERHEAD,
    WRITE,
    Tally,
    dcp_writes,
    listing_requests,
    requests_for,
)

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench_scale_sim:begin -->", "<!-- bench_scale_sim:end -->"
SECTION = "## Simulated scale: a commit's metadata path at 64 to 16,384 ranks, shardstore vs DCP (bench_scale_sim)"
RANKS = (64, 512, 4096, 16384)
ROLES = ("exp_avg", "exp_avg_sq", "param")  # shardstore's description order: (name, role) sorted
STEP = 1000  # the commit's step: every parameter's Adam age


@dataclass(frozen=True)
class Llama:
    """A Llama-3 config as published (config.json), and the tensor-parallel degree simulated."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tp: int

    def tensors(self, layers: int) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, tp placement) of every parameter of the first ``layers`` decoder layers,
        the embedding, the final norm and the head: "s0" Shard(0), "s1" Shard(1), "rep" Replicate."""
        h, i, kv = self.hidden, self.intermediate, self.kv_heads * (self.hidden // self.heads)
        out = [("model.embed_tokens.weight", (self.vocab, h), "s0")]
        for n in range(layers):
            p = f"model.layers.{n}."
            out += [
                (p + "input_layernorm.weight", (h,), "rep"),
                (p + "mlp.down_proj.weight", (h, i), "s1"),
                (p + "mlp.gate_proj.weight", (i, h), "s0"),
                (p + "mlp.up_proj.weight", (i, h), "s0"),
                (p + "post_attention_layernorm.weight", (h,), "rep"),
                (p + "self_attn.k_proj.weight", (kv, h), "s0"),
                (p + "self_attn.o_proj.weight", (h, h), "s1"),
                (p + "self_attn.q_proj.weight", (h, h), "s0"),
                (p + "self_attn.v_proj.weight", (kv, h), "s0"),
            ]
        return out + [("model.norm.weight", (h,), "rep"), ("lm_head.weight", (self.vocab, h), "s0")]

    def config(self) -> dict[str, Any]:
        return {
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "vocab_size": self.vocab,
            "tie_word_embeddings": False,
        }


#: meta-llama/Meta-Llama-3-8B, Meta-Llama-3-70B and Llama-3.1-405B config.json; tp: the
#: tensor-parallel degree simulated (8 within a host for the two large ones).
MODELS = {
    "8B": Llama("Llama-3 8B", 4096, 14336, 32, 32, 8, 128256, tp=2),
    "70B": Llama("Llama-3 70B", 8192, 28672, 80, 64, 8, 128256, tp=8),
    "405B": Llama("Llama-3.1 405B", 16384, 53248, 126, 128, 8, 128256, tp=8),
}


def placements(kind: str, tp: int, *, dp_only: bool = False) -> tuple[Any, ...]:
    """FSDP2 over dp on top of the tp plan (see module docstring)."""
    if dp_only or tp == 1:
        return (Shard(0),)
    return {
        "s0": (_StridedShard(0, split_factor=tp), Shard(0)),
        "s1": (Shard(0), Shard(1)),
        "rep": (Shard(0), Replicate()),
    }[kind]


@dataclass(frozen=True)
class Mesh:
    shape: tuple[int, ...]
    dp_only: bool = False

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def coord(self, rank: int) -> tuple[int, ...]:
        return (rank // self.shape[1], rank % self.shape[1]) if len(self.shape) == 2 else (rank,)


def save_mesh(n: int, tp: int) -> Mesh:
    return Mesh((n // tp, tp)) if tp > 1 else Mesh((n,))


def samples(n: int) -> list[int]:
    """The ranks whose per-rank work runs for real: the first, one in the middle, the last."""
    return sorted({0, n // 2 + 1, n - 1})


# -- stand-ins: a storage that counts, a store that moves no tensor byte --------------------------------


class CountingStorage:
    """A ``Storage`` (backends.base) in memory: manifests, refs and the config are held and
    returned; tensor objects exist as (id, size) only (``register``) and reading one is an
    error (a path that would need tensor bytes shows up). Bytes are counted, and each call is
    tallied (``tally``, under ``tally.phase``) as the S3 requests S3Storage would send for it
    (``_s3_requests.requests_for``; it reads with ``read_hashed``, as S3Storage does)."""

    url = "count://sim"

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.virtual: dict[str, int] = {}
        self.tally = Tally()
        self.read_bytes = 0
        self.written_bytes = 0
        self._sorted: list[str] | None = None  # every key, sorted, for ``sizes`` (kept while nothing is added)

    def _size(self, key: str) -> int | None:
        return len(self.data[key]) if key in self.data else self.virtual.get(key)

    def register(self, key: str, size: int) -> None:
        """A tensor object its owner writes in the block exchange (a create-only write)."""
        self.tally.add(key, requests_for("write_once", size=size, found=key in self.virtual))
        self.virtual[key] = size
        self._sorted = None

    def read(self, key: str, limit: int | None = None) -> bytes:
        if key in self.virtual:
            raise AssertionError(f"{key}: a tensor object was read; the simulation holds no tensor bytes")
        if key not in self.data:
            self.tally.add(key, requests_for("read", found=False))
            raise ObjectNotFound(f"{key} is missing from store {self.url}")
        self.tally.add(key, requests_for("read", size=len(self.data[key])))
        self.read_bytes += len(self.data[key])
        return self.data[key]

    def read_hashed(self, key: str, hasher: Any, limit: int | None = None) -> tuple[bytes, str]:
        data = self.read(key, limit)
        h = hasher()
        h.update(data)
        return data, h.hexdigest()

    def hash_object(self, key: str, hasher: Any, *, threads: int = 1) -> tuple[str, int]:
        data, digest = self.read_hashed(key, hasher)
        return digest, len(data)

    def size(self, key: str) -> int | None:
        self.tally.add(key, requests_for("size"))
        return self._size(key)

    def exists(self, key: str) -> bool:
        self.tally.add(key, requests_for("exists"))
        return self._size(key) is not None

    def touch(self, key: str) -> int | None:
        n = self._size(key)
        self.tally.add(key, requests_for("touch", size=n or 0, found=n is not None))
        return n

    def write_once(self, key: str, data: Any) -> bool:
        found = self._size(key) is not None
        self.tally.add(key, requests_for("write_once", size=len(memoryview(data).cast("B")), found=found))
        if found:
            return False
        self.data[key] = bytes(data)
        self._sorted = None
        self.written_bytes += len(self.data[key])
        return True

    def swap(self, key: str, expected: bytes | None, new: bytes) -> None:
        self.tally.add(key, requests_for("swap_new" if expected is None else "swap"))
        if self.data.get(key) != expected:
            raise ss.RefConflict(f"{key}: changed")
        self.data[key] = bytes(new)
        self._sorted = None

    def delete(self, key: str) -> None:
        self.tally.add(key, requests_for("delete"))
        self.data.pop(key, None)
        self._sorted = None

    def delete_if(self, key: str, expected: bytes) -> None:
        self.tally.add(key, requests_for("delete_if"))
        if self.data.get(key) != expected:
            raise ss.RefConflict(f"{key}: changed")
        del self.data[key]
        self._sorted = None

    def list(self, prefix: str) -> Iterator[str]:
        keys = sorted(k for k in (*self.data, *self.virtual) if k.startswith(prefix.rstrip("/") + "/"))
        self.tally.add(prefix.rstrip("/") + "/", requests_for("list", keys=len(keys)))
        return iter(keys)

    def sizes(self, keys: list[str]) -> dict[str, int]:
        """``ListedSizes``, as S3Storage answers it (the store's presence checks of many objects:
        the gc fence's, a restore's size check): the listing pages its walk would take over the
        keys held here (``listing_requests``), tallied under the first key asked about."""
        if self._sorted is None:
            self._sorted = sorted({*self.data, *self.virtual})
        if keys:
            self.tally.add(min(keys), Counter(LIST=listing_requests(self._sorted, list(keys))))
        return {k: n for k in keys if (n := self._size(k)) is not None}

    def refresh(self, key: str, size: int) -> bool:
        found = self._size(key) is not None
        self.tally.add(key, requests_for("refresh", size=size, found=found))
        return found

    def mtime(self, key: str) -> float | None:
        self.tally.add(key, requests_for("mtime"))
        return 0.0 if self._size(key) is not None else None

    def sync(self) -> None:
        return None


class StandInStore(Store):
    """The real Store over a ``CountingStorage``, but a tensor read checks the object's size,
    is tallied as the GETs it would send, and moves no byte: ``read_into`` leaves the destination as it is, ``get_tensor`` returns an empty
    tensor of ``fake`` (a ``FakeTensorMode``). Restore's plan (which blocks, into which views)
    runs unchanged; ``first_read`` is the CPU time of its first block read (restore plans every
    read before it runs one)."""

    fake: Any = None
    reads = 0
    read_tensor_bytes = 0
    first_read: float | None = None
    stop = False  # raise PlanDone at the first read

    def _check(self, oid: str, nbytes: int, what: str) -> None:
        if self.first_read is None:
            self.first_read = time.process_time()
            if self.stop:
                raise PlanDone
        key = object_key(oid)
        have = self.storage._size(key)  # the read's own size check: no request of its own
        if have != nbytes:
            raise ss.TensorMismatch(f"{what}: object {oid} is {have} bytes, {nbytes} wanted")
        self.storage.tally.add(key, requests_for("read_into", size=nbytes))  # what S3Storage's read sends
        self.reads += 1
        self.read_tensor_bytes += nbytes

    def read_into(self, oid: str, dest: torch.Tensor, *, what: str = "tensor") -> None:
        self._check(oid, dest.numel() * dest.element_size(), what)

    def get_tensor(self, oid: str, dtype: str, shape: tuple[int, ...], *, what: str = "tensor") -> torch.Tensor:
        self._check(oid, expected_nbytes(dtype, shape), what)
        with self.fake:
            return torch.empty(shape, dtype=torch_dtype(dtype))


class Importer:
    """Stands in for an optimizer on the restore path: takes the moments shardstore read (``state_import``)."""

    def __init__(self) -> None:
        self.params = 0

    def state_import(self, groups: dict, params: dict) -> None:
        self.params = len(params)


# -- a rank of a fake process group, and its meta-device DTensors -----------------------------------


@contextlib.contextmanager
def as_rank(rank: int, mesh: Mesh) -> Iterator[DeviceMesh]:
    """This process as ``rank`` of a ``mesh.size``-rank fake group (collectives do nothing).

    DTensor caches the sharding of each op by its inputs' specs, whose meshes compare by shape,
    not by the coordinate of the rank holding them: a process that is several ranks in turn
    drops that cache between them, or an op (restore's ``empty_like`` of a moment) would hand
    this rank a DTensor on an earlier rank's mesh."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (propagator.propagate_op_sharding, getattr(propagator, "_propagate_tensor_meta_cached", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ dispatch's own
    if native is not None:
        native()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=mesh.size)
    try:
        yield DeviceMesh("cpu", torch.arange(mesh.size).view(mesh.shape), _init_backend=False)
    finally:
        dist.destroy_process_group()


def meta_dtensor(shape: tuple[int, ...], device_mesh: DeviceMesh, pl: tuple[Any, ...], fake: Any = None) -> DTensor:
    """This rank's DTensor of ``shape``: its local tensor on the meta device, or (``fake``: a
    ``FakeTensorMode``) a fake CPU tensor, which restore takes as a tensor it owns."""
    local_shape, _ = compute_local_shape_and_global_offset(shape, device_mesh, pl)
    stride = tuple(math.prod(shape[k + 1 :]) for k in range(len(shape)))
    if fake is None:
        local = torch.empty(local_shape, dtype=torch.float32, device="meta")
    else:
        with fake:
            local = torch.empty(local_shape, dtype=torch.float32)
    return DTensor.from_local(local, device_mesh, pl, run_check=False, shape=torch.Size(shape), stride=stride)


def rank_dtensors(
    model: Llama, layers: int, mesh: Mesh, device_mesh: DeviceMesh, fake: Any = None
) -> dict[str, dict[str, DTensor]]:
    """name -> role -> this rank's DTensor (param and both moments; see ``meta_dtensor``)."""
    out = {}
    for name, shape, kind in model.tensors(layers):
        pl = placements(kind, model.tp, dp_only=mesh.dp_only)
        out[name] = {role: meta_dtensor(shape, device_mesh, pl, fake) for role in ROLES}
    return out


def group_of(shape: tuple[int, ...]) -> str:
    return "decay" if len(shape) == 2 else "no_decay"


HYPER = {"decay": Hyper(3e-4, 0.9, 0.95, 1e-8, 0.1), "no_decay": Hyper(3e-4, 0.9, 0.95, 1e-8, 0.0)}


def dcp_state_dict(model: Llama, layers: int, dts: dict[str, dict[str, DTensor]]) -> dict[str, Any]:
    """What ``get_state_dict(model, optimizer)`` gives DCP for FSDP2 + AdamW (fully qualified names)."""
    names = [n for n, _, _ in model.tensors(layers)]
    groups = []
    for g in ("decay", "no_decay"):
        h = HYPER[g]
        groups.append({"lr": h.lr, "betas": (h.beta1, h.beta2), "eps": h.eps, "weight_decay": h.weight_decay,
                       "amsgrad": False, "foreach": None, "maximize": False, "capturable": False,
                       "differentiable": False, "fused": None, "decoupled_weight_decay": True,
                       "params": [n for n, s, _ in model.tensors(layers) if group_of(s) == g]})  # fmt: skip
    state = {n: {"step": torch.tensor(float(STEP)), "exp_avg": dts[n]["exp_avg"], "exp_avg_sq": dts[n]["exp_avg_sq"]}
             for n in names}  # fmt: skip
    return {"model": {n: dts[n]["param"] for n in names}, "optim": {"state": state, "param_groups": groups}}


# -- boxes of every rank ---------------------------------------------------------------------------------


class Boxes:
    """Every rank's parts of each (shape, placement) class, from ``mesh_parts`` (without torch's
    per-rank cross-check: the sampled ranks run it, in ``describe`` and in DCP's planner)."""

    def __init__(self, model: Llama, mesh: Mesh) -> None:
        self.model, self.mesh = model, mesh
        self.cache: dict[tuple, list[tuple]] = {}

    def of(self, shape: tuple[int, ...], kind: str) -> list[tuple]:
        key = (shape, kind)
        if key not in self.cache:
            pl = placements(kind, self.model.tp, dp_only=self.mesh.dp_only)
            self.cache[key] = [
                tuple(box for box, _ in mesh_parts(shape, self.mesh.shape, self.mesh.coord(r), pl, check=False)[1])
                for r in range(self.mesh.size)
            ]
        return self.cache[key]


# -- the sampled ranks: the real per-rank paths of both systems ---------------------------------------


@dataclass
class Sampled:
    """What the sampled save ranks did for real: shardstore's description and DCP's local plan."""

    descriptions: dict[int, bytes] = field(default_factory=dict)
    layouts: dict[int, bytes] = field(default_factory=dict)  # each sampled rank's layout digest
    describe_s: list[float] = field(default_factory=list)
    plans: dict[int, SavePlan] = field(default_factory=dict)
    local_plan_s: list[float] = field(default_factory=list)
    coordinator: Any = None  # rank 0's DefaultSavePlanner


def sample_saves(model: Llama, layers: int, mesh: Mesh) -> Sampled:
    out = Sampled()
    for r in samples(mesh.size):
        with as_rank(r, mesh) as dm:
            dts = rank_dtensors(model, layers, mesh, dm)
            params = {
                name: ParamOpt(group_of(tuple(d["param"].shape)), STEP, d["exp_avg"], d["exp_avg_sq"])
                for name, d in dts.items()
            }
            state = SlotState({name: d["param"] for name, d in dts.items()}, OptimState("adamw", dict(HYPER), params))
            t = time.process_time()
            _, desc = describe(state)
            out.layouts[r] = describe_layout(state).digest
            out.descriptions[r] = encode_description(desc)
            out.describe_s.append(time.process_time() - t)
            sd = dcp_state_dict(model, layers, dts)
            planner = DefaultSavePlanner()
            t = time.process_time()
            planner.set_up_planner(sd, storage_meta=None, is_coordinator=r == 0)
            out.plans[r] = planner.create_local_plan()
            out.local_plan_s.append(time.process_time() - t)
            if r == 0:
                out.coordinator = planner
    return out


# -- shardstore ------------------------------------------------------------------------------------------


@dataclass
class Figures:
    """One system at one (model, N, layers): bytes and CPU seconds."""

    stored: float = 0.0  # metadata stored (shardstore: shard + commit manifests; DCP: .metadata)
    stored_rank: float = 0.0  # per rank (shardstore: mean shard manifest)
    exchanged_rank: float = 0.0  # bytes a rank receives on the save's metadata path
    coordinator_in: float = 0.0  # bytes the coordinator receives or reads
    restore_rank_in: float = 0.0  # metadata a restoring rank reads
    rank_s: float = 0.0  # a rank's save-path CPU seconds
    coordinator_s: float = 0.0
    restore_rank_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)  # not extrapolated in layers: the K-layer run's


def gathered(n: int, sizes: list[int]) -> int:
    """What one rank receives from ``dtensor.all_gather_bytes`` of these ``n`` messages: each
    rank's size (an int64), then every message padded to the largest."""
    return 8 * n + n * max(max(sizes), 1)


def ss_save(
    model: Llama, layers: int, n: int, boxes: Boxes, real: Sampled, *, rng: bool = False
) -> tuple[Figures, dict[str, Any]]:
    """shardstore's commit at ``n`` ranks (steps 1-7 of the module docstring). ``rng``: every
    shard manifest names its rank's RNG objects (``rank_rng``), as ``save_distributed`` does by
    default; off, as in the tables (DCP's state dict has none)."""
    tensors = model.tensors(layers)
    fig = Figures()
    # 1. the sampled ranks' descriptions (from real DTensors) against generated ones, and their
    #    layout digests against the model's: every rank's digest is that one, so the all-gather
    #    of 33-byte digests is all that crosses the network (SPEC §15.2 step 1)
    order = sorted((name, role, shape, kind) for name, shape, kind in tensors for role in ROLES)
    full_sizes = []
    for r, raw in real.descriptions.items():
        want = encode_description(
            [Described(name, role, "float32", shape, boxes.of(shape, kind)[r]) for name, role, shape, kind in order]
        )
        assert raw == want, f"rank {r}: the generated description differs from describe()'s"
        full_sizes.append(len(raw))
    layout = model_layout(model, layers, boxes.mesh)
    for r, digest in real.layouts.items():
        assert digest == layout.digest, f"rank {r}: describe_layout's digest differs from the model's"
    describe_s = real.describe_s
    # 2. the plan: every rank's boxes worked out from the layout (the same on every rank, timed
    #    once), then each sampled rank's own part of the plan (plan_local, timed on each: the
    #    mean is charged to every rank). For comparison, the whole plan every rank computed
    #    before (plan_union): tensors are planned independently, and the tensors of one class
    #    (shape and placement: every layer's q_proj, all three roles) alike, so each class is
    #    planned once, on one of its tensors, and charged to all of them; its owners stand in
    #    for every tensor's of the class in the storage tallies below
    plan_s, union, plain = local_plan(layout, n)
    fig.fixed["plan_s"] = plan_s
    if 0 < layers < model.layers:  # this rank's plan of all L layers, timed (see local_plan)
        fig.fixed["plan_s"] = local_plan(model_layout(model, model.layers, boxes.mesh), n)[0]
    whole_s = 0.0
    plan = ExchangePlan(union, plain, [])
    classes: dict[tuple, list[tuple[str, str]]] = {}
    kinds = {name: kind for name, _shape, kind in tensors}
    for key, (_dtype, shape, _held) in sorted(union.items()):
        classes.setdefault((shape, kinds[key[0]]), []).append(key)
    pieces = 0
    owners: dict[tuple, dict[int, int]] = {}  # class -> block index -> the rank that writes it
    for cls, keys in classes.items():
        key = keys[0]
        t = time.process_time()
        planned = plan_union({key: union[key]}, n)
        whole_s += (time.process_time() - t) * len(keys)
        pieces += sum(1 + len(b.sends) for b in planned) * len(keys)
        owners[cls] = {b.index: b.owner for b in planned}
    # 3. the exchange's stand-ins: would-be block ids (the canonical grid's), registered with their sizes
    storage = CountingStorage()
    storage.tally.phase = "create"
    store = Store(storage)
    storage.tally.phase = "blocks"
    ids: dict[tuple[str, str], list[str]] = {}
    blocks = 0
    written_by: dict[int, list[str]] = {}
    for (name, role), (dtype, shape, _held) in sorted(union.items()):
        owner = owners[(shape, kinds[name])]
        for bi, box in enumerate(grid(dtype, shape)):
            oid = hash_bytes(f"{model.name}\0{name}\0{role}\0{bi}".encode())
            storage.register(object_key(oid), expected_nbytes(dtype, box[1]))
            ids.setdefault((name, role), []).append(oid)
            written_by.setdefault(owner.get(bi, 0), []).append(object_key(oid))
            blocks += 1
    # each owner's presence check of its blocks before writing them (``put_tensors`` on S3: listing
    # pages), as in a store already holding this commit's objects (any commit after the first; the
    # first, into an empty store, lists fewer pages)
    held = sorted(storage.virtual)
    for keys in written_by.values():
        storage.tally.add(keys[0], Counter(LIST=listing_requests(held, keys)))
    # _copies_agree: one all-reduce of 8 int64 sums when a non-empty slice or a plain tensor has
    # several holders (no all-gather unless a copy differs)
    shared = any(
        len(rs) > 1 and math.prod(box[1]) for _key, (_d, _s, held) in plan.union.items() for box, rs in held.items()
    ) or any(len(rs) > 1 for rs in plan.plain.values())
    fp_bytes = 64 if shared else 0
    # 4. every rank's shard manifest
    info = ss.CommitInfo(step=STEP, job="scale-sim", profile="fp32", config=model.config(), data_cursor=STEP)
    payload = {key: StoredPayload(make_payload("float32", plan.union[key][1], ids[key]), torch.float32,
                                  plan.union[key][1]) for key in ids}  # fmt: skip
    recorded: dict[int, list[str]] = {}
    for name, slot in plan.recorders().items():
        recorded.setdefault(slot, []).append(name)
    param_boxes = [(name, shape, kind) for name, shape, kind in tensors]
    shard_ids, shard_sizes, write_s = [], [], 0.0
    labels = {
        ref_key("main"): "the ref",
        object_key(hash_bytes(encode_config(model.config()))): "the model config object",
    }
    storage.tally.phase = "commit"  # commit_state's phase 1: the coordinator writes the model config, once
    put_config(store, info)
    storage.tally.phase = "shard"
    # commit_state's phase 2 begins with the coordinator writing its RNG objects and broadcasting their ids
    shared = frozenset(store.put(v) for v in rank_rng(0).values()) if rng else frozenset()
    for r in range(n):
        mine = sorted(recorded.get(r, []))
        states = rank_rng(r) if rng else {}
        labels.update({object_key(hash_bytes(v)): f"the {k} RNG object" for k, v in states.items()})
        t = time.process_time()
        params = {nm: ParamOpt(group_of(payload[(nm, "param")].shape), STEP, payload[(nm, "exp_avg")],
                               payload[(nm, "exp_avg_sq")]) for nm in mine}  # fmt: skip
        used = {p.group for p in params.values()}
        state = SlotState(
            {nm: payload[(nm, "param")] for nm in mine},
            OptimState("adamw", {g: h for g, h in HYPER.items() if g in used}, params),
            slices=make_slices((nm, b) for nm, shape, kind in param_boxes for b in boxes.of(shape, kind)[r]),
            rng=states,
        )
        sid = write_shard(store, state, info=info, parent=None, slot=r, slots=n, write_config=False, written=shared)
        write_s += time.process_time() - t
        shard_ids.append(sid)
        labels[object_key(sid)] = "a shard manifest"
        shard_sizes.append(len(storage.data[object_key(sid)]))
    # 5. the coordinator (commit_state reads the ref twice: the parent, and the value to swap from)
    storage.tally.phase = "commit"
    before = storage.read_bytes
    t = time.process_time()
    store.ref("main"), store.ref("main")
    cid = write_commit(store, shard_ids, info=info, parent=None, write_config=False)
    store.set_ref("main", cid, expected=None)
    fig.coordinator_s = time.process_time() - t
    objects = len(storage.virtual) + sum(1 for k in storage.data if k.startswith("objects/"))
    fig.coordinator_in = (storage.read_bytes - before) + sum(33 * n for _ in range(5))
    commit_bytes = len(storage.data[object_key(cid)])
    # 6. acknowledgements, and what acknowledging cost before (load_commit on every rank)
    ack_s, old_ack_s = [], []
    storage.tally.phase = "ack"
    for r in samples(n):
        t = time.process_time()
        acknowledge(store, cid, slot=r, shard=shard_ids[r])
        ack_s.append(time.process_time() - t)
    storage.tally.phase = "check"  # not the commit's: a comparison, and verify
    t = time.process_time()
    load_commit(store, cid)
    old_ack_s.append(time.process_time() - t)
    # 7. verify, structure and sizes
    t = time.process_time()
    report = ss.verify(store, [cid], deep=False)
    verify_s = time.process_time() - t
    assert report.ok, [str(p) for p in report.problems[:3]]
    fig.stored = sum(shard_sizes) + commit_bytes
    fig.stored_rank = sum(shard_sizes) / n
    desc_total = gathered(n, [33] * n)  # the layout digests (status byte + 32)
    protocol = 6 * 33 * n  # the commit protocol's five 33-byte all-gathers, and agree_on_commit's on restore
    fig.exchanged_rank = desc_total + fp_bytes + 32 * blocks + protocol + commit_bytes
    fig.rank_s = mean(describe_s) + write_s / n + mean(ack_s)  # + the plan: run_point adds fixed["plan_s"]
    fig.extra = {
        "describe_s": mean(describe_s), "whole_plan_s": whole_s, "write_shard_s": write_s / n, "ack_s": mean(ack_s),
        "old_ack_s": old_ack_s[0], "verify_s": verify_s, "descriptions": desc_total, "blocks": blocks, "pieces": pieces,
        "full_descriptions": gathered(n, [max(full_sizes)] * n),
        "commit_bytes": commit_bytes, "shard_max": max(shard_sizes), "s3_objects": objects,
    }  # fmt: skip
    return fig, {"store": store, "storage": storage, "cid": cid, "ids": ids, "labels": labels}


def model_layout(model: Llama, layers: int, mesh: Mesh) -> Any:
    """The layout every rank of ``mesh`` has (``sharded.dtensor.make_layout``; what its ranks'
    ``describe_layout`` gives: checked on the sampled ranks)."""
    order = sorted((name, role, shape, kind) for name, shape, kind in model.tensors(layers) for role in ROLES)
    return make_layout(
        [(tuple(mesh.shape), tuple(range(mesh.size)))],
        [
            (name, role, "float32", shape, 0, placements(kind, model.tp, dp_only=mesh.dp_only))
            for name, role, shape, kind in order
        ],
        [],
    )


def local_plan(layout: Any, n: int) -> tuple[float, Any, Any]:
    """CPU seconds of one rank's plan (every rank's boxes from ``layout``, ``derive_union``: once,
    the same on every rank; then ``plan_local``: on each sampled rank, the mean), the union and
    the plain holders. Its cost is not linear in layers (the tensors of one class, every
    layer's q_proj, share the work on their slices), and the layout of every layer costs
    O(classes x N) memory, not O(layers x N): ``ss_save`` times it on the whole model."""
    t = time.process_time()
    union, plain = derive_union(layout, n, lambda r: r)
    derive_s = time.process_time() - t
    local_s = []
    for r in samples(n):
        t = time.process_time()
        plan_local(union, n, r)
        local_s.append(time.process_time() - t)
    return derive_s + mean(local_s), union, plain


def rank_rng(rank: int) -> dict[str, bytes]:
    """Rank ``rank``'s RNG objects as a trainer leaves them: Python's and NumPy's seeded per rank
    (distinct objects), torch's seeded alike on every rank (DTensor's random ops need one seed
    across an SPMD mesh: one object, which every rank writes). Sets this process's generators."""
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(0)
    return capture_rng(cuda=False)


# -- DCP ---------------------------------------------------------------------------------------------------


def dcp_items(model: Llama, layers: int, boxes: Boxes, rank: int) -> list[WriteItem]:
    """The WriteItems ``create_local_plan`` makes for ``rank`` (DCP's types, the rank's one box per DTensor)."""
    props = TensorProperties(dtype=torch.float32)
    items = []
    for name, shape, kind in model.tensors(layers):
        (box,) = boxes.of(shape, kind)[rank]
        for fqn in (f"model.{name}", f"optim.state.{name}.exp_avg", f"optim.state.{name}.exp_avg_sq"):
            offsets, sizes = torch.Size(box[0]), torch.Size(box[1])
            items.append(WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                               properties=props, size=torch.Size(shape))))  # fmt: skip
        empty = torch.Size([])
        items.append(WriteItem(index=MetadataIndex(f"optim.state.{name}.step", empty), type=WriteItemType.TENSOR,
                               tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=empty, sizes=empty),
                                                           properties=props, size=empty)))  # fmt: skip
    return items


def item_bytes(item: WriteItem) -> int:
    """The bytes FileSystemWriter writes for ``item``: its chunk (not the whole tensor, which is
    what ``WriteItem.tensor_storage_size`` counts) through ``torch.save``; 64 for a bytes item."""
    if item.tensor_data is None:
        return 64
    return math.prod(item.tensor_data.chunk.sizes) * 4 + SAVE_OVERHEAD


def dcp_save(model: Llama, layers: int, n: int, boxes: Boxes, real: Sampled) -> tuple[Figures, bytes, Any]:
    fig = Figures()
    local_s, coordinator = real.local_plan_s, real.coordinator
    mapping = real.plans[0].planner_data
    byte_items = [it for it in real.plans[0].items if it.type == WriteItemType.BYTE_IO]
    plans = []
    for r in range(n):
        tensor_items = dcp_items(model, layers, boxes, r)
        plan = SavePlan(tensor_items + byte_items, planner_data=mapping)  # every rank lists the bytes; dedup keeps one
        if r in real.plans:
            want = sorted(real.plans[r].items, key=lambda it: it.index.fqn)
            assert sorted(plan.items, key=lambda it: it.index.fqn) == want, f"rank {r}: DCP's local plan differs"
            assert real.plans[r].planner_data == mapping
        plans.append(plan)
    gathered = sum(len(pickle.dumps(p)) for p in plans)
    t = time.process_time()
    global_plans, metadata = coordinator.create_global_plan(plans)
    writer = FileSystemWriter("/nonexistent-scale-sim")
    global_plans = writer.prepare_global_plan(global_plans)
    plan_s = time.process_time() - t
    scattered = [len(pickle.dumps(p)) for p in global_plans]
    results, file_chunks = [], []
    for r, plan in enumerate(global_plans):
        off, out = 0, []
        file_chunks.append([item_bytes(it) - SAVE_OVERHEAD for it in plan.items if it.tensor_data is not None])
        for it in plan.items:
            length = item_bytes(it)
            out.append(WriteResult(index=it.index, size_in_bytes=length,
                                   storage_data=_StorageInfo(f"__{r}_0.distcp", off, length)))  # fmt: skip
            off += length
        results.append(out)
    written = sum(len(pickle.dumps(w)) for w in results)
    t = time.process_time()
    storage_md = {}
    for wr_list in results:  # FileSystemWriter.finish
        storage_md.update({wr.index: wr.storage_data for wr in wr_list})
    metadata.storage_data = storage_md
    raw = pickle.dumps(metadata)
    finish_s = time.process_time() - t
    # _DistWrapper.all_reduce("write", ...) broadcasts finish's result, the whole Metadata, to
    # every rank: pickled once more on the coordinator, unpickled on every rank
    t = time.process_time()
    pickle.dumps(metadata)
    broadcast_s = time.process_time() - t
    t = time.process_time()
    pickle.loads(raw)
    unpickle_s = time.process_time() - t
    fig.stored = len(raw)
    fig.stored_rank = 0.0
    fig.exchanged_rank = sum(scattered) / n + len(raw)
    fig.coordinator_in = gathered + written
    fig.coordinator_s = plan_s + finish_s + broadcast_s
    fig.rank_s = mean(local_s) + unpickle_s
    fig.extra = {"local_plan_s": mean(local_s), "global_plan_s": plan_s, "finish_s": finish_s + broadcast_s,
                 "unpickle_s": unpickle_s,
                 "local_plan_bytes": gathered / n, "chunks": sum(len(getattr(v, "chunks", ())) for v in
                                                                 metadata.state_dict_metadata.values()),
                 }  # fmt: skip
    fig.fixed["file_chunks"] = file_chunks
    return fig, raw, metadata


class PlanDone(Exception):
    """Raised by the stand-in store at a restore's first block read: its plan is complete."""


def sample_restores(
    model: Llama, layers: int, n: int, saved: dict[str, Any], raw: bytes, ss_fig: Figures, dcp_fig: Figures
) -> None:
    """Restores on sampled ranks of the n/2-rank dp mesh, both systems, reading no tensor byte.

    shardstore: ``restore`` into DTensors over fake CPU tensors (``FakeTensorMode``: shapes, no
    memory; restore skips meta tensors as not owned), timed up to its first block read (it plans
    every read — ``load_commit``, the checks, which blocks go into which views — before it runs
    one). The first sampled rank then runs its reads against the stand-in store (sizes checked,
    blocks counted); the others stop there. DCP: ``pickle.loads`` of the .metadata and
    ``DefaultLoadPlanner.create_local_plan`` on the same DTensors."""
    storage: CountingStorage = saved["storage"]
    store = StandInStore(storage, create=False)
    store.fake = FakeTensorMode(allow_non_fake_inputs=True)
    target = Mesh((n // 2,), dp_only=True)
    ss_s, ss_in, dcp_s = [], [], []
    for i, r in enumerate((0, target.size - 1)):  # every rank reads the same manifests: two suffice
        with as_rank(r, target) as dm:
            dts = rank_dtensors(model, layers, target, dm, store.fake)
            params = {name: d["param"] for name, d in dts.items()}
            before, reads0, bytes0 = storage.read_bytes, store.reads, store.read_tensor_bytes
            store.first_read, store.stop = None, i > 0
            storage.tally.phase = f"restore {i}"  # the first sampled rank's is whole: its reads run
            t = time.process_time()
            try:
                store.resolve("main")  # agree_on_commit: each rank resolves the target
                done = ss.restore(store, saved["cid"], params, Importer(), rng=False, threads=1)
                assert len(done.tensors) == len(params), (len(done.tensors), len(params))
                if i == 0:  # the other sampled rank may hold nothing (the last of 8,192 holds no row of 4,096)
                    ss_fig.extra["restore_blocks"] = store.reads - reads0
                    ss_fig.extra["s3_restore_rank_bytes"] = store.read_tensor_bytes - bytes0
            except PlanDone:
                pass
            ss_s.append((store.first_read or time.process_time()) - t)
            ss_in.append(storage.read_bytes - before)
            storage.tally.phase = "check"
            sd = dcp_state_dict(model, layers, dts)
            t = time.process_time()
            metadata = pickle.loads(raw)  # every rank reads the whole .metadata (FileSystemReader.read_metadata)
            planner = DefaultLoadPlanner()
            planner.set_up_planner(sd, metadata, is_coordinator=r == 0)
            plan = planner.create_local_plan()
            dcp_s.append(time.process_time() - t)
            assert plan.items
            if i == 0:  # the files and byte ranges its reads take (FileSystemReader.read_data groups them by file)
                dcp_fig.fixed["read_ranges"] = [
                    (sd_.relative_path, sd_.offset, sd_.length)
                    for sd_ in (metadata.storage_data[item.storage_index] for item in plan.items)
                ]
    ss_fig.restore_rank_s, ss_fig.restore_rank_in = mean(ss_s), mean(ss_in)
    dcp_fig.restore_rank_s, dcp_fig.restore_rank_in = mean(dcp_s), len(raw)


# -- the S3 request budget (bench_s3_requests.py) -----------------------------------------------------

#: The phases of a commit whose requests are counted whole (every rank's, or the coordinator's);
#: "ack" ran on the sampled ranks and stands for all N.
SAVE_PHASES = ("blocks", "shard", "commit")
RATE_CLASSES = {"W": WRITE, "R": READ}


def s3_figures(model: Llama, layers: int, n: int, saved: dict[str, Any], fig: Figures) -> None:
    """shardstore's S3 requests per commit and per restore, from the tally of the storage calls
    (``CountingStorage``): per method and rate class, on ``objects/`` and elsewhere, the
    coordinator's, and the key S3 cannot split that takes the most (its requests, summed over
    the ranks that send them: the commit manifest every rank reads back, a block every restoring
    rank reads)."""
    storage: CountingStorage = saved["storage"]
    tally, per_ack = storage.tally, n / len(samples(n))
    save: Counter[tuple[str, str]] = Counter()
    for phase in SAVE_PHASES:
        save.update(tally.classes(phase))
    save.update({k: v * per_ack for k, v in tally.classes("ack").items()})
    restore = tally.classes("restore 0")  # one restoring rank's, whole
    coordinator = tally.classes("commit")
    out: dict[str, float] = {}
    for label, got in (("save", save), ("restore_rank", restore), ("coordinator", coordinator)):
        for m in (*RATE_CLASSES["W"], *RATE_CLASSES["R"]):
            out[f"{label}_{m}"] = sum(v for (mm, _c), v in got.items() if mm == m)
        for rate, methods in RATE_CLASSES.items():
            out[f"{label}_{rate}"] = sum(v for (m, _c), v in got.items() if m in methods)
            out[f"{label}_objects_{rate}"] = sum(v for (m, c), v in got.items() if m in methods and c == "objects")
    keys: dict[str, list[float]] = {}
    for phase, times in [(p, 1.0) for p in SAVE_PHASES] + [("ack", per_ack)]:
        for key, (w, r) in tally.per_key(phase).items():
            keys.setdefault(key, [0.0, 0.0])
            keys[key][0] += w * times
            keys[key][1] += r * times
    hot = max(keys, key=lambda k: max(keys[k][0] / PUT_RATE, keys[k][1] / GET_RATE))
    out["save_hot_W"], out["save_hot_R"] = keys[hot]
    fig.fixed["save_hot"] = _what(hot, saved)
    mine = tally.per_key("restore 0")
    readers = block_readers(model, layers, n, saved["ids"], [k for k in mine if k in storage.virtual])
    spread = {k: (w * readers.get(k, n // 2), r * readers.get(k, n // 2)) for k, (w, r) in mine.items()}
    hot = max(spread, key=lambda k: max(spread[k][0] / PUT_RATE, spread[k][1] / GET_RATE))
    out["restore_hot_W"], out["restore_hot_R"] = spread[hot]
    fig.fixed["restore_hot"] = _what(hot, saved)
    fig.extra.update({f"s3_{k}": v for k, v in out.items()})


def _what(key: str, saved: dict[str, Any]) -> str:
    """What a hot key holds, in words."""
    if key == object_key(saved["cid"]):
        return "the commit manifest"
    if key in saved["storage"].virtual:
        return "a tensor block"
    return saved["labels"].get(key, key.split("/", 1)[0] + "/")


def block_readers(
    model: Llama, layers: int, n: int, ids: dict[tuple[str, str], list[str]], keys: list[str]
) -> dict[str, int]:
    """How many of the n/2 restoring ranks (dp only) read each block of ``keys``: those whose
    part of its tensor meets the block."""
    target = Boxes(model, Mesh((n // 2,), dp_only=True))
    where = {object_key(oid): (name, bi) for (name, _role), oids in ids.items() for bi, oid in enumerate(oids)}
    shapes = {name: (shape, kind) for name, shape, kind in model.tensors(layers)}
    grids: dict[tuple[int, ...], list] = {}
    out = {}
    for key in keys:
        name, bi = where[key]
        shape, kind = shapes[name]
        box = grids.setdefault(shape, grid("float32", shape))[bi]
        out[key] = sum(1 for parts in target.of(shape, kind) if any(intersect(box, b) is not None for b in parts))
    return out


def dcp_s3_figures(n: int, raw: bytes, fig: Figures) -> None:
    """DCP through ``FsspecWriter`` / ``FsspecReader`` on s3fs (default block size): the objects
    a save writes (a file per rank, and the .metadata) and the bytes of its files (requests are
    counted from the sizes, extrapolated in layers, by ``bench_s3_requests``: s3fs's part count
    is a step in the size); and what one restoring rank reads of the files: the byte ranges of
    its load plan, file by file, through s3fs's read-ahead cache (a GET for each range the last
    GET's window, the range and one block after it, does not hold)."""
    import s3fs

    block = s3fs.S3FileSystem.default_block_size
    data = sum(sum(dcp_writes(chunks)) for chunks in fig.fixed.pop("file_chunks"))
    files: dict[str, list[tuple[int, int]]] = {}
    for path, offset, length in fig.fixed.pop("read_ranges"):
        files.setdefault(path, []).append((offset, length))
    gets = 0
    for spans in files.values():
        lo = hi = -1
        for offset, length in spans:
            if not (lo <= offset and offset + length <= hi):
                gets += 1
                lo, hi = offset, offset + length + block
    fig.extra.update({"s3_objects": n + 1, "s3_data_bytes": data, "s3_restore_rank_GET": gets})
    fig.fixed["files_read"] = len(files)  # not linear in layers: every layer's tensors come from the same files


# -- one model at one N; layers and extrapolation --------------------------------------------------------


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def simulate(
    model: Llama, n: int, layers: int, boxes: Boxes | None = None, *, requests: bool = False
) -> dict[str, Figures]:
    """Both systems at ``n`` ranks with ``layers`` decoder layers. Python's cyclic garbage
    collector is off while it runs: this process holds every rank's metadata (N times what a
    rank holds), and full collections over it would charge each step with a cost no rank has.
    ``requests``: RNG objects in every shard manifest, and the S3 request budget's figures
    (``s3_figures``, ``dcp_s3_figures``) in each system's ``extra`` and ``fixed``."""
    gc.collect()
    gc.disable()
    try:
        return _simulate(model, n, layers, boxes or Boxes(model, save_mesh(n, model.tp)), requests)
    finally:
        gc.enable()


def _simulate(model: Llama, n: int, layers: int, boxes: Boxes, requests: bool = False) -> dict[str, Figures]:
    t = time.process_time()
    real = sample_saves(model, layers, boxes.mesh)
    ss_fig, saved = ss_save(model, layers, n, boxes, real, rng=requests)
    t1 = time.process_time()
    dcp_fig, raw, _metadata = dcp_save(model, layers, n, boxes, real)
    t2 = time.process_time()
    sample_restores(model, layers, n, saved, raw, ss_fig, dcp_fig)
    if requests:
        s3_figures(model, layers, n, saved, ss_fig)
        dcp_s3_figures(n, raw, dcp_fig)
    print(f"  {model.name}, {n} ranks, {layers} layers: CPU s: samples + shardstore {t1 - t:.1f}, dcp {t2 - t1:.1f}, "
          f"restores {time.process_time() - t2:.1f}", file=sys.stderr, flush=True)  # fmt: skip
    return {"shardstore": ss_fig, "dcp": dcp_fig}


def extrapolate(zero: Figures, some: Figures, k: int, total: int) -> Figures:
    """v(L) = v(0) + (v(K) - v(0)) * L / K for every figure."""

    def line(a: float, b: float) -> float:
        return a + (b - a) * total / k

    out = Figures(**{f.name: line(getattr(zero, f.name), getattr(some, f.name))
                     for f in dataclasses.fields(Figures) if f.name not in ("extra", "fixed")})  # fmt: skip
    out.extra = {key: line(zero.extra.get(key, 0.0), v) for key, v in some.extra.items()}
    out.fixed = dict(some.fixed)
    return out


def run_point(
    model: Llama, n: int, budget: int, max_layers: int, *, requests: bool = False
) -> tuple[dict[str, Figures], int]:
    """Both systems at ``n`` ranks: the whole model if it has at most ``max_layers`` layers and
    n x tensors fits ``budget``, else extrapolated from 0 and K layers (K <= ``max_layers``).
    Returns the figures and K (= L when whole). ``requests``: see ``simulate``."""
    per_layer = 9
    if model.layers <= max_layers and n * (3 + per_layer * model.layers) <= budget:
        figs, k = simulate(model, n, model.layers, requests=requests), model.layers
    else:
        k = max(1, min(model.layers, max_layers, (budget // n - 3) // per_layer))
        boxes = Boxes(model, save_mesh(n, model.tp))  # every rank's parts, shared by both runs
        zero, some = simulate(model, n, 0, boxes, requests=requests), simulate(model, n, k, boxes, requests=requests)
        figs = {s: extrapolate(zero[s], some[s], k, model.layers) for s in zero}
    figs["shardstore"].rank_s += figs["shardstore"].fixed["plan_s"]  # the whole model's plan (ss_save)
    return figs, k


def slope(ns: list[int], values: list[float]) -> float:
    """Least-squares slope of log(value) on log(N): the growth exponent."""
    xs, ys = [math.log(x) for x in ns], [math.log(max(v, 1e-12)) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


# -- tables ---------------------------------------------------------------------------------------------------


def human(b: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b:.0f} B"


def secs(s: float) -> str:
    """CPU seconds; a time extrapolated below zero (noise times L / K) shows as ≈0."""
    if s < 0:
        return "≈0"
    return f"{s:.3f}" if s < 10 else f"{s:.1f}"


COLUMNS = (
    ("stored", "metadata stored", human),
    ("stored_rank", "stored per rank", human),
    ("exchanged_rank", "received per rank (save)", human),
    ("coordinator_in", "coordinator receives/reads", human),
    ("restore_rank_in", "read per rank (restore)", human),
    ("rank_s", "rank CPU s (save)", secs),
    ("coordinator_s", "coordinator CPU s", secs),
    ("restore_rank_s", "rank CPU s (restore plan)", secs),
)


def tables(points: dict[tuple[str, int], tuple[dict[str, Figures], int]], ns: list[int]) -> list[str]:
    lines = ["| model | N (dp × tp) | layers run | system | " + " | ".join(c[1] for c in COLUMNS) + " |",
             "|---|---|---|---|" + "---|" * len(COLUMNS)]  # fmt: skip
    for (key, n), (figs, k) in points.items():
        model = MODELS[key]
        mesh = f"{n} ({n // model.tp} × {model.tp})"
        run = f"{model.layers}" if k == model.layers else f"0 and {k} of {model.layers}"
        for system, fig in figs.items():
            cells = " | ".join(fmt(getattr(fig, attr)) if attr != "stored_rank" or fig.stored_rank else "—"
                               for attr, _, fmt in COLUMNS)  # fmt: skip
            lines.append(f"| {model.name} | {mesh} | {run} | {system} | {cells} |")
    lines += ["", "**Growth exponents** (least-squares slope of log value on log N over "
              f"N = {', '.join(map(str, ns))}; 1.0 is linear)", "",
              "| model | system | " + " | ".join(c[1] for c in COLUMNS if c[0] != "stored_rank") + " |",
              "|---|---|" + "---|" * (len(COLUMNS) - 1)]  # fmt: skip
    for key in dict.fromkeys(k for k, _ in points):
        got = [points[(key, n)][0] for n in ns if (key, n) in points]
        if len(got) < 2:
            continue
        for system in got[0]:
            cells = " | ".join(f"{slope(ns[: len(got)], [getattr(g[system], a) for g in got]):.2f}"
                               for a, _, _ in COLUMNS if a != "stored_rank")  # fmt: skip
            lines.append(f"| {MODELS[key].name} | {system} | {cells} |")
    lines += ["", "**shardstore's save path per rank, split** (CPU s; acknowledging before this branch: load_commit)", "",
              "| model | N | describe | plan (this rank's part) | whole plan (every rank, before) | write_shard | acknowledge | acknowledge before | verify --no-deep (one process) | blocks | layout digests all-gathered | full descriptions (all-gathered before layouts) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for (key, n), (figs, _k) in points.items():
        e = figs["shardstore"].extra
        lines.append(f"| {MODELS[key].name} | {n} | {secs(e['describe_s'])} | {secs(figs['shardstore'].fixed['plan_s'])} | {secs(e['whole_plan_s'])} | "
                     f"{secs(e['write_shard_s'])} | {secs(e['ack_s'])} | {secs(e['old_ack_s'])} | {secs(e['verify_s'])} | "
                     f"{e['blocks']:.0f} | {human(e['descriptions'])} | {human(e['full_descriptions'])} |")  # fmt: skip
    lines += ["", "**DCP's save path, split** (CPU s)", "",
              "| model | N | create_local_plan (per rank) | the Metadata broadcast, unpickled (per rank) | create_global_plan + prepare_global_plan | finish (storage_data, pickled for the file and the broadcast) | local plan pickled (per rank) | chunks in Metadata |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for (key, n), (figs, _k) in points.items():
        e = figs["dcp"].extra
        lines.append(f"| {MODELS[key].name} | {n} | {secs(e['local_plan_s'])} | {secs(e['unpickle_s'])} | {secs(e['global_plan_s'])} | "
                     f"{secs(e['finish_s'])} | {human(e['local_plan_bytes'])} | {e['chunks']:.0f} |")  # fmt: skip
    return lines


def targets(points: dict, ns: list[int]) -> list[str]:
    """The issue's target: shardstore's coordinator work and stored metadata grow no faster than
    linearly and are below DCP's at every N >= 512."""
    lines = ["", "**Target** (issue 33): shardstore's coordinator CPU and stored metadata grow no faster than "
             "linearly in N (exponent ≤ 1.05) and are below DCP's at every N ≥ 512", "",
             "| model | coordinator exponent | stored exponent | coordinator below DCP (N ≥ 512) | stored below DCP (N ≥ 512) | met |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for key in dict.fromkeys(k for k, _ in points):
        got = [(n, points[(key, n)][0]) for n in ns if (key, n) in points]
        if len(got) < 2:
            continue
        ce = slope([n for n, _ in got], [g["shardstore"].coordinator_s for _, g in got])
        se = slope([n for n, _ in got], [g["shardstore"].stored for _, g in got])
        big = [g for n, g in got if n >= 512]
        cb = all(g["shardstore"].coordinator_s < g["dcp"].coordinator_s for g in big)
        sb = all(g["shardstore"].stored < g["dcp"].stored for g in big)
        met = ce <= 1.05 and se <= 1.05 and cb and sb
        lines.append(f"| {MODELS[key].name} | {ce:.2f} | {se:.2f} | {yes(cb)} | {yes(sb)} | {yes(met)} |")
    return lines


def yes(b: bool) -> str:
    return "yes" if b else "**no**"


def head(args: argparse.Namespace, loads: tuple[str, str], wall: float, check: str) -> list[str]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    cmd = "python benchmarks/bench_scale_sim.py" + (" --quick" if args.quick else "") + (
        f" --budget {args.budget}" if args.budget != DEFAULT_BUDGET else "") + (
        f" --max-layers {args.max_layers}" if args.max_layers != 8 else "") + (
        f" --models {args.models}" if args.models != "8B,70B,405B" and not args.quick else "") + (
        f" --ranks {args.ranks}" if args.ranks else "")  # fmt: skip
    return [
        f"`{cmd}`",
        "",
        f"commit {commit.stdout.strip()}; {os.cpu_count()} cores ({platform.processor() or platform.machine()}); "
        f"load average (1/5/15 min) {loads[0]} at the start, {loads[1]} at the end; {wall:.0f} s wall; "
        f"torch {torch.__version__}; Python {platform.python_version()}.",
        "One process, no tensor bytes (see the script's docstring for what runs and what stands in). "
        "Times are CPU seconds of the process; per-rank save times are means over ranks 0, N/2+1 and N−1, "
        "restore times over the first and last of the N/2 ranks restored into (dp only); ≈0: a time "
        'extrapolated below zero (noise). "received per rank (save)": shardstore\'s all-gathered '
        "layout digests, the replicas' check sums (an all-reduce), block-id table, protocol ids and the commit manifest read back; "
        "DCP's scattered global plan and the Metadata it broadcasts when the save ends (`_DistWrapper.all_reduce`). \"coordinator receives/reads\": shardstore's shard manifests read by "
        "write_commit (twice: once to build, once to check) and the protocol ids; DCP's gathered local plans "
        "and write results. Rows run on fewer layers than the model has are extrapolated linearly in layers.",
        check,
        "",
    ]


DEFAULT_BUDGET = 60_000


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def exchange_restore(model: Llama, n: int, saved: int | None = None) -> dict[str, Any]:
    """A computation, not a measurement: a restore by exchange (SPEC.md §16.2) of ``model``
    (float32 parameters and both AdamW moments, every layer) into ``n`` ranks, dp only
    (``Shard(0)``, torch.chunk's rows), by the SPEC's assignment rule: the blocks of each
    payload (payloads in a fixed pseudo-random order standing for their keys' order, blocks in
    grid order) read by the rank, of those whose rows cross the block, with the fewest bytes so
    far (ties: the lowest rank). Returns, per rank (min, mean, max): blocks read (a GET each,
    and a HEAD each for the size check), bytes read, pieces sent and received (point-to-point
    messages); and the plan's size: blocks, pieces, one rank's description in bytes (JSON, as
    all-gathered) and the bytes each rank receives in that all-gather.

    And the restore's reads besides tensor blocks, for a commit saved by ``saved`` ranks (one
    shard manifest each; default 2n): on its own every rank reads the ref, the commit manifest,
    every shard manifest and the model config object (``saved`` + 3 GETs); in the group
    (SPEC.md §16.3) rank 0 reads the ref and the commit manifest, each shard manifest is read
    once in the group (a rank reads at most ceil(saved / n)), and every rank still reads the
    config (``restore`` reads it after ``load_commit``): 2 + ``saved`` + n GETs in all."""
    saved = 2 * n if saved is None else saved
    from shardstore.sharded.read_exchange import TILES, Needed

    loads = np.zeros(n, dtype=np.int64)
    reads = np.zeros(n, dtype=np.int64)
    sends = np.zeros(n, dtype=np.int64)
    crossed = np.zeros(n, dtype=np.int64)  # blocks each rank's rows cross (pieces it receives + blocks it reads)
    payloads = [(name, shape, role) for name, shape, _ in model.tensors(model.layers) for role in ROLES]
    payloads.sort(key=lambda x: zlib.crc32(f"{x[0]}\0{x[2]}".encode()))
    blocks = pieces = 0
    desc0: list[Needed] = []
    for name, shape, role in payloads:
        rows = shape[0]
        c = -(-rows // n)  # torch.chunk's piece
        holders = -(-rows // c)  # ranks holding at least one row
        if rows > 0:
            desc0.append(Needed("0" * 64, TILES, "float32", shape, (((0,) * len(shape), (min(c, rows), *shape[1:])),)))
        for start, extent in grid("float32", shape):
            lo, hi = start[0] // c, min((start[0] + extent[0] - 1) // c, holders - 1)
            r = lo + int(np.argmin(loads[lo : hi + 1]))
            nbytes = 4 * math.prod(extent)
            loads[r] += nbytes
            reads[r] += 1
            sends[r] += hi - lo
            crossed[lo : hi + 1] += 1
            blocks += 1
            pieces += hi - lo + 1
    received = crossed - reads
    one = len(msgspec.json.encode(desc0)) + 1

    def spread(a: np.ndarray) -> tuple[float, float, float]:
        return float(a.min()), float(a.mean()), float(a.max())

    return {
        "blocks": blocks,
        "pieces": pieces,
        "reads": spread(reads),
        "bytes": spread(loads),
        "sends": spread(sends),
        "received": spread(received),
        "description_bytes": one,
        "gathered_bytes": one * n,
        "manifest_gets_alone": n * (saved + 3),
        "manifest_gets_group": 2 + saved + n,
        "shard_manifests_per_rank": -(-saved // n),
        "read_class_alone_manifests": n * (saved + 3) + 2 * blocks,
        "read_class": 2 + saved + n + 2 * blocks,
    }


def exchange_table(keys: list[str], ns: list[int]) -> list[str]:
    """``exchange_restore`` for each model and N (restoring into N/2), as a table."""
    lines = [
        "**Computed: a restore by exchange into N/2 ranks, dp only** (SPEC.md §16.2's assignment, run here over "
        "every block of every layer; no request sent, no byte read)",
        "",
        "| model | N → N/2 | tensor blocks (each: 1 GET + 1 HEAD, once per group) | blocks read per rank "
        "(min / mean / max) | tensor bytes read per rank, max | pieces sent per rank, max | pieces received per "
        "rank, max | pieces, all ranks | one rank's description / all-gathered per rank | manifest and config "
        "GETs, all ranks: each rank on its own / the group's manifests once (SPEC.md §16.3) | shard manifests read "
        "per rank, max | read-class requests, all ranks (blocks + manifests + config) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in keys:
        model = MODELS[key]
        for n in ns:
            t = time.time()
            e = exchange_restore(model, n // 2, n)  # saved by n ranks: n shard manifests
            print(f"{model.name} exchange model at {n // 2} ranks: {time.time() - t:.1f} s", file=sys.stderr)
            lo, mean_, hi = e["reads"]
            lines.append(
                f"| {model.name} | {n:,} → {n // 2:,} | {e['blocks']:,} | {lo:,.0f} / {mean_:,.1f} / {hi:,.0f} | "
                f"{human(e['bytes'][2])} | {e['sends'][2]:,.0f} | {e['received'][2]:,.0f} | {e['pieces']:,} | "
                f"{human(e['description_bytes'])} / {human(e['gathered_bytes'])} | "
                f"{e['manifest_gets_alone']:,} / {e['manifest_gets_group']:,} | {e['shard_manifests_per_rank']:,} | "
                f"{e['read_class']:,} (was {e['read_class_alone_manifests']:,}) |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8B only, at 64 and 512 ranks, one layer set (<= 30 s)")
    ap.add_argument("--budget", type=int, default=DEFAULT_BUDGET, help="most ranks x tensors in one simulation")
    ap.add_argument("--max-layers", type=int, default=8, help="most decoder layers in one simulation")
    ap.add_argument("--models", default="8B,70B,405B")
    ap.add_argument("--results", default=None, help="write the tables into this RESULTS.md")
    ap.add_argument(
        "--exchange-restore",
        action="store_true",
        help="only compute a restore by exchange of --models into N/2 ranks (SPEC.md §16.2) and print its table",
    )
    ap.add_argument("--ranks", default=None, help="the N, comma-separated (default 64,512,4096,16384)")
    args = ap.parse_args(argv)
    if args.exchange_restore:
        ranks = [int(x) for x in args.ranks.split(",")] if args.ranks else list(RANKS)
        print("\n".join(exchange_table(args.models.split(","), ranks)))
        return 0
    started, loads0 = time.time(), load()
    ns = [64, 512] if args.quick else [int(x) for x in args.ranks.split(",")] if args.ranks else list(RANKS)
    keys = ["8B"] if args.quick else args.models.split(",")
    budget = 1 if args.quick else args.budget
    points: dict[tuple[str, int], tuple[dict[str, Figures], int]] = {}
    simulate(MODELS["8B"], 16, 0)  # warm-up, discarded: lazy imports and first calls are no rank's cost
    for key in keys:
        for n in ns:
            t = time.time()
            points[(key, n)] = run_point(MODELS[key], n, budget, 1 if args.quick else args.max_layers)
            print(f"{MODELS[key].name} at {n} ranks: {time.time() - t:.1f} s", file=sys.stderr, flush=True)
    check = extrapolation_check() if not args.quick and not args.ranks else ""
    lines = head(args, (loads0, load()), time.time() - started, check) + tables(points, ns) + targets(points, ns)
    text = "\n".join(lines)
    print(text)
    if args.results:
        write_block(args.results, BEGIN, END, SECTION, text)
    return 0


def extrapolation_check() -> str:
    """8B at 64 ranks, whole against extrapolated from 0 and 2 layers: how far each figure moves
    (times: those of at least 0.05 s whole, below which CPU time is noise)."""
    model, n = MODELS["8B"], 64
    whole = simulate(model, n, model.layers)
    zero, two = simulate(model, n, 0), simulate(model, n, 2)
    worst: dict[str, float] = {}
    for system in whole:
        ext = extrapolate(zero[system], two[system], 2, model.layers)
        for f in dataclasses.fields(Figures):
            a = getattr(whole[system], f.name) if f.name != "extra" else 0
            if not a or (f.name.endswith("_s") and a < 0.05):
                continue
            worst[f"{system} {f.name}"] = abs(getattr(ext, f.name) - a) / a
    sizes = {k: v for k, v in worst.items() if not k.endswith("_s")}
    times = {k: v for k, v in worst.items() if k.endswith("_s")}
    b, t = max(sizes, key=sizes.get), max(times, key=times.get)
    return (f"Extrapolation check (8B at 64 ranks, the whole model against 0 and 2 layers): bytes within "
            f"{100 * sizes[b]:.1f}% (worst: {b}), CPU times within {100 * times[t]:.0f}% (worst: {t}).")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
