"""Launch: start the process group under `torchrun`, or start N local workers on 127.0.0.1.

Both paths meet in `run_worker`: it reads the variables `torchrun` sets (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), initialises the default process group
(Gloo on CPU, NCCL when CUDA is present) with a timeout that bounds every collective and
wait, runs the worker function, and tears the group down. Under `torchrun` a script calls
`run_worker(fn, ...)` itself; `launch_local` spawns the N processes, sets those same
variables for each, and waits for them.

`launch_local` never kills a worker the moment another one fails: survivors are given
`failure_grace` to notice the failure themselves (the pipeline's timeouts guarantee they
do) and report their own error, and only then are stragglers terminated. Each worker's
error comes back through a JSON file: its text (class, message, traceback) and the
qualified names of its class and bases, which callers route by (`WorkerFailedError.ranks_raising`),
never by parsing the text; nothing is pickled
except the spawn arguments, which is how `multiprocessing` starts a function. A worker
that a signal kills (native code calling abort) is reported with the signal's name and
whether its function had already returned, and prints every thread's Python stack.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import importlib
import json
import multiprocessing
import multiprocessing.connection
import os
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shardtrain.errors import LaunchError, WorkerFailedError, qualified_name
from shardtrain.workers import forkserver

__all__ = ["WorkerContext", "init_from_env", "attempt_prefix", "shutdown", "run_worker", "launch_local", "free_port"]

T = TypeVar("T")
#: The most bytes of a worker's error report read back (a traceback, not a log).
_MAX_REPORT = 1 << 20
_ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class WorkerContext:
    """Who this worker is and where its tensors live."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    timeout: timedelta


