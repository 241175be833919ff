"""Grow: a `grow` commit that appends decoder blocks which start as the identity.

Appending K blocks to an L-layer commit C writes layers L..L+K-1 after the last one.
Each new block copies block `copy_from`'s internal weights (attention q/k/v, MLP
gate/up, both RMSNorms) and has its attention output projection (`o_proj`) and MLP down
projection (`down_proj`) set to exactly zero, so both residual branches add exactly zero
and the block maps its input to itself bitwise: the grown model computes the same logits
(after Net2Net's function-preserving growth, adapted to pre-norm residual blocks).

Existing tensors keep their entries unchanged (payload and moment object ids, groups,
births, ages). A new parameter is born at C's step with Adam age 0 and no moments (its
moments start at zero on its first update, and its bias correction counts its own age),
in the group of the parameter it was copied from. Copied payloads are the very same
objects (equal bytes, one object id); the zero projections are one new object per shape.
The model config of the commit is C's with `num_hidden_layers` = L + K; the layout is
the partition given (from the planner or by hand), else L + K layers split evenly over
C's slot count. SPEC.md §Transitions states what may change and what must not.

`identity_check` rebuilds only the new blocks from the store and checks that each maps
hidden states to themselves bitwise, so the check never needs the whole model.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from shardstore import Store, TensorEntry, load_commit
from shardstore.format.grid import put_payloads, read_whole
from shardstore.format.manifest import FORMAT_VERSION, MAX_MANIFEST_BYTES, OptimEntry, Payload, banded
from shardstore.format.tensors import torch_dtype
from shardtrain.engine.model import LlamaDecoderLayer, rotary_tables
from shardtrain.engine.partition import LAYER_PARAMETER_SUFFIXES, Partition
from shardtrain.errors import TransitionError
from shardtrain.reshape.regroup import TransitionResult, commit_config, journal_transition, move_ref, write_layout

__all__ = ["ZEROED_SUFFIXES", "check_append", "grow", "identity_check"]

ZEROED_SUFFIXES = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def check_append(layers: int, append: object) -> int:
    """``append`` if it is an int >= 1 whose grown commit could be read back; TransitionError otherwise.

    Checked before anything is allocated or written: the commit manifest's layout names every
    tensor once (SPEC.md §Commit manifest), so the names of the appended layers alone — at
    least ``len('"model.layers.L.<suffix>",')`` bytes each — must fit the 64 MiB every reader
    accepts. Shard manifests, which hold more per tensor, are checked exactly before each is written."""
    if isinstance(append, bool) or not isinstance(append, int) or append < 1:
        raise TransitionError(f"--append must be an int >= 1, got {append!r}")
    per_layer = sum(
        len(f'"model.layers.{layers}.{x}",') for x in LAYER_PARAMETER_SUFFIXES
    )  # a lower bound per new layer
    if append * per_layer > MAX_MANIFEST_BYTES:
        most = MAX_MANIFEST_BYTES // per_layer
        raise TransitionError(
            f"--append {append}: the names of {append * len(LAYER_PARAMETER_SUFFIXES):,} new tensors alone "
            f"exceed the {MAX_MANIFEST_BYTES:,}-byte commit manifest limit (SPEC.md §Limits); at most "
            f"{most:,} blocks could ever fit (the shard manifests allow fewer)"
        )
    return append


def grow(
    store: Store,
    commit: str,
    append: int,
    *,
    copy_from: int | None = None,
    partition: Partition | None = None,
    ref: str | None = None,
) -> TransitionResult:
    """Write the `grow` commit of `commit` with `append` identity blocks copied from `copy_from` (default the last)."""
    started = time.time()
    before = set(store.objects())
    lc = load_commit(store, commit)
    config, raw = commit_config(store, lc)
    layers = config.num_hidden_layers
    check_append(layers, append)  # before any allocation that K sizes
    source = layers - 1 if copy_from is None else copy_from
    if not 0 <= source < layers:
        raise TransitionError(f"--copy-from {source} is not a layer of commit {lc.id[:12]} (layers 0..{layers - 1})")
    grown = dataclasses.replace(config, num_hidden_layers=layers + append)
    grown_raw = {**raw, "num_hidden_layers": layers + append}
    if grown.to_hf_dict() != {**config.to_hf_dict(), "num_hidden_layers": layers + append}:
        raise TransitionError("the grown config differs from the commit's in more than the layer count")
    entries = dict(lc.entries())
    missing = [
        f"model.layers.{source}.{x}" for x in LAYER_PARAMETER_SUFFIXES if f"model.layers.{source}.{x}" not in entries
    ]
    if missing:
        raise TransitionError(f"commit {lc.id[:12]} has no tensor {missing[0]!r}: not a shardtrain Llama layout")
    taken = [n for n in entries if n.startswith(tuple(f"model.layers.{j}." for j in range(layers, layers + append)))]
    if taken:
        raise TransitionError(f"commit {lc.id[:12]} already has tensor {taken[0]!r} beyond its {layers} layers")
    step = lc.commit.step
    zero_ids: dict[tuple[str, tuple[int, ...]], Payload] = {}
    # A transition keeps its parent's grid (SPEC.md §Versioning): the row bands of version 2 or 3, and
    # version 1's one object per tensor whatever its size (a format-1 commit's zero projection may be over 4 MiB).
    bands, whole = banded(lc.commit.version), lc.commit.version == FORMAT_VERSION
    for j in range(layers, layers + append):
        for suffix in LAYER_PARAMETER_SUFFIXES:
            src = entries[f"model.layers.{source}.{suffix}"]
            param = src.param
            if suffix in ZEROED_SUFFIXES:
                key = (src.dtype, tuple(src.shape))
                if key not in zero_ids:
                    zeros = torch.zeros(src.shape, dtype=torch_dtype(src.dtype))
                    if whole:
                        zero_ids[key] = store.put_tensors([zeros])[0]
                    else:
                        zero_ids[key] = put_payloads(store, [zeros], bands=bands)[0]  # canonical blocks if over 4 MiB
                param = zero_ids[key]
            optim = None
            if src.optim is not None:  # trained: a new Adam clock in the source's group
                optim = OptimEntry(
                    group=src.optim.group, birth=step, age=0, exp_avg=None, exp_avg_sq=None, moment_dtype=None
                )
            name = f"model.layers.{j}.{suffix}"
            entries[name] = TensorEntry(name=name, dtype=src.dtype, shape=src.shape, param=param, optim=optim)
    store.sync()  # the zero projections are durable before a manifest names them
    if partition is None:
        partition = Partition.even(layers + append, len(lc.shards))
    cid = write_layout(store, lc, entries, grown, grown_raw, partition, transition="grow")
    new = load_commit(store, cid)
    move_ref(store, ref, lc.id, cid)
    journal_transition(store, cid, {"transition": "grow", "append": append, "copy_from": source}, started)
    return TransitionResult(
        cid,
        lc.id,
        step,
        new.commit.learned_root,
        lc.commit.learned_root,
        partition,
        tuple(sorted(set(store.objects()) - before)),
    )


@torch.no_grad()
def identity_check(store: Store, commit: str, layers: range, *, tokens: int = 16, seed: int = 0) -> bool:
    """Whether each decoder layer in `layers` of `commit` maps random hidden states to themselves bitwise."""
    lc = load_commit(store, commit)
    config, _ = commit_config(store, lc)
    entries = lc.entries()
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(2, tokens, config.hidden_size, generator=gen)  # (B, T, C)
    cos, sin = rotary_tables(config, tokens, "cpu")
    for j in layers:
        block = LlamaDecoderLayer(config)
        for name, p in block.named_parameters():
            e = entries[f"model.layers.{j}.{name}"]
            p.copy_(read_whole(store, e.param, e.dtype, tuple(e.shape), what=f"tensor {e.name!r}"))
        if not torch.equal(block(h, cos, sin), h):
            return False
    return True
