"""What the sharded benchmarks (``bench_dtensor.py``, ``bench_mesh.py``) share.

- Gloo processes: ``spawn`` starts them (1 torch thread each) and ``group`` tears each one's
  process group down whatever happens; ``Timer`` times a method between two barriers (the
  table takes the slowest rank's time);
- the cold page cache (``drop``, as root) and the process's I/O counters (``io``);
- ``CountingStorage``: the store's own storage, its object reads and writes counted at the
  storage layer (the bytes a restore or a copy fetched, the bytes a save wrote);
- seed-filled state: every parameter and AdamW moment gets values drawn from its name, so a
  model on any mesh can be filled from (``fill``) or compared with (``expected``) the same
  whole tensors without gathering them;
- the RESULTS.md block between a benchmark's markers, and the table lines both print.

Not a benchmark itself (the leading underscore): imported by the two scripts, which run from
the repository root as ``python benchmarks/<script>.py``, so this directory is on ``sys.path``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch._dynamo  # noqa: F401  before any group (see shardtrain.workers.launch)
import torch.distributed as dist
import torch.multiprocessing as mp
from _fio import FIO, fio_run
from _results import write_block

import shardstore as ss
from shardstore.sharded.exchange import last_exchange

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLES = ("param", "exp_avg", "exp_avg_sq")


# -- processes ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker: Callable[..., None], nprocs: int, args: tuple) -> None:
    """Run ``worker(rank, port, *args)`` in ``nprocs`` spawned processes; raises if any fails
    (torch's process context then ends the others)."""
    mp.start_processes(worker, args=(free_port(), *args), nprocs=nprocs, join=True, start_method="spawn")


@contextlib.contextmanager
def group(rank: int, world: int, port: int) -> Iterator[None]:
    """This process's Gloo group of ``world`` ranks on one machine, one torch thread; destroyed on the way out."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=900))
    try:
        yield
    finally:
        dist.destroy_process_group()


class Timer:
    """Each method's wall time on this rank, between a barrier before and one after."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        dist.barrier()
        self.times.setdefault(name, []).append(time.perf_counter() - t0)
        return out


def rotated(items: Sequence[Any], rep: int) -> list[Any]:
    """``items`` rotated by ``rep``: each repetition runs every method once, in a different order."""
    k = rep % len(items)
    return list(items[k:]) + list(items[:k])


# -- the page cache and the process's I/O ----------------------------------------------------


def can_drop() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop(rank: int, enabled: bool) -> None:
    """Rank 0 writes back and drops the page cache (every rank waits at the next barrier)."""
    if enabled and rank == 0:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")


def io() -> dict[str, int]:
    """This process's ``read_bytes`` / ``write_bytes`` (all threads): what it made the block
    device read (so 0 from a warm page cache; readahead included) and the file bytes it
    dirtied for writing. Not ``rchar``/``wchar``, which count Gloo's socket traffic too.
    Empty where /proc/self/io is missing."""
    try:
        with open("/proc/self/io") as f:
            pairs = (line.split(":") for line in f)
            return {k: int(v) for k, v in pairs if k in ("read_bytes", "write_bytes")}
    except OSError:
        return {}


def io_delta(before: dict[str, int], key: str) -> int | None:
    after = io()
    return after[key] - before[key] if key in after and key in before else None


class CountingStorage:
    """Stands in for a store's storage: counts the bytes and number of objects (``objects/``
    keys: tensor blocks and manifests) read through it, whatever read path the store takes,
    and those it writes (bytes staged to files, objects created); everything else passes
    through unchanged."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.read_bytes = self.read_objects = self.written_bytes = self.written_objects = 0
        self._lock = threading.Lock()

    def _read(self, key: str, n: int) -> None:
        if key.startswith("objects/"):
            with self._lock:
                self.read_bytes += n
                self.read_objects += 1

    def _wrote(self, key: str, n: int, created: int) -> None:
        if key.startswith("objects/"):
            with self._lock:
                self.written_bytes += n
                self.written_objects += created

    def read(self, key: str, limit: int | None = None) -> Any:
        data = self.inner.read(key) if limit is None else self.inner.read(key, limit=limit)
        self._read(key, len(data))
        return data

    def read_hashed(self, key: str, hasher: Any, limit: int | None = None) -> Any:
        data, digest = self.inner.read_hashed(key, hasher, limit)
        self._read(key, len(data))
        return data, digest

    def read_into(self, key: str, out: Any, consume: Any = None) -> int:
        n = self.inner.read_into(key, out, consume)
        if n == len(out):  # a size mismatch reads nothing
            self._read(key, n)
        return n

    def write_once(self, key: str, data: Any) -> bool:
        created = self.inner.write_once(key, data)
        self._wrote(key, len(memoryview(data).cast("B")) if created else 0, int(created))
        return created

    def begin_write(self, key: str, data: Any) -> str | None:
        tmp = self.inner.begin_write(key, data)
        if tmp is not None:  # written to a file (created when end_writes links it)
            self._wrote(key, len(memoryview(data).cast("B")), 0)
        return tmp

    def end_writes(self, pending: list[tuple[str, str]], **kwargs: Any) -> list[bool]:
        done = self.inner.end_writes(pending, **kwargs)
        with self._lock:
            self.written_objects += sum(
                1 for (key, _), created in zip(pending, done) if created and key.startswith("objects/")
            )
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def counted(store: ss.Store) -> tuple[ss.Store, CountingStorage]:
    """The same store, its object reads and writes counted."""
    counter = CountingStorage(store.storage)
    return ss.Store(counter, create=False), counter


def tree_size(path: str) -> tuple[int, int]:
    """(files, bytes) under ``path``."""
    files = size = 0
    for d, _, names in os.walk(path):
        for n in names:
            files += 1
            size += os.path.getsize(os.path.join(d, n))
    return files, size


# -- seed-filled state ---------------------------------------------------------------------


def adamw_with_moments(model: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW over ``model`` after one step, so both moments (and ``step``) exist; no grads kept."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    for p in model.parameters():
        p.grad = None
    return opt


def state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """(``name/role``, tensor) of every parameter and both moments, in model order."""
    out = []
    for name, p in model.named_parameters():
        out += [
            (f"{name}/param", p),
            (f"{name}/exp_avg", opt.state[p]["exp_avg"]),
            (f"{name}/exp_avg_sq", opt.state[p]["exp_avg_sq"]),
        ]
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def locals_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [_local(t) for _, t in state(model, opt)]


def share(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """This rank's bytes of parameters and moments (its local slices)."""
    return sum(t.numel() * t.element_size() for t in locals_of(model, opt))


def _slice_of(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full``'s part that ``like`` (a DTensor, or a plain tensor: all of it) holds on this
    rank, split locally by ``like``'s placements (nothing is sent)."""
    if not hasattr(like, "to_local"):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def fill(
    source: tuple[torch.nn.Module, torch.optim.Optimizer],
    dests: Sequence[tuple[torch.nn.Module, torch.optim.Optimizer]],
) -> list[list[torch.Tensor]]:
    """Fill ``source``'s parameters and moments from whole tensors drawn from each one's name
    (every rank draws the same), and return, for each of ``dests`` (the same module on another
    mesh), the local slices it must hold after a restore. Moments get values of their own, so a
    moment restored into the wrong tensor or slice is caught; ``step`` stays 1."""
    src = state(*source)
    outs = [state(*d) for d in dests]
    want: list[list[torch.Tensor]] = [[] for _ in dests]
    with torch.no_grad():
        for i, (key, t) in enumerate(src):
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            full = torch.randn(tuple(t.shape), generator=g, dtype=t.dtype)
            _local(t).copy_(_slice_of(full, t))
            for w, out in zip(want, outs):
                if out[i][0] != key or tuple(out[i][1].shape) != tuple(t.shape):
                    raise SystemExit(
                        f"destination tensor {out[i][0]} {list(out[i][1].shape)} is not the source's {key} {list(t.shape)}"
                    )
                w.append(_slice_of(full, out[i][1]).clone())
    return want


def zero(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Zero every local slice and each ``step``: a restore that skips anything is caught."""
    with torch.no_grad():
        for t in locals_of(model, opt):
            t.zero_()
        for s in opt.state.values():
            s["step"].zero_()


def mismatches(model: torch.nn.Module, opt: torch.optim.Optimizer, want: Sequence[torch.Tensor]) -> list[str]:
    """Names of the tensors whose local slice differs from ``want`` (and of any ``step`` not 1)."""
    bad = [key for (key, t), w in zip(state(model, opt), want, strict=True) if not torch.equal(_local(t), w)]
    bad += [f"{name}/step" for name, p in model.named_parameters() if float(opt.state[p]["step"]) != 1.0]
    return bad


# -- tables and RESULTS.md -------------------------------------------------------------------


def commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def slowest(results: Sequence[dict], name: str) -> list[float]:
    """Each repetition's time of method ``name``: the slowest rank's."""
    reps = len(results[0]["times"][name])
    return [max(r["times"][name][i] for r in results) for i in range(reps)]


def method_table(
    results: Sequence[dict], ours: str, peer: str, total: int, labels: tuple[str, str] | None = None
) -> list[str]:
    """Lines of a two-row table (ours, then the peer; shown as ``labels`` if given): median s
    (min–max), GB/s of ``total`` bytes, and the ratio of speeds (the peer's median time over ours)."""
    lines = ["| method | median s (min–max) | GB/s median | shardstore ÷ DCP |", "|---|---|---|---|"]
    for name, label, r in zip((ours, peer), labels or (ours, peer), (ratio(results, ours, peer), 1.0)):
        ts = slowest(results, name)
        med = statistics.median(ts)
        lines.append(f"| {label} | {med:.3f} ({min(ts):.3f}–{max(ts):.3f}) | {total / med / 1e9:.2f} | {r:.2f} |")
    return lines


def ratio(results: Sequence[dict], ours: str, peer: str) -> float:
    """The peer's median time over ours: shardstore's speed over the peer's."""
    return statistics.median(slowest(results, peer)) / statistics.median(slowest(results, ours))


def mib(n: float | None) -> str:
    return "—" if n is None else f"{n / MIB:.1f}"


def met(ok: bool) -> str:
    return "yes" if ok else "**no**"


def target_rows(
    results: Sequence[dict],
    saves: tuple[str, str],
    restores: tuple[str, str],
    others: Sequence[str],
    dests: Sequence[str],
    worst: dict[str, float],
) -> list[str]:
    """Issue 26's targets of a sharded benchmark: save and each restore into another mesh against
    DCP (medians), and bytes read per rank against its share in each destination."""
    save = ratio(results, *saves)
    lines = [
        "",
        "**targets** (issue 26)",
        "",
        "| target | figure | met |",
        "|---|---|---|",
        f"| save ≥ 1.2× dcp.save (median) | {save:.2f}× | {met(save >= 1.2)} |",
    ]
    for d in others:
        r = ratio(results, f"{restores[0]} → {d}", f"{restores[1]} → {d}")
        lines.append(
            f"| cold restore into {d} ≥ 1.2× dcp.load + set_state_dict (median) | {r:.2f}× | {met(r >= 1.2)} |"
        )
    for d in dests:
        lines.append(
            f"| bytes read per rank ≤ 1.25× its share, into {d} | {worst[d]:.3f}× (worst rank) | {met(worst[d] <= 1.25)} |"
        )
    return lines


def main(
    doc: str,
    worker: Callable[..., None],
    world: int,
    name: str,
    table: Callable[..., str],
    markers: tuple[str, str, str],
    mib_help: str,
    argv: list[str] | None = None,
    options: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    """The command line the sharded benchmarks share: run ``worker`` on ``world`` processes,
    print ``table`` of their results and, with ``--results``, write it between ``markers``
    (begin, end, section) of that file. ``options`` adds a benchmark's own arguments."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    if options is not None:
        options(ap)
    ap.add_argument("--mib", type=int, default=256, help=mib_help)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir beside the repository)")
    ap.add_argument("--results", default=None, help="write the table into this RESULTS.md")
    ap.add_argument("--warm", action="store_true", help="never drop the page cache (smoke runs)")
    args = ap.parse_args(argv)
    drop_ok = not args.warm and can_drop()
    start = load()
    work = tempfile.mkdtemp(prefix=f"bench-{name}-", dir=args.dir or os.path.dirname(ROOT))
    out = os.path.join(work, "result")
    try:
        spawn(worker, world, (args, work, out, drop_ok))
        results = [json.load(open(f"{out}.{r}")) for r in range(world)]
        text = table(results, args, drop_ok, (start, load()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(text)
    if args.results:
        write_block(args.results, *markers, text)
    return 0


# -- the device's limit and where a save's time went ------------------------------------------

FIO_WRITE, FIO_READ = "limit: fio sequential write + fsync", "limit: fio cold sequential read"
PHASES = ("stage_s", "transfer_s", "write_s", "durable_s", "agree_s")


def fio_limits(timer: Timer, rank: int, world: int, work: str, share: int, drop_ok: bool) -> None:
    """The device at this benchmark's size, in the same run: rank 0 runs fio with ``world``
    jobs of ``share`` bytes each, in files of 4 MiB (one tile), written with a final fsync and
    then read cold, while the others wait; every rank records fio's own runtimes (so the
    tables' slowest-rank rule gives fio's). Nothing is recorded without fio."""
    if FIO is None:
        return
    got = [0.0, 0.0]
    if rank == 0:
        d = os.path.join(work, "fio")
        os.makedirs(d, exist_ok=True)
        os.sync()
        files = max(1, share // (4 * MIB))
        got[0] = fio_run(d, "write", world, share, files)
        drop(0, drop_ok)
        got[1] = fio_run(d, "read", world, share, files)
        shutil.rmtree(d, ignore_errors=True)
    dist.broadcast_object_list(got, src=0)
    timer.times.setdefault(FIO_WRITE, []).append(got[0])
    timer.times.setdefault(FIO_READ, []).append(got[1])


def exchange_profile(seconds: float) -> dict[str, float]:
    """This rank's latest block exchange's time by phase, and the save's whole time."""
    stats = last_exchange()
    return {"save_s": seconds, **{k: getattr(stats, k) for k in PHASES}}


def limit_row(results: Sequence[dict], ours: str, limit: str, total: int) -> list[str]:
    """A table row for fio's figure (when measured), with shardstore's speed over the device's."""
    if limit not in results[0]["times"]:
        return []
    ts = slowest(results, limit)
    med = statistics.median(ts)
    return [
        f"| {limit} ({len(results)} jobs, shardstore ÷ device) | {med:.3f} ({min(ts):.3f}–{max(ts):.3f}) | "
        f"{total / med / 1e9:.2f} | {ratio(results, ours, limit):.2f} |"
    ]


def profile_rows(results: Sequence[dict]) -> list[str]:
    """Where each rank's save went (medians over repetitions): the block exchange's phases, and
    the rest (descriptions, agreement, manifests, the commit protocol)."""
    if not results[0].get("profile"):
        return []
    lines = [
        "**where each rank's save went** (medians over runs, s; `shardstore.sharded.exchange.ExchangeStats`)",
        "",
        "| rank | save | stage | transfer | hash + write | fsync barrier | flag all-reduces | rest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rank, r in enumerate(results):
        med = {k: statistics.median(p[k] for p in r["profile"]) for k in ("save_s", *PHASES)}
        rest = med["save_s"] - sum(med[k] for k in PHASES)
        lines.append(
            f"| {rank} | {med['save_s']:.3f} | " + " | ".join(f"{med[k]:.3f}" for k in PHASES) + f" | {rest:.3f} |"
        )
    return lines + [""]


def warm_up(rank: int, model: torch.nn.Module, opt: torch.optim.Optimizer, work: str) -> None:
    """One untimed save of each method before the timed runs: the first call of either pays
    one-time costs a training job pays once (shardstore's modules load on first use, DCP's
    planner and both sides' thread pools start), which would otherwise weigh on one run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ss_dir, dcp_dir = os.path.join(work, "warm-ss"), os.path.join(work, "warm-dcp")
    ss.save_distributed(ss.open_store(ss_dir), model, opt, info=ss.CommitInfo(step=1), rng=False)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(ss_dir, ignore_errors=True)
        shutil.rmtree(dcp_dir, ignore_errors=True)


def restorer(
    ours: bool, ss_dir: str, dcp_dir: str, model: torch.nn.Module, opt: torch.optim.Optimizer, reads: list[int]
) -> Callable[[], None]:
    """A restore of the saved checkpoint into ``model`` and ``opt``: shardstore's (its bytes
    read, counted at the storage layer, appended to ``reads``) or DCP's (``dcp.load`` then
    ``set_state_dict``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def ss_restore() -> None:
        store, counter = counted(ss.open_store(ss_dir, create=False))
        ss.restore(store, "main", model, opt)
        reads.append(counter.read_bytes)

    def dcp_restore() -> None:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=dcp_dir)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    return ss_restore if ours else dcp_restore


def report_head(script: str, args: argparse.Namespace, loads: tuple[str, str], drop_ok: bool, setup: str) -> list[str]:
    """The command, commit, machine, load and what was measured, above a sharded benchmark's tables."""
    return [
        f"`python benchmarks/{script} --mib {args.mib} --reps {args.reps}{' --warm' if args.warm else ''}`",
        "",
        f"commit {commit()}; {os.cpu_count()} cores; load average (1/5/15 min) {loads[0]} at the start, {loads[1]} at the end; "
        f"torch {torch.__version__}; shardstore {ss.__version__}; {setup}",
        "Page cache before each restore: "
        + ("dropped (as root)." if drop_ok else "NOT dropped: restores read warm pages."),
        f"Medians of {args.reps} interleaved runs (min–max), after one untimed save of each; the time is the slowest rank's; "
        "ratios are shardstore's speed over DCP's.",
        "",
    ]


def timing_tables(
    results: Sequence[dict],
    saves: tuple[str, str],
    restores: tuple[str, str],
    dests: Sequence[str],
    total: int,
    save_title: str,
) -> list[str]:
    """The save table (with fio's write and where each rank's save went) and one restore table
    per destination (with fio's cold read)."""
    lines = [
        save_title,
        "",
        *method_table(results, *saves, total),
        *limit_row(results, saves[0], FIO_WRITE, total),
        "",
        *profile_rows(results),
    ]
    for d in dests:
        lines += [
            f"**restore into {d}**",
            "",
            *method_table(results, f"{restores[0]} → {d}", f"{restores[1]} → {d}", total, restores),
            *limit_row(results, f"{restores[0]} → {d}", FIO_READ, total),
            "",
        ]
    return lines
