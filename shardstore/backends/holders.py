"""Who holds a lock or an intent: a process named so that another process can tell whether
it still runs (SPEC.md §14, §19b).

A **holder** is ``{"boot": …, "host": …, "pid": …, "pidns": …, "start": …}``: the host
name, the process id, the process's start time (field 22 of ``/proc/<pid>/stat``, clock
ticks after boot), the kernel's boot id and the process's pid namespace. Another process
judges it:

- **dead** — same host, boot id and pid namespace, and no process ``pid`` with that start
  time exists (it exited, or its pid was reused by another process);
- **alive** — that process still exists;
- **unknown** — another host, another boot (a pid means nothing across machines or
  boots: two machines may share a host name, and the host's pid namespace has the same
  inode number on every Linux kernel), another pid namespace (a container's pids are not
  this one's to look up), or no ``/proc`` to look with.

Only **dead** licenses taking over what the holder held; callers treat **unknown** like
**alive** (a lease, an explicit command, or waiting).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

__all__ = ["MAX_RECORD", "holder_record", "read_holder", "holder_state", "process_state", "this_process"]

#: The most bytes a holder record may take (a lock file or marker is read no further).
MAX_RECORD = 4096


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read(256).strip()
    except (OSError, UnicodeDecodeError):
        return None


def _start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks after boot), None if there is no such process or no /proc."""
    text = _read_text(f"/proc/{pid}/stat")
    if text is None:
        return None
    fields = text.rsplit(")", 1)[-1].split()  # the command name, in parentheses, may hold spaces
    return fields[19] if len(fields) > 19 else None


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
    except (ValueError, UnicodeDecodeError):
        return None
    if (
        not isinstance(doc, dict)
        or set(doc) != {"boot", "host", "pid", "pidns", "start"}
        or not isinstance(doc["pid"], int)
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
    return "alive" if _start_time(pid) == start else "dead"


def this_process() -> dict[str, Any]:
    """This process as a holder (the fields of ``holder_record``)."""
    pid = os.getpid()
    return {
        "boot": _read_text("/proc/sys/kernel/random/boot_id"),
        "host": socket.gethostname(),
        "pid": pid,
        "pidns": _pidns(),
        "start": _start_time(pid),
    }
