"""Adversarial review of the block exchange by layout digest and local plans (SPEC.md §Block
exchange), over a real 3-process Gloo group: an odd world, so shards are uneven and some
empty, every block of a column split is assembled from pieces of several ranks, and two
meshes are used at once.

- layouts that agree (a 1-d mesh of 3 and a 1 x 3 "tp" mesh in one rank's state; uneven,
  empty, replicated and multi-block tensors, plain tensors beside): restored bitwise, and the
  commit is the one the descriptions' path and the whole plan on every rank give (the
  algorithm before the layout digest), and the one the tree before it (89eb2a6) gave;
- layouts that differ for one tensor only (rank 2 holds it on the 1 x 3 mesh, the others on
  the 1-d one: the same boxes): the descriptions' path, the same commit as when all agree;
- a replicated tensor whose copy on one rank differs in one element: TensorMismatch naming the
  tensor and its holders, on every rank, with no ref moved.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo_group import run_group_on_store

import shardstore as ss
import shardstore.sharded.dtensor as sdt

#: The commit of the agreeing layouts below as the tree before the layout digest and local
#: plans wrote it (89eb2a6: every rank's descriptions all-gathered, every block planned on every
#: rank; run there with this module's ``_body``, its ``agree`` save). Commit ids are the format's:
#: a change to them bumps the format version (SPEC.md), and this pin with it.
BEFORE_AGREE = "203b177ec11d8fbd4b77061c3fc427fd28ce466bde8201d9857e3056a3fe4172"


def _values(shape: tuple[int, ...], k: int) -> torch.Tensor:
    """Distinct, reproducible values (no RNG: the pinned commit ids above depend on them)."""
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float32) * 0.5 + k).reshape(shape)


def _dtensor(full: torch.Tensor, mesh, placements, tweak: float = 0.0):
    """This rank's DTensor of ``full``: its local tensor cut by ``distribute_tensor`` (no collective
    sends: every rank holds ``full``), then changed by ``tweak`` at its first element if non-zero."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    d = distribute_tensor(full, mesh, placements)
    local = d.to_local().clone()
    if tweak and local.numel():
        local.view(-1)[0] += tweak
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def _body(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    store = ss.open_store(root)
    line = init_device_mesh("cpu", (3,))
    tp = init_device_mesh("cpu", (1, 3), mesh_dim_names=("dp", "tp"))
    full = {
        "a": _values((7, 5), 1),  # 3, 3, 1 rows
        "b": _values((2, 5), 2),  # 1, 1, 0 rows: rank 2's slice is empty
        "c": _values((5, 7), 3),  # columns 3, 3, 1, on the 1 x 3 mesh
        "d": _values((5,), 4),  # replicated on all three
        "wide": _values((2, 700_001), 5),  # 2 blocks, each assembled from all three ranks' columns
        "z": _values((8, 3), 6),
        "buf": _values((4,), 7),  # plain
    }

    def state(z_mesh=line, z_pl=(Shard(0),), tweak_d: float = 0.0) -> dict:
        return {
            "a": _dtensor(full["a"], line, [Shard(0)]),
            "b": _dtensor(full["b"], line, [Shard(0)]),
            "c": _dtensor(full["c"], tp, [Replicate(), Shard(1)]),
            "d": _dtensor(full["d"], line, [Replicate()], tweak_d),
            "wide": _dtensor(full["wide"], line, [Shard(1)]),
            "z": _dtensor(full["z"], z_mesh, list(z_pl)),
            "buf": full["buf"].clone(),
        }

    def save(st: dict) -> str:
        return ss.save_distributed(store, st, info=ss.CommitInfo(step=1, job="three"), rng=False, ref=None, parent=None)

    out: dict = {}
    sent: list[int] = []
    gather = sdt.all_gather_bytes

    def counting(raw, group):
        sent.append(len(raw))
        return gather(raw, group)

    sdt.all_gather_bytes = counting
    try:
        out["agree"] = save(state())
        out["agree_gathered"] = list(sent)
        sent.clear()
        # rank 2 holds z on the 1 x 3 mesh: its layout differs, its boxes do not
        out["differ"] = save(state(tp, (Replicate(), Shard(0))) if rank == 2 else state())
        out["differ_gathered"] = list(sent)
    finally:
        sdt.all_gather_bytes = gather
    agree, local = sdt.layouts_agree, sdt.plan_local
    sdt.layouts_agree = lambda gathered: False  # the algorithm before: descriptions, whole plan
    sdt.plan_local = lambda union, world, rank: sdt.plan_union(union, world)
    try:
        out["before"] = save(state())
    finally:
        sdt.layouts_agree, sdt.plan_local = agree, local
    back = {n: torch.empty(t.shape) for n, t in full.items()}
    ss.restore(store, out["agree"], back)
    out["equal"] = all(torch.equal(back[n], full[n]) for n in full)
    try:  # rank 1's copy of the replicated d differs in one element
        save(state(tweak_d=1.0 if rank == 1 else 0.0))
        out["mismatch"] = "saved"
    except ss.ShardstoreError as e:
        out["mismatch"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    _, results = run_group_on_store(_body, 3, tmp_path_factory.mktemp("three"))
    return results


def test_agreeing_layouts_give_the_descriptions_commit_and_the_values(three):
    assert all(r["equal"] for r in three)
    assert len({r["agree"] for r in three}) == 1
    assert all(r["agree"] == r["before"] for r in three)  # descriptions + whole plan: the same commit
    # the layout digest (33 bytes) only: no description, no DTensor replica's hash, no plain tensor's
    # fingerprint (both compared by ``_copies_agree``'s one all-reduce)
    assert all(r["agree_gathered"] == [33] for r in three), three
    assert three[0]["agree"] == BEFORE_AGREE  # the tree before the change wrote this commit


def test_a_layout_differing_in_one_tensor_takes_the_descriptions_path_to_the_same_commit(three):
    for r in three:
        assert r["differ"] == r["agree"]
        # the digest, then the descriptions (longer); the plain tensor's fingerprint is not gathered
        assert len(r["differ_gathered"]) == 2 and r["differ_gathered"][0] == 33 < r["differ_gathered"][1]


def test_a_replica_differing_in_one_element_is_refused_naming_its_holders(three):
    for r in three:
        assert r["mismatch"].startswith("CommitProtocolError: "), r["mismatch"]  # the ref was not moved
        assert "tensor 'd'" in r["mismatch"] and "ranks [0, 1, 2]" in r["mismatch"], r["mismatch"]
        assert "different values" in r["mismatch"]
