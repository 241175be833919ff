"""The local directory backend of the storage protocol (SPEC.md §Objects, §Refs, §Storage backends).

``LocalStorage`` works through ``os`` directly, because fsspec's local filesystem has no
fsync, no create-only link and no mmap. Objects are written to ``tmp/`` (writeback
started per chunk), fsynced as a batch, then hard-linked into place (``link`` fails if the
name exists, which makes writes create-only and concurrent writers of one object safe),
and the batch's directories fsynced. A batched write's tmp file is unnamed (``O_TMPFILE``,
linked through its descriptor) where the file system has them, up to ``_UnnamedFiles``'
bound of open descriptors, else a named file in ``tmp/``; a single ``write_once``'s directories are fsynced in
``sync()``. A copy writes an object it receives piece by piece into its tmp file as the pieces
arrive (``open_write``: ``_TmpWrite``), to be linked by the same ``end_writes``. A write that finds its object present refreshes the
object's modification time, so gc's grace period protects objects a save in progress
deduplicated against. Refs move by a lock file (``ref_locks``) renamed over the ref. No path
component under the root may be a symbolic link. Reads land in memory of their own, hashed
chunk by chunk as they arrive (never a live mapping that a rewrite or truncation of the file
could change or fault after hashing); restores read straight into the destination tensors.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import InvalidName, ObjectNotFound, ObjectTooLarge, RefConflict, StorageError
from ..format.names import check_key
from .base import Buffer, show_ref_value
from .posix import (
    FIRST_READ,
    READ_CHUNK,
    READ_FLAGS,
    close_quietly,
    freshen,
    fsync_dir,
    read_ahead,
    read_exact,
    start_writeback,
    unlink_quietly,
)
from .ref_locks import break_lock, take_lock

__all__ = ["LocalStorage"]
_CHUNK = 8 << 20
_PARALLEL_CHUNK = 16 << 20  # one multi-threaded hasher's read: enough for both of its threads
#: Directories fsynced at once by ``sync``. A save's objects land in up to 256 ``objects/xx``
#: directories, each fsynced at the barrier: one after another that took 1.1-1.7 s on the
#: development VM (a cache flush each), 8 at a time 0.04-0.11 s, the device merging the
#: flushes that arrive together (benchmarks/RESULTS.md, "busy CPU").
_SYNC_THREADS = 8
#: Per-thread reusable buffers for ``hash_object`` (bounded: one chunk per thread).
_tls = threading.local()
#: The start of the token that stands for an unnamed tmp file in a batch's pending list (never a
#: file name: ``secrets.token_hex`` names are hex digits only).
_UNNAMED = ".unnamed-"


class _UnnamedFiles:
    """The unnamed tmp files (``O_TMPFILE``) of this process's batched writes, from their write to
    their batch's link or discard: token -> open descriptor.

    An unnamed file has no entry in ``tmp/``: creating it and letting it go are no operations on
    that directory (which every writer of the store shares, one lock for all), its fsync and its
    link go through the descriptor (no path lookups), and an interrupted write leaves nothing
    behind. It costs a descriptor held until the batch ends, so at most ``cap`` are open at
    once, in the whole process (a quarter of its descriptor limit, at most 1024); past that a
    write takes a named tmp file, as in a ``tmp/`` where unnamed files cannot be made or linked
    (found once per directory by a probe: NFS has none, a ``/proc`` that hides descriptors
    cannot link them)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: dict[str, int] = {}
        self.serial = 0
        self.cap = _descriptor_share() if hasattr(os, "O_TMPFILE") else 0
        self.usable: dict[str, bool] = {}  # tmp directory -> whether unnamed files work there

    def create(self, tmpdir: str) -> tuple[str, int] | None:
        """(token, descriptor) of a new unnamed file in ``tmpdir``; None when at the bound or
        where they do not work. FileNotFoundError if ``tmpdir`` is missing, as for a named file."""
        with self.lock:
            usable = self.usable.get(tmpdir)  # read once, with the place taken: the answer this write follows
            if len(self.open) >= self.cap or usable is False:
                return None
            self.serial += 1
            token = os.path.join(tmpdir, f"{_UNNAMED}{self.serial}")
            self.open[token] = -1  # its place under the bound, taken before the open
        fd = -1
        try:
            if usable is None:  # not probed when the place was taken (another writer may be probing): probe
                usable = _unnamed_work(tmpdir)
                if usable is not None:  # an answer of the file system's, not a passing error
                    with self.lock:
                        self.usable[tmpdir] = usable
            if not usable:
                with self.lock:
                    del self.open[token]
                return None
            fd = os.open(tmpdir, os.O_WRONLY | os.O_TMPFILE, 0o644)
            with self.lock:  # inside the try: an interrupt before it lands must not keep the place or the descriptor
                self.open[token] = fd
        except BaseException:
            with self.lock:
                self.open.pop(token, None)
            if fd >= 0:
                close_quietly(fd)
            raise
        return token, fd

    def fd(self, tmp: str) -> int | None:
        """The descriptor of unnamed file ``tmp``; None for a named tmp file."""
        with self.lock:
            return self.open.get(tmp)

    def drop(self, tmp: str) -> bool:
        """Let unnamed file ``tmp`` go (closed: nothing of it stays); False if ``tmp`` is not one."""
        with self.lock:
            fd = self.open.pop(tmp, None)
        if fd is None:
            return False
        if fd >= 0:
            close_quietly(fd)
        return True


