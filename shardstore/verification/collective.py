"""The collectives of a group's commit read (SPEC.md §16.3), bytes in uint8 tensors, never pickled.

Each is bounded before it allocates: a length every rank receives alike is checked against a
bound every rank computes alike, so a length over it is refused on every rank at once and no
rank is left waiting in the next collective. Imported only when a group is given: it imports
``torch.distributed`` (a store-only command never does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import FAILURE_BYTES, ManifestError, ShardstoreError, failure_report, raise_peer

__all__ = ["world", "rank", "broadcast_from_first", "gather"]


def world(group: Any) -> int:
    return dist.get_world_size(group)


def rank(group: Any) -> int:
    return dist.get_rank(group)


def broadcast_from_first(raw: bytes, group: Any, bound: int, what: str) -> bytes:
    """Group rank 0's ``raw`` on every rank (others pass b""): its length first, checked against
    ``bound`` on every rank (ManifestError on every rank if over), then the bytes."""
    n = torch.tensor([len(raw)], dtype=torch.int64)
    dist.broadcast(n, group=group, group_src=0)
    size = int(n.item())
    if not 0 <= size <= bound:
        raise ManifestError(f"{what}: group rank 0 sends {size} bytes, over the bound of {bound} (SPEC.md §16.3)")
    buf = torch.zeros(max(size, 1), dtype=torch.uint8)
    if dist.get_rank(group) == 0 and raw:
        buf[:size] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.broadcast(buf, group=group, group_src=0)
    return raw if dist.get_rank(group) == 0 else bytes(buf[:size].numpy().tobytes())


def gather(raw: bytes, error: BaseException | None, group: Any, bound: Callable[[int], int], where: str) -> list[bytes]:
    """Every rank's ``raw`` in group rank order, and an agreement: each rank sends its length and
    whether it failed (``error``; its ``raw`` is then not sent). If any rank failed, every rank
    raises: a failed rank its own ``error``, the others the first failed rank's (``raise_peer``),
    after only the failure reports travel, each bounded. Else every length is checked against
    ``bound(rank)`` (the same on every rank: ManifestError on every rank if one is over) before
    the bytes are gathered, padded to the longest."""
    report = failure_report(error) if error is not None else b""
    head = torch.tensor([len(report) if error is not None else len(raw), int(error is not None)], dtype=torch.int64)
    heads = [torch.zeros(2, dtype=torch.int64) for _ in range(world(group))]
    dist.all_gather(heads, head, group=group)
    sizes = [int(h[0].item()) for h in heads]
    failed = [bool(int(h[1].item())) for h in heads]
    if any(failed):
        for r, (n, bad) in enumerate(zip(sizes, failed)):
            if bad and not 0 <= n <= FAILURE_BYTES:
                raise ShardstoreError(
                    f"rank {r} of the group {where} failed, with a report of {n} bytes (SPEC.md §16.3)"
                )
        got = _all_gather(report, [n if bad else 0 for n, bad in zip(sizes, failed)], group)
        if error is not None:
            raise error
        raise_peer([g if bad else None for g, bad in zip(got, failed)], where)
    for r, n in enumerate(sizes):
        if not 0 <= n <= bound(r):
            raise ManifestError(
                f"rank {r} of the group {where} sends {n} bytes, over the bound of {bound(r)} (SPEC.md §16.3)"
            )
    return _all_gather(raw, sizes, group)


def _all_gather(raw: bytes, sizes: list[int], group: Any) -> list[bytes]:
    top = max(sizes, default=0)
    mine = torch.zeros(max(top, 1), dtype=torch.uint8)
    if raw:
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in sizes]
    dist.all_gather(out, mine, group=group)
    return [bytes(t[:n].numpy().tobytes()) for t, n in zip(out, sizes)]
