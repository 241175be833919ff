"""Schedule: the order in which each pipeline slot runs its microbatch actions in one step.

A step of the ring 0 -> 1 -> ... -> n-1 -> 0 over M microbatches is made of three kinds
of action (`Action`): `forward` k (slot 0: embed and run its layers; slot s > 0: receive
the activation and run its layers; every slot then sends on), `head` k (slot 0 only:
receive the last activation, final norm, output head, loss of microbatch k, send its
gradient back) and `backward` k (receive the gradient, run the layers' backward, send
it on; on slot 0 it ends in the embedding). Slot 0 is both the first and the last stage
of the ring, so its list interleaves all three kinds. A schedule is one tuple of actions
per slot; `Pipeline` executes it with asynchronous sends and blocking receives.

Two schedules, both a pure function of (number of slots, number of microbatches):

- ``synchronous`` (GPipe-like, the original order): every slot runs all forwards, slot 0
  then all heads, then every slot all backwards. Every slot holds the forward graphs of
  all M microbatches at once.
- ``overlapped`` (bounded one-forward-one-backward): stages work on different
  microbatches at once. The order is found by simulating the ring with a fixed cost
  model (a stage's forward 1, its backward 2, the head 1, messages free) and a list
  scheduler that, whenever a slot is idle, starts the first ready action of a priority
  order among (forward, head, backward), with at most `limit` microbatches in flight per
  slot (forward done, backward not yet). Every priority order and limit in n..n+2 is
  simulated and the shortest is kept (ties: the smaller limit, then the first order), so
  a slot never holds more than n + 2 microbatches' forward graphs (`in_flight`).
  Because the order is a complete execution of the step's dependency graph in that
  simulation, executing it with blocking receives cannot deadlock, whatever the real
  costs are (`check` re-proves it for any schedule).

Why the result is bitwise identical whichever schedule runs (so the schedule is a
runtime choice, not bound into the job; see docs/SHARDTRAIN-FORMATS.md §4): in both, each
slot runs its forwards, its heads and its backwards each in microbatch order (`check`
enforces it), every layer is its own autograd segment whose inputs are the same tensors
whatever else ran in between, and so every parameter receives the same gradient
contributions in the same order. The one parameter fed by two kinds of action is a tied
embedding (head and embedding backward); the synchronous order adds all M head
contributions before any embedding contribution, so the pipeline defers slot 0's
embedding backwards until the last head has run (holding each deferred microbatch's
(b, t, C) gradient, and the token ids the embedding's graph keeps) and then applies
them in microbatch order.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from typing import NamedTuple

from shardtrain.errors import ConfigError

__all__ = [
    "FORWARD",
    "HEAD",
    "BACKWARD",
    "SCHEDULES",
    "Action",
    "synchronous",
    "overlapped",
    "build",
    "check",
    "in_flight",
]

FORWARD, HEAD, BACKWARD = "forward", "head", "backward"
SCHEDULES = ("overlapped", "synchronous")
_COST = {FORWARD: 1, HEAD: 1, BACKWARD: 2}  # the simulation's cost model (arbitrary units)

Plan = tuple[tuple["Action", ...], ...]


class Action(NamedTuple):
    """One microbatch's forward, head (slot 0) or backward on one slot."""

    kind: str
    microbatch: int


def _dependency(action: Action, slot: int, n: int) -> tuple[str, int, int] | None:
    """The (kind, microbatch, slot) whose message `action` on `slot` waits for; None for none."""
    kind, k = action
    if kind == FORWARD:
        return None if slot == 0 else (FORWARD, k, slot - 1)
    if kind == HEAD:
        return (FORWARD, k, n - 1)
    if slot == n - 1:
        return (HEAD, k, 0)  # with one slot, the head's gradient is handed over locally
    return (BACKWARD, k, slot + 1)


def synchronous(num_slots: int, num_microbatches: int) -> Plan:
    """All forwards, then (slot 0) all heads, then all backwards, each in microbatch order."""
    _check_sizes(num_slots, num_microbatches)
    mbs = range(num_microbatches)
    return tuple(
        tuple(
            [Action(FORWARD, k) for k in mbs]
            + ([Action(HEAD, k) for k in mbs] if s == 0 else [])
            + [Action(BACKWARD, k) for k in mbs]
        )
        for s in range(num_slots)
    )


