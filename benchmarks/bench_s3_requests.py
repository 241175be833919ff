"""The S3 request budget of a commit and of a restore (issue 33, item 2): objects and requests
(PUT, POST, COPY, DELETE; GET, HEAD, LIST) measured against an S3-compatible server for small N,
and extrapolated to Llama-3 8B, 70B and 405B at 64 to 16,384 ranks, beside DCP. Not a test.

**Measured** (``--ranks``, default 2, 4 and 8 Gloo processes): moto's S3 server on 127.0.0.1
behind a layer that counts every request it answers (``_s3_requests.CountingServer``), phase by
phase. The model is Llama-shaped and small: ``--layers`` blocks of q/o/gate/down projections
(``--hidden`` square, gate and down 2x wide; column-parallel q and gate ``Shard(0)``, row-parallel
o and down ``Shard(1)``, ``parallelize_module``) and an RMSNorm each, under FSDP2 over ``dp`` on a
(N/2 x 2) mesh, with AdamW state; torch's RNG seeded alike on every rank, Python's and NumPy's
per rank (as ``bench_scale_sim.rank_rng``). Phases, every rank, each between barriers:

- open: ``open_storage`` and ``Store`` (the config read) and the probe of the server's request
  conditions (once per process, at its first write);
- commit 1, 2 and 3: ``save_distributed`` (RNG included, its default; a model config recorded);
  the second after every local value changed (a step's worth of new blocks, the ref moved from
  commit 1), the third with nothing changed (every object already there: frozen tensors' cost);
- restore: ``agree_on_commit`` + ``restore`` of commit 3 into the same state under FSDP2 alone
  over all N ranks (dp only, as the simulation restores), checked value for value;
- restore (group): the same commit restored again by the same N ranks by exchange, ``restore(
  store, "main", ..., group=)`` over the job's Gloo group (its manifests read once in the group,
  the ref resolved by rank 0, each tensor block read once by one rank needing it: SPEC.md §16.2,
  §16.3), checked bitwise against the restore on its own; each rank's tensor bytes read
  (``Restored.bytes_read``) in both restores are tabled beside its share;
- dcp save and dcp load: ``dcp.save`` through ``FsspecWriter`` (s3fs, block size ``--dcp-block``
  MiB, s3fs's default 50) and ``dcp.load`` through ``FsspecReader`` into the same dp-only state,
  checked.

Each rank's store sits on a ``RecordingStorage``, which tallies every storage call as the
requests ``_s3_requests.requests_for`` says S3Storage sends for it, and answers the store's
presence checks of many objects as S3Storage does (``ListedSizes``: listing pages, tallied as the
pages the walk asked for), so the store takes the path it takes on S3. The run fails unless the
server's count equals that prediction, method by method in every shardstore phase: the rule the
extrapolation applies to storage calls it cannot send is the one the server confirmed. Retries
are counted apart: moto's in-memory backend fails some concurrent CopyObject calls onto one key
(the copy that refreshes an object every rank writes) with a 500, which S3Storage retries; and
requests whose answer the client lost (botocore's ``after-call-error``), which it retries too.

**Extrapolated** (``--models``, ``--sizes``; ``--skip-sim`` leaves it out): ``bench_scale_sim``'s
simulated commit of each model at each N (its real write_shard, write_commit, ref move behind the
gc fence, acknowledgements and restore on sampled ranks, over an in-memory storage; blocks written
by their owners as create-only writes), with RNG objects, every storage call tallied by the same
rule (presence checks of many objects as the listing pages ``listing_requests`` counts over the
keys held, the owners' presence listing of their blocks before writing them included, as in a
store already holding the commit's objects: about one page per block where they are sparse);
layers extrapolated linearly, as there. DCP at the same N: a file per rank and the .metadata
(``s3fs_write`` at s3fs's default 50 MiB block), plus the save's fixed requests fitted to the
measured runs (a + b N); a restoring rank reads the .metadata whole and the byte ranges
of its load plan through s3fs's read-ahead.

S3's published rates (per partitioned prefix, per second): 3,500 PUT/COPY/POST/DELETE and 5,500
GET/HEAD. "S3 floor" is the fewest seconds those rates allow, for one partition (the store's
prefix before S3 has split it) and for 256 (objects/00 … objects/ff, each its own partition),
never below what the hottest key takes alone (a key is never split).

    python benchmarks/bench_s3_requests.py [--results benchmarks/RESULTS.md]   # over 26 min on 2 busy cores
    python benchmarks/bench_s3_requests.py --models 405B                       # 30 min at load 12-25
    python benchmarks/bench_s3_requests.py --quick                             # 2 ranks, 8B at 64 ranks
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import fsspec.asyn
import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dist_bench as db  # noqa: E402
from _results import write_block  # noqa: E402
from _s3_requests import (  # noqa: E402
    READ,
    WRITE,
    CountingServer,
    RecordingStorage,
    Tally,
    dcp_writes,
    floor_seconds,
    mark,
    retried,
    s3fs_file,
    s3fs_write,
    watch_lost,
)

import shardstore as ss  # noqa: E402
from shardstore.backends.location import open_storage  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench_s3_requests:begin -->", "<!-- bench_s3_requests:end -->"
SECTION = "## The S3 request budget: a commit and a restore, measured on moto and extrapolated to 16,384 ranks (bench_s3_requests)"
BUCKET = "budget-{}"  # one per measured run: moto's backend is one per process, and blocks are the same at any N
KEY = "budget"
SS_PHASES = ("open", "commit 1", "commit 2", "commit 3", "restore", "restore (group)")
DCP_PHASES = ("dcp save", "dcp load")
METHODS = (*WRITE, *READ)
MIB = 1 << 20
BLOCK = 50 * MIB  # s3fs's default block size: its multipart part size and read-ahead
INTERVAL = 600  # seconds: the checkpoint interval the issue asks about


def options(endpoint: str, **extra: Any) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "key": KEY, "secret": KEY, "client_kwargs": {"region_name": "us-east-1"}, **extra}


# -- the measured runs --------------------------------------------------------------------------------------


def build(kind: str, hidden: int, layers: int, mesh2d: Any, line: Any) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """``layers`` Llama-shaped blocks (q, o, gate, down and an RMSNorm each) on the meta device,
    split as ``kind`` says ("2d": tensor parallel on the mesh's tp dim, then FSDP2 over dp;
    "fsdp": FSDP2 over all ranks), given local storage; AdamW after one step."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with torch.device("meta"):
        blocks = torch.nn.ModuleList()
        for _ in range(layers):
            b = torch.nn.Module()
            b.q = torch.nn.Linear(hidden, hidden, bias=False)
            b.o = torch.nn.Linear(hidden, hidden, bias=False)
            b.gate = torch.nn.Linear(hidden, 2 * hidden, bias=False)
            b.down = torch.nn.Linear(2 * hidden, hidden, bias=False)
            b.norm = torch.nn.RMSNorm(hidden)
            blocks.append(b)
        model = torch.nn.Module()
        model.layers = blocks
    for b in blocks:
        if kind == "2d":
            plan = {
                "q": ColwiseParallel(),
                "o": RowwiseParallel(),
                "gate": ColwiseParallel(),
                "down": RowwiseParallel(),
            }
            parallelize_module(b, mesh2d["tp"], plan)
        fully_shard(b, mesh=mesh2d["dp"] if kind == "2d" else line)
    fully_shard(model, mesh=mesh2d["dp"] if kind == "2d" else line)
    model.to_empty(device="cpu")
    return model, db.adamw_with_moments(model)


