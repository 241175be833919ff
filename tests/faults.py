"""Fault-injecting storage for the reliability tests (tests/reliability/).

Four tools, each small enough to read in one sitting:

- ``OpLog``: a ``Storage`` wrapper that numbers every call the store makes (read, size,
  exists, write_once, swap, sync, delete, list, mtime), labels what each write carries
  (tensor/RNG/config object, shard manifest, commit manifest, ref, journal) and calls a
  hook *before* call k. ``kill_at(k)`` is the hook that SIGKILLs the process: crash points.
- ``FaultyOs``: a stand-in for the ``os`` module inside the local backend that numbers
  every system call the local backend makes (open, write, fsync, link, replace, unlink,
  makedirs, fstat, readv, scandir...) and, at call k, raises an ``OSError`` with a chosen
  errno or kills the process: SQLite-style I/O-error and crash injection one level below
  the Storage protocol.
- ``PowerLossStorage``: an in-memory backend with the local backend's durability contract
  (SPEC.md §Objects, §Refs): an object's bytes are fsynced before its name is linked, the
  name is durable only after ``sync()`` (the directory fsync); a ref update is durable
  when ``swap`` returns (rename + directory fsync). ``crash()`` returns the state a power
  cut leaves: each not-yet-durable name independently kept or lost; in ``weak`` mode
  (a filesystem that breaks the contract) kept names may also hold truncated or garbled
  bytes.
- ``S3FaultClient``: stands in front of the S3 backend's aiobotocore client and answers
  the k-th request with an injected error (500, 503, a timeout before or after the
  request reached the server, 412).
"""

from __future__ import annotations

import asyncio
import errno as errno_mod
import os
import random
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from shardstore.backends.base import Buffer, Storage
from shardstore.errors import ObjectNotFound, ObjectTooLarge, RefConflict

__all__ = [
    "OpLog",
    "kill_at",
    "label",
    "FaultyOs",
    "set_local_os",
    "patch_local_os",
    "LOCAL_OS_MODULES",
    "PowerCut",
    "PowerLossStorage",
    "S3FaultClient",
    "KILL",
]

KILL = "kill"


def die() -> None:
    """End this process at once, as a crash would (no finally blocks, no atexit, no flush)."""
    os.kill(os.getpid(), signal.SIGKILL)


def label(key: str, data: Buffer | None = None) -> str:
    """What a storage write carries, for op logs: the kind of object, or ref/journal/config."""
    if key.startswith("refs/"):
        return "ref"
    if key.startswith("journal/"):
        return "journal"
    if key == "config":
        return "store config"
    if key.startswith("objects/") and data is not None:
        head = bytes(memoryview(data).cast("B")[:4096])
        if head.startswith(b'{"algorithm"') and b'"type":"shard"' in bytes(data):
            return "shard manifest"
        if head.startswith(b'{"config"') and b'"type":"commit"' in bytes(data):
            return "commit manifest"
        return "object"
    return key.split("/", 1)[0]


class CountingStore:
    """Stands in for a Store on the restore path and records which objects are read."""

    def __init__(self, store: Any) -> None:
        self.store, self.read = store, []

    def read_into(self, oid: str, dest: Any, *, what: str) -> None:
        self.read.append(oid)
        self.store.read_into(oid, dest, what=what)

    def get_tensor(self, oid: str, dtype: str, shape: tuple[int, ...], *, what: str) -> Any:
        self.read.append(oid)
        return self.store.get_tensor(oid, dtype, shape, what=what)


