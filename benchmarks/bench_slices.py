"""Time of the commit slice check (SPEC.md §15.5) against a linear pass over the same slices.

Every reader of a commit with slices (verify, show, copy, gc, restore) checks that the
distinct slices of each tensor are disjoint and cover it. Two layouts, each an exact cover
of one 2-D tensor by ``n`` slices:

- **rows**: ``n`` full-width rows (FSDP2's dim-0 split on ``n`` ranks);
- **mixed**: ``n/2`` full-width rows over the top half and ``n/2`` half-height columns under
  them (issue 30: a check that swept along one dim held every column at once, and every
  reader took time growing with the square of ``n``).

Each case runs in a fresh process (``--limit`` seconds at most; a case cut off prints
"> limit"), ``--reps`` times, interleaved; the table gives the median time of
``commit_slice_problems`` and its ratio to the peer measured in the same process: the sum of
the boxes' volumes (one linear pass over the same records, the floor any check pays).
``--before TREE`` adds the same cases run with another checkout's ``shardstore`` (say, one
at the commit before the change).

    python benchmarks/bench_slices.py [--sizes 1000,10000,100000] [--reps 3] [--limit 120] [--before OLD_TREE]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys

__all__ = ["main"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Run in a child (argv: tree, layout, n): prints the check's seconds and the floor's.
_CASE = """
import math, sys, time
sys.path.insert(0, sys.argv[1])
from types import SimpleNamespace
from shardstore.format.manifest import Slice
from shardstore.format.slices import commit_slice_problems
layout, n = sys.argv[2], int(sys.argv[3])
if layout == "rows":
    shape = (n, 64)
    boxes = [((i, 0), (1, 64)) for i in range(n)]
else:
    half = n // 2
    shape = (2 * half, half)
    boxes = [((i, 0), (1, half)) for i in range(half)] + [((half, j), (half, 1)) for j in range(half)]
slices = tuple(Slice(name="w", start=s, shape=e) for s, e in sorted(boxes))
shards = {0: SimpleNamespace(slices=slices)}
entries = {"w": SimpleNamespace(shape=shape)}
t = time.perf_counter()
floor = sum(math.prod(x.shape) for x in slices)
t_floor = time.perf_counter() - t
assert floor == math.prod(shape)
t = time.perf_counter()
problems = list(commit_slice_problems(shards, entries))
t_check = time.perf_counter() - t
assert problems == [], problems
print(t_check, t_floor)
"""


def _case(tree: str, layout: str, n: int, limit: float) -> tuple[float, float] | None:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CASE, tree, layout, str(n)],
            capture_output=True,
            text=True,
            timeout=limit,
            check=True,
        )
    except subprocess.TimeoutExpired:
        return None
    check, floor = map(float, done.stdout.split())
    return check, floor


def _fmt(t: float) -> str:
    return f"{t * 1000:.1f} ms" if t < 1 else f"{t:.2f} s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000", help="slice counts, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--limit", type=float, default=120.0, help="seconds a case may run before it is cut off")
    ap.add_argument("--before", help="another checkout whose slice check to time alongside this one")
    args = ap.parse_args(argv)
    trees = [("this tree", ROOT)] + ([("--before", os.path.abspath(args.before))] if args.before else [])
    cases = [(layout, int(n), label, tree) for layout in ("rows", "mixed") for n in args.sizes.split(",")
             for label, tree in trees]  # fmt: skip
    times: dict[tuple, list[tuple[float, float] | None]] = {c: [] for c in cases}
    for _ in range(args.reps):
        for layout, n, label, tree in cases:
            if times[layout, n, label, tree] and times[layout, n, label, tree][-1] is None:
                continue  # cut off once: do not wait for it again
            times[layout, n, label, tree].append(_case(tree, layout, n, args.limit))
    print(
        f"slice check, median of {args.reps} fresh processes; load average {os.getloadavg()[0]:.1f}; "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print("| layout | slices | tree | check | floor (sum of volumes) | check ÷ floor |")
    print("|---|---|---|---|---|---|")
    for (layout, n, label, _), runs in times.items():
        if None in runs:
            print(f"| {layout} | {n:,} | {label} | > {args.limit:.0f} s (cut off) | | |")
            continue
        check = statistics.median(r[0] for r in runs)
        floor = statistics.median(r[1] for r in runs)
        print(f"| {layout} | {n:,} | {label} | {_fmt(check)} | {_fmt(floor)} | {check / floor:.0f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