def worker(rank: int, port: int, world: int, endpoint: str, args: argparse.Namespace, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    opts = options(endpoint)
    with db.group(rank, world, port):
        mesh2d = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        line = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)  # one seed on every rank, as DTensor's random ops need
        random.seed(rank)
        np.random.seed(rank)
        model, opt = build("2d", args.hidden, args.layers, mesh2d, line)
        dest, dest_opt = build("fsdp", args.hidden, args.layers, mesh2d, line)
        (want,) = db.fill((model, opt), [(dest, dest_opt)])
        tally, lost = Tally(), Tally()

        def phase(name: str) -> None:
            dist.barrier()
            tally.phase = lost.phase = name
            if rank == 0:
                mark(endpoint, name)
            dist.barrier()

        phase("open")
        storage = RecordingStorage(open_storage(f"s3://{BUCKET.format(world)}/ss", **opts), tally)
        store = ss.Store(storage, create=False)
        assert storage.conditional, storage.inner.conditional_reason
        watch_lost(fsspec.asyn.sync(storage.inner.fs.loop, storage.inner.fs.set_session), lost)
        # a model config, as a trainer records one (the object every rank's shard manifest names)
        config = {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "model_type": "llama"}
        phase("commit 1")
        ss.save_distributed(store, model, opt, info=ss.CommitInfo(step=1, config=config))
        with torch.no_grad():  # a step's worth of change: every local value
            for t in db.locals_of(model, opt):
                t.add_(1.0)
        want = [w + 1.0 for w in want]
        phase("commit 2")
        cid = ss.save_distributed(store, model, opt, info=ss.CommitInfo(step=2, config=config))
        phase("commit 3")  # nothing changed: every object is already there
        again = ss.save_distributed(store, model, opt, info=ss.CommitInfo(step=2, config=config))
        assert again != cid  # a new commit (its parent)
        cid = store.ref("main")
        db.zero(dest, dest_opt)
        phase("restore")
        assert ss.agree_on_commit(store, "main") == cid
        alone = ss.restore(store, cid, dest, dest_opt, rng=False)
        phase("check")
        bad = db.mismatches(dest, dest_opt, [w for w in want])
        if bad:
            raise SystemExit(f"rank {rank}: shardstore's restore differs in {bad[:5]}")
        restored = [t.clone() for t in db.locals_of(dest, dest_opt)]
        db.zero(dest, dest_opt)
        phase("restore (group)")  # the manifests read once in the group, each block once (SPEC.md §16.2, §16.3)
        grouped = ss.restore(store, "main", dest, dest_opt, rng=False, group=dist.group.WORLD)
        phase("check (group)")
        assert grouped.commit == cid, (grouped.commit, cid)
        got = db.locals_of(dest, dest_opt)
        bad = [i for i, (a, b) in enumerate(zip(got, restored, strict=True)) if not torch.equal(a, b)]
        bad += db.mismatches(dest, dest_opt, want)  # the steps too
        if bad:
            raise SystemExit(f"rank {rank}: the restore by exchange differs from the restore on its own in {bad[:5]}")
        read = {"restore": alone.bytes_read, "restore (group)": grouped.bytes_read}
        dcp_url = f"s3://{BUCKET.format(world)}/dcp"
        block = {"default_block_size": args.dcp_block * MIB}
        msd, osd = get_state_dict(model, opt)
        chunks = [t.numel() * t.element_size() for t in _tensors({"model": msd, "optim": osd})]  # this rank's items
        phase("dcp save")
        dcp.save({"model": msd, "optim": osd}, storage_writer=FsspecWriter(dcp_url, **opts, **block))
        db.zero(dest, dest_opt)
        msd, osd = get_state_dict(dest, dest_opt)
        sd = {"model": msd, "optim": osd}
        phase("dcp load")
        dcp.load(sd, storage_reader=FsspecReader(dcp_url, **opts, **block))
        phase("check 2")
        set_state_dict(dest, dest_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        bad = db.mismatches(dest, dest_opt, want)
        if bad:
            raise SystemExit(f"rank {rank}: dcp.load differs in {bad[:5]}")
        with open(f"{out}.{rank}", "w") as f:
            json.dump(
                {
                    "tally": tally.to_json(),
                    "lost": lost.to_json(),
                    "share": db.share(model, opt),
                    "chunks": chunks,
                    "read": read,
                    "dest_share": db.share(dest, dest_opt),
                },
                f,
            )
        dist.barrier()


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The local tensors of a state dict, at any depth (a DTensor's local part)."""
    if isinstance(tree, torch.Tensor):
        return [tree.to_local() if hasattr(tree, "to_local") else tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def measure(world: int, args: argparse.Namespace, work: str) -> dict[str, Any]:
    """One measured run on ``world`` ranks: the server's tally, the ranks' predicted tally, the
    objects each prefix holds at the end and their sizes."""
    import boto3

    bucket = BUCKET.format(world)
    server = CountingServer(bucket)
    try:
        client = boto3.client(
            "s3",
            endpoint_url=server.endpoint,
            aws_access_key_id=KEY,
            aws_secret_access_key=KEY,
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=bucket)
        ss.Store(open_storage(f"s3://{bucket}/ss", **options(server.endpoint)))  # the store exists before the job
        out = os.path.join(work, f"rank-{world}")
        mark(server.endpoint, "setup")
        db.spawn(worker, world, (world, server.endpoint, args, out))
        mark(server.endpoint, "after")
        predicted, lost = Tally(), Tally()
        shares, chunks, reads, dest_shares = [], [], [], []
        for r in range(world):
            doc = json.load(open(f"{out}.{r}"))
            predicted.merge(Tally.from_json(doc["tally"]))
            lost.merge(Tally.from_json(doc["lost"]))
            shares.append(doc["share"])
            chunks.append(doc["chunks"])
            reads.append(doc["read"])
            dest_shares.append(doc["dest_share"])
        listed: dict[str, list[int]] = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for o in page.get("Contents", []):
                listed.setdefault(o["Key"].split("/", 1)[0], []).append(o["Size"])
        dcp_files = [
            o["Size"]
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="dcp/")
            for o in page.get("Contents", [])
            if o["Key"].endswith(".distcp")
        ]
        return {"world": world, "server": server.tally, "status": server.status, "predicted": predicted, "lost": lost, "listed": listed,
                "dcp_files": dcp_files, "shares": shares, "chunks": chunks, "reads": reads, "dest_shares": dest_shares}  # fmt: skip
    finally:
        server.stop()


def agrees(run: dict[str, Any], phase: str) -> bool:
    """The server's count in ``phase``, less its error answers (S3Storage retried them), is the
    prediction, or above it by no more than the requests whose answer the client lost (retried
    too; the server may or may not have seen the lost attempt), method by method."""
    got = run["server"].methods(phase)
    got.subtract(retried(run["status"], phase))
    want, slack = run["predicted"].methods(phase), run["lost"].methods(phase)
    return all(want[m] <= got[m] <= want[m] + slack[m] for m in METHODS) and not [m for m in got if m not in METHODS]


def check(run: dict[str, Any]) -> list[str]:
    """Where the server's count differs from the storage calls' prediction (shardstore's phases)."""
    return [
        f"{run['world']} ranks, {phase}: server {dict(run['server'].methods(phase))} (error answers "
        f"{dict(retried(run['status'], phase))}, answers lost {dict(run['lost'].methods(phase))}), "
        f"predicted {dict(run['predicted'].methods(phase))}; answers by status "
        f"{sorted((m, c, n) for (p, m, c), n in run['status'].items() if p == phase)}"
        for phase in SS_PHASES
        if not agrees(run, phase)
    ]


def measured_table(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "**Measured** (moto on 127.0.0.1; requests the server answered, summed over ranks; "
        '"= storage calls": the same count, method by method, as the prediction from each rank\'s storage calls, '
        "less the server's error answers and the requests whose answer the client lost, which S3Storage retried, counted apart)",
        "",
        "| N | phase | "
        + " | ".join(METHODS)
        + " | write-class | read-class | hottest key (requests) | = storage calls |",
        "|---|---|" + "---|" * len(METHODS) + "---|---|---|---|",
    ]
    for run in runs:
        server: Tally = run["server"]
        for phase in (*SS_PHASES, *DCP_PHASES):
            got = server.methods(phase)
            keys = server.per_key(phase)
            hot = max(keys, key=lambda k: sum(keys[k])) if keys else ""
            again = sum(retried(run["status"], phase).values()) + sum(run["lost"].methods(phase).values())
            same = "—" if phase in DCP_PHASES else ("yes" if agrees(run, phase) else "**no**")
            if again and phase not in DCP_PHASES:
                same += f" ({again} retried)"
            lines.append(
                f"| {run['world']} | {phase} | " + " | ".join(str(got[m]) for m in METHODS) + f" | {sum(got[m] for m in WRITE)} | "
                f"{sum(got[m] for m in READ)} | {_key_words(hot)} ({sum(keys.get(hot, (0, 0)))}) | {same} |"
            )  # fmt: skip
    lines += ["", "| N | tensor bytes read per rank, restore (MiB, min–max) | the same, restore (group) | "
              "the rank's share: parameters and moments (MiB, min–max) |", "|---|---|---|---|"]  # fmt: skip
    for run in runs:
        lines.append(
            f"| {run['world']} | {_mib_range([r['restore'] for r in run['reads']])} | "
            f"{_mib_range([r['restore (group)'] for r in run['reads']])} | {_mib_range(run['dest_shares'])} |"
        )
    lines += ["", "| N | objects in the store after the three commits | DCP's files after one save | DCP's data files (MiB each) |",
              "|---|---|---|---|"]  # fmt: skip
    for run in runs:
        listed = run["listed"]
        ss_objects = len(listed.get("ss", [])) - 1  # less the config
        lines.append(
            f"| {run['world']} | {ss_objects} (incl. refs) | {len(listed.get('dcp', []))} | "
            + ", ".join(f"{s / MIB:.1f}" for s in sorted(run["dcp_files"]))
            + " |"
        )
    return lines


def _mib_range(values: list[int]) -> str:
    lo, hi = min(values) / MIB, max(values) / MIB
    return f"{lo:.1f}" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}–{hi:.1f}"


def _key_words(key: str) -> str:
    parts = key.split("/")
    if not key:
        return "the bucket"
    if parts[0] == "dcp":
        return "dcp/" + parts[-1]
    if len(parts) > 1 and parts[1] == "objects":
        return "objects/…"
    return "/".join(parts[1:2]) + "/…" if len(parts) > 2 else key


def dcp_fixed(runs: list[dict[str, Any]], block: int) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """DCP's save requests beyond writing its data files (mkdir, exists, the .metadata written as
    .metadata.tmp and renamed), per method, fitted as a + b N over the measured runs."""
    rows, fits = [], {}
    extra: dict[int, Counter[str]] = {}
    for run in runs:
        data: Counter[str] = Counter()
        for chunks in run["chunks"]:
            data.update(s3fs_write(dcp_writes(chunks), block))
        got = run["server"].methods("dcp save")
        extra[run["world"]] = Counter({m: got[m] - data[m] for m in METHODS})
        rows.append(f"{run['world']} ranks: data files {dict(data)}, the rest {dict(extra[run['world']])}")
    ns = sorted(extra)
    for m in METHODS:
        ys = [extra[n][m] for n in ns]
        if len(ns) == 1:
            fits[m] = (float(ys[0]), 0.0)
            continue
        mx, my = sum(ns) / len(ns), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(ns, ys)) / sum((x - mx) ** 2 for x in ns)
        fits[m] = (my - b * mx, b)
    return fits, rows