class OpLog:
    """Forwards every Storage call to ``inner``, numbering them; ``hook(n, op, key)`` runs first."""

    def __init__(self, inner: Storage, hook: Callable[[int, str, str], None] | None = None) -> None:
        self.inner = inner
        self.url = inner.url
        self.hook = hook
        self.log: list[tuple[str, str, str]] = []  # (op, key, label)
        self._lock = threading.Lock()

    def _op(self, op: str, key: str, data: Buffer | None = None) -> None:
        with self._lock:
            n = len(self.log)
            self.log.append((op, key, label(key, data) if op in ("write_once", "swap") else ""))
        if self.hook is not None:
            self.hook(n, op, key)

    def read(self, key: str, limit: int | None = None) -> Buffer:
        self._op("read", key)
        return self.inner.read(key, limit)

    def size(self, key: str) -> int | None:
        self._op("size", key)
        return self.inner.size(key)

    def exists(self, key: str) -> bool:
        self._op("exists", key)
        return self.inner.exists(key)

    def write_once(self, key: str, data: Buffer) -> bool:
        self._op("write_once", key, data)
        return self.inner.write_once(key, data)

    def swap(self, key: str, expected: bytes | None, new: bytes) -> None:
        self._op("swap", key, new)
        self.inner.swap(key, expected, new)

    def delete(self, key: str) -> None:
        self._op("delete", key)
        self.inner.delete(key)

    def delete_if(self, key: str, expected: bytes) -> None:
        self._op("delete_if", key)
        self.inner.delete_if(key, expected)

    def list(self, prefix: str) -> Iterator[str]:
        self._op("list", prefix)
        return iter(list(self.inner.list(prefix)))

    def mtime(self, key: str) -> float | None:
        self._op("mtime", key)
        return self.inner.mtime(key)

    def sync(self) -> None:
        self._op("sync", "")
        self.inner.sync()


def kill_at(k: int, ops: tuple[str, ...] | None = None) -> Callable[[int, str, str], None]:
    """A hook that kills the process just before call number ``k`` (counting only ``ops`` if given)."""
    seen = [0]

    def hook(n: int, op: str, key: str) -> None:
        if ops is not None and op not in ops:
            return
        if seen[0] == k:
            die()
        seen[0] += 1

    return hook


# -- system-call level ----------------------------------------------------------------

#: The os functions LocalStorage calls that touch the disk; each call is one numbered point.
SYSCALLS = (
    "open",
    "write",
    "fsync",
    "close",
    "link",
    "replace",
    "rename",
    "unlink",
    "makedirs",
    "fstat",
    "lstat",
    "readv",
    "utime",
    "posix_fadvise",
)


#: Calls that need free space: a sticky ENOSPC keeps failing these (close, unlink, reads still work).
_SPACE = ("open:w", "write", "fsync", "link", "makedirs", "replace", "utime")


#: The modules whose ``os`` the local backend's system calls go through.
LOCAL_OS_MODULES = ("shardstore.backends.local", "shardstore.backends.posix")


def set_local_os(value: Any) -> list[Any]:
    """Make every module of ``LOCAL_OS_MODULES`` call ``value`` for ``os``; return what they had
    (pass it back to restore them: ``set_local_os(saved)`` with a list restores each in turn)."""
    import importlib

    mods = [importlib.import_module(m) for m in LOCAL_OS_MODULES]
    saved = [m.os for m in mods]
    for i, m in enumerate(mods):
        m.os = value[i] if isinstance(value, list) else value  # type: ignore[attr-defined]
    return saved


def patch_local_os(monkeypatch: Any, value: Any) -> None:
    """``set_local_os`` undone at the end of the test (pytest's monkeypatch)."""
    import importlib

    for m in LOCAL_OS_MODULES:
        monkeypatch.setattr(importlib.import_module(m), "os", value)


