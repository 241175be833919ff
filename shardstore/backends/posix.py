"""The POSIX file primitives the local backend is built from: exact reads that ask for one
page first, readahead of a file about to be read, early writeback, directory fsync, quiet
close and unlink, and freshening a duplicate's modification time (SPEC.md §19, §19.1).

Every call goes through this module's ``os``, as ``LocalStorage``'s do, so the fault tests
can number and fail each system call of a save (``tests/faults.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = [
    "READ_CHUNK",
    "FIRST_READ",
    "start_writeback",
    "will_need",
    "READ_FLAGS",
    "read_exact",
    "close_quietly",
    "unlink_quietly",
    "freshen",
    "fsync_dir",
]

#: Bytes per readv(2) on the streaming read paths: small enough that a chunk is still in the
#: core's cache when it is hashed (faster than 8 MiB chunks: benchmarks/RESULTS.md, "design measurements").
READ_CHUNK = 1 << 20
#: The first read of every file asks for one page. Linux (6.x) fills the first readahead
#: window of a file with order-0 (4 KiB) folios whatever the request size, and raises the
#: folio order by 2 for each window after it, as a sequential reader reaches it: a first read
#: of 1 MiB leaves half of a 4 MiB object in 4 KiB folios, which makes cold reads of blocks
#: slower and every later copy of the same bytes out of the page cache (deep verify) costlier
#: in CPU. A 4 KiB first read, then ``READ_CHUNK`` reads, lets the kernel reach large folios
#: from the second window on (the measurements: benchmarks/RESULTS.md, "format 2 restore").
FIRST_READ = 4096


#: How an object file is opened for reading: never through a symbolic link, and never waiting
#: for a writer (a named pipe planted at a key would otherwise block the open until one came;
#: no effect on a regular file).
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing these dirty pages of ``fd`` now (no wait), so the later
    fsync is short. (On Linux, DONTNEED starts writeback of dirty pages and keeps them cached.)"""
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        pass


def will_need(fd: int) -> None:
    """Ask the kernel to start reading all of ``fd`` into the page cache now (no wait), so a
    later read finds it there: the reads of the next objects overlap the hashing of this one."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except (AttributeError, OSError):  # pragma: no cover - not Linux, or a file system without readahead
        pass


def read_exact(fd: int, out: memoryview, consume: Callable[[memoryview], None] | None) -> int:
    """Fill ``out`` from ``fd``'s offset, one page first (``FIRST_READ``), then ``READ_CHUNK``
    at a time, calling ``consume`` on each piece right after it lands; return the bytes read
    (fewer than ``len(out)`` only if the file ended first)."""
    size = len(out)
    off = 0
    step = FIRST_READ
    while off < size:
        n = os.readv(fd, [out[off : off + step]])
        if n == 0:
            return off
        if consume is not None:
            consume(out[off : off + n])
        off += n
        step = READ_CHUNK
    return off


def close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass  # a read-only descriptor: nothing can be lost


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # a leftover tmp file is harmless; gc removes it after its grace period


def freshen(path: str) -> None:
    """A write found ``path`` already there (content addressing: the same bytes). Make it young
    again, so gc's grace period protects it for the save that is about to name it, exactly as
    if that save had written it (git does the same: freshen on a duplicate write)."""
    try:
        os.utime(path, follow_symlinks=False)
    except OSError:
        pass  # gone or read-only: the save's later read-back or verify reports a missing object


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
