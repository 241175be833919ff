"""Bounded reading of untrusted input: files and JSON text (SPEC.md §Limits, §Threat model).

Two helpers that every reader of hostile bytes outside the store shares:

- ``read_regular_file``: read a file named by a user (``config.json`` of an import) only
  if it is a regular file, never more than a limit: a symbolic link to ``/dev/zero`` or a
  FIFO is refused, not read forever or waited on.
- ``check_json_nesting``: refuse JSON nested deeper than a limit *before* parsing it, so that
  no recursive parser or walker (``json``, msgspec, our own canonicalisers) ever sees it;
  deep nesting is refused with a typed error, never a ``RecursionError``.
"""

from __future__ import annotations

import os
import re
import stat

import numpy as np

from ..errors import ManifestError

__all__ = ["json_nesting", "check_json_nesting", "read_regular_file"]

#: A JSON string literal (escapes included); what is inside one is never structure.
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


def json_nesting(raw: bytes | memoryview) -> int:
    """The deepest bracket nesting of JSON text ``raw`` (strings skipped), without parsing it.

    Linear time, no recursion: strings are cut out by one regular expression, then the
    running sum of +1 per ``[``/``{`` and -1 per ``]``/``}`` is taken with NumPy."""
    text = _STRING.sub(b"", bytes(raw))
    if not text:
        return 0
    steps = _OPEN[np.frombuffer(text, dtype=np.uint8)]
    return int(max(0, np.cumsum(steps, dtype=np.int64).max()))


def check_json_nesting(raw: bytes | memoryview, limit: int, what: str) -> None:
    """ManifestError naming ``what`` if ``raw`` nests deeper than ``limit`` brackets."""
    depth = json_nesting(raw)
    if depth > limit:
        raise ManifestError(f"{what}: JSON nested {depth} levels deep, over the limit of {limit} (SPEC.md §Limits)")


def read_regular_file(path: str, limit: int, what: str | None = None) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes; else ManifestError.

    Opened non-blocking (a FIFO cannot stall the open), checked with ``fstat`` on the open
    descriptor (no race with a rename), read with a hard cap of ``limit + 1`` bytes (a file
    that grows meanwhile is still bounded). A missing file is ManifestError too."""
    name = what or path
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ManifestError(f"{name} is missing") from None
    except OSError as e:
        raise ManifestError(f"{name}: cannot be opened ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError(f"{name} is not a regular file (a device, FIFO or directory); refusing to read it")
        if st.st_size > limit:
            raise ManifestError(f"{name}: {st.st_size} bytes is over the {limit}-byte limit (SPEC.md §Limits)")
        chunks: list[bytes] = []
        got = 0
        while got <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > limit:
            raise ManifestError(f"{name}: grew past the {limit}-byte limit while being read (SPEC.md §Limits)")
        return b"".join(chunks)
    except OSError as e:
        raise ManifestError(f"{name}: cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
