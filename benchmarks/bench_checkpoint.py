"""Checkpoint save / restore / verify: shardstore against torch.save, safetensors and DCP, and the machine's limits.

One training state (parameters + AdamW moments) in two shapes: ``many`` (201 tensors of
10 MiB at ``--scale 1``; the scale sets their size, ``--params`` their number) and ``few`` (9 tensors
of ~228 MiB); ~2 GiB each at ``--scale 1``. Every method
runs in the same process, interleaved (each repetition runs every method once, in a
rotated order), and the tables give medians with min–max. Measured per repetition:

- limits: fsync'd sequential write of the whole state to one file (dd-like, one writer),
  cold sequential read of that file into the state's own (already touched) memory; the
  device's own figures from ``fio`` (when installed) at the benchmark's sizes: sequential
  write ending in fsync and cold sequential read (page cache dropped, fio's ``invalidate``),
  one job over one file of the whole state and 4 jobs over files of the state's tensor size;
  memcpy of the state into a touched buffer, BLAKE3 with 1 and 2 threads (max_threads=2
  per tensor, and two 1-thread hashers in a pool);
- save (fsync included for every method): ``shardstore.save``; ``torch.save`` + fsync;
  ``safetensors.torch.save_file`` + fsync; ``dcp.save`` default and with
  ``FileSystemWriter(thread_count=2)``; then shardstore's second save of the unchanged
  state (bytes passed to write(2) counted from /proc/self/io);
- restore from a cold page cache (``drop_caches`` when root; said otherwise) into the
  already-built model and optimizer: ``shardstore.restore`` (verifies every byte);
  ``torch.load(weights_only=True)`` + copy; ``load_file`` + copy; ``dcp.load`` in place.
  The state is zeroed before and its BLAKE3 digest checked after, outside the timing;
- verify (warm cache): ``shardstore.verify`` of the commit against BLAKE3 on the same bytes;
- async: the blocking part of ``shardstore.AsyncSaver.save`` (staging reused, as in a
  training loop; the first call is reported apart) and of ``dcp.async_save``, and the time
  until each is durable. The state is perturbed before each, so both write everything.

Every save's CPU time (user + system, all threads of this process) is reported beside its
wall time: on a CPU that training keeps busy, that is what a save pays for. Before the
first repetition each library saves and loads a tiny state once, untimed, so that no timed
run pays for loading modules. ``--busy N`` starts N processes that spin on the CPU for the
whole run (a checkpoint is usually written while training keeps the cores busy) and judges
saves against every peer at 1.0x instead of 1.2x; its tables go to their own block of
RESULTS.md. ``--methods`` runs a subset (shardstore is always run).

    python benchmarks/bench_checkpoint.py [--scale 1] [--reps 3] [--shapes many,few] [--busy 0]
        [--methods limits,fio,shardstore,torch,safetensors,dcp,async] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import blake3
import torch
from _fio import FIO, FIO_JOBS, fio_run
from _results import write_block

import shardstore as ss

__all__ = ["main"]

MIB = 1 << 20
GIB = 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- bench_checkpoint:begin -->", "<!-- bench_checkpoint:end -->"
SECTION = "## Checkpoint save / restore / verify"
BUSY_BEGIN, BUSY_END = "<!-- bench_checkpoint_busy:begin -->", "<!-- bench_checkpoint_busy:end -->"
BUSY_SECTION = "## Checkpoint save / restore / verify on a busy CPU (--busy)"
METHODS = ("limits", "fio", "shardstore", "torch", "safetensors", "dcp", "async")

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

# -- the training state ------------------------------------------------------------------


class Bag(torch.nn.Module):
    """Parameters only: the benchmark needs their bytes, not a forward pass."""

    def __init__(self, shapes: list[tuple[int, ...]], seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.params = torch.nn.ParameterList(
            torch.nn.Parameter(torch.empty(s).uniform_(-1, 1, generator=g)) for s in shapes
        )


def build_state(
    shape: str, scale: float, seed: int = 0, params: int = 67
) -> tuple[Bag, torch.optim.AdamW, dict[str, torch.Tensor], int]:
    """Model + AdamW with moments filled in (age 1), and the flat state dict the peers save."""
    if shape == "many":  # ~200 tensors: 67 parameters x (param, exp_avg, exp_avg_sq), 10 MiB each at scale 1
        shapes = [(max(1, round(2560 * scale)), 1024)] * params
    else:  # a few big tensors: 3 parameters of ~228 MiB each, x3 = 9 tensors
        rows = max(1, int(round(2 * GIB * scale / 9 / 4 / 4096)))
        shapes = [(rows, 4096)] * 3
    model = Bag(shapes, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed + 1)
    for p in model.parameters():
        opt.state[p] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.empty_like(p).uniform_(-1e-3, 1e-3, generator=g),
            "exp_avg_sq": torch.empty_like(p).uniform_(0, 1e-6, generator=g),
        }
    sd = flat_state(model, opt)
    return model, opt, sd, sum(t.numel() * t.element_size() for t in sd.values())


def flat_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """name -> tensor for parameters and both moments (the optimizer's own tensors, not copies)."""
    sd: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters():
        sd[n] = p.detach()
        sd[n + ".exp_avg"] = opt.state[p]["exp_avg"]
        sd[n + ".exp_avg_sq"] = opt.state[p]["exp_avg_sq"]
    return sd


def views(sd: dict[str, torch.Tensor]) -> list[memoryview]:
    return [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in sd.values()]


def digest(sd: dict[str, torch.Tensor]) -> str:
    h = blake3.blake3(max_threads=2)
    for v in views(sd):
        h.update(v)
    return h.hexdigest()


def perturb(sd: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for t in sd.values():
            t.mul_(1.0000001)  # every tensor changes: nothing deduplicates


# -- measuring ---------------------------------------------------------------------------


def can_drop() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


DROP = False


def cold() -> None:
    os.sync()
    if DROP:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> int:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return status("VmRSS")


def wchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


#: Not a first save into a new store: a training loop's next one, every tensor changed.
NEXT_SAVE = "shardstore.save, next step (every tensor changed, same store)"
#: The disk's own rate on the files restore reads: as many readers as restore's threads.
RESTORE_THREADS = 8
PARALLEL_READ = f"limit: cold parallel read of the same object files ({RESTORE_THREADS} threads, no hashing)"
_tls = threading.local()


def read_files(files: list[str], threads: int) -> None:
    """Read every file, ``threads`` at a time, in ``readv`` calls into a reused per-thread
    buffer (cache-hot: an upper bound for reading into tensors): one page first, then 1 MiB,
    the pattern of shardstore's local reads (a 1 MiB first read makes Linux fill the first
    2 MiB of each file with 4 KiB folios, which is slower: shardstore/local.py)."""

    def one(p: str) -> None:
        buf = getattr(_tls, "buf", None)
        if buf is None:
            buf = _tls.buf = memoryview(mmap.mmap(-1, MIB))
        fd = os.open(p, os.O_RDONLY)
        try:
            if os.readv(fd, [buf[:4096]]):
                while os.readv(fd, [buf]):
                    pass
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, files))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def cpu_seconds() -> float:
    """User + system CPU time of this process so far, every thread of it included."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def kernel_seconds() -> float:
    """System CPU time of this process so far: the kernel's share (copies into the page cache,
    file creation, writeback started from the process), every thread of it included."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