def init_from_env(*, timeout: timedelta = timedelta(seconds=300), backend: str | None = None) -> WorkerContext:
    """Initialise the default process group from torchrun's environment variables."""
    missing = [v for v in _ENV_VARS if v not in os.environ]
    if missing:
        raise LaunchError(
            f"missing launch environment variables {missing}; start workers with torchrun or shardtrain.launch_local"
        )
    try:
        rank, world, local = (int(os.environ[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        int(os.environ["MASTER_PORT"])
    except ValueError as exc:
        raise LaunchError(f"launch environment variables must be integers: {exc}") from exc
    if not (world >= 1 and 0 <= rank < world and local >= 0):
        raise LaunchError(f"invalid RANK={rank} / WORLD_SIZE={world} / LOCAL_RANK={local}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # An NCCL group also gets Gloo for host tensors: the step loss, the gradient norms and the
    # commit protocol's ids are CPU tensors, which NCCL's collectives refuse.
    spec = "cpu:gloo,cuda:nccl" if backend == "nccl" else backend
    if not dist.is_initialized():
        # Importing torch._dynamo while a group exists (torch 2.13 does it lazily, e.g. when
        # a torch optimizer is built) leaves a reference that keeps the group alive after
        # destroy_process_group: its Gloo threads then run into interpreter shutdown, and
        # one that takes the GIL there aborts the process ("terminate called without an
        # active exception"). Imported before the group, it holds none.
        importlib.import_module("torch._dynamo")
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            dist.init_process_group(spec, init_method="env://", rank=rank, world_size=world, timeout=timeout)
        else:
            # Under torchrun the workers' store outlives a failed attempt (the agent of node
            # rank 0 keeps one TCPStore for every rendezvous round); a restarted group that
            # read the previous attempt's Gloo addresses would connect to dead sockets. So
            # the group's keys go under a prefix that this attempt's workers agree on through
            # the store itself (`attempt_prefix`). TORCHELASTIC_RESTART_COUNT cannot serve:
            # each node's agent counts only its own workers' failures, so after one node's
            # worker dies (or a replacement node joins) the nodes hold different counts.
            use_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            base = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                world,
                is_master=not use_agent and rank == 0,
                timeout=timeout,
                multi_tenant=not use_agent,
            )
            store = dist.PrefixStore(attempt_prefix(base, rank, world, timeout), base)
            dist.init_process_group(spec, store=store, rank=rank, world_size=world, timeout=timeout)
    return WorkerContext(rank, world, local, backend, device, timeout)


def attempt_prefix(store: dist.Store, rank: int, world: int, timeout: timedelta, *, poll: float = 0.02) -> str:
    """A key prefix that every worker of this attempt shares and no earlier attempt used.

    The store may hold any keys of earlier attempts (their workers are gone: an agent
    stops its workers before it joins the next rendezvous round). So each worker r > 0
    announces a fresh random nonce under ``join/<r>`` and waits for ``welcome/<nonce>``,
    a key only this attempt's rank 0 can write, since no earlier process saw the nonce.
    Rank 0 draws a fresh generation token, welcomes whatever nonce ``join/<r>`` holds
    (a stale one is harmless: nobody waits on it) until every rank has acknowledged the
    token under ``ack/<token>/<r>``. Keys with a fresh name cannot be stale, so the
    workers meet whatever the nodes' restart counts are. LaunchError after ``timeout``.
    """
    root = f"shardtrain/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        token = secrets.token_hex(8)
        waiting = set(range(1, world))
        welcomed: dict[int, str] = {}
        while waiting:
            for r in sorted(waiting):
                if store.check([f"{root}/ack/{token}/{r}"]):
                    waiting.discard(r)
                elif store.check([f"{root}/join/{r}"]):
                    nonce = store.get(f"{root}/join/{r}").decode()
                    if welcomed.get(r) != nonce:
                        store.set(f"{root}/welcome/{nonce}", token)
                        welcomed[r] = nonce
            if waiting:
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"rank 0: ranks {sorted(waiting)} did not join this attempt's group within "
                        f"{timeout.total_seconds():.0f} s"
                    )
                time.sleep(poll)
    else:
        nonce = secrets.token_hex(16)
        store.set(f"{root}/join/{rank}", nonce)
        while not store.check([f"{root}/welcome/{nonce}"]):
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"rank {rank}: rank 0 of this attempt did not answer within {timeout.total_seconds():.0f} s"
                )
            time.sleep(poll)
        token = store.get(f"{root}/welcome/{nonce}").decode()
        store.set(f"{root}/ack/{token}/{rank}", nonce)
    return f"{root}/attempt/{token}"


def shutdown() -> None:
    """Destroy the default process group if there is one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def run_worker(
    fn: Callable[..., T], *args: Any, timeout: timedelta = timedelta(seconds=300), backend: str | None = None
) -> T:
    """`fn(ctx, *args)` inside an initialised process group (the torchrun entry)."""
    ctx = init_from_env(timeout=timeout, backend=backend)
    result = fn(ctx, *args)
    # Only a worker that finished tears the group down cleanly; one that raised leaves it to
    # process exit, since destroying a group whose peer is gone can block. The barrier keeps
    # one worker from tearing down Gloo pairs a peer is still using.
    if ctx.world_size > 1:
        try:
            dist.barrier()
        except Exception:  # a peer failed after this worker finished: its own error reports it
            return result
    shutdown()
    return result


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _environ(extra: Mapping[str, str]) -> Iterator[None]:
    """Temporarily set environment variables in this process (children inherit them)."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _child_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    backend: str | None,
    error_path: str,
    env: Mapping[str, str],
    streams: forkserver.StdStreams | None,
) -> None:
    forkserver.adopt(env, streams)  # what a spawned worker would have inherited
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    # A worker killed by a signal (an abort in native code, a segfault) leaves no Python
    # error to report; this prints every thread's Python stack to its stderr first.
    faulthandler.enable(all_threads=True)
    finished = error_path + ".finished"

    def work(ctx: WorkerContext, *a: Any) -> Any:
        result = fn(ctx, *a)
        Path(finished).touch()  # only the group's teardown is left
        return result

    try:
        run_worker(work, *args, timeout=timedelta(seconds=timeout_s), backend=backend)
    except BaseException as exc:  # report every failure to the launcher, then exit at once
        report = {
            "raised": [qualified_name(c) for c in type(exc).__mro__],  # what the launcher routes by
            "text": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
        }
        Path(error_path).write_text(json.dumps(report))
        os._exit(1)
    # Leave as a forked multiprocessing child does, without interpreter shutdown: the work is
    # done, its files are closed and the group is destroyed. Shutdown would only tear down
    # native objects; while a stray reference kept the group alive (see init_from_env) it
    # aborted a finished worker about once in 400 groups (tests/stress_teardown.py), and
    # nothing needs it here. Threads the function left running are still waited for.
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _read_report(path: str) -> tuple[str, tuple[str, ...]] | None:
    """A worker's error report (`_child_main` writes it): its text and the classes of what it
    raised; None where the worker left none (it died without raising)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.loads(f.read(_MAX_REPORT))
        return str(doc["text"]).strip(), tuple(str(c) for c in doc["raised"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its error report could not be read ({exc})", ()


def _describe_exit(code: int, finished: bool = False) -> str:
    """'exited with code 3', 'killed by SIGABRT (exit code -6)', and for a worker whose
    function had returned, 'finished its work, then ... while shutting down'."""
    how = f"exited with code {code}"
    if code < 0:
        with contextlib.suppress(ValueError):
            how = f"killed by {signal.Signals(-code).name} (exit code {code})"
    return f"finished its work, then {how} while shutting down" if finished else how


def launch_local(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    *,
    timeout: timedelta = timedelta(seconds=300),
    join_timeout: float = 900.0,
    failure_grace: float | None = None,
    env: Mapping[str, str] | None = None,
    backend: str | None = None,
) -> None:
    """Run `fn(ctx, *args)` in `world_size` fresh processes forming one process group.

    `fn` must be importable by module name (it is pickled by reference). Workers are forked
    from a server that imported torch once (`shardtrain.workers.forkserver`) when that gives them
    exactly what a spawned worker would get, else spawned. `env` is added to the workers'
    environment as if before they imported anything (for example `ATEN_CPU_CAPABILITY`).
    Raises `WorkerFailedError` naming every failed rank.
    """
    if world_size < 1:
        raise LaunchError(f"world_size must be >= 1, got {world_size}")
    grace = failure_grace if failure_grace is not None else 2 * timeout.total_seconds() + 10
    ctx = forkserver.context(env)
    child_env = forkserver.child_environment(env)
    streams = forkserver.StdStreams()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="shardtrain-launch-") as tmp:
        errors = [os.path.join(tmp, f"error-{rank}.txt") for rank in range(world_size)]
        procs = [
            ctx.Process(
                target=_child_main,
                name=f"shardtrain-worker-{rank}",
                args=(
                    fn,
                    args,
                    rank,
                    world_size,
                    port,
                    timeout.total_seconds(),
                    backend,
                    errors[rank],
                    child_env,
                    streams,
                ),
            )
            for rank in range(world_size)
        ]
        with _environ(dict(env or {})):
            for p in procs:
                p.start()
        deadline = time.monotonic() + join_timeout
        failures: dict[int, str] = {}
        raised: dict[int, tuple[str, ...]] = {}
        try:
            while any(p.exitcode is None for p in procs):
                now = time.monotonic()
                if now >= deadline:
                    break
                live = [p.sentinel for p in procs if p.exitcode is None]
                multiprocessing.connection.wait(live, timeout=min(1.0, deadline - now))
                if any(p.exitcode not in (None, 0) for p in procs):
                    deadline = min(deadline, time.monotonic() + grace)
        finally:
            for rank, p in enumerate(procs):
                if p.exitcode is None:
                    p.terminate()
                    p.join(5)
                    if p.exitcode is None:
                        p.kill()
                        p.join()
                    failures[rank] = f"terminated: did not finish in time (exit code {p.exitcode})"
                elif p.exitcode != 0:
                    report = _read_report(errors[rank])
                    if report is None:
                        failures[rank] = _describe_exit(p.exitcode, os.path.exists(errors[rank] + ".finished"))
                    else:
                        failures[rank], raised[rank] = report
        if failures:
            raise WorkerFailedError(failures, raised)