class FaultyOs:
    """Replaces the local backend's ``os`` (``set_local_os``): numbers calls of ``SYSCALLS``; at call ``at`` either
    raises ``OSError(err)`` (and, with ``sticky``, at every later call too, as a full disk
    does) or kills the process (``err == KILL``). ``os.path``, ``os.walk`` and the rest pass
    through, except that ``walk`` honours the same fault for the directory scan at ``at``."""

    def __init__(
        self,
        real: Any = os,
        at: int | None = None,
        err: int | str = errno_mod.EIO,
        sticky: bool = False,
        only: tuple[str, ...] | None = None,
        fsync: bool = True,
    ) -> None:
        self._real = real
        self._fsync = fsync
        self.at, self.err, self.sticky, self.only = at, err, sticky, only
        self.calls: list[str] = []
        self.walked: list[str] = []  # directories scanned by walk, in order
        self._lock = threading.Lock()
        self.path = real.path

    def _point(self, name: str) -> None:
        if self.only is not None and name not in self.only:
            return
        with self._lock:
            n = len(self.calls)
            self.calls.append(name)
        if self.at is None or n < self.at or (n > self.at and not (self.sticky and name in _SPACE)):
            return
        if self.err == KILL:
            die()
        raise OSError(self.err, f"{os.strerror(int(self.err))} (injected at {name} #{n})")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name not in SYSCALLS or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            flags = args[1] if name == "open" and len(args) > 1 else kwargs.get("flags", 0)
            self._point(
                name if name != "open" else ("open:w" if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) else "open:r")
            )
            if name == "fsync" and not self._fsync:
                return None  # a killed process loses nothing the page cache holds: skip the disk wait
            return attr(*args, **kwargs)

        return call

    def walk(self, top: str, topdown: bool = True, onerror: Any = None, followlinks: bool = False) -> Iterator[Any]:
        """``os.walk`` whose directory scans are numbered points: a fault at one behaves as
        ``os.walk`` does when ``scandir`` fails there (``onerror`` is called, or the directory
        is silently skipped)."""
        for entry in self._real.walk(top, topdown=topdown, followlinks=followlinks):
            self.walked.append(entry[0])
            try:
                self._point("scandir")
            except OSError as e:
                if onerror is not None:
                    onerror(e)
                entry[1][:] = []
                continue
            yield entry


# -- power loss -----------------------------------------------------------------------


class PowerCut(BaseException):
    """Raised inside a save to stop it where the power went (BaseException: nothing catches it)."""