# -- a busy CPU ----------------------------------------------------------------------------

SPIN = "while True:\n    pass\n"


def spinners(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` processes that spin on the CPU until stopped (``stop``): training's load, without training."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]
    if procs:
        print(f"busy: {n} spinning, pids {','.join(str(p.pid) for p in procs)}", file=sys.stderr, flush=True)
    return procs


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def du(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            total += os.lstat(os.path.join(d, f)).st_size
    return total


# -- one repetition of each method -------------------------------------------------------


class Run:
    """Samples for one shape: ``samples[(op, method)] = [seconds, ...]``, plus notes."""

    def __init__(
        self, shape: str, model: Bag, opt: torch.optim.AdamW, sd: dict[str, torch.Tensor], nbytes: int, work: str
    ) -> None:
        self.shape, self.model, self.opt, self.sd, self.nbytes, self.work = shape, model, opt, sd, nbytes, work
        self.samples: dict[tuple[str, str], list[float]] = {}
        self.notes: dict[str, list[float]] = {}
        self.ref = digest(sd)
        self.saver: Any = None
        self.buf = torch.empty(nbytes + 64 * len(sd), dtype=torch.uint8)
        self.buf.fill_(1)  # touched once: memcpy into already-touched memory

    def add(self, op: str, method: str, seconds: float) -> None:
        self.samples.setdefault((op, method), []).append(seconds)

    def saved(self, method: str, fn: Callable[[], Any]) -> Any:
        """Run one save: its wall time under ``save``, its CPU time under ``save CPU`` and the
        kernel's part of that under ``save CPU, kernel``."""
        c, k = cpu_seconds(), kernel_seconds()
        dt, out = timed(fn)
        self.add("save CPU", method, cpu_seconds() - c)
        self.add("save CPU, kernel", method, kernel_seconds() - k)
        self.add("save", method, dt)
        return out

    def note(self, key: str, value: float) -> None:
        self.notes.setdefault(key, []).append(value)

    def zero(self) -> None:
        with torch.no_grad():
            for t in self.sd.values():
                t.zero_()

    def check(self, method: str) -> None:
        got = digest(self.sd)
        if got != self.ref:
            raise SystemExit(f"{method}: restored state differs from the saved one")

    def path(self, name: str) -> str:
        p = os.path.join(self.work, name)
        shutil.rmtree(p, ignore_errors=True)
        if os.path.exists(p):
            os.unlink(p)
        return p

    def memcpy(self) -> None:
        """The state copied into one already-touched buffer (torch's copy, as a stager would)."""
        off = 0
        with torch.no_grad():
            for t in self.sd.values():
                n = t.numel() * t.element_size()
                self.buf[off : off + n].copy_(t.reshape(-1).view(torch.uint8))
                off += (n + 63) // 64 * 64

    # limits
    def limits(self) -> None:
        vs = views(self.sd)
        dt, _ = timed(lambda: [blake3.blake3(v, max_threads=1).digest() for v in vs])
        self.add("hash", "BLAKE3, 1 thread", dt)
        dt, _ = timed(lambda: [blake3.blake3(v, max_threads=2).digest() for v in vs])
        self.add("hash", "BLAKE3, max_threads=2", dt)
        with ThreadPoolExecutor(2) as pool:
            dt, _ = timed(lambda: list(pool.map(lambda v: blake3.blake3(v, max_threads=1).digest(), vs)))
        self.add("hash", "BLAKE3, 2 x 1-thread pool", dt)

        dt, _ = timed(self.memcpy)
        self.add("memcpy", "memcpy into touched memory", dt)

        path = self.path("dd.bin")
        os.sync()

        def write() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            for v in vs:
                o = 0
                while o < len(v):
                    o += os.write(fd, v[o : o + 64 * MIB])
            os.fsync(fd)
            os.close(fd)

        dt, _ = timed(write)
        self.add("save", "limit: fsync'd sequential write", dt)
        cold()

        def read() -> None:
            fd = os.open(path, os.O_RDONLY)
            for v in vs:
                o = 0
                while o < len(v):
                    o += os.readv(fd, [v[o : o + 64 * MIB]])
            os.close(fd)

        dt, _ = timed(read)
        self.add("restore", "limit: cold sequential read", dt)
        os.unlink(path)

    def fio(self) -> None:
        """The device's own figures from fio, at this state's total size: one job over one file
        and ``FIO_JOBS`` jobs over files of the state's tensor size (``nrfiles`` each, visited in
        order); writes end in fsync (fio counts it in the job's runtime) and reads start cold."""
        if FIO is None:
            return
        each = max(1, self.nbytes // len(self.sd))
        for jobs, files in ((1, 1), (FIO_JOBS, max(1, len(self.sd) // FIO_JOBS))):
            size = self.nbytes // jobs
            label = f"{jobs} job, 1 file" if jobs == 1 else f"{jobs} jobs, {files} files of {each / MIB:.1f} MiB each"
            d = self.path(f"fio-{jobs}")
            os.makedirs(d)
            os.sync()
            self.add("save", f"limit: fio sequential write + fsync ({label})", fio_run(d, "write", jobs, size, files))
            cold()
            self.add("restore", f"limit: fio cold sequential read ({label})", fio_run(d, "read", jobs, size, files))
            shutil.rmtree(d)

    # shardstore
    def shardstore(self) -> None:
        path = self.path("ss")
        store = ss.open_store(path)
        os.sync()
        base = reset_peak()
        self.saved("shardstore.save", lambda: ss.save(store, self.model, self.opt, step=1, rng=False))
        self.note("save peak added / state", (status("VmHWM") - base) / self.nbytes)
        before_w, before_du = wchar(), du(os.path.join(path, "objects"))
        dt, cid2 = timed(lambda: ss.save(store, self.model, self.opt, step=2, rng=False))
        self.note("second save: bytes passed to write(2)", wchar() - before_w)
        self.note("second save: bytes added under objects/", du(os.path.join(path, "objects")) - before_du)
        self.add("second save", "shardstore.save, unchanged state", dt)
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(path, "objects")) for f in fs)
        cold()
        dt, _ = timed(lambda: read_files(files, RESTORE_THREADS))
        self.add("restore", PARALLEL_READ, dt)
        self.zero()
        cold()
        base = reset_peak()
        dt, _ = timed(lambda: ss.restore(store, cid2, self.model, self.opt, threads=RESTORE_THREADS))
        self.note("restore peak added / state", (status("VmHWM") - base) / self.nbytes)
        self.add("restore", "shardstore.restore (verifies every byte)", dt)
        self.sd = flat_state(self.model, self.opt)  # an older restore installs new moment tensors
        self.check("shardstore.restore")
        dt, rep = timed(lambda: ss.verify(store, [cid2]))
        if not rep.ok:
            raise SystemExit(f"verify found problems: {rep.problems[:3]}")
        self.add("verify", "shardstore.verify (deep, warm)", dt)
        vs = views(self.sd)  # the limit measured right after, so that both see the same machine load
        with ThreadPoolExecutor(2) as pool:
            dt, _ = timed(lambda: list(pool.map(lambda v: blake3.blake3(v, max_threads=1).digest(), vs)))
        self.add("verify", "limit: BLAKE3 2 x 1-thread pool on the same bytes", dt)
        dt, _ = timed(lambda: [blake3.blake3(v, max_threads=2).digest() for v in vs])
        self.add("verify", "limit: BLAKE3 max_threads=2 on the same bytes", dt)
        # a training loop's next checkpoint: every tensor changed, into the store that holds the last one
        perturb(self.sd)
        os.sync()
        self.saved(NEXT_SAVE, lambda: ss.save(store, self.model, self.opt, step=3, rng=False))
        self.ref = digest(self.sd)
        shutil.rmtree(path)

    def torch_save(self) -> None:
        path = self.path("torch.pt")
        os.sync()

        def save() -> None:
            with open(path, "wb") as f:
                torch.save(self.sd, f)
                f.flush()
                os.fsync(f.fileno())

        self.saved("torch.save + fsync", save)
        self.zero()
        cold()

        def load() -> None:
            got = torch.load(path, weights_only=True)
            with torch.no_grad():
                for k, t in self.sd.items():
                    t.copy_(got[k])

        dt, _ = timed(load)
        self.add("restore", "torch.load(weights_only) + copy", dt)
        self.check("torch.load")
        os.unlink(path)

    def safetensors(self) -> None:
        from safetensors.torch import load_file, save_file

        path = self.path("model.safetensors")
        os.sync()

        def save() -> None:
            save_file(self.sd, path)
            fsync_path(path)

        self.saved("safetensors save_file + fsync", save)
        self.zero()
        cold()

        def load() -> None:
            got = load_file(path)
            with torch.no_grad():
                for k, t in self.sd.items():
                    t.copy_(got[k])

        dt, _ = timed(load)
        self.add("restore", "safetensors load_file + copy", dt)
        self.check("safetensors")
        os.unlink(path)

    def dcp(self) -> None:
        import torch.distributed.checkpoint as dcp

        path = self.path("dcp")
        os.sync()
        self.saved("dcp.save (default)", lambda: dcp.save(self.sd, checkpoint_id=path))
        self.zero()
        cold()
        dt, _ = timed(lambda: dcp.load(self.sd, checkpoint_id=path))
        self.add("restore", "dcp.load", dt)
        self.check("dcp.load")
        shutil.rmtree(path)
        path = self.path("dcp2")
        os.sync()
        self.saved(
            "dcp.save FileSystemWriter(thread_count=2)",
            lambda: dcp.save(self.sd, storage_writer=dcp.FileSystemWriter(path, thread_count=2)),
        )
        shutil.rmtree(path)

    def async_saves(self) -> None:
        import torch.distributed.checkpoint as dcp

        if not hasattr(ss, "AsyncSaver"):  # an older shardstore (baseline runs)
            return
        # shardstore: the saver (and its staging arena) lives across repetitions, as in training
        perturb(self.sd)
        path = self.path("ss-async")
        store = ss.open_store(path)
        if self.saver is None:
            self.saver = ss.AsyncSaver(store)
            dt, _ = timed(lambda: self.saver.save(self.model, self.opt, step=1, rng=False))
            self.note("AsyncSaver first call (allocates staging), s", dt)
            self.saver.wait()
            shutil.rmtree(path)
            perturb(self.sd)
            store = ss.open_store(path)
        self.saver.store = store
        os.sync()
        t0 = time.perf_counter()
        self.saver.save(self.model, self.opt, step=1, rng=False)
        t1 = time.perf_counter()
        self.saver.wait()
        t2 = time.perf_counter()
        self.add("async blocking", "shardstore.AsyncSaver.save", t1 - t0)
        self.add("async total", "shardstore.AsyncSaver.save + wait", t2 - t0)
        dt, _ = timed(self.memcpy)  # paired with the measurement above (same machine load)
        self.add("async blocking", "limit: memcpy of the state", dt)
        shutil.rmtree(path)

        perturb(self.sd)
        path = self.path("dcp-async")
        os.sync()
        t0 = time.perf_counter()
        fut = dcp.async_save(self.sd, checkpoint_id=path)
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        self.add("async blocking", "dcp.async_save", t1 - t0)
        self.add("async total", "dcp.async_save + result()", t2 - t0)
        shutil.rmtree(path)
        self.ref = digest(self.sd)


def warm_up(work: str) -> None:
    """Each library saves and loads a tiny state once, untimed: the first call of each loads
    modules (about 0.5 s for shardstore.save on a busy CPU), which no training loop pays at
    every checkpoint."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    model, opt, sd, _ = build_state("many", 0.0001, params=1)
    d = tempfile.mkdtemp(prefix="warm-", dir=work)
    try:
        store = ss.open_store(os.path.join(d, "ss"))
        cid = ss.save(store, model, opt, step=1, rng=False)
        ss.restore(store, cid, model, opt)
        ss.verify(store, [cid])
        torch.save(sd, os.path.join(d, "t.pt"))
        torch.load(os.path.join(d, "t.pt"), weights_only=True)
        save_file(sd, os.path.join(d, "s.safetensors"))
        load_file(os.path.join(d, "s.safetensors"))
        dcp.save(sd, checkpoint_id=os.path.join(d, "dcp"))
        dcp.load(sd, checkpoint_id=os.path.join(d, "dcp"))
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -- reporting ---------------------------------------------------------------------------


def fmt_rate(nbytes: int, secs: list[float]) -> str:
    rates = sorted(nbytes / s / 1e9 for s in secs)
    return f"{statistics.median(rates):.2f} ({rates[0]:.2f}–{rates[-1]:.2f})"


def table(run: Run, op: str, ours: str, rate: bool = True) -> list[str]:
    rows = [(m, s) for (o, m), s in run.samples.items() if o == op]
    if (op, ours) not in run.samples:
        return []
    mine = statistics.median(run.samples[(op, ours)])
    head = (
        "| method | median s (min–max) | GB/s median (min–max) | shardstore ÷ method (time ratio⁻¹) |"
        if rate
        else "| method | median s (min–max) | shardstore ÷ method |"
    )
    out = [f"**{op}** — {run.shape}", "", head, "|---|---|---|---|" if rate else "|---|---|---|"]
    for m, s in rows:
        med = statistics.median(s)
        secs = f"{med:.3f} ({min(s):.3f}–{max(s):.3f})"
        ratio = med / mine  # >1: shardstore is faster / blocks less
        if rate:
            out.append(f"| {m} | {secs} | {fmt_rate(run.nbytes, s)} | {ratio:.2f} |")
        else:
            out.append(f"| {m} | {secs} | {ratio:.2f} |")
    return out + [""]


def med(run: Run, op: str, m: str) -> float:
    s = run.samples.get((op, m))
    return statistics.median(s) if s else float("nan")


def targets(run: Run) -> list[str]:
    """Each target of issue 7 as a ratio of medians from this run."""

    def r(op: str, a: str, b: str) -> float:  # speed of a relative to b
        return med(run, op, b) / med(run, op, a)

    save = "shardstore.save"
    rows = [
        ("save ≥ 0.8× fsync'd sequential write", r("save", save, "limit: fsync'd sequential write"), 0.8),
        ("save ≥ 1.5× dcp.save default", r("save", save, "dcp.save (default)"), 1.5),
        ("save ≥ 1.0× dcp.save thread_count=2", r("save", save, "dcp.save FileSystemWriter(thread_count=2)"), 1.0),
        (
            "second save ≤ 0.5× first save (time)",
            med(run, "second save", "shardstore.save, unchanged state") / med(run, "save", save),
            -0.5,
        ),
        (
            "async blocking ≤ 1.5× memcpy (time)",
            med(run, "async blocking", "shardstore.AsyncSaver.save")
            / med(run, "async blocking", "limit: memcpy of the state"),
            -1.5,
        ),
        (
            "async blocking ≤ dcp.async_save's (time)",
            med(run, "async blocking", "shardstore.AsyncSaver.save") / med(run, "async blocking", "dcp.async_save"),
            -1.0,
        ),
        (
            "restore ≥ 0.7× cold sequential read",
            r("restore", "shardstore.restore (verifies every byte)", "limit: cold sequential read"),
            0.7,
        ),
        (
            "restore ≥ 1.0× safetensors load_file + copy",
            r("restore", "shardstore.restore (verifies every byte)", "safetensors load_file + copy"),
            1.0,
        ),
        ("restore ≥ 1.5× dcp.load", r("restore", "shardstore.restore (verifies every byte)", "dcp.load"), 1.5),
        (
            "(not a target) restore ÷ the disk's parallel read of its files",
            r("restore", "shardstore.restore (verifies every byte)", PARALLEL_READ),
            0.0,
        ),
        (
            "verify ≥ 0.8× BLAKE3 max_threads=2",
            r("verify", "shardstore.verify (deep, warm)", "limit: BLAKE3 max_threads=2 on the same bytes"),
            0.8,
        ),
        (
            "verify ≥ 0.8× BLAKE3 2 x 1-thread pool",
            r("verify", "shardstore.verify (deep, warm)", "limit: BLAKE3 2 x 1-thread pool on the same bytes"),
            0.8,
        ),
    ]
    out = [f"**targets** — {run.shape}", "", "| target | measured | met |", "|---|---|---|"]
    for name, value, want in rows:
        if value != value:  # NaN: not measured in this run
            continue
        ok = value <= -want if want < 0 else value >= want
        out.append(f"| {name} | {value:.2f}× | {'—' if want == 0 else 'yes' if ok else 'NO'} |")
    w = run.notes["second save: bytes passed to write(2)"]
    d = run.notes["second save: bytes added under objects/"]
    out.append(
        f"| second save writes 0 tensor bytes | write(2) {int(statistics.median(w))} B, objects/ +{int(statistics.median(d))} B (manifests only) | {'yes' if max(d) < 1 * MIB else 'NO'} |"
    )
    peak = run.notes["save peak added / state"]
    out.append(
        f"| save peak memory ≤ state + 10% | +{100 * max(peak):.1f}% of the state (max over runs) | {'yes' if max(peak) <= 0.10 else 'NO'} |"
    )
    return out + [""]


SAVE_PEERS = [
    "torch.save + fsync",
    "safetensors save_file + fsync",
    "dcp.save (default)",
    "dcp.save FileSystemWriter(thread_count=2)",
]
RESTORE_PEERS = ["torch.load(weights_only) + copy", "safetensors load_file + copy", "dcp.load"]


def run_targets(run: Run, want: float = 1.2) -> list[str]:
    """Issue 26's targets, judged run by run (not on medians): in every repetition shardstore
    is at least ``want`` (1.2; issue 33's busy CPU: 1.0) times as fast as every peer, and at
    least 0.8x as fast as the best of fio's figures measured in that same repetition."""
    out = [
        f"**targets, run by run** — {run.shape}",
        "",
        "| target | worst run (ratio, peer) | per-run ratios against that peer | met |",
        "|---|---|---|---|",
    ]
    profile = [
        f"**each method's speed ÷ fio's best in the same run** — {run.shape} (where a peer is within "
        "1.2× of the device, beating it by 1.2× would mean writing or reading faster than the device)",
        "",
        "| op | method | per-run ratios | median |",
        "|---|---|---|---|",
    ]
    for op, ours, peers in (
        ("save", "shardstore.save", SAVE_PEERS),
        ("restore", "shardstore.restore (verifies every byte)", RESTORE_PEERS),
    ):
        mine = run.samples.get((op, ours))
        if not mine:
            continue
        worst = None
        for peer in peers:
            theirs = run.samples.get((op, peer))
            if theirs:
                ratios = [t / m for t, m in zip(theirs, mine)]
                if worst is None or min(ratios) < min(worst[1]):
                    worst = (peer, ratios)
        if worst:
            peer, ratios = worst
            out.append(
                f"| {op} ≥ {want:.1f}× every peer in every run | {min(ratios):.2f}×, {peer} | "
                f"{', '.join(f'{r:.2f}' for r in ratios)} | {'yes' if min(ratios) >= want else 'NO'} |"
            )
        nxt = run.samples.get((op, NEXT_SAVE))
        ran = [p for p in peers if (op, p) in run.samples] if nxt else []
        if nxt and ran:
            ratios, peer = min(
                (([t / m for t, m in zip(run.samples[(op, p)], nxt)], p) for p in ran), key=lambda rp: min(rp[0])
            )
            out.append(
                f"| (not a target) next save, same store, against every peer | {min(ratios):.2f}×, {peer} | "
                f"{', '.join(f'{r:.2f}' for r in ratios)} | — |"
            )
        fio = [v for (o, m), v in run.samples.items() if o == op and m.startswith("limit: fio")]
        if fio:
            best = [min(col) for col in zip(*fio)]  # the fastest fio figure of each repetition
            ratios = [b / m for b, m in zip(best, mine)]
            out.append(
                f"| {op} ≥ 0.8× fio's best in the same run | {min(ratios):.2f}× | "
                f"{', '.join(f'{r:.2f}' for r in ratios)} | {'yes' if min(ratios) >= 0.8 else 'NO'} |"
            )
            for method in [ours, *peers]:
                theirs = run.samples.get((op, method))
                if theirs:
                    rs = [b / t for b, t in zip(best, theirs)]
                    profile.append(
                        f"| {op} | {method} | {', '.join(f'{r:.2f}' for r in rs)} | {statistics.median(rs):.2f} |"
                    )
    return out + [""] + (profile + [""] if len(profile) > 4 else [])


def versions() -> str:
    import numpy
    import safetensors

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "shardstore", "benchmarks/bench_checkpoint.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        commit, dirty = "?", ""
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return (
        f"commit {commit}{' (shardstore or this script modified)' if dirty else ''}; {os.cpu_count()} cores ({cpu}), "
        f"{ram:.1f} GiB RAM, Linux {platform.release()}; Python {platform.python_version()}, torch {torch.__version__}, "
        f"safetensors {safetensors.__version__}, blake3 {blake3.__version__}, numpy {numpy.__version__}, shardstore {ss.__version__}"
    )


def main(argv: list[str] | None = None) -> int:
    global DROP
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the ~2 GiB state (e.g. 0.1)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shapes", default="many,few")
    ap.add_argument(
        "--params", type=int, default=67, help="parameters of the 'many' shape (x3 tensors with the moments)"
    )
    ap.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU for the whole run")
    ap.add_argument("--methods", default=",".join(METHODS), help="which methods to run (shardstore always runs)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir beside the repository)")
    ap.add_argument("--results", default=None, help="write the tables into this RESULTS.md")
    ap.add_argument("--warm", action="store_true", help="never drop the page cache, even as root (smoke runs)")
    args = ap.parse_args(argv)
    chosen = {m.strip() for m in args.methods.split(",") if m.strip()} | {"shardstore"}
    if chosen - set(METHODS) or args.busy < 0:
        ap.error(f"--methods takes {','.join(METHODS)}; --busy takes a count >= 0")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    DROP = not args.warm and can_drop()
    work = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir or os.path.dirname(ROOT))
    command = f"--scale {args.scale} --reps {args.reps} --shapes {args.shapes} --params {args.params}"
    if args.busy:
        command += f" --busy {args.busy}"
    if chosen != set(METHODS):
        command += f" --methods {','.join(m for m in METHODS if m in chosen)}"
    lines = [
        f"`python benchmarks/bench_checkpoint.py {command}`",
        "",
        versions() + ".",
        "",
        "Page cache before each restore: "
        + (
            "dropped (`echo 3 > /proc/sys/vm/drop_caches`, as root)."
            if DROP
            else ("NOT dropped (--warm)" if args.warm else "NOT dropped (not root)") + ": restores read warm pages."
        ),
        "Ratios are shardstore's speed over the row's (above 1: shardstore faster, or blocks less); medians of "
        f"{args.reps} interleaved runs, min–max in brackets.",
    ]
    head = len(lines)
    loads = [f"start {load_average()}"]
    spinning = spinners(args.busy)
    try:
        warm_up(work)
        for shape in args.shapes.split(","):
            model, opt, sd, nbytes = build_state(shape, args.scale, params=args.params)
            run = Run(shape, model, opt, sd, nbytes, work)
            methods = [
                m
                for name, m in zip(
                    METHODS,
                    [run.limits, run.fio, run.shardstore, run.torch_save, run.safetensors, run.dcp, run.async_saves],
                )
                if name in chosen
            ]
            for rep in range(args.reps):
                loads.append(f"{shape} rep {rep + 1} {load_average()}")
                k = rep % len(methods)
                for m in methods[k:] + methods[:k]:
                    print(f"[{shape} rep {rep + 1}/{args.reps}] {m.__name__}", file=sys.stderr, flush=True)
                    m()
            if run.saver is not None:
                run.saver.close()
            lines += [
                "",
                f"### {shape}: {len(sd)} tensors, {nbytes / GIB:.2f} GiB ({nbytes / len(sd) / MIB:.1f} MiB each)",
                "",
            ]
            for op, ours, rate in [
                ("save", "shardstore.save", True),
                ("save CPU", "shardstore.save", False),
                ("save CPU, kernel", "shardstore.save", False),
                ("second save", "shardstore.save, unchanged state", True),
                ("restore", "shardstore.restore (verifies every byte)", True),
                ("verify", "shardstore.verify (deep, warm)", True),
                ("async blocking", "shardstore.AsyncSaver.save", False),
                ("async total", "shardstore.AsyncSaver.save + wait", False),
                ("hash", "BLAKE3, max_threads=2", True),
            ]:
                lines += table(run, op, ours, rate)
            lines += targets(run)
            lines += run_targets(run, want=1.0 if args.busy else 1.2)
            notes = ", ".join(f"{k}: {statistics.median(v):.3g}" for k, v in run.notes.items())
            lines += [f"Notes (medians): {notes}.", ""]
            del model, opt, sd, run
    finally:
        loads.append(f"end {load_average()}")
        stop(spinning)
        shutil.rmtree(work, ignore_errors=True)
    cpu = (
        f"CPU: busy, {args.busy} process{'es' if args.busy > 1 else ''} spinning on it for the whole run (`--busy`)"
        if args.busy
        else "CPU: not loaded by this script"
    )
    lines[head:head] = [
        f"{cpu}; {os.cpu_count()} cores; load average (1/5/15 min): {', '.join(loads)}.",
        "`save CPU` rows: CPU seconds (user + system, every thread of this process) during each save; "
        "their ratio is the method's over shardstore's (above 1: shardstore uses less). `save CPU, kernel`: "
        "the system part alone (copies into the page cache, file creation).",
    ]
    text = "\n".join(lines)
    print(text)
    if args.results:
        if args.busy:
            write_block(args.results, BUSY_BEGIN, BUSY_END, BUSY_SECTION, text)
        else:
            write_block(args.results, BEGIN, END, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
