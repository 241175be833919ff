"""A two-minute tour of the library: train a small model, save it as two slots, commit,
restore into a fresh model, verify, train more, commit again, and diff the two commits.

Run: ``python -m shardstore_cli.quickstart DIR``. Everything is local; nothing is downloaded.
"""

from __future__ import annotations

import random
import sys

import numpy as np
import torch

import shardstore

from .shardstore_cli import main as shardstore_cli


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, gen: torch.Generator) -> None:
    for _ in range(steps):
        x = torch.randn(16, 8, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x.flip(1)).backward()
        opt.step()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m shardstore_cli.quickstart DIR", file=sys.stderr)
        return 2
    random.seed(0)  # every RNG the commit records is seeded: same run, same commit ids
    np.random.seed(0)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 5, gen)

    store = shardstore.open_store(args[0])
    names = [n for n, _ in model.named_parameters()]
    slots = [shardstore.capture(model, opt, names=names[:2]), shardstore.capture(model, opt, names=names[2:])]
    first = shardstore.save_slots(store, slots, info=shardstore.CommitInfo(step=5, job="quickstart"), ref="main")
    print(f"commit {first} (2 slots, step 5)")

    fresh = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    shardstore.restore(store, "main", fresh, fresh_opt)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    print(f"restored into a fresh model: parameters equal = {same}")

    _train(fresh, fresh_opt, 3, gen)
    second = shardstore.save(store, fresh, fresh_opt, step=8, job="quickstart")
    print(f"commit {second} (1 slot, step 8, parent {store.commit(second).parent[:12]})")

    report = shardstore.verify(store)
    print(
        f"verify: {len(report.commits)} commits, {report.objects_checked} objects, {report.bytes_hashed} bytes hashed, "
        f"{'clean' if report.ok else f'{len(report.problems)} problems'}"
    )
    print(f"$ shardstore diff {args[0]} {first[:12]} {second[:12]}", flush=True)
    shardstore_cli(["diff", args[0], first, second])
    return 0 if report.ok and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
