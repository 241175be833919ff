"""Start-up time of the ``shardstore`` command line against named peers, in one run.

Each command runs as a fresh process, ``--reps`` times, interleaved with the peers so that a
busy machine slows every row alike; the table gives the median wall time and its ratio to
the interpreter's own start (``python -c pass``). Peers: ``python -c pass`` (the floor any
Python tool pays), ``python -c "import torch"`` (what every command paid before the
store-only commands stopped importing torch) and ``git --version`` (what users compare a
command line with). ``--before TREE`` adds the same commands run from another checkout
(say, one at the commit before the change), loaded from that tree's ``cli/`` folder.

    python benchmarks/bench_cli_startup.py [--reps 7] [--before /tmp/old-checkout]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ["main"]

#: Loads a checkout's CLI from its cli/ folder (installed as shardstore_cli) and runs it.
_FROM_TREE = (
    "import importlib.util, sys; tree = sys.argv.pop(1); sys.path.insert(0, tree); "
    "spec = importlib.util.spec_from_file_location('shardstore_cli', tree + '/cli/__init__.py', "
    "submodule_search_locations=[tree + '/cli']); m = importlib.util.module_from_spec(spec); "
    "sys.modules['shardstore_cli'] = m; spec.loader.exec_module(m); "
    "from shardstore_cli.shardstore_cli import main; sys.exit(main(sys.argv[1:]))"
)


def _make_store(path: str) -> str:
    """A small store with two commits (made by the library, in a child: this process stays torch-free)."""
    code = (
        "import sys, torch, shardstore as ss; s = ss.open_store(sys.argv[1]); m = torch.nn.Linear(64, 64); "
        "o = torch.optim.AdamW(m.parameters()); ss.save(s, m, o, step=1); m(torch.randn(2, 64)).sum().backward(); "
        "o.step(); print(ss.save(s, m, o, step=2))"
    )
    return subprocess.run([sys.executable, "-c", code, path], check=True, capture_output=True, text=True).stdout.strip()


def _time(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--before", help="another checkout whose CLI to time alongside this one")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        store = os.path.join(tmp, "store")
        _make_store(store)
        py = sys.executable
        here = [py, "-m", "shardstore_cli.shardstore_cli"]
        rows: dict[str, list[str]] = {
            "python -c pass (floor)": [py, "-c", "pass"],
            'python -c "import torch" (peer)': [py, "-c", "import torch"],
        }
        if shutil.which("git"):
            rows["git --version (peer)"] = ["git", "--version"]
        for name, sub in (
            ("--version", ["--version"]),
            ("log", ["log", store]),
            ("show main", ["show", store, "main"]),
            ("verify", ["verify", store]),
            ("gc --dry-run", ["gc", store, "--dry-run"]),
        ):
            rows[f"shardstore {name}"] = [*here, *sub]
            if args.before:
                rows[f"shardstore {name} (--before)"] = [py, "-c", _FROM_TREE, args.before, *sub]
        times: dict[str, list[float]] = {k: [] for k in rows}
        for _ in range(args.reps):  # interleaved: every row sees the same moments of the machine
            for k, cmd in rows.items():
                times[k].append(_time(cmd))
    floor = statistics.median(times["python -c pass (floor)"])
    load = os.getloadavg()[0]
    print(
        f"CLI start-up, median of {args.reps} fresh processes each (interleaved); load average {load:.1f}; "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print("| command | median | range | × python -c pass |")
    print("|---|---|---|---|")
    for k, ts in times.items():
        med = statistics.median(ts)
        print(f"| {k} | {med:.3f} s | {min(ts):.3f}–{max(ts):.3f} s | {med / floor:.1f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