#: Errors a probe may meet that say nothing of unnamed files (a named file would meet them too, and
#: they pass): no answer, the next write probes again.
_PASSING = frozenset(
    (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EINTR, errno.EAGAIN)
)


def _unnamed_work(tmpdir: str) -> bool | None:
    """Whether an unnamed file made in ``tmpdir`` can be linked there (a probe, its name removed at
    once); None where the probe met a passing error (``_PASSING``: no descriptor free, a full disk),
    which decides nothing. FileNotFoundError if ``tmpdir`` is missing."""
    try:
        fd = os.open(tmpdir, os.O_WRONLY | os.O_TMPFILE, 0o644)
    except FileNotFoundError:
        raise
    except OSError as e:  # EOPNOTSUPP (NFS, older kernels: EISDIR), EINVAL: none here
        return None if e.errno in _PASSING else False
    probe = os.path.join(tmpdir, secrets.token_hex(16))
    try:
        _link(probe, probe, fd)
    except OSError as e:  # EPERM, EACCES, ENOENT, EXDEV: a /proc that cannot link descriptors
        return None if e.errno in _PASSING else False
    finally:
        close_quietly(fd)
    unlink_quietly(probe)
    return True


def _descriptor_share() -> int:
    """How many unnamed tmp files may be open at once: a quarter of the soft limit on this
    process's descriptors, at most 1024 (0 where the limit cannot be read)."""
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # pragma: no cover - not POSIX
        return 0
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(0, min(1024, soft // 4))


_unnamed = _UnnamedFiles()


def _forget_unnamed_in_child() -> None:
    """In a child forked while a batch was open (a data loader's worker forked while a background
    save writes): the parent's unnamed files are the parent's to link or drop. The child closes
    its copies of their descriptors, so that a file the parent drops is freed when the parent
    closes it rather than when the child exits, and starts with an empty registry and a fresh
    lock (the parent's may have been held by another thread at the fork). Its serial goes on from
    the parent's: a token of the parent's still in the child's memory (a batch open at the fork)
    must never name a file of the child's, which a link through it would put under the parent's key."""
    global _unnamed
    inherited = list(_unnamed.open.values())
    usable, cap, serial = dict(_unnamed.usable), _unnamed.cap, _unnamed.serial
    _unnamed = _UnnamedFiles()
    _unnamed.usable, _unnamed.cap, _unnamed.serial = usable, cap, serial
    for fd in inherited:
        if fd >= 0:
            close_quietly(fd)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_unnamed_in_child)


class LocalStorage:
    """A store on a local directory, crash-safe, reading only bytes it hashed (see module docstring)."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        self._dirty: set[str] = set()
        self._lock = threading.Lock()

    def _path(self, key: str) -> str:
        """The file path of ``key``; InvalidName if a directory on the way (``objects/ab``,
        ``refs``, ...) is a symbolic link, which could lead outside the store (SPEC.md §Threat
        model). The last component is opened with O_NOFOLLOW or lstat-ed by each caller."""
        parts = check_key(key).split("/")
        path = self.root
        for seg in parts[:-1]:
            path = os.path.join(path, seg)
            if os.path.islink(path):
                raise InvalidName(f"{key}: {path} in store {self.root} is a symbolic link; refusing to follow it")
        return os.path.join(path, parts[-1])

    def _dir(self, key: str) -> str:
        """``_path`` for a directory the store itself walks or writes into (``tmp``, a listing's root)."""
        path = self._path(key)
        if os.path.islink(path):
            raise InvalidName(f"{path} in store {self.root} is a symbolic link; refusing to follow it")
        return path

    def _io(self, op: str, key: str, e: OSError) -> StorageError:
        return StorageError(f"{op} {key!r} in store {self.root}: {e.strerror or e}")

    def read(self, key: str, limit: int | None = None) -> Buffer:
        return self._read(key, limit, None)

    def read_hashed(self, key: str, hasher: Callable[[], Any], limit: int | None = None) -> tuple[Buffer, str]:
        """The bytes at ``key`` and their digest, each chunk hashed right after it lands."""
        h = hasher()
        data = self._read(key, limit, h.update)
        return data, h.hexdigest()

    def _read(self, key: str, limit: int | None, consume: Callable[[memoryview], None] | None) -> bytearray:
        """Read ``key`` into memory of its own (never a live mapping of the file: the bytes
        handed out are exactly the bytes that were hashed, whatever happens to the file
        afterwards). ObjectTooLarge above ``limit``, before allocating; a file that shrinks
        while being read is a StorageError, never a SIGBUS."""
        fd = self._open_read(key)
        try:
            size = os.fstat(fd).st_size
            if limit is not None and size > limit:
                raise ObjectTooLarge(
                    f"{key} in store {self.root} is {size} bytes, over this reader's limit of {limit} (SPEC.md §Limits)"
                )
            buf = bytearray(size)
            got = read_exact(fd, memoryview(buf), consume)
            if got != size:
                raise StorageError(
                    f"read {key!r} in store {self.root}: the file shrank from {size} to {got} bytes while being read"
                )
            return buf
        except OSError as e:
            raise self._io("read", key, e) from None
        finally:
            close_quietly(fd)

    def _lstat(self, key: str) -> os.stat_result | None:
        try:
            return os.lstat(self._path(key))
        except FileNotFoundError:
            return None

    def size(self, key: str) -> int | None:
        st = self._lstat(key)
        return None if st is None else st.st_size

    def exists(self, key: str) -> bool:
        return os.path.lexists(self._path(key))

    def mtime(self, key: str) -> float | None:
        st = self._lstat(key)
        return None if st is None else st.st_mtime

    def touch(self, key: str) -> int | None:
        """Refresh the object's mtime (never through a symbolic link), then return its size.
        A refresh the file system refuses (read-only, not ours) is ignored as in ``write_once``."""
        freshen(self._path(key))
        st = self._lstat(key)
        return None if st is None else st.st_size

    def _write_tmp(self, data: Buffer) -> str:
        tmpdir = self._dir("tmp")
        os.makedirs(tmpdir, exist_ok=True)
        tmp = os.path.join(tmpdir, secrets.token_hex(16))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data).cast("B")
            while view:
                n = os.write(fd, view[: 1 << 30])
                view = view[n:]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        return tmp

    def begin_write(self, key: str, data: Buffer) -> str | None:
        """First half of a batched ``write_once``: write ``data`` to a tmp file, not yet durable
        or visible. Returns the tmp path (an unnamed file's token) to hand to ``end_writes``, or
        None if ``key`` exists."""
        opened = self._new_tmp(key)
        if opened is None:
            return None
        tmp, fd = opened
        named = _unnamed.fd(tmp) is None  # an unnamed file stays open until its batch ends
        try:
            view = memoryview(data).cast("B")
            off = 0
            while off < len(view):
                n = os.write(fd, view[off : off + _CHUNK])
                start_writeback(fd, off, n)
                off += n
        except BaseException as e:
            if named:
                close_quietly(fd)
            self._drop_tmp(tmp)
            if isinstance(e, OSError):
                raise self._io("write", key, e) from None
            raise
        if named:
            try:
                os.close(fd)
            except OSError as e:
                unlink_quietly(tmp)
                raise self._io("write", key, e) from None
        return tmp

    def _new_tmp(self, key: str) -> tuple[str, int] | None:
        """(path or token, descriptor) of a new tmp file for ``key``'s bytes, unnamed where one
        can be had (``_UnnamedFiles``: its descriptor stays open until its batch ends); None if
        ``key`` exists (refreshed)."""
        path = self._path(key)
        if os.path.lexists(path):
            freshen(path)
            return None
        tmpdir = self._dir("tmp")
        try:  # ``tmp`` made only when missing (a mkdir of an existing directory still locks it); the object's at the link
            return self._open_tmp(tmpdir)
        except FileNotFoundError:
            try:
                os.makedirs(tmpdir, exist_ok=True)
                return self._open_tmp(tmpdir)
            except OSError as e:
                raise self._io("write", key, e) from None
        except OSError as e:
            raise self._io("write", key, e) from None

    @staticmethod
    def _open_tmp(tmpdir: str) -> tuple[str, int]:
        made = _unnamed.create(tmpdir)
        if made is not None:
            return made
        tmp = os.path.join(tmpdir, secrets.token_hex(16))
        return tmp, _create(tmp)

    @staticmethod
    def _drop_tmp(tmp: str) -> None:
        """Remove a tmp file of a batched write: close an unnamed one, unlink a named one."""
        if not _unnamed.drop(tmp):
            unlink_quietly(tmp)

    def discard_writes(self, pending: list[tuple[str, str]]) -> None:
        """Remove the tmp files of ``pending`` ((key, tmp) pairs a ``begin_write`` or an
        ``open_write`` returned) without linking any: nothing of them is ever visible."""
        for _key, tmp in pending:
            self._drop_tmp(tmp)

    def open_write(self, key: str) -> _TmpWrite | None:
        """``begin_write`` for bytes that arrive piece by piece (a copy's, hashed on the way): the
        tmp file to write them into, its path to hand to ``end_writes`` once closed; None if
        ``key`` exists (refreshed). Writeback starts at ``close``, from the caller's thread:
        pieces may be written on an event loop, which must not wait for the device."""
        opened = self._new_tmp(key)
        return None if opened is None else _TmpWrite(self, key, *opened)

    def end_writes(self, pending: list[tuple[str, str]], *, threads: int = 2) -> list[bool]:
        """Second half: fsync every tmp file of ``pending`` ((key, tmp path) pairs), link each
        into place create-only, then fsync the directories the links went into: the batch is
        durable when this returns. True for each key this call wrote. Both rounds of fsyncs
        run ``threads`` at a time: they wait on the device, and concurrent ones share its cache
        flushes (one after another, each directory's cost a flush of its own: benchmarks/RESULTS.md, bench_dcp)."""

        def fsync(item: tuple[str, str]) -> None:
            key, tmp = item
            try:
                fd = _unnamed.fd(tmp)
                if fd is not None:
                    os.fsync(fd)
                    return
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as e:
                raise self._io("write", key, e) from None

        dirs: set[str] = set()
        try:
            _each(fsync, pending, threads)
            written = []
            for key, tmp in pending:
                path = self._path(key)
                try:
                    _link(tmp, path, _unnamed.fd(tmp))
                    written.append(True)
                except FileExistsError:
                    freshen(path)
                    written.append(False)  # another writer won; same name means same bytes
                except OSError as e:
                    raise self._io("write", key, e) from None
                dirs.update((os.path.dirname(path), os.path.dirname(os.path.dirname(path))))
        except BaseException:
            with self._lock:
                self._dirty.update(dirs)  # names linked before the failure: durable at the next sync()
            raise
        finally:
            self.discard_writes(pending)  # the tmp names (an unnamed file: its descriptor) go, linked or not
        self._sync_dirs(sorted(dirs, key=len, reverse=True), threads)
        return written

    def _open_read(self, key: str) -> int:
        try:  # O_NONBLOCK: a named pipe planted at a key must not block its reader (no effect on a file)
            return os.open(self._path(key), READ_FLAGS)
        except FileNotFoundError:
            raise ObjectNotFound(f"{key} is missing from store {self.root}") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise InvalidName(f"{key} in store {self.root} is a symbolic link; refusing to follow it") from None
            raise self._io("read", key, e) from None

    def read_into(self, key: str, out: memoryview, consume: Callable[[memoryview], None] | None = None) -> int:
        """Read the object at ``key`` into ``out`` when its size is exactly ``len(out)``, calling
        ``consume`` on each chunk right after it lands (while it is in cache: hash it there).
        Returns the object's size; when that differs from ``len(out)`` nothing is read."""
        fd = self._open_read(key)
        try:
            size = os.fstat(fd).st_size
            if size != len(out):
                return size
            return read_exact(fd, out, consume)  # fewer bytes: truncated under us
        except OSError as e:
            raise self._io("read", key, e) from None
        finally:
            os.close(fd)

    def read_ahead(self, key: str) -> None:
        """Have the kernel start reading the object at ``key`` into the page cache (``read_ahead``:
        its own readahead windows, started without waiting) and return at once; nothing for a key
        that cannot be opened or is not a regular file (the read that follows names the failure).
        The bytes a read returns are still the file's, read and hashed as ever."""
        try:
            fd = os.open(self._path(key), READ_FLAGS)  # a planted named pipe: returns at once too
        except (OSError, InvalidName):
            return
        try:
            read_ahead(fd)
        finally:
            close_quietly(fd)

    def hash_object(self, key: str, hasher: Callable[[], Any], *, threads: int = 1) -> tuple[str, int]:
        """(hex digest, size) of the object at ``key``; ``hasher()`` makes a fresh hash object
        running ``threads`` threads of its own.

        The file is opened here (never through a symbolic link) and read through a reused,
        page-aligned per-thread buffer, never mapped: a file mapped while another process
        truncates it kills the reader with SIGBUS, where a read just returns fewer bytes (and
        the hash then names the damage). A one-thread hasher takes the file chunk by chunk
        while each chunk is in the core's cache; a multi-threaded BLAKE3 hasher takes larger
        chunks, so that its threads have enough to split. Since format version 2 an object
        larger than one grid block (4 MiB) is rare (version-1 stores, imports of old data).
        """
        h = hasher()
        fd = self._open_read(key)
        try:
            chunk = _PARALLEL_CHUNK if threads > 1 else READ_CHUNK
            attr = "pbuf" if threads > 1 else "buf"
            buf = getattr(_tls, attr, None)
            if buf is None:
                buf = memoryview(mmap.mmap(-1, chunk))  # anonymous, page-aligned, reused by this thread
                setattr(_tls, attr, buf)
            size = 0
            step = buf[:FIRST_READ]
            while True:
                n = os.readv(fd, [step])
                if n == 0:
                    break
                h.update(buf[:n])
                size += n
                step = buf
        except OSError as e:
            raise self._io("read", key, e) from None
        finally:
            os.close(fd)
        return h.hexdigest(), size

    def write_once(self, key: str, data: Buffer) -> bool:
        path = self._path(key)
        if os.path.lexists(path):
            freshen(path)
            return False
        parent = os.path.dirname(path)
        try:
            os.makedirs(parent, exist_ok=True)
            tmp = self._write_tmp(data)
            try:
                os.link(tmp, path)
                written = True
            except FileExistsError:
                freshen(path)
                written = False  # another writer won; same name means same bytes
            finally:
                os.unlink(tmp)
        except OSError as e:
            raise self._io("write", key, e) from None
        with self._lock:
            self._dirty.add(parent)
            self._dirty.add(os.path.dirname(parent))
        return written

    def _take_lock(self, key: str, path: str) -> tuple[str, int]:
        """Create ``path``'s exclusive lock file, recording its holder (every ref writer takes it);
        a dead holder's is taken over, any other held lock is RefConflict (``ref_locks``)."""
        lock, tmpdir = path + ".lock", self._dir("tmp")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return lock, take_lock(
                key, lock, os.path.join(tmpdir, secrets.token_hex(16)), os
            )  # this module's os: tests replace it
        except OSError as e:
            raise self._io("lock", key, e) from None

    def break_lock(self, key: str) -> dict[str, Any] | None:
        """Remove ``key``'s lock file unless a live writer on this host holds it; the holder it recorded."""
        return break_lock(self._path(key) + ".lock", key, os)

    def _check_current(self, key: str, expected: bytes | None) -> None:
        try:
            current: bytes | None = bytes(self.read(key))  # O_NOFOLLOW: a planted link is refused
        except ObjectNotFound:
            current = None
        if current != expected:
            raise RefConflict(f"{key}: expected {show_ref_value(expected)}, found {show_ref_value(current)}")

    def delete_if(self, key: str, expected: bytes) -> None:
        """Under the ref's lock, so that no ``swap`` lands between the comparison and the unlink."""
        path = self._path(key)
        lock, fd = self._take_lock(key, path)
        try:
            self._check_current(key, expected)
            os.unlink(path)
            fsync_dir(os.path.dirname(path))
        except OSError as e:
            raise self._io("delete", key, e) from None
        finally:
            close_quietly(fd)
            unlink_quietly(lock)

    def swap(self, key: str, expected: bytes | None, new: bytes) -> None:
        path = self._path(key)
        lock, fd = self._take_lock(key, path)
        renamed = False
        try:
            self._check_current(key, expected)
            os.ftruncate(fd, 0)  # the holder record goes: the lock file becomes the ref's new value
            os.pwrite(fd, new, 0)
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(lock, path)
            renamed = True
            fsync_dir(os.path.dirname(path))
        except OSError as e:
            if renamed:  # the new value is visible to every reader: say so, a retry would conflict
                raise StorageError(
                    f"update {key!r} in store {self.root}: the ref now holds the new value, but fsync of its "
                    f"directory failed ({e.strerror or e}), so it may not survive a power loss"
                ) from None
            raise self._io("update", key, e) from None
        finally:
            if fd >= 0:
                close_quietly(fd)
            if not renamed:
                unlink_quietly(lock)

    def delete_stale(self, key: str, cutoff: float) -> bool:
        """Delete the object at ``key`` only if its mtime is not after ``cutoff``; True if deleted.

        gc's delete without a window: the file is first renamed away (atomic), so a writer's
        refresh (``touch``) either lands before the rename — then the time read from the
        renamed file is young and it is linked back into place — or finds the name gone and
        the writer writes the object again. (Plain stat-then-unlink would lose an object
        refreshed in between.) A gc killed between the rename and the link-back leaves the
        object under ``tmp/``: lost to a writer that refreshed it in that instant only."""
        path = self._path(key)
        tmpdir = self._dir("tmp")
        doomed = os.path.join(tmpdir, f"gc-{secrets.token_hex(8)}")
        try:
            os.makedirs(tmpdir, exist_ok=True)
            os.rename(path, doomed)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise self._io("delete", key, e) from None
        try:
            if os.lstat(doomed).st_mtime > cutoff:  # refreshed before it was taken: put it back
                try:
                    os.link(doomed, path)
                except FileExistsError:
                    pass  # written again meanwhile: same name, same bytes
                return False
            return True
        except OSError as e:
            raise self._io("delete", key, e) from None
        finally:
            unlink_quietly(doomed)
            with self._lock:
                self._dirty.add(os.path.dirname(path))

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self._io("delete", key, e) from None

    def list(self, prefix: str) -> Iterator[str]:
        base = self._dir(prefix)

        def fail(e: OSError) -> None:
            # os.walk skips a directory it cannot scan unless told otherwise; a ref or object
            # silently missing from a listing would make gc treat reachable objects as garbage.
            if not isinstance(e, FileNotFoundError):
                raise self._io("list", prefix, e) from None

        for dirpath, dirnames, filenames in os.walk(base, onerror=fail):
            dirnames.sort()
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            for name in sorted(filenames):
                yield f"{rel}/{name}"

    def sync(self) -> None:
        """fsync every directory a write linked into since the last ``sync``: the object
        directories of a batch together, ``_SYNC_THREADS`` at a time (their fsyncs share the file
        system's journal commits), deepest first. Their order does not matter to the protocol:
        nothing names what they hold until ``sync`` has returned."""
        with self._lock:
            dirty, self._dirty = sorted(self._dirty, key=len, reverse=True), set()
        self._sync_dirs(dirty, _SYNC_THREADS)

    def _sync_dirs(self, dirs: list[str], threads: int) -> None:
        """fsync each directory of ``dirs`` that still exists, ``threads`` at a time; on a failure
        the ones not known durable go back to the dirty set (the next ``sync()`` retries them)
        and StorageError names the first that failed."""
        done: set[str] = set()

        def one(d: str) -> None:
            try:
                if os.path.isdir(d):
                    fsync_dir(d)
            except OSError as e:
                raise StorageError(f"sync {d} in store {self.root}: {e.strerror or e}") from None
            with self._lock:
                done.add(d)

        try:
            _each(one, dirs, threads)
        except BaseException:
            with self._lock:
                self._dirty.update(d for d in dirs if d not in done)
            raise


class _TmpWrite:
    """An object's tmp file being written piece by piece (``LocalStorage.open_write``)."""

    def __init__(self, storage: LocalStorage, key: str, tmp: str, fd: int) -> None:
        self.storage, self.key, self.tmp, self.fd, self.size = storage, key, tmp, fd, 0
        self.named = _unnamed.fd(tmp) is None  # an unnamed file's descriptor stays open until its batch ends

    def write(self, piece: Buffer) -> None:
        view = memoryview(piece).cast("B")
        try:
            while view:
                n = os.write(self.fd, view[: 1 << 30])
                view = view[n:]
                self.size += n
        except OSError as e:
            raise self.storage._io("write", self.key, e) from None

    def restart(self) -> None:
        if self.size == 0:
            return  # nothing written yet (the first attempt): no system call
        try:
            os.ftruncate(self.fd, 0)
            os.lseek(self.fd, 0, os.SEEK_SET)
        except OSError as e:
            raise self.storage._io("write", self.key, e) from None
        self.size = 0

    def close(self) -> str:
        fd, self.fd = self.fd, -1
        start_writeback(fd, 0, self.size)  # the whole file at once: it is written by now
        if self.named:
            try:
                os.close(fd)
            except OSError as e:
                unlink_quietly(self.tmp)
                raise self.storage._io("write", self.key, e) from None
        return self.tmp

    def discard(self) -> None:
        if self.fd >= 0 and self.named:
            close_quietly(self.fd)
        self.fd = -1
        self.storage._drop_tmp(self.tmp)


def _create(path: str) -> int:
    """A new file at ``path``, opened for writing (FileExistsError if anything is there)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)


def _link(tmp: str, path: str, fd: int | None = None) -> None:
    """Link ``tmp`` at ``path``, create-only (FileExistsError if taken), making its directory if
    missing; ``fd``: the descriptor of an unnamed tmp file, linked through it instead."""
    if fd is None:
        src, link = tmp, os.link
    else:  # linkat(2) with AT_SYMLINK_FOLLOW of the descriptor's /proc entry (unprivileged, unlike AT_EMPTY_PATH);
        # os.link makes that call only when given a source directory descriptor, which an absolute path ignores
        src = f"/proc/self/fd/{fd}"

        def link(src: str, path: str) -> None:
            os.link(src, path, src_dir_fd=fd, follow_symlinks=True)

    try:
        link(src, path)
    except FileNotFoundError:
        if not os.path.exists(src):
            raise
        os.makedirs(os.path.dirname(path), exist_ok=True)
        link(src, path)


def _each(fn: Callable[[Any], None], items: Sequence[Any], threads: int) -> None:
    """``fn`` on every item, ``threads`` at a time (in order on the calling thread for one);
    the first exception is raised once every call has ended."""
    if threads > 1 and len(items) > 1:
        with ThreadPoolExecutor(max_workers=min(threads, len(items))) as pool:
            list(pool.map(fn, items))
    else:
        for item in items:
            fn(item)
