"""Who holds a lock or an intent: a process named so that another process can tell whether
it still runs (SPEC.md §14, §19.2).

A **holder** is ``{"boot": …, "host": …, "pid": …, "pidns": …, "start": …}``: the host
name, the process id, the process's start time (field 22 of ``/proc/<pid>/stat``, clock
ticks after boot), the kernel's boot id and the process's pid namespace. Another process
judges it:

- **dead** — same host, boot id and pid namespace, and no process ``pid`` with that start
  time exists: ``kill(pid, 0)`` answers "no such process" (ESRCH), or ``/proc/<pid>/stat``
  is readable and names another start time (the pid was reused);
- **alive** — a process ``pid`` exists and is not shown to be another one: its start time
  matches, or it cannot be inspected (``kill`` answers EPERM, another user's process, and
  its ``/proc/<pid>/stat`` is hidden by ``hidepid``; or the ``/proc`` mounted here is not
  this process's own — ``/proc/self/stat`` names another pid —, so ``kill`` alone decides);
- **unknown** — another host, another boot (a pid means nothing across machines or
  boots: two machines may share a host name, and the host's pid namespace has the same
  inode number on every Linux kernel), another pid namespace (a container's pids are not
  this one's to look up), or no ``/proc`` to name the holder with.

Only **dead** licenses taking over what the holder held; callers treat **unknown** like
**alive** (a lease, an explicit command, or waiting). A process that exists but cannot be
looked at is never taken for dead: that is how a live gc was once taken for a dead one
by a writer of another user under ``hidepid=2`` (issue 30).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

__all__ = [
    "MAX_RECORD",
    "holder_record",
    "read_holder",
    "check_holder",
    "holder_state",
    "process_state",
    "this_process",
]

#: The most bytes a holder record may take (a lock file or marker is read no further).
MAX_RECORD = 4096


def _read_text(path: str, limit: int = 256) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:  # a command name may hold any byte
            return f.read(limit).strip()
    except (OSError, UnicodeDecodeError):
        return None


def _stat_fields(path: str) -> list[str] | None:
    """The fields of a ``/proc/<pid>/stat`` file after the command name (field 3 onward), None if unreadable."""
    text = _read_text(path, limit=4096)  # 52 fields of at most 20 digits, and a command name of at most 64 bytes
    if text is None:
        return None
    fields = text.rsplit(")", 1)[-1].split()  # the command name, in parentheses, may hold spaces
    return fields if len(fields) > 19 else None


def _start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks after boot), None if there is no such process,
    it is hidden from this one (``hidepid``), or there is no /proc."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    return None if fields is None else fields[19]


def _own_proc() -> bool:
    """True if the /proc mounted here is this process's: ``/proc/self/stat`` names our own pid
    (a /proc of another pid namespace, or a file planted there, would name pids that are not ours)."""
    text = _read_text("/proc/self/stat", limit=32)
    return text is not None and text.split(" ", 1)[0] == str(os.getpid())


#: The largest pid Linux hands out (``PID_MAX_LIMIT``, 2**22); a record naming more, or less than 1, names no process.
_PID_MAX = 1 << 22


def _exists(pid: int) -> bool | None:
    """Whether a process ``pid`` exists, by ``kill(pid, 0)`` (no signal is sent): EPERM says it
    exists (another user's), ESRCH that it does not; None if the kernel would not say."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return None
    return True


def _pidns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def holder_record() -> bytes:
    """This process's record (one line of JSON), written into a lock file or gc marker it creates."""
    return json.dumps(this_process(), sort_keys=True, separators=(",", ":")).encode() + b"\n"


def read_holder(raw: bytes) -> dict[str, Any] | None:
    """The holder a lock file's bytes record, or None (an old lock, or one holding the new ref value)."""
    try:
        doc = json.loads(raw[:MAX_RECORD]) if len(raw) <= MAX_RECORD else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return check_holder(doc)


def check_holder(doc: Any) -> dict[str, Any] | None:
    """``doc`` (decoded JSON) if it is a holder record, else None: a record of the wrong shape
    names nobody and is never judged dead."""
    if (
        not isinstance(doc, dict)
        or set(doc) != {"boot", "host", "pid", "pidns", "start"}
        or not isinstance(doc["pid"], int)
        or isinstance(doc["pid"], bool)
        or not isinstance(doc["host"], str)
        or not all(doc[k] is None or isinstance(doc[k], str) for k in ("boot", "pidns", "start"))
    ):
        return None
    return doc


def holder_state(holder: dict[str, Any] | None) -> str:
    """``"dead"``, ``"alive"`` or ``"unknown"`` (another host, boot or pid namespace; no record; no /proc)."""
    if holder is None or holder["host"] != socket.gethostname():
        return "unknown"
    return process_state(holder["boot"], holder["pidns"], holder["pid"], holder["start"])


def process_state(boot: str | None, pidns: str | None, pid: int, start: str | None) -> str:
    """``"dead"``, ``"alive"`` or ``"unknown"`` for process ``pid`` started at ``start`` under
    boot id ``boot`` in pid namespace ``pidns`` (``/proc/self/ns/pid``'s link text), judged
    from this process (module docstring; the caller has checked the host)."""
    if start is None or boot is None or boot != _read_text("/proc/sys/kernel/random/boot_id"):
        return "unknown"  # another boot: a pid of ours says nothing about it (and /proc may be another machine's)
    if pidns is None or pidns != _pidns():
        return "unknown"  # another container on this kernel: its pids are not ours to look up
    if isinstance(pid, bool) or not 0 < pid <= _PID_MAX:
        return "unknown"  # names no process (kill(0, 0) would ask about our own process group)
    exists = _exists(pid)
    if exists is None:
        return "unknown"
    if not exists:
        return "dead"
    if not _own_proc():
        return "alive"  # a /proc that is not ours cannot tell a reused pid: the process exists
    now = _start_time(pid)
    if now is None:
        # hidden (hidepid), or it exited between the two looks: never dead on what we cannot see
        return "dead" if _exists(pid) is False else "alive"
    return "alive" if now == start else "dead"  # another start time: the pid was reused


def this_process() -> dict[str, Any]:
    """This process as a holder (the fields of ``holder_record``); ``start`` is None where the
    /proc mounted here is not this process's (such a holder is never judged dead)."""
    fields = _stat_fields("/proc/self/stat") if _own_proc() else None
    return {
        "boot": _read_text("/proc/sys/kernel/random/boot_id"),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pidns": _pidns(),
        "start": None if fields is None else fields[19],
    }
