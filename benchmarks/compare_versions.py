"""Cold restore and deep verify of this checkout's shardstore against other trees, interleaved in one process.

On a shared machine two benchmark runs minutes apart see different loads; this loads each
tree's ``shardstore`` package under its own name (the package imports itself only
relatively), saves the same training state (``bench_checkpoint``'s shapes) into one store
per tree, then repeats, rotating the order each time: restore into the zeroed state from a
cold page cache (``drop_caches`` as root) and deep verify, each tree once, each followed
by BLAKE3 of the same bytes in a pool of two 1-thread hashers (the verify target's
limit), so that every ratio compares figures taken seconds apart.

    python benchmarks/compare_versions.py [--scale 0.5] [--reps 7] [--shapes many,few] NAME=TREE ...

``TREE`` is a directory holding a ``shardstore`` package (e.g. ``git archive 086da34 | tar
-x -C /tmp/old``); this checkout is always included as ``this``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType

import blake3
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_checkpoint as bc  # noqa: E402  (the same states and page-cache handling)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_tree(name: str, tree: str) -> ModuleType:
    """The ``shardstore`` package under ``tree``, imported as ``shardstore_<name>``."""
    pkg = os.path.join(tree, "shardstore")
    spec = importlib.util.spec_from_file_location(
        f"shardstore_{name}", os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg]
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def pool_hash(views: list[memoryview]) -> float:
    with ThreadPoolExecutor(2) as pool:
        t = time.perf_counter()
        list(pool.map(lambda v: blake3.blake3(v, max_threads=1).digest(), views))
        return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--shapes", default="many,few")
    ap.add_argument("trees", nargs="*", help="NAME=TREE")
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    bc.DROP = bc.can_drop()
    versions = {name: load_tree(name, tree) for name, tree in (t.split("=", 1) for t in args.trees)}
    versions["this"] = load_tree("this", ROOT)
    work = tempfile.mkdtemp(prefix="compare-", dir=os.path.dirname(ROOT))
    print(
        f"`python benchmarks/compare_versions.py --scale {args.scale} --reps {args.reps} --shapes {args.shapes} {' '.join(args.trees)}`"
    )
    print(f"page cache dropped before each restore: {bc.DROP}; load average at start: {os.getloadavg()[0]:.2f}")
    try:
        for shape in args.shapes.split(","):
            model, opt, sd, nbytes = bc.build_state(shape, args.scale)
            ref = bc.digest(sd)
            stores = {}
            for name, ss in versions.items():
                store = ss.open_store(os.path.join(work, f"{shape}-{name}"))
                stores[name] = (ss, store, ss.save(store, model, opt, step=1, rng=False))
            samples: dict[tuple[str, str], list[float]] = {}
            names = list(versions)
            loads = []
            for rep in range(args.reps):
                for name in names[rep % len(names) :] + names[: rep % len(names)]:
                    ss, store, cid = stores[name]
                    with torch.no_grad():
                        for t in sd.values():
                            t.zero_()
                    bc.cold()
                    t0 = time.perf_counter()
                    ss.restore(store, cid, model, opt, threads=bc.RESTORE_THREADS)
                    samples.setdefault((name, "restore"), []).append(time.perf_counter() - t0)
                    sd = bc.flat_state(model, opt)
                    if bc.digest(sd) != ref:
                        raise SystemExit(f"{name}: restored state differs from the saved one")
                    t0 = time.perf_counter()
                    rep_ = ss.verify(store, [cid])
                    samples.setdefault((name, "verify"), []).append(time.perf_counter() - t0)
                    if not rep_.ok:
                        raise SystemExit(f"{name}: verify found problems")
                    samples.setdefault((name, "blake3 pool"), []).append(pool_hash(bc.views(sd)))
                loads.append(os.getloadavg()[0])
            objects = {name: sum(1 for _ in stores[name][1].objects()) for name in names}
            print(
                f"\n### {shape}: {len(sd)} tensors, {nbytes / bc.GIB:.2f} GiB; load average during the run {min(loads):.1f}–{max(loads):.1f}\n"
            )
            print(
                "| tree | objects | cold restore s, median (min–max) | deep verify s | BLAKE3 2 x 1-thread pool s | verify ÷ BLAKE3 speed |"
            )
            print("|---|---|---|---|---|---|")
            for name in names:
                cell = []
                for op in ("restore", "verify", "blake3 pool"):
                    s = samples[(name, op)]
                    cell.append(f"{statistics.median(s):.3f} ({min(s):.3f}–{max(s):.3f})")
                ratio = statistics.median(
                    b / v for b, v in zip(samples[(name, "blake3 pool")], samples[(name, "verify")])
                )
                print(f"| {name} | {objects[name]} | {cell[0]} | {cell[1]} | {cell[2]} | {ratio:.2f}× |")
            del model, opt, sd
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
