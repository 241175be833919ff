"""Plain (non-DTensor) tensors several ranks hold whole (SPEC.md §Block exchange, steps 2 and 4),
over a real 3-process Gloo group: their copies are compared by the one all-reduce of cancelling
sums that compares DTensor replicas, and all-gathered only when a sum is not zero.

- a buffer on every rank beside a sharded and a replicated DTensor: only the layout digest is
  all-gathered, the save restores bitwise, and its commit is the one the tree before this change
  (907577c) wrote;
- that buffer differing on one rank: TensorMismatch naming it and its holders, on every rank,
  after one more all-gather (the holders' digests);
- a buffer held by ranks 0 and 1 only (their layouts differ from rank 2's: the descriptions are
  all-gathered, and with them who holds it): it saves, with the commit before this change; when
  rank 1's copy differs, the error names ranks 0 and 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo_group import run_group_on_store

import shardstore as ss
import shardstore.sharded.dtensor as sdt

#: The commits of ``_body``'s ``all`` and ``some`` saves as the tree before the plain tensors'
#: comparison joined the all-reduce wrote them (907577c, where every holder's fingerprint was
#: all-gathered). The comparison writes nothing, so the ids must not move.
BEFORE_ALL = "085d463524a61ebd553215514eec40b028b1241cf7d5251e22dccc024965fb9c"
BEFORE_SOME = "8d9fb6ef0221de87cc7443e975e2e32ee5a39186be41ada0c1ee2ecc9476bc29"


def _body(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    store = ss.open_store(root)
    mesh = init_device_mesh("cpu", (world,))
    w = torch.arange(36.0).reshape(9, 4)
    r = torch.arange(5.0) + 0.25
    buf = torch.arange(6.0) * 0.5 + 1

    def state(holders: range, tweak: int | None = None) -> dict:
        st = {"w": distribute_tensor(w, mesh, [Shard(0)]), "r": distribute_tensor(r, mesh, [Replicate()])}
        if rank in holders:
            st["buf"] = buf.clone()
            if rank == tweak:
                st["buf"][3] += 1.0
        return st

    sent: list[int] = []
    gather = sdt.all_gather_bytes

    def counting(raw, group):
        sent.append(len(raw))
        return gather(raw, group)

    def save(st: dict) -> tuple[str, list[int]]:
        sent.clear()
        sdt.all_gather_bytes = counting
        try:
            cid = ss.save_distributed(
                store, st, info=ss.CommitInfo(step=1, job="plain"), rng=False, ref=None, parent=None
            )
        except ss.ShardstoreError as e:
            cid = f"{type(e).__name__}: {e}"
        finally:
            sdt.all_gather_bytes = gather
        return cid, list(sent)

    out: dict = {}
    out["all"], out["all_gathered"] = save(state(range(3)))
    back = {"w": torch.empty(9, 4), "r": torch.empty(5), "buf": torch.empty(6)}
    ss.restore(store, out["all"], back)
    out["all_equal"] = torch.equal(back["w"], w) and torch.equal(back["r"], r) and torch.equal(back["buf"], buf)
    out["all_differ"], out["all_differ_gathered"] = save(state(range(3), tweak=2))
    out["some"], out["some_gathered"] = save(state(range(2)))
    back = {"w": torch.empty(9, 4), "r": torch.empty(5), "buf": torch.empty(6)}
    ss.restore(store, out["some"], back)
    out["some_equal"] = torch.equal(back["buf"], buf)
    out["some_differ"], out["some_differ_gathered"] = save(state(range(2), tweak=1))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    _, results = run_group_on_store(_body, 3, tmp_path_factory.mktemp("plain"), timeout_s=60)
    return results


def test_a_buffer_on_every_rank_gathers_only_the_layout_digest(three):
    for r in three:
        assert r["all_equal"], r
        assert r["all_gathered"] == [33], r  # no JSON map of fingerprints: the all-reduce compared them
        assert r["all"] == BEFORE_ALL, r


def test_a_buffer_differing_on_one_rank_is_refused_naming_it_and_its_holders(three):
    for r in three:
        msg = r["all_differ"]
        assert msg.startswith("CommitProtocolError: "), msg  # every rank raises; the ref is not moved
        assert "tensor 'buf': ranks [0, 1, 2] hold it as a plain (not DTensor) tensor with different values" in msg
        # the layout digest, then (the sum not zero) every rank's digests of its shared copies
        assert len(r["all_differ_gathered"]) == 2 and r["all_differ_gathered"][0] == 33, r


def test_a_buffer_some_ranks_hold_saves_and_a_differing_copy_names_its_holders(three):
    for r in three:
        assert r["some_equal"], r
        assert r["some"] == BEFORE_SOME, r
        # the digest, then the descriptions (the layouts differ): nothing for the plain tensor
        assert len(r["some_gathered"]) == 2 and r["some_gathered"][0] == 33 < r["some_gathered"][1], r
        msg = r["some_differ"]
        assert msg.startswith("CommitProtocolError: "), msg
        assert "tensor 'buf': ranks [0, 1] hold it as a plain (not DTensor) tensor with different values" in msg
        assert len(r["some_differ_gathered"]) == 3, r
