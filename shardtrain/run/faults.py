"""Faults injected on purpose (``SHARDTRAIN_FAULT``): a worker lost at a chosen step and
microbatch, so the recovery tests and the demo can lose a worker (or a whole host) in the
middle of an update and check that the group resumes to the uninterrupted run's commit.

Nothing here runs unless the environment variable is set.
"""

from __future__ import annotations

import os
import signal
import time
from typing import NamedTuple

from shardtrain.errors import JobError

__all__ = ["FAULT_ENV", "Fault", "fault_from_env", "inject_fault"]

FAULT_ENV = "SHARDTRAIN_FAULT"


class Fault(NamedTuple):
    """One injected fault (``SHARDTRAIN_FAULT``): where it fires and how the worker is lost."""

    slot: int  # -1: every worker that reads the environment
    step: int
    microbatch: int
    once: str | None = None  # fire only if this file is absent, and create it
    host: bool = False  # also kill the torchrun agent: the whole host is lost
    hang: bool = False  # stop answering instead of exiting (the agent must stop the worker)


def fault_from_env() -> list[Fault]:
    """The faults SHARDTRAIN_FAULT asks for: ``slot=S,step=N,microbatch=M`` each, then options.

    Several faults are separated by ';'. ``slot=*`` is every worker that reads this
    environment: under torchrun, the workers of the node whose agent was given it. An
    optional ``attempt=A`` limits a fault to restart number A of this node's torchrun agent
    (its TORCHELASTIC_RESTART_COUNT, which each node counts for itself); ``once=PATH``
    fires it only if no file PATH exists, and creates it (a fault that fires once, whatever
    the restart counts); ``host=1`` also kills the worker's parent, the torchrun agent: the
    whole host is lost; ``hang=1`` makes the worker hang instead of exiting.
    """
    raw = os.environ.get(FAULT_ENV)
    out: list[Fault] = []
    for one in (raw or "").split(";"):
        if not one.strip():
            continue
        try:
            parts = dict(p.split("=", 1) for p in one.strip().split(","))
            if "attempt" in parts and int(parts["attempt"]) != int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
                continue
            once = parts.get("once")
            if once is not None and os.path.exists(once):
                continue
            out.append(
                Fault(
                    -1 if parts["slot"] == "*" else int(parts["slot"]),
                    int(parts["step"]),
                    int(parts["microbatch"]),
                    once,
                    parts.get("host") == "1",
                    parts.get("hang") == "1",
                )
            )
        except (ValueError, KeyError) as exc:
            raise JobError(
                f"{FAULT_ENV}={raw!r}: expected slot=S,step=N,microbatch=M[,attempt=A][,once=PATH]"
                f"[,host=1][,hang=1] (';' between faults)"
            ) from exc
    return out


def inject_fault(fault: Fault) -> None:
    """Lose this worker now as ``fault`` says, unless its ``once`` file says it already fired."""
    if fault.once is not None:
        try:
            os.close(os.open(fault.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    if fault.hang:
        while True:
            time.sleep(60)
    if fault.host:
        os.kill(os.getppid(), signal.SIGKILL)
    os._exit(3)