def _simulate(n: int, m: int, priority: tuple[str, ...], limit: int) -> tuple[int, Plan]:
    """List-schedule the step on the cost model; return (makespan, per-slot order)."""
    done: dict[tuple[str, int, int], int] = {}
    nxt = [{FORWARD: 0, HEAD: 0, BACKWARD: 0} for _ in range(n)]
    busy_until = [0] * n
    live = [0] * n
    order: list[list[Action]] = [[] for _ in range(n)]
    remaining = (2 * n + 1) * m
    events = [0]
    while remaining:
        now = heapq.heappop(events)
        for s in range(n):
            if busy_until[s] > now:
                continue
            for kind in priority:
                k = nxt[s][kind]
                if k >= m or (kind == HEAD and s != 0) or (kind == FORWARD and live[s] >= limit):
                    continue
                dep = _dependency(Action(kind, k), s, n)
                if dep is not None and done.get(dep, now + 1) > now:
                    continue
                nxt[s][kind] += 1
                live[s] += {FORWARD: 1, HEAD: 0, BACKWARD: -1}[kind]
                busy_until[s] = done[(kind, k, s)] = now + _COST[kind]
                order[s].append(Action(kind, k))
                heapq.heappush(events, busy_until[s])
                remaining -= 1
                break
    return max(done.values()), tuple(tuple(o) for o in order)


@functools.lru_cache(maxsize=256)
def overlapped(num_slots: int, num_microbatches: int) -> Plan:
    """The bounded overlapped order (see the module docstring); deterministic in its arguments."""
    _check_sizes(num_slots, num_microbatches)
    n, m = num_slots, num_microbatches
    best: tuple[int, int, int, Plan] | None = None
    for limit in range(n, n + 3):
        for rank, priority in enumerate(itertools.permutations((FORWARD, HEAD, BACKWARD))):
            span, plan = _simulate(n, m, priority, limit)
            if best is None or (span, limit, rank) < best[:3]:
                best = (span, limit, rank, plan)
    assert best is not None
    check(best[3], m)  # complete, ordered and deadlock-free (computed once per size: cached)
    return best[3]


def build(name: str, num_slots: int, num_microbatches: int) -> Plan:
    """The schedule called `name` (one of `SCHEDULES`)."""
    if name == "overlapped":
        return overlapped(num_slots, num_microbatches)
    if name == "synchronous":
        return synchronous(num_slots, num_microbatches)
    raise ConfigError(f"unknown pipeline schedule {name!r}; expected one of {', '.join(SCHEDULES)}")


def check(plan: Plan, num_microbatches: int) -> None:
    """Raise `ConfigError` unless `plan` runs every action once, each kind in microbatch order,
    heads on slot 0 only, and completes when run with blocking receives (no deadlock)."""
    n, m = len(plan), num_microbatches
    for s, actions in enumerate(plan):
        for kind in (FORWARD, HEAD, BACKWARD):
            got = [a.microbatch for a in actions if a.kind == kind]
            want = list(range(m)) if kind != HEAD or s == 0 else []
            if got != want:
                raise ConfigError(f"schedule: slot {s} runs {kind} of microbatches {got}, expected {want}")
        if len(actions) != (3 if s == 0 else 2) * m:
            raise ConfigError(f"schedule: slot {s} has actions of unknown kind")
        seen: set[int] = set()
        for a in actions:
            if a.kind == FORWARD:
                seen.add(a.microbatch)
            elif a.microbatch not in seen:
                raise ConfigError(f"schedule: slot {s} runs {a.kind} of microbatch {a.microbatch} before its forward")
    done: set[tuple[str, int, int]] = set()
    pos = [0] * n
    while any(pos[s] < len(plan[s]) for s in range(n)):
        moved = False
        for s in range(n):
            while pos[s] < len(plan[s]):
                a = plan[s][pos[s]]
                dep = _dependency(a, s, n)
                if dep is not None and dep not in done:
                    break
                done.add((a.kind, a.microbatch, s))
                pos[s] += 1
                moved = True
        if not moved:
            stuck = {s: plan[s][pos[s]] for s in range(n) if pos[s] < len(plan[s])}
            raise ConfigError(f"schedule deadlocks: slots wait on each other at {stuck}")


def in_flight(actions: tuple[Action, ...]) -> int:
    """The most microbatches whose forward graph one slot holds at once under `actions`."""
    live = peak = 0
    for a in actions:
        live += {FORWARD: 1, HEAD: 0, BACKWARD: -1}[a.kind]
        peak = max(peak, live)
    return peak


def _check_sizes(num_slots: int, num_microbatches: int) -> None:
    if num_slots < 1 or num_microbatches < 1:
        raise ConfigError(
            f"a schedule needs at least one slot and one microbatch, got {num_slots} and {num_microbatches}"
        )