class PowerLossStorage:
    """An in-memory backend with the local backend's durability contract (see the module
    docstring). ``cut_at``: raise ``PowerCut`` before durability-relevant step number
    ``cut_at`` (write_once, sync, delete, and the three steps of swap: lock, rename,
    directory fsync)."""

    def __init__(
        self, durable: dict[str, bytes] | None = None, *, cut_at: int | None = None, name: str = "power"
    ) -> None:
        self.url = f"powerloss://{name}"
        self.durable: dict[str, bytes] = dict(durable or {})
        self.visible: dict[str, bytes] = dict(self.durable)
        self.pending: list[tuple[str, str, bytes | None]] = []  # ("set"/"del", key, data) not yet durable
        self.cut_at = cut_at
        self.steps: list[tuple[str, str]] = []
        self._lock = threading.RLock()

    def _step(self, what: str, key: str) -> None:
        n = len(self.steps)
        self.steps.append((what, key))
        if self.cut_at is not None and n == self.cut_at:
            raise PowerCut(f"power cut before {what} {key} (step {n})")

    # reads see the running process's view
    def read(self, key: str, limit: int | None = None) -> Buffer:
        with self._lock:
            if key not in self.visible:
                raise ObjectNotFound(f"{key} is missing from store {self.url}")
            if limit is not None and len(self.visible[key]) > limit:
                raise ObjectTooLarge(
                    f"{key} in {self.url} is {len(self.visible[key])} bytes, over the limit of {limit}"
                )
            return self.visible[key]

    def size(self, key: str) -> int | None:
        with self._lock:
            return len(self.visible[key]) if key in self.visible else None

    def exists(self, key: str) -> bool:
        with self._lock:
            return key in self.visible

    def mtime(self, key: str) -> float | None:
        return 0.0 if self.exists(key) else None

    def list(self, prefix: str) -> Iterator[str]:
        with self._lock:
            return iter(sorted(k for k in self.visible if k.startswith(prefix + "/")))

    def write_once(self, key: str, data: Buffer) -> bool:
        with self._lock:
            self._step("write_once", key)
            if key in self.visible:
                return False
            raw = bytes(data)  # the file's bytes are fsynced before the name is linked
            self.visible[key] = raw
            self.pending.append(("set", key, raw))
            return True

    def delete(self, key: str) -> None:
        with self._lock:
            self._step("delete", key)
            if self.visible.pop(key, None) is not None:
                self.pending.append(("del", key, None))

    def sync(self) -> None:
        with self._lock:
            self._step("sync", "")
            self._persist()

    def _persist(self) -> None:
        for op, key, data in self.pending:
            if op == "set":
                self.durable[key] = data  # type: ignore[assignment]
            else:
                self.durable.pop(key, None)
        self.pending.clear()

    def swap(self, key: str, expected: bytes | None, new: bytes) -> None:
        with self._lock:
            lock = key + ".lock"
            self._step("swap:lock", key)
            if lock in self.visible:
                raise RefConflict(f"{key} is locked by another writer ({lock} exists)")
            self.visible[lock] = b""
            self.pending.append(("set", lock, b""))
            current = self.visible.get(key)
            if current != expected:
                del self.visible[lock]
                self.pending.append(("del", lock, None))
                raise RefConflict(f"{key}: expected {expected!r}, found {current!r}")
            self.visible[lock] = bytes(new)  # written and fsynced into the lock file
            self.pending.append(("set", lock, bytes(new)))
            self._step("swap:rename", key)
            del self.visible[lock]
            self.visible[key] = bytes(new)
            self.pending.append(("rename", key, bytes(new)))
            self._step("swap:fsync-dir", key)
            self._persist_rename(key)

    def delete_if(self, key: str, expected: bytes) -> None:
        with self._lock:
            self._step("delete_if", key)
            if key + ".lock" in self.visible:
                raise RefConflict(f"{key} is locked by another writer")
            current = self.visible.get(key)
            if current != expected:
                raise RefConflict(f"{key}: expected {expected!r}, found {current!r}")
            del self.visible[key]
            self.pending.append(("del", key, None))

    def _persist_rename(self, key: str) -> None:
        # the directory fsync makes the rename (and so everything before it in refs/) durable
        keep = []
        for op, k, data in self.pending:
            if k in (key, key + ".lock"):
                continue
            keep.append((op, k, data))
        self.durable[key] = self.visible[key]
        self.durable.pop(key + ".lock", None)
        self.pending = keep

    def crash(self, rng: random.Random, *, weak: bool = False) -> dict[str, bytes]:
        """The durable state a power cut now leaves. Each pending change to a name survives or
        not, independently (different directory entries persist independently); a rename is
        all-or-nothing. ``weak``: a kept new object may hold a prefix or garbled bytes."""
        with self._lock:
            state = dict(self.durable)
            for op, key, data in self.pending:
                if rng.random() < 0.5:
                    continue  # this change never reached the disk
                if op == "del":
                    state.pop(key, None)
                elif op == "rename":
                    state[key] = data  # type: ignore[assignment]
                    state.pop(key + ".lock", None)
                else:
                    raw = data or b""
                    if weak and key.startswith("objects/") and raw and rng.random() < 0.5:
                        if rng.random() < 0.5:
                            raw = raw[: rng.randrange(len(raw))]
                        else:
                            b = bytearray(raw)
                            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
                            raw = bytes(b)
                    state[key] = raw
            return state


# -- S3 -------------------------------------------------------------------------------


