"""Forkserver: start local workers by forking a process that has already imported torch.

A spawned worker is a fresh interpreter: it imports torch, torch.distributed and
torch._dynamo again (about 2-4 s of CPU on a small machine) before it runs a line of the
trainer, and a local group of N workers pays that N times. `multiprocessing`'s
*forkserver* start method instead forks each worker from one server process that imported
those modules once, so a group starts in milliseconds. The server never creates a process
group, a thread pool or a CUDA context, so a forked worker starts as clean as a spawned one.

What a spawned worker would see and a forked one must see too:

- **Environment.** A forkserver child inherits the *server's* environment, fixed when the
  server started. `child_environment()` captures the launcher's environment (plus the
  launch's extra variables) and `adopt()` installs it in the worker before the worker
  function runs, so everything read at run time is what spawn would give.
- **Import-time variables.** Some variables act only when torch is imported
  (`ATEN_CPU_CAPABILITY` picks the CPU kernels, hence the bits of every result; the
  `OMP_`/`MKL_` thread settings; `PYTHONHASHSEED`). Those cannot be changed after the
  fork, so `context()` uses the server only when the launch's values of every such variable
  equal the server's, and falls back to spawn otherwise (`RUN_TIME_VARIABLES` names the
  few under those prefixes that torch reads only when called, which `adopt()` covers). A
  server this module did not start (someone else's forkserver in the same process) is never
  trusted.
- **Standard streams.** A forked worker writes to the server's stdout/stderr, which were
  the launcher's at the time the server started (under pytest, a test's capture file).
  The launcher's current descriptors 1 and 2 are passed to each worker (`StdStreams`) and
  put in place by `adopt()`, so a worker's prints and faulthandler stacks land where a
  spawned worker's would.

`SHARDTRAIN_START_METHOD=spawn` turns the server off; platforms without the forkserver
method always spawn.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

__all__ = [
    "IMPORT_TIME_PREFIXES",
    "PRELOAD",
    "RUN_TIME_VARIABLES",
    "StdStreams",
    "adopt",
    "child_environment",
    "context",
    "start",
]

#: Variables whose effect is fixed when the interpreter starts or torch is imported.
IMPORT_TIME_PREFIXES = (
    "ATEN_",
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "OPENBLAS_",
    "TORCH_",
    "PYTORCH_",
    "PYTHON",
    "LD_",
    "CUDA_",
    "NCCL_",
)
#: Variables under those prefixes that torch reads when a function runs, not at import: a
#: forked worker sees the launcher's value through `adopt()` as a spawned one would, so a
#: difference never forces spawn. `PYTORCH_NVML_BASED_CUDA_CHECK` is read by each
#: `torch.cuda.is_available()` call, and importing lightning's fabric sets it in the
#: launcher's environment: counting it made every launch after that import spawn.
RUN_TIME_VARIABLES = frozenset({"PYTORCH_NVML_BASED_CUDA_CHECK"})
#: Modules the server imports once for every worker it forks.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "numpy", "msgspec", "blake3", "shardstore", "shardtrain")

_lock = threading.Lock()
_server_env: dict[str, str] | None = None  # the import-time variables the server started with


def _import_time(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and k not in RUN_TIME_VARIABLES}


def child_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a spawned worker of this launch would start with."""
    return {**os.environ, **(extra or {})}


def _enabled() -> bool:
    return (
        os.environ.get("SHARDTRAIN_START_METHOD", "forkserver") != "spawn"
        and "forkserver" in multiprocessing.get_all_start_methods()
    )


def start(env: Mapping[str, str] | None = None, preload: tuple[str, ...] = PRELOAD) -> bool:
    """Start the server now with `env`'s import-time variables; False if it cannot be used.

    Called by `context()` on a launch's first start; callers that spawn their own groups
    (tests) may call it early so that every later launch with the same import-time
    variables shares the server.
    """
    global _server_env
    if (
        not _enabled()
        or multiprocessing.parent_process() is not None
        or getattr(multiprocessing.current_process(), "_inheriting", False)
    ):
        return False  # a worker (or one still unpickling its target) never starts a server
    full = child_environment(env)
    with _lock:
        if _server_env is not None:
            return _server_env == _import_time(full)
        server = multiprocessing.forkserver._forkserver  # type: ignore[attr-defined]
        if getattr(server, "_forkserver_pid", None) is not None:
            return False  # someone else's server: its environment is unknown
        saved = dict(os.environ)
        try:
            os.environ.clear()
            os.environ.update(full)
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(list(preload))
            server.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _server_env = _import_time(full)
        return True


def context(env: Mapping[str, str] | None = None) -> multiprocessing.context.BaseContext:
    """The forkserver context when it gives a worker what spawn would, else spawn's."""
    if start(env):
        return multiprocessing.get_context("forkserver")
    return multiprocessing.get_context("spawn")


def _adopt_fd(fd: Any) -> int:
    return int(fd.detach())


class _InheritFd:
    """Pickles as a duplicate of descriptor `fd` in the child (forkserver or spawn)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_adopt_fd, (multiprocessing.reduction.DupFd(self.fd),))


class StdStreams:
    """The launcher's stdout and stderr, handed to a worker as descriptors."""

    def __init__(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed or odd stream: nothing buffered worth keeping
                pass
        self.fds: list[Any] = [_InheritFd(fd) if _is_open(fd) else None for fd in (1, 2)]


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def adopt(env: Mapping[str, str], streams: StdStreams | None) -> None:
    """In the worker: take the launcher's environment and standard streams."""
    os.environ.clear()
    os.environ.update(env)
    if streams is None:
        return
    for target, fd in zip((1, 2), streams.fds):
        if isinstance(fd, int) and fd != target:
            os.dup2(fd, target)
            os.close(fd)
