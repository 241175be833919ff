"""Racing writers on one local store (issue 8, part 8). Children are forked (os.fork).

- K processes move one ref by compare-and-swap, round after round, each with a real
  commit: exactly one winner per round, every loser gets ``RefConflict``, and the ref's
  parent chain holds every acknowledged (winning) commit in order.
- Two trainers save into the same store at once, each on its own ref, sharing a frozen
  tensor (so their writes of that object collide) and then also racing on one shared ref
  with retry: neither corrupts the other's commits; every acknowledged commit verifies
  and restores to exactly the state its trainer saved.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

import torch

import shardstore as ss

SLOW = bool(os.environ.get("SHARDSTORE_SLOW"))


def _state(who: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * who + step)
    return {"frozen": torch.arange(64.0), "w": torch.randn(16, generator=g), "b": torch.full((4,), float(step))}


def _children(n: int, body: Any) -> list[int]:
    pids = []
    for i in range(n):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 0
            try:
                body(i)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 3
            os._exit(code)
        pids.append(pid)
    return [os.waitpid(p, 0)[1] for p in pids]


def test_k_processes_cas_one_ref(tmp_path: Any) -> None:
    k, rounds = (6, 20) if SLOW else (4, 6)
    root = str(tmp_path / "s")
    ss.open_store(root)
    barrier = mp.get_context("fork").Barrier(k)
    out = str(tmp_path / "out")
    os.makedirs(out)

    def body(me: int) -> None:
        store = ss.open_store(root, create=False)
        for r in range(rounds):
            barrier.wait()
            current = store.ref("main")
            barrier.wait()
            try:
                # the commit is written first (no ref), then all race on the ref at once
                cid = ss.save(
                    store, _state(me, r), step=r, rng=False, ref=None, parent=current, job=f"w{me}", threads=1
                )
                barrier.wait()
                store.set_ref("main", cid, expected=current)
                result = f"won {cid}"
            except ss.RefConflict:
                result = "lost"
            with open(os.path.join(out, f"{r}-{me}"), "w") as f:
                f.write(result)
            barrier.wait()

    assert all(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in _children(k, body))
    store = ss.open_store(root, create=False)
    winners = []
    for r in range(rounds):
        res = [open(os.path.join(out, f"{r}-{me}")).read() for me in range(k)]
        won = [x.split()[1] for x in res if x.startswith("won")]
        assert len(won) == 1 and res.count("lost") == k - 1, res
        winners.append(won[0])
    chain, c = [], store.ref("main")
    while c is not None:
        chain.append(c)
        c = store.commit(c).parent
    assert chain[::-1] == winners  # every acknowledged commit, in order, nothing lost
    assert ss.verify(store).ok


def test_two_trainers_share_a_store(tmp_path: Any) -> None:
    steps = 12 if SLOW else 5
    root = str(tmp_path / "s")
    ss.open_store(root)
    out = str(tmp_path / "acks")
    os.makedirs(out)

    def body(me: int) -> None:
        store = ss.open_store(root, create=False)
        acks = []
        for step in range(steps):
            acks.append(ss.save(store, _state(me, step), step=step, rng=False, ref=f"runs/t{me}", job=f"t{me}"))
            while True:  # and both also push to one shared ref, retrying on conflict
                current = store.ref("shared")
                try:
                    cid = ss.save(
                        store, _state(me, step), step=step, rng=False, ref=None, parent=current, job=f"t{me}-shared"
                    )
                    store.set_ref("shared", cid, expected=current)
                    acks.append(cid)
                    break
                except ss.RefConflict:
                    continue
        with open(os.path.join(out, str(me)), "w") as f:
            f.write("\n".join(acks))

    assert all(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in _children(2, body))
    store = ss.open_store(root, create=False)
    report = ss.verify(store)
    assert report.ok, [str(p) for p in report.problems]
    shared, c = set(), store.ref("shared")
    while c is not None:
        shared.add(c)
        c = store.commit(c).parent
    for me in range(2):
        acks = open(os.path.join(out, str(me))).read().split()
        assert len(acks) == 2 * steps
        for i, cid in enumerate(acks):
            step = i // 2
            if i % 2:
                assert cid in shared, "an acknowledged push to the shared ref was lost"
            assert ss.verify(store, [cid]).ok
            got = {n: torch.zeros_like(t) for n, t in _state(me, step).items()}
            ss.restore(store, cid, got)
            assert all(torch.equal(got[n], t) for n, t in _state(me, step).items())


# -- issue 12, item 2: pins are read-modify-written by compare-and-swap ----------------------


def _fake_ids(n: int, salt: str, root: str) -> list[str]:
    """``n`` small objects written straight into the layout of the local store at ``root`` (no
    fsync: only their ids matter); a pin names present objects (the gc fence checks, SPEC.md §19.2)."""
    from shardstore.format.tensors import hash_bytes
    from shardstore.store import object_key

    ids = []
    for i in range(n):
        data = f"{salt} {i}".encode()
        ids.append(hash_bytes(data))
        path = os.path.join(root, object_key(ids[-1]))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return ids


def test_pin_cas_refuses_a_stale_expected_value(tmp_path: Any) -> None:
    """``Store.pin(expected=...)`` is a real compare-and-swap: a value changed since it was
    read is not overwritten (before the fix, pin compared against a second read)."""
    store = ss.open_store(str(tmp_path / "s"))
    a, b, c = _fake_ids(3, "pin", str(tmp_path / "s"))
    store.pin("jobs/j", [a], expected=None)
    seen = store.pinned("jobs/j")
    store.add_to_pin("jobs/j", [b])  # another writer, in between
    import pytest

    with pytest.raises(ss.RefConflict):
        store.pin("jobs/j", [*seen, c], expected=seen)
    assert store.pinned("jobs/j") == tuple(sorted([a, b]))
    with pytest.raises(ss.RefConflict):
        store.pin("jobs/j", [c], expected=None)  # "absent" is a value too


def test_concurrent_copy_pin_loses_no_update(tmp_path: Any) -> None:
    """K processes each ``copy_commit(..., pins=["jobs/j"])`` from their own source into one
    destination whose pin is large (10,000 ids, so that a read-modify-write takes a while), all at once,
    round after round: the destination's pin ends holding every object any copy pinned."""
    k, rounds = 4, 2
    dst_root = str(tmp_path / "dst")
    dst = ss.open_store(dst_root)
    dst.pin("jobs/j", _fake_ids(10_000, "held", dst_root), expected=None)
    sources = []
    for i in range(k):
        src = ss.open_store(str(tmp_path / f"src{i}"))
        cid = ss.save(src, _state(i, 0), step=0, rng=False)
        sources.append((src, cid))
    barrier = mp.get_context("fork").Barrier(k)
    wanted: set[str] = set()
    for rnd in range(rounds):
        mine = []
        for i, (src, _cid) in enumerate(sources):
            oid = src.put(f"job file of source {i}, round {rnd}".encode())
            src.add_to_pin("jobs/j", [oid])
            mine.append(oid)
        wanted |= set(mine)

        def body(i: int) -> None:
            src, cid = sources[i]
            barrier.wait()
            ss.copy_commit(src, ss.open_store(dst_root, create=False), cid, pins=["jobs/j"], threads=1)

        assert [os.WEXITSTATUS(s) for s in _children(k, body)] == [0] * k
        lost = wanted - set(dst.pinned("jobs/j") or ())
        assert not lost, (rnd, sorted(lost))