class S3FaultClient:
    """In front of the real aiobotocore client: request number ``at`` (counting only ``ops``
    if given) fails with ``fault``, or, for ``("after", exc)``, is sent and its answer lost.
    ``repeat``: that many consecutive requests fail (a persistent outage)."""

    def __init__(
        self, real: Any, at: int | None = None, fault: Any = None, repeat: int = 1, ops: tuple[str, ...] | None = None
    ) -> None:
        self.real, self.at, self.fault, self.repeat, self.ops = real, at, fault, repeat, ops
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.real, name)
        if (
            not asyncio.iscoroutinefunction(method)
            and not name.endswith("_object")
            and name
            not in (
                "list_objects_v2",
                "create_multipart_upload",
                "upload_part",
                "complete_multipart_upload",
                "abort_multipart_upload",
            )
        ):
            return method

        async def call(**kw: Any) -> Any:
            counted = self.ops is None or name in self.ops
            n = len(self.calls)
            if counted:
                self.calls.append(name)
            hit = counted and self.at is not None and self.at <= n < self.at + self.repeat
            if hit and not isinstance(self.fault, tuple):
                raise self.fault
            result = await method(**kw)
            if hit:
                raise self.fault[1]
            return result

        return call


# -- states to save and to compare against ---------------------------------------------


def frozen_slots(model: Any, opt: Any, split: int, *, rng: dict[str, bytes] | None = None) -> list[Any]:
    """Two slots' states (names[:split], names[split:]) with every tensor cloned, so later
    training does not change what a saved-later state holds."""
    import dataclasses

    import shardstore as ss

    names = [n for n, _ in model.named_parameters()]
    out = []
    for part in (names[:split], names[split:]):
        st = ss.capture(model, opt, names=part, rng=False)
        tensors = {n: t.detach().clone() for n, t in st.tensors.items()}
        params = {
            n: dataclasses.replace(
                p,
                exp_avg=None if p.exp_avg is None else p.exp_avg.clone(),
                exp_avg_sq=None if p.exp_avg_sq is None else p.exp_avg_sq.clone(),
            )
            for n, p in st.optim.params.items()
        }
        optim = dataclasses.replace(st.optim, params=params)
        out.append(ss.SlotState(tensors, optim, dict(rng or {})))
    return out


def snapshot(model: Any, opt: Any) -> dict[str, bytes]:
    """Every parameter's and moment's bytes and every Adam age, for bitwise comparison."""
    out: dict[str, bytes] = {}
    for n, p in model.named_parameters():
        out[n] = p.detach().numpy().tobytes()
        st = opt.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                out[f"{n}/{k}"] = st[k].numpy().tobytes()
        if "step" in st:
            out[f"{n}/step"] = str(float(st["step"])).encode()
    return out


def slots_snapshot(states: list[Any]) -> dict[str, bytes]:
    """The same map as ``snapshot`` for slot states about to be saved."""
    out: dict[str, bytes] = {}
    for s in states:
        for n, t in s.tensors.items():
            out[n] = t.numpy().tobytes()
            p = s.optim.params.get(n)
            if p is not None and p.exp_avg is not None:
                out[f"{n}/exp_avg"] = p.exp_avg.numpy().tobytes()
                out[f"{n}/exp_avg_sq"] = p.exp_avg_sq.numpy().tobytes()
                out[f"{n}/step"] = str(float(p.age)).encode()
    return out


def fast_dir(fallback: str) -> str:
    """A scratch directory on a RAM file system where there is one (``/dev/shm``): kill tests
    create and remove hundreds of small stores, and page-cache semantics are all a process
    kill can observe. Falls back to ``fallback``."""
    import tempfile

    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return tempfile.mkdtemp(prefix="shardstore-faults-", dir=shm)
    return tempfile.mkdtemp(prefix="shardstore-faults-", dir=fallback)


def forge_ref(store: Any, name: str, oid: str) -> None:
    """Point ref ``name`` at ``oid`` past the gc fence's presence check (``Store.set_ref`` refuses a
    missing commit): a store damaged on purpose, for the checkers that must report it."""
    from shardstore.store import ref_key

    store.storage.swap(ref_key(name), None, (oid + "\n").encode())
