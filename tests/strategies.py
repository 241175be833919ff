"""Hypothesis strategies for manifests and named training state."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from shardstore.format.manifest import (
    FORMAT_VERSION,
    CommitManifest,
    GroupSpec,
    OptimEntry,
    OptimizerSpec,
    RngEntry,
    ShardManifest,
    SlotLayout,
    TensorEntry,
    f64_encode,
)

oids = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
names = st.from_regex(r"[a-z][a-z0-9_.]{0,15}", fullmatch=True)
group_names = st.sampled_from(["decay", "no_decay", "g0"])
floats = st.floats(allow_nan=False, allow_infinity=False, width=64).map(f64_encode)
dtypes = st.sampled_from(["float32", "bfloat16", "float16", "float64", "int64", "int32", "int8", "uint8", "bool"])
shapes = st.lists(st.integers(0, 5), max_size=3).map(tuple)


@st.composite
def group_specs(draw, name=None):
    return GroupSpec(
        name=name or draw(group_names),
        lr=draw(floats),
        beta1=draw(floats),
        beta2=draw(floats),
        eps=draw(floats),
        weight_decay=draw(floats),
    )


@st.composite
def tensor_entries(draw, name: str, step: int, groups: list[str]):
    optim = None
    if groups and draw(st.booleans()):
        age = draw(st.integers(0, step))
        has = age > 0 or draw(st.booleans())
        optim = OptimEntry(
            group=draw(st.sampled_from(groups)),
            birth=step - age,
            age=age,
            exp_avg=draw(oids) if has else None,
            exp_avg_sq=draw(oids) if has else None,
            moment_dtype="float32" if has else None,
        )
    return TensorEntry(name=name, dtype=draw(dtypes), shape=draw(shapes), param=draw(oids), optim=optim)


@st.composite
def shard_manifests(draw):
    step = draw(st.integers(0, 1000))
    gnames = sorted(draw(st.sets(group_names, max_size=2)))
    tnames = sorted(draw(st.sets(names, min_size=0, max_size=6)))
    entries = tuple(draw(tensor_entries(n, step, gnames)) for n in tnames)
    used = sorted({e.optim.group for e in entries if e.optim})
    slots = draw(st.integers(1, 4))
    return ShardManifest(
        version=FORMAT_VERSION,
        job=draw(st.from_regex(r"[a-z][a-z0-9-]{0,10}", fullmatch=True)),
        step=step,
        parent=draw(st.none() | oids),
        config=draw(st.none() | oids),
        slot=draw(st.integers(0, slots - 1)),
        slots=slots,
        algorithm="adamw" if used else "none",
        groups=tuple(draw(group_specs(name=g)) for g in used),
        entries=entries,
        rng=tuple(
            RngEntry(kind=k, object=draw(oids))
            for k in sorted(draw(st.sets(st.sampled_from(["python", "numpy", "torch", "cuda:0"]))))
        ),
    )


@st.composite
def commit_manifests(draw):
    n = draw(st.integers(1, 3))
    return CommitManifest(
        version=FORMAT_VERSION,
        job="job",
        schedule=draw(st.none() | st.just("sched-1")),
        profile="fp32",
        config=draw(st.none() | oids),
        optimizer=OptimizerSpec(algorithm="adamw", groups=(draw(group_specs(name="decay")),)),
        step=draw(st.integers(0, 10**6)),
        data_cursor=draw(st.none() | st.integers(0, 10**9)),
        layout=tuple(
            SlotLayout(slot=i, shard=draw(oids), tensors=tuple(sorted(draw(st.sets(names, max_size=3)))))
            for i in range(n)
        ),
        learned_root=draw(oids),
        parent=draw(st.none() | oids),
        transition=draw(st.sampled_from(["init", "train", "repartition", "grow", "import"])),
    )


@st.composite
def named_states(draw, max_tensors: int = 6):
    """A small named training state: tensors, AdamW-like moments, ages and groups."""
    n = draw(st.integers(1, max_tensors))
    tnames = sorted(draw(st.sets(names, min_size=n, max_size=n)))
    step = draw(st.integers(0, 20))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    tensors, params = {}, {}
    for name in tnames:
        shape = draw(st.lists(st.integers(1, 4), min_size=0, max_size=2))
        t = torch.randn(shape, generator=g)
        tensors[name] = t
        age = draw(st.integers(0, step))
        moments = (torch.randn(shape, generator=g), torch.rand(shape, generator=g)) if age > 0 else (None, None)
        params[name] = (draw(st.sampled_from(["decay", "no_decay"])), age, *moments)
    return step, tensors, params