# -- the extrapolation -------------------------------------------------------------------------------------


def extrapolated(args: argparse.Namespace, fits: dict[str, tuple[float, float]]) -> list[str]:
    import bench_scale_sim as sim

    lines = []
    rows = []
    for key in args.models.split(","):
        model = sim.MODELS[key]
        for n in args.sizes:
            t = time.time()
            figs, k = sim.run_point(model, n, args.budget, args.max_layers, requests=True)
            print(f"{model.name} at {n} ranks: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
            rows.append((model, n, k, figs))
    lines += [
        "**Extrapolated: one commit** (`bench_scale_sim`'s simulated commit, its storage calls as S3 requests; "
        "layers extrapolated linearly from the runs named; RNG objects included)",
        "",
        "| model | N | layers run | objects written | PUT | COPY | POST + DELETE | GET | HEAD | LIST | "
        "coordinator's requests (HEADs) | hottest key: what, requests | S3 floor, 1 partition | S3 floor, 256 partitions | "
        "DCP: objects | DCP: write requests |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, n, k, figs in rows:
        e, f = figs["shardstore"].extra, figs["shardstore"].fixed
        d = figs["dcp"].extra
        w, r = e["s3_save_W"], e["s3_save_R"]
        hot = (e["s3_save_hot_W"], e["s3_save_hot_R"])
        other_w, other_r = w - e["s3_save_objects_W"], r - e["s3_save_objects_R"]
        one = floor_seconds(w, r, 1, hot)
        many = max(
            floor_seconds(e["s3_save_objects_W"], e["s3_save_objects_R"], 256, hot), floor_seconds(other_w, other_r)
        )
        files = s3fs_file(round(d["s3_data_bytes"] / n), BLOCK)
        meta = s3fs_file(round(figs["dcp"].stored), BLOCK)  # written once, as .metadata.tmp
        fixed = sum(max(0.0, a + b * n) for m, (a, b) in fits.items() if m in WRITE)
        dcp_w = n * sum(files.values()) + sum(meta.values()) + fixed
        run = f"{model.layers}" if k == model.layers else f"0, {k} of {model.layers}"
        lines.append(
            f"| {model.name} | {n:,} | {run} | {_n(e['s3_objects'])} | {_n(e['s3_save_PUT'])} | {_n(e['s3_save_COPY'])} | "
            f"{_n(e['s3_save_POST'] + e['s3_save_DELETE'])} | {_n(e['s3_save_GET'])} | {_n(e['s3_save_HEAD'])} | "
            f"{_n(e['s3_save_LIST'])} | {_n(e['s3_coordinator_W'] + e['s3_coordinator_R'])} ({_n(e['s3_coordinator_HEAD'])}) | "
            f"{f['save_hot']}, {_n(sum(hot))} | {_secs(one)} | {_secs(many)} | {_n(d['s3_objects'])} | {_n(dcp_w)} |"
        )  # fmt: skip
    lines += [
        "",
        "**Extrapolated: one restore into N/2 ranks, dp only** (every restoring rank; a rank's requests are the first "
        "sampled rank's, whole; DCP's modelled: the .metadata and its load plan's byte ranges through s3fs's read-ahead)",
        "",
        "| model | N → N/2 | GET per rank | HEAD per rank | tensor bytes read per rank ÷ its share | read-class, all ranks | "
        "of which shard manifests | hottest key: what, requests | S3 floor, 1 partition | S3 floor, 256 partitions | "
        "DCP: GET + HEAD per rank | DCP: all ranks | DCP: the .metadata's GETs (one key), all ranks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, n, _k, figs in rows:
        e, f = figs["shardstore"].extra, figs["shardstore"].fixed
        d = figs["dcp"].extra
        ranks = n // 2
        r = e["s3_restore_rank_R"] * ranks
        obj = e["s3_restore_rank_objects_R"] * ranks
        hot = (e["s3_restore_hot_W"], e["s3_restore_hot_R"])
        one = floor_seconds(0, r, 1, hot)
        many = max(floor_seconds(0, obj, 256, hot), floor_seconds(0, r - obj))
        meta_rank = math.ceil(figs["dcp"].stored / BLOCK)  # every rank reads the .metadata whole (and a HEAD)
        dcp_rank = d["s3_restore_rank_GET"] + figs["dcp"].fixed["files_read"] + meta_rank + 1
        meta_gets = meta_rank * ranks
        share = 12 * sum(math.prod(shape) for _, shape, _ in model.tensors(model.layers)) / ranks
        lines.append(
            f"| {model.name} | {n:,} → {ranks:,} | {_n(e['s3_restore_rank_GET'])} | {_n(e['s3_restore_rank_HEAD'])} | "
            f"{e['s3_restore_rank_bytes'] / 2**30:,.1f} GiB ÷ {share / 2**30:,.2f} GiB | "
            f"{_n(r)} | {_n(n * ranks)} | {f['restore_hot']}, {_n(sum(hot))} | {_secs(one)} | {_secs(many)} | "
            f"{_n(dcp_rank)} | {_n(dcp_rank * ranks)} | {_n(meta_gets)} ({_secs(meta_gets / 5500)}) |"
        )  # fmt: skip
    return lines


def _n(x: float) -> str:
    return f"{x:,.0f}"


def _secs(s: float) -> str:
    flag = "" if s <= INTERVAL else " **> 600**"
    return (f"{s:,.0f} s" if s >= 10 else f"{s:.1f} s") + flag


# -- main ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4,8", help="measured runs' rank counts (even)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--dcp-block", type=int, default=50, help="s3fs block size (MiB) of the measured DCP runs")
    ap.add_argument("--models", default="8B,70B,405B")
    ap.add_argument("--sizes", default="64,512,4096,16384")
    ap.add_argument(
        "--budget", type=int, default=60_000, help="bench_scale_sim's most ranks x tensors in one simulation"
    )
    ap.add_argument("--max-layers", type=int, default=8)
    ap.add_argument("--skip-sim", action="store_true", help="measure only")
    ap.add_argument("--quick", action="store_true", help="2 ranks measured; 8B at 64 ranks extrapolated")
    ap.add_argument("--results", default=None, help="write the tables into this RESULTS.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.models, args.sizes, args.budget, args.max_layers = "2", "8B", "64", 1, 1
    args.sizes = [int(x) for x in args.sizes.split(",")]
    started, load0 = time.time(), db.load()
    work = tempfile.mkdtemp(prefix="bench-s3req-")
    try:
        runs = [measure(int(w), args, work) for w in args.ranks.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    bad = [b for run in runs for b in check(run)]
    fits, fit_rows = dcp_fixed(runs, args.dcp_block * MIB)
    lines = head(args, argv, (load0, db.load()), time.time() - started) + measured_table(runs)
    lines += ["", "DCP's save beyond its data files (s3fs at the measured block size): " + "; ".join(fit_rows)
              + ". Fitted a + b N per method: " + ", ".join(f"{m} {a:.1f} + {b:.2f} N" for m, (a, b) in fits.items() if a or b), ""]  # fmt: skip
    if not args.skip_sim:
        lines += extrapolated(args, fits)
    lines[2] = lines[2].replace("WALL", f"{time.time() - started:.0f}")
    text = "\n".join(lines)
    print(text)
    if bad:
        print("\n".join(["the server's count differs from the storage calls' prediction:", *bad]), file=sys.stderr)
        return 1
    if args.results:
        write_block(args.results, BEGIN, END, SECTION, text)
    return 0


def command_options(argv: list[str] | None) -> list[str]:
    """The options a run was given, less ``--results`` and its file (where the block goes, not
    what was measured), so that a block records the command that made it."""
    given = list(sys.argv[1:] if argv is None else argv)
    out, skip = [], False
    for a in given:
        if skip:
            skip = False
        elif a == "--results":
            skip = True
        elif not a.startswith("--results="):
            out.append(a)
    return out


def head(args: argparse.Namespace, argv: list[str] | None, loads: tuple[str, str], wall: float) -> list[str]:
    import moto
    import s3fs

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    cmd = " ".join(["python benchmarks/bench_s3_requests.py", *command_options(argv)])
    return [
        f"`{cmd}`",
        "",
        f"commit {commit.stdout.strip()}; {os.cpu_count()} cores; load average (1/5/15 min) {loads[0]} at the start, "
        f"{loads[1]} at the end of the measured runs; WALL s wall; torch {torch.__version__}; moto {moto.__version__}; s3fs {s3fs.__version__}; Python "
        f"{platform.python_version()}. Measured model: {args.layers} block(s) of hidden {args.hidden} "
        f"({args.hidden}², {args.hidden}², 2×{args.hidden}², 2×{args.hidden}² and a norm), float32, AdamW; "
        f"(N/2 × 2) dp × tp mesh.",
        "",
    ]


if __name__ == "__main__":
    sys.exit(main())
