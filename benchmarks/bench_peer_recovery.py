"""Recovery of one lost worker through peer replicas, against a local-disk store and S3 (issue 32).

Not a test. For a group of 2 and of 3 Gloo processes on this machine (each process stands
for a host: its memory tier is a directory of its own under /dev/shm), it:

1. builds each slot's training state (float32 parameters and both AdamW moments, ``--mib``
   of state for the whole group, every tensor filled from a seed), commits it with
   ``save_distributed`` to a local-disk store through each worker's memory tier
   (write-through, as ``shardtrain train`` does), holds the commit in each tier, sends each
   slot's objects to its buddy (``replicate``: slot i → i+1) and copies the commit to an
   S3 store (moto's server on 127.0.0.1);
2. loses the last slot's host: its tier directory (its own slot's objects and the replica it
   kept of the slot before it) is deleted;
3. recovers the whole group three ways, interleaved (each repetition in another order),
   every worker's state zeroed first:
   - **peers**: the group's tiers as shardtrain reads them: the lost worker gets its slot's
     objects from its buddy (``start_fetch``, point-to-point over the group, written to its
     tier as they arrive), every other worker reads its own tier while it sends them; each restore reads through ``TieredStorage`` (memory, then
     peers, then the store; every object verified against its id);
   - **local disk**: every worker restores from the local-disk store, page cache dropped
     first (as root; said in the output when it cannot be);
   - **S3**: every worker restores from the S3 store;
   then each worker takes one AdamW step (its first resumed update); after the peers recovery
   the group then commits that step as shardtrain's committer does (through each worker's
   tier, held, replicated), timed and its CPU counted, and the starting commit is put back in
   every tier (untimed) for the next repetition.

It reports per method the group's restore time (the slowest worker's, between barriers), the
time to the first resumed update, the lost worker's restore time, and the tensor bytes read
from the durable store; for the peers path, the CPU time of the restore, of the first update and
of the first commit after it (every thread of every process), that commit's time, and what the
lost worker's tier held after the restore; and the per-hop rate of the buddy's transfer (the lost slot's bytes
over the exchange's time), from which it works out, on paper, a recovery from peers
against a recovery from storage for the seed's 1.7 B model and for a 70 B model. Every
restore is checked bitwise against the state committed.

Numbers against moto measure a Python HTTP server on loopback, not S3; a one-machine Gloo
"hop" is loopback TCP, not a network. Both are stand-ins, said in the table's header.

    python benchmarks/bench_peer_recovery.py [--mib 1024] [--reps 3] [--workers 2,3] [--frozen 0]
        [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from _dist_bench import ROOT, Timer, can_drop, commit, counted, drop, group, load, rotated, spawn
from _results import write_block

import shardstore as ss
from shardstore.backends.memory_tier import MemoryTier
from shardstore.backends.tiers import TieredStorage
from shardstore.checkpoint.replicas import replicate, start_fetch
from shardstore.format.closure import commit_closure
from shardstore.format.tensors import hash_bytes

MIB = 1 << 20
TENSOR_MIB = 8  # each parameter tensor (its two moments the same size)
BUCKET = "bench"
METHODS = ("peers", "local disk", "S3")
MARKERS = (
    "<!-- bench_peer_recovery:begin -->",
    "<!-- bench_peer_recovery:end -->",
    "## Recovery through peer replicas",
)


def _slot_model(rank: int, world: int, total_mib: int) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """This slot's parameters (a third of its share of the state; the moments are the rest),
    in tensors of TENSOR_MIB, with AdamW after one step so both moments exist."""
    params_mib = max(TENSOR_MIB, total_mib // (3 * world))
    n = -(-params_mib // TENSOR_MIB)
    model = torch.nn.ParameterDict(
        {f"slot{rank}_w{i}": torch.nn.Parameter(torch.empty(TENSOR_MIB * MIB // 4)) for i in range(n)}
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(generator=g)
            p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    return model, opt


def _tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        out += [p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]]
    return out


def _digests(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    return [hash_bytes(t.detach().numpy().tobytes()) for t in _tensors(model, opt)]


def _zero(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for t in _tensors(model, opt):
            t.zero_()


def _first_update(model: torch.nn.Module, opt: torch.optim.Optimizer, frozen: float = 0.0) -> None:
    """One AdamW step; the first ``frozen`` fraction of the parameters get no gradient (AdamW
    leaves them and their moments unchanged: the next commit's unchanged objects)."""
    params = list(model.parameters())
    for p in params[int(len(params) * frozen) :]:
        p.grad = torch.ones_like(p)
    opt.step()
    for p in model.parameters():
        p.grad = None


def worker(rank: int, port: int, world: int, args: argparse.Namespace, work: str, s3: dict[str, Any]) -> None:
    logging.getLogger("botocore").setLevel(logging.WARNING)
    with group(rank, world, port):
        model, opt = _slot_model(rank, world, args.mib)
        share = sum(t.numel() * t.element_size() for t in _tensors(model, opt))
        lost = world - 1  # the host lost: the last slot's
        host = os.path.join(args.shm, f"host{rank}")  # this process's host's tier root

        def tier(slot: int) -> MemoryTier:
            return MemoryTier(host, slot, keep=1)

        # 1. the commit, through this worker's tier (write-through), held there and replicated.
        local = ss.open_store(os.path.join(work, "store"))
        own = tier(rank)
        through = ss.Store(TieredStorage(local.storage, [own], fill=own), create=False)
        cid = ss.save_distributed(through, model, opt, info=ss.CommitInfo(step=1), rng=False)
        # read through the tier, as shardtrain's committer does: the other slots' shard manifests
        # (part of this slot's closure) land in it too, so the replica it offers is complete
        ids = commit_closure(ss.load_commit(through, cid), slot=rank).ids()
        own.hold(cid, ids)
        replicate(None, slot=rank, commit=cid, objects=ids, own=own, tier_for=tier, replicas=1)
        if rank == 0:
            ss.copy_commit(local, ss.open_store(s3["url"], **s3["options"]), cid, ref="main")
        dist.barrier()
        want = _digests(model, opt)
        remote = ss.open_store(s3["url"], create=False, **s3["options"])

        def lose() -> None:  # 2. the lost host's tier is gone
            if rank == lost:
                shutil.rmtree(host, ignore_errors=True)
            dist.barrier()

        timer = Timer()
        record: dict[str, Any] = {
            "rank": rank,
            "share": share,
            "restore": {},
            "store_bytes": {},
            "fetch": [],
            "cpu": {},  # CPU seconds of this process (all threads) per phase
            "commit": [],  # the first commit after the peers recovery: wall s, CPU s
            "tier_after": [],  # bytes of this worker's own tier right after the peers restore
            "held_peak": [],  # the most bytes of peers' copies held in memory during the restore
        }

        def cpu(name: str, fn: Any) -> Any:
            c0 = time.process_time()
            out = fn()
            record["cpu"].setdefault(name, []).append(time.process_time() - c0)
            return out

        def commit_after() -> None:
            """The first commit after the peers recovery, as shardtrain's committer makes it (in
            the foreground here: timed between barriers), then the starting commit put back in
            every tier (untimed): restored from the store, committed through the tier again (the
            same id: no ref moved, no parent), held and replicated."""
            own = tier(rank)
            writer = ss.Store(TieredStorage(local.storage, [own], fill=own), create=False)

            def run() -> None:
                c2 = ss.save_distributed(
                    writer, model, opt, info=ss.CommitInfo(step=2), rng=False, ref=None, parent=cid
                )
                ids2 = commit_closure(ss.load_commit(writer, c2), slot=rank).ids()
                own.hold(c2, ids2)
                replicate(None, slot=rank, commit=c2, objects=ids2, own=own, tier_for=tier, replicas=1)

            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            run()
            wall, used = time.perf_counter() - t0, time.process_time() - c0
            dist.barrier()
            record["commit"].append([wall, used])
            _zero(model, opt)
            ss.restore(local, cid, model, opt, slot=rank, rng=False)
            again = ss.save_distributed(
                writer, model, opt, info=ss.CommitInfo(step=1), rng=False, ref=None, parent=None
            )
            assert again == cid, "the starting commit put back under another id"
            own.hold(cid, ids)
            replicate(None, slot=rank, commit=cid, objects=ids, own=own, tier_for=tier, replicas=1)
            dist.barrier()

        def restore_from(method: str) -> None:
            t0 = time.perf_counter()
            if method == "peers":
                mine = tier(rank)
                mine.clear_partial()
                f0 = time.perf_counter()
                # as shardtrain's start does: the exchange in the background, the restore at once (a
                # worker whose tier holds the commit reads it while it sends its buddy's copies; one
                # that lacks it reads each copy as soon as it has landed in its tier)
                fetching = start_fetch(None, slot=rank, commit=cid, own=mine, tier_for=tier, replicas=1)
                reader = TieredStorage(local.storage, [mine, fetching.copies], fill=mine)
                ss.restore(ss.Store(reader, create=False), cid, model, opt, slot=rank, rng=False)
                copies, report = fetching.wait()
                if report.received:
                    record["fetch"].append((report.received, time.perf_counter() - f0))
                store_bytes = reader.counts()["store"]
                record["tier_after"].append(mine.nbytes())
                record["held_peak"].append(getattr(copies, "held_peak", None))
            else:
                src, counter = counted(local if method == "local disk" else remote)
                ss.restore(src, cid, model, opt, slot=rank, rng=False)
                store_bytes = counter.read_bytes
            record["restore"].setdefault(method, []).append(time.perf_counter() - t0)
            record["store_bytes"].setdefault(method, []).append(store_bytes)

        drop_ok = can_drop() and not args.warm
        for rep in range(args.reps):
            for method in rotated(METHODS, rep):
                lose()
                _zero(model, opt)
                drop(rank, drop_ok and method == "local disk")
                timer(method, lambda m=method: cpu(m, lambda: restore_from(m)))
                if _digests(model, opt) != want:
                    raise SystemExit(f"rank {rank}: {method} restored other bytes than were committed")
                timer(
                    f"{method} + first update",
                    lambda m=method: cpu(f"{m} + first update", lambda: _first_update(model, opt, args.frozen)),
                )
                if method == "peers":
                    commit_after()
        record["times"] = timer.times
        record["dropped"] = drop_ok
        with open(os.path.join(work, f"result.{rank}"), "w") as f:
            json.dump(record, f)


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def table(runs: dict[int, list[dict]], args: argparse.Namespace, loads: tuple[str, str]) -> str:
    import platform

    lines = [
        f"`python benchmarks/bench_peer_recovery.py --mib {args.mib} --reps {args.reps} "
        f"--workers {','.join(map(str, runs))}`",
        "",
        f"commit {commit()}; {os.cpu_count()} cores ({platform.processor() or platform.machine()}); load average "
        f"{loads[0]} at the start, {loads[1]} at the end; torch {torch.__version__}; Gloo on loopback (one process "
        f"per stand-in host, its memory tier a directory on /dev/shm); S3: moto on 127.0.0.1.",
        "Page cache before each local-disk restore: "
        + ("dropped (as root)." if all(r[0]["dropped"] for r in runs.values()) else "NOT dropped (warm)."),
        "Medians of the repetitions (min–max), methods interleaved; the group's time is the slowest worker's; "
        "'store bytes' are the tensor objects read from the durable store by the whole group.",
        "",
        "| workers | state | method | group restore s | + first update s | lost worker's restore s | "
        "store bytes (group) | S3 ÷ method (restore) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rates = []
    verdicts = []
    for world, results in runs.items():
        total = sum(r["share"] for r in results)

        def group_times(name: str, rs: list[dict] = results) -> list[float]:
            return [max(r["times"][name][i] for r in rs) for i in range(len(rs[0]["times"][name]))]

        s3 = _median(group_times("S3"))
        for method in METHODS:
            ts = group_times(method)
            upd = [a + b for a, b in zip(ts, group_times(f"{method} + first update"))]
            lost = results[-1]["restore"][method]
            stored = [sum(r["store_bytes"][method][i] for r in results) for i in range(len(ts))]
            lines.append(
                f"| {world} | {total / 2**30:.2f} GiB | {method} | {_median(ts):.2f} ({min(ts):.2f}–{max(ts):.2f}) | "
                f"{_median(upd):.2f} | {_median(lost):.2f} | {max(stored):,} | {s3 / _median(ts):.2f}× |"
            )
        peers = _median(group_times("peers"))
        peers_store = max(sum(r["store_bytes"]["peers"][i] for r in results) for i in range(args.reps))
        verdicts.append((world, s3 / peers, peers_store))
        for n, s in results[-1]["fetch"]:
            rates.append(n / s)
    lines += [
        "",
        "The peers path's CPU (every thread of every process of the group, `time.process_time`; medians) and the "
        "first commit after the recovery (its wall time between barriers, run in the foreground here, where "
        "shardtrain runs it in the background; through each worker's tier, held, replicated)"
        + (f"; the first update leaves {args.frozen:.0%} of the parameters unchanged" if args.frozen else "")
        + ":",
        "",
        "| workers | restore CPU s (lost worker's) | first update CPU s | first commit s | "
        "first commit CPU s (lost worker's) | lost worker's tier after the restore | peers' copies held at most |",
        "|---|---|---|---|---|---|---|",
    ]
    for world, results in runs.items():

        def summed(name: str, rs: list[dict] = results) -> float:
            return _median([sum(r["cpu"][name][i] for r in rs) for i in range(len(rs[0]["cpu"][name]))])

        commits = [max(r["commit"][i][0] for r in results) for i in range(len(results[0]["commit"]))]
        commit_cpu = [sum(r["commit"][i][1] for r in results) for i in range(len(results[0]["commit"]))]
        lost_restore = _median(results[-1]["cpu"]["peers"])
        lost_commit = _median([c[1] for c in results[-1]["commit"]])
        held = [h for h in results[-1]["held_peak"] if h is not None]
        lines.append(
            f"| {world} | {summed('peers'):.2f} ({lost_restore:.2f}) | {summed('peers + first update'):.2f} | "
            f"{_median(commits):.2f} | {_median(commit_cpu):.2f} ({lost_commit:.2f}) | "
            f"{max(results[-1]['tier_after']):,} B | " + (f"{max(held):,} B |" if held else "n/a |")
        )
    lines += ["", "**targets** (issue 32, item 5)", "", "| target | figure | met |", "|---|---|---|"]
    for world, speedup, stored in verdicts:
        lines.append(
            f"| {world} workers: 0 tensor bytes from the durable store when recovering through peers | "
            f"{stored:,} bytes | {'yes' if stored == 0 else '**no**'} |"
        )
        lines.append(
            f"| {world} workers: restore phase ≥ 3× faster than from S3 (same run) | {speedup:.2f}× | "
            f"{'yes' if speedup >= 3 else '**no**'} |"
        )
    if rates:
        hop = _median(rates)
        lines += [
            "",
            f"**On paper.** The buddy's transfer ran at {hop / 1e9:.2f} GB/s per hop here (median of the lost "
            f"slot's fetches: its bytes over the exchange's time, loopback Gloo). A recovery moves one slot's "
            f"state (float32 weights and both AdamW moments: 12 bytes per parameter) once, from its buddy, while "
            f"a restore from storage moves it at the storage's per-host rate. Recovery of one slot, seconds:",
            "",
            "| model | slots | slot state | from the buddy at this hop rate | at 10 Gb/s per hop | "
            "from S3 at 1 GB/s per host | from S3 at 200 MB/s per host |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, params in (("seed 1.7 B", 1.7e9), ("70 B", 70e9)):
            for slots in (8, 64):
                b = 12 * params / slots
                lines.append(
                    f"| {name} | {slots} | {b / 1e9:.1f} GB | {b / hop:.1f} | {b / 1.25e9:.1f} | {b / 1e9:.1f} | "
                    f"{b / 2e8:.1f} |"
                )
        lines += [
            "",
            "The buddy's hop is a dedicated point-to-point link the group already has; storage bandwidth is shared "
            "by every host restoring at once (a whole-job restart reads N slots through it), which the per-host "
            "figures above do not even charge.",
        ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="training state of the whole group, MiB (default 1024)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", default="2,3", help="group sizes to run, e.g. 2,3")
    ap.add_argument("--warm", action="store_true", help="never drop the page cache (smoke runs)")
    ap.add_argument(
        "--frozen", type=float, default=0.0, help="fraction of the parameters the first update leaves unchanged"
    )
    ap.add_argument("--results", default=None, help="write the table into this RESULTS.md")
    args = ap.parse_args()
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    start = load()
    runs: dict[int, list[dict]] = {}
    try:
        host, port = server.get_host_and_port()
        options = {
            "endpoint_url": f"http://{host}:{port}",
            "key": "bench",
            "secret": "bench",
            "client_kwargs": {"region_name": "us-east-1"},
        }
        import s3fs

        s3fs.S3FileSystem(**options).call_s3("create_bucket", Bucket=BUCKET)
        for world in (int(w) for w in args.workers.split(",")):
            work = tempfile.mkdtemp(prefix="bench-peer-", dir=os.path.dirname(ROOT))
            args.shm = tempfile.mkdtemp(
                prefix="bench-peer-tiers-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
            )
            try:
                s3 = {"url": f"s3://{BUCKET}/w{world}-{os.path.basename(work)}", "options": options}
                spawn(worker, world, (world, args, work, s3))
                runs[world] = [json.load(open(os.path.join(work, f"result.{r}"))) for r in range(world)]
            finally:
                shutil.rmtree(work, ignore_errors=True)
                shutil.rmtree(args.shm, ignore_errors=True)
    finally:
        server.stop()
    text = table(runs, args, (start, load()))
    print(text)
    if args.results:
        write_block(args.results, *MARKERS, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
