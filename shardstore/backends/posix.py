"""The POSIX file primitives the local backend is built from: exact reads that ask for one
page first, readahead of a file about to be read (``read_ahead``), early writeback, directory fsync, quiet
close and unlink, and freshening a duplicate's modification time (SPEC.md §19, §19.1).

Every call goes through this module's ``os``, as ``LocalStorage``'s do, so the fault tests
can number and fail each system call of a save (``tests/faults.py``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

__all__ = [
    "READ_CHUNK",
    "FIRST_READ",
    "start_writeback",
    "will_need",
    "readahead_marks",
    "read_ahead",
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


#: The page size the kernel's readahead counts in (``readahead_marks``).
PAGE = os.sysconf("SC_PAGESIZE") if hasattr(os, "sysconf") else 4096
#: The kernel's default readahead of a device (``VM_READAHEAD_PAGES``: 128 KiB), in pages: what
#: ``read_ahead`` assumes where ``/sys/class/bdi`` does not say.
DEFAULT_RA_PAGES = 32
#: The most one-page reads ``read_ahead`` walks a file with (a device with little readahead
#: has many small windows): past it, and where no window but the first would be started, it
#: asks with ``will_need`` instead.
MAX_MARKS = 64
_ra_pages: dict[int, int] = {}  # st_dev -> its backing device's readahead, in pages


def readahead_marks(pages: int, ra_pages: int) -> list[int]:
    """The pages of a ``pages``-page file that one-page reads must touch, in order, for Linux's
    readahead to read all of it, each window started from the last one's mark: page 0 (the first
    window: ``get_init_ra_size`` of one page), then the page each window marks (its first page,
    ``PG_readahead``), as long as the window it starts begins inside the file; windows grow 4x
    below ``ra_pages``/16, 2x up to ``ra_pages`` (``get_next_ra_size``, mm/readahead.c). For a
    4 MiB object with 8 MiB of readahead: pages 0, 1, 4, 20, 84, 340."""
    if pages <= 0:
        return []
    size = 4 if 1 <= ra_pages // 32 else 2 if 1 <= ra_pages // 4 else max(1, ra_pages)
    marks = [0]
    if size <= 1:  # no mark in a one-page window: the reader's own reads go on from there
        return marks
    mark, start = 1, size  # the first window's mark: its second page (async_size = size - 1)
    while start < pages:
        marks.append(mark)
        mark = start  # each later window marks its first page (async_size = size)
        size = 4 * size if size < ra_pages // 16 else 2 * size if size <= ra_pages // 2 else ra_pages
        start += size
    return marks


def _readahead_pages(dev: int) -> int:
    """The readahead of the device backing ``dev`` (an ``st_dev``), in pages: its
    ``/sys/class/bdi/MAJ:MIN/read_ahead_kb``, else ``DEFAULT_RA_PAGES``."""
    pages = _ra_pages.get(dev)
    if pages is None:
        try:
            with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb") as f:
                pages = max(1, int(f.read().strip()) * 1024 // PAGE)
        except (OSError, ValueError):
            pages = DEFAULT_RA_PAGES
        _ra_pages[dev] = pages
    return pages


def read_ahead(fd: int) -> None:
    """Have the kernel start reading all of ``fd`` (a regular file, read from offset 0 next) into
    the page cache, and return at once: the device reads the next objects while the thread
    hashes this one.

    Each page of ``readahead_marks`` is read with ``RWF_NOWAIT`` into a scratch page: a page not
    yet cached starts the file's readahead and the read returns EAGAIN instead of waiting; a
    marked page starts the next window. The windows are the kernel's own, filled with large
    folios as a sequential reader's are; ``posix_fadvise(WILLNEED)`` (``will_need``, the
    fallback where ``RWF_NOWAIT`` is refused or missing) fills 4 KiB pages, which cost a
    one-thread load of a DCP checkpoint 60-120 ms more system CPU per 384 MiB and fill smaller
    requests (benchmarks/RESULTS.md, "RWF_NOWAIT read-ahead"). Advisory: if the marks are not
    where this kernel puts them, less is read ahead; the bytes a read returns are the file's."""
    flag = getattr(os, "RWF_NOWAIT", None)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return
        if flag is None:
            will_need(fd)
            return
        pages = -(-st.st_size // PAGE)
        marks = readahead_marks(pages, _readahead_pages(st.st_dev))
        if len(marks) > MAX_MARKS or (pages > 1 and len(marks) == 1):
            will_need(fd)
            return
        page = bytearray(PAGE)
        for mark in marks:
            try:
                os.preadv(fd, [page], mark * PAGE, flag)
            except BlockingIOError:  # not in the page cache yet: its read has started
                continue
    except OSError:  # RWF_NOWAIT refused by this file system (EOPNOTSUPP): the kernel's advice instead
        will_need(fd)


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
