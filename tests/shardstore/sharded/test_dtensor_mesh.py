"""2-D meshes (FSDP2 x tensor parallelism) and strided shards over a real 4-process Gloo group,
and each rank's peak memory during a save, measured (SPEC.md §Slices on the grid, §Block exchange).

One group of 4 processes (mesh ``(dp, tp) = (2, 2)``) does everything, starting processes being
the expensive part:

- the model is made tensor parallel on ``tp`` (``fc1`` colwise: its weight ``Shard(0)``; ``fc2``
  rowwise) and then FSDP2-sharded on ``dp``, so ``fc1``'s tensors are
  ``(_StridedShard(0, sf=2), Shard(0))``; 2 AdamW steps, then ``save_distributed`` (and
  ``AsyncSaver.save_distributed``: the same commit);
- that commit is restored into the same 2-D mesh (saving again gives the same commit), into
  FSDP2 on ranks 0-1 (a 1-D mesh) and into a plain model on every rank, each bitwise; the
  learned-state root equals that of the plain model saved by one process;
- DTensors whose local tensor is *several* boxes of the global tensor (``_StridedShard`` with
  no later ``Shard`` to undo it: rows ``0-2, 5-7`` of 10 on one rank, columns ``0-1, 4-5`` of 8
  on another) are saved and restored into themselves and into plain tensors;
- a ``Partial`` placement on the 2-D mesh is refused naming the tensor;
- a 96 MiB tensor split by columns over the 4 ranks (every block assembled from 4 pieces) is
  saved with batches of 2 blocks while each rank measures its resident-set high-water mark.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.distributed as dist
from dtensor_models import WIDE, Net, train
from dtensor_models import adamw as _opt
from gloo_group import run_group
from read_counter import ReadCounter

import shardstore as ss
import shardstore.sharded.dtensor as sdt
import shardstore.sharded.exchange as sex
from shardstore.format.grid import BLOCK_BYTES

BIG = (96, 262144)  # 96 MiB float32, blocks of 4 rows (1 MiB each)
MiB = 1 << 20


def _two_d(mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    m = parallelize_module(Net(), mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(m.fc1, mesh=mesh["dp"])
    fully_shard(m, mesh=mesh["dp"])
    return m


def _equal_to_plain(model, opt, plain, popt) -> bool:
    """Every parameter and both moments, gathered (``full_tensor``), bitwise equal to a plain model's."""
    ok = True
    for (_, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        ok &= torch.equal(p.full_tensor(), q)
        for k in ("exp_avg", "exp_avg_sq"):
            ok &= torch.equal(opt.state[p][k].full_tensor(), popt.state[q][k])
        ok &= float(opt.state[p]["step"]) == float(popt.state[q]["step"])
    return bool(ok)


def _same_locals(model, opt, other, oopt) -> bool:
    """Every local tensor (parameter and moments) bitwise equal, same placements."""
    ok = True
    for (_, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        ok &= p.placements == q.placements and torch.equal(p.to_local(), q.to_local())
        for k in ("exp_avg", "exp_avg_sq"):
            ok &= torch.equal(opt.state[p][k].to_local(), oopt.state[q][k].to_local())
    return bool(ok)


def _info(step: int) -> ss.CommitInfo:
    return ss.CommitInfo(step=step, job="mesh-test")


def _model_checks(rank: int, store: ss.Store, mesh, pair, async_group) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    out: dict = {}
    m = _two_d(mesh)
    opt = _opt(m)
    train(m, opt, 2, seed=1, batch=2)
    out["placements"] = {n: str(p.placements) for n, p in m.named_parameters()}
    c = ss.save_distributed(store, m, opt, info=_info(2), rng=False, ref="main", parent=None)
    out["c2d"] = c
    # what the save all-gathers: one layout digest a rank (status byte + 32), nothing else; and the
    # same state through the full descriptions' path and the whole plan on every rank (the
    # algorithm before layouts and local plans: every rank's boxes all-gathered, every block
    # planned by plan_union) is the same commit
    sent: list[int] = []
    gather, agree, local = sdt.all_gather_bytes, sdt.layouts_agree, sdt.plan_local

    def counting(raw, group):
        sent.append(len(raw))
        return gather(raw, group)

    sdt.all_gather_bytes = counting
    try:
        out["by_layout"] = ss.save_distributed(store, m, opt, info=_info(2), rng=False, ref=None, parent=None)
        out["gathered_by_layout"] = list(sent)
        sent.clear()
        sdt.layouts_agree = lambda gathered: False
        sdt.plan_local = lambda union, world, rank: sdt.plan_union(union, world)
        out["by_descriptions"] = ss.save_distributed(store, m, opt, info=_info(2), rng=False, ref=None, parent=None)
        out["gathered_by_descriptions"] = list(sent)
    finally:
        sdt.all_gather_bytes, sdt.layouts_agree, sdt.plan_local = gather, agree, local
    saver = ss.AsyncSaver(store)  # the same state, snapshot (local tensors re-wrapped), saved in the background
    saver.save_distributed(m, opt, info=_info(2), group=async_group, rng=False, ref=None, parent=None)
    out["async"] = saver.close()
    plain = Net()
    popt = _opt(plain)
    ss.restore(store, c, plain, popt)
    out["plain_equal"] = _equal_to_plain(m, opt, plain, popt)  # (c) a plain model, on every rank
    again = _two_d(mesh)
    aopt = _opt(again)
    r = ss.restore(store, c, again, aopt)  # (a) the same 2-D mesh
    out["same_mesh_equal"] = _same_locals(m, opt, again, aopt)
    out["same_mesh_bytes_read"] = r.bytes_read
    out["same_mesh_resave"] = ss.save_distributed(store, again, aopt, info=_info(2), rng=False, ref=None, parent=None)
    train(m, opt, 1, seed=1, batch=2)
    train(again, aopt, 1, seed=1, batch=2)
    out["same_mesh_continues"] = _same_locals(m, opt, again, aopt)  # one more step: still bitwise equal
    if rank < 2:  # (b) FSDP2 on a 1-D mesh of ranks 0 and 1
        f = Net()
        fully_shard(f.fc1, mesh=DeviceMesh.from_group(pair, "cpu"))
        fully_shard(f, mesh=DeviceMesh.from_group(pair, "cpu"))
        fopt = _opt(f)
        ss.restore(store, c, f, fopt)
        out["fsdp2_equal"] = _equal_to_plain(f, fopt, plain, popt)
        out["fsdp2"] = ss.save_distributed(store, f, fopt, info=_info(2), rng=False, ref=None, parent=None, group=pair)
    if rank == 0:  # the same state saved whole by one process
        out["single"] = ss.save(store, plain, popt, step=2, job="mesh-test", rng=False, ref=None, parent=None)
    dist.barrier()
    return out


def _strided_checks(rank: int, store: ss.Store, mesh) -> dict:
    """DTensors whose local tensor is several boxes (``distribute_tensor`` makes them: DTensor's
    own split), saved, and restored into themselves and into plain tensors."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    g = torch.Generator().manual_seed(5)
    full = {"rows": torch.randn(10, WIDE, generator=g), "cols": torch.randn(4, 8, generator=g)}
    placements = {
        "rows": (Replicate(), _StridedShard(0, split_factor=2)),
        "cols": (_StridedShard(1, split_factor=2), Replicate()),
    }
    dts = {
        k: distribute_tensor(full[k], mesh, placements[k], src_data_rank=None) for k in full
    }  # every rank has full: split locally
    out: dict = {"parts": {k: len(sdt.local_region(t)[1]) for k, t in dts.items()}}
    c = ss.save_distributed(store, dts, None, info=_info(0), rng=False, ref=None, parent=None)
    out["commit"] = c
    plain = {k: torch.zeros_like(v) for k, v in full.items()}
    ss.restore(store, c, plain)
    out["plain_equal"] = all(torch.equal(plain[k], full[k]) for k in full)
    back = {k: distribute_tensor(torch.zeros_like(full[k]), mesh, placements[k], src_data_rank=None) for k in full}
    r = ss.restore(store, c, back)
    out["self_equal"] = all(torch.equal(back[k].to_local(), dts[k].to_local()) for k in full)
    out["bytes_read"] = r.bytes_read
    if rank == 0:
        out["single"] = ss.save(store, full, step=0, job="mesh-test", rng=False, ref=None, parent=None)
    bad = {
        "rows": DTensor.from_local(torch.zeros(10, WIDE), mesh, (Partial(), Replicate()), run_check=False),
        "cols": torch.zeros(4, 8),
    }
    try:  # a Partial destination: refused before any byte is read into either tensor
        ss.restore(store, c, bad)
    except ss.TensorMismatch as e:
        out["partial_restore"] = str(e)
    out["partial_untouched"] = bool((bad["rows"].to_local() == 0).all()) and bool((bad["cols"] == 0).all())
    partial = {"summed": DTensor.from_local(torch.ones(4, 4), mesh, (Partial(), Replicate()), run_check=False)}
    try:
        ss.save_distributed(store, partial, None, info=_info(0), rng=False, ref=None, parent=None)
    except ss.CommitProtocolError as e:
        out["partial"] = str(e)
    # Shard(0) twice, applied tp first (a shard order that is not the placements' own):
    # the placements alone would give the wrong rows, so it is refused.
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry

    t = distribute_tensor(torch.zeros(8, 4), mesh, (Shard(0), Shard(0)), src_data_rank=None)
    spec = DTensorSpec(
        mesh,
        (Shard(0), Shard(0)),
        tensor_meta=t._spec.tensor_meta,
        shard_order=(ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),),
    )
    try:
        ss.save_distributed(
            store,
            {"reordered": DTensor(t._local_tensor, spec, requires_grad=False)},
            None,
            info=_info(0),
            rng=False,
            ref=None,
            parent=None,
        )
    except ss.CommitProtocolError as e:
        out["order"] = str(e)
    return out


def _vm(key: bytes) -> int:
    with open("/proc/self/status", "rb") as f:
        for line in f.read(1 << 16).splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key!r} in /proc/self/status")


def _memory_check(rank: int, store: ss.Store, world_mesh) -> list[dict]:
    """A 96 MiB tensor split by columns (every block assembled from 4 ranks' strips) saved
    with batches of 2 blocks, twice (the second time with new values, so every block is
    written again): this rank's peak resident set during each save, measured."""
    from torch.distributed.tensor import DTensor, Shard

    rows, cols = BIG
    local = torch.randn(rows, cols // 4, generator=torch.Generator().manual_seed(rank))  # never the whole tensor
    big = DTensor.from_local(local, world_mesh, (Shard(1),), run_check=False, shape=torch.Size(BIG), stride=(cols, 1))
    out = []
    sex.BATCH_BYTES = 2 * BLOCK_BYTES
    try:
        for step in range(2):
            local.add_(1.0)
            dist.barrier()
            # Hand memory freed earlier back to the kernel, so that what the save allocates shows
            # as new resident pages rather than reusing free heap the baseline already counted.
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            with open("/proc/self/clear_refs", "wb") as f:
                f.write(b"5")  # VmHWM := VmRSS now
            before = _vm(b"VmRSS:")
            c = ss.save_distributed(store, {"big": big}, None, info=_info(step), rng=False, ref=None, parent=None)
            peak = _vm(b"VmHWM:")
            ex = vars(sex.last_exchange()).copy()
            out.append({"commit": c, "before": before, "peak": peak, "slice": local.numel() * 4, "exchange": ex})
    finally:
        sex.BATCH_BYTES = 16 * BLOCK_BYTES
    return out


READ = (4096, 4096)  # 64 MiB float32: 4 x 4 tiles of 1024 x 1024 (SPEC.md §5.1, version 4)


def _read_checks(rank: int, store: ss.Store, mesh, world_mesh) -> dict:
    """A 64 MiB weight saved from ``(Shard(0), Shard(1))`` on the 2 x 2 mesh, restored into
    row splits, column splits, the 2-D split and FSDP2-on-TP's strided rows: this rank's
    bytes read (counted by the restore at the storage reads) against its share."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    full = torch.randn(READ, generator=torch.Generator().manual_seed(11))  # every rank: split locally, not sent
    saved = distribute_tensor(full, mesh, (Shard(0), Shard(1)), src_data_rank=None)
    c = ss.save_distributed(store, {"w": saved}, None, info=_info(0), rng=False, ref=None, parent=None)
    out: dict = {"commit": c, "reads": {}}
    counter = ReadCounter(store.storage)
    counted = ss.Store(counter, create=False)  # the same store, its object reads counted at the storage layer
    dests = {
        "Shard(0) x4": (world_mesh, (Shard(0),)),
        "Shard(1) x4": (world_mesh, (Shard(1),)),
        "(Shard(0), Shard(1)) 2x2": (mesh, (Shard(0), Shard(1))),
        "FSDP2 on TP 2x2": (mesh, (_StridedShard(0, split_factor=2), Shard(0))),
    }
    for name, (m, placements) in dests.items():
        want = distribute_tensor(full, m, placements, src_data_rank=None)
        dest = distribute_tensor(torch.zeros(READ), m, placements, src_data_rank=None)
        before = counter.bytes
        r = ss.restore(counted, c, {"w": dest})
        out["reads"][name] = {"read": counter.bytes - before, "reported": r.bytes_read, "share": dest.to_local().numel() * 4,
                              "equal": torch.equal(dest.to_local(), want.to_local())}  # fmt: skip
    return out


def _body(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    store = ss.open_store(root)
    pair = dist.new_group([0, 1])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    result = {"memory": _memory_check(rank, store, init_device_mesh("cpu", (world,)))}  # first: a fresh heap
    result["model"] = _model_checks(rank, store, mesh, pair, dist.new_group(list(range(world))))
    result["strided"] = _strided_checks(rank, store, mesh)
    result["reads"] = _read_checks(rank, store, mesh, init_device_mesh("cpu", (world,)))
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mesh")
    root = str(tmp / "store")
    store = ss.open_store(root)
    return store, run_group(_body, 4, tmp, root)


def test_fsdp2_on_tensor_parallel_restores_into_any_mesh_bitwise(runs):
    store, results = runs
    model = [r["model"] for r in results]
    assert model[0]["placements"]["fc1.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert model[0]["placements"]["fc2.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert len({m["c2d"] for m in model}) == 1
    assert all(m["async"] == m["c2d"] for m in model)  # AsyncSaver.save_distributed: the same commit
    # the layout's digest alone crosses the network (33 bytes; the replicated fc2.bias is compared
    # by an all-reduce), and the plan from it is the descriptions' plan: the same commit
    assert all(m["by_layout"] == m["by_descriptions"] == m["c2d"] for m in model)
    assert all(m["gathered_by_layout"] == [33] for m in model), [m["gathered_by_layout"] for m in model]
    assert all(m["gathered_by_descriptions"][0] == 33 and m["gathered_by_descriptions"][1] > 1000 for m in model)
    assert all(m["plain_equal"] for m in model)  # (c) a plain model on every rank
    assert all(m["same_mesh_equal"] for m in model)  # (a) the same 2-D mesh, local tensor by local tensor
    assert all(m["same_mesh_resave"] == m["c2d"] for m in model)  # ... and saving it again is the same commit
    assert all(m["same_mesh_continues"] for m in model)  # ... and a step from it matches one from the original
    assert model[0]["fsdp2_equal"] and model[1]["fsdp2_equal"]  # (b) FSDP2 on a 1-D mesh of 2 ranks
    roots = {k: store.commit(model[0][k]).learned_root for k in ("c2d", "fsdp2", "single")}
    assert len(set(roots.values())) == 1, roots
    c = ss.load_commit(store, model[0]["c2d"])
    assert (
        c.commit.version == 4 and len(c.entries()["fc1.weight"].param) == 2
    )  # 4: the tile grid (SPEC.md §5.1); slices recorded
    assert ss.verify(store).ok


def test_local_tensors_of_several_boxes_are_saved_and_restored(runs):
    store, results = runs
    strided = [r["strided"] for r in results]
    # rows: tp coordinate 0 holds rows 0-2 and 5-7, coordinate 1 rows 3-4 and 8-9; cols: 0-1 and 4-5, 2-3 and 6-7
    assert all(s["parts"] == {"rows": 2, "cols": 2} for s in strided)
    assert len({s["commit"] for s in strided}) == 1
    assert all(s["plain_equal"] and s["self_equal"] for s in strided)
    assert store.commit(strided[0]["commit"]).learned_root == store.commit(strided[0]["single"]).learned_root
    # each rank reads the blocks its parts overlap, each once: the rows tensor's two column tiles
    # (all 10 rows, columns 0-65535 and 65536-131071) both hold rows of every rank; and the one
    # block of the small tensor
    assert [s["bytes_read"] for s in strided] == [10 * WIDE * 4 + 4 * 8 * 4 for rank in range(4)]


def test_each_rank_reads_its_share_for_row_column_2d_and_fsdp2_on_tp_splits(runs, tmp_path):
    """The tile grid's point (issue 26): bytes read per rank, counted at the reads, within 1.25x
    of its share for Shard(0), Shard(1), (Shard(0), Shard(1)) and FSDP2-on-TP; and ``copy --shard
    K`` of the 2 x 2 save copies slot K's share (its tiles), not the checkpoint."""
    store, results = runs
    reads = [r["reads"] for r in results]
    assert len({r["commit"] for r in reads}) == 1
    figures = {
        name: [(r["reads"][name]["read"], r["reads"][name]["share"]) for r in reads] for name in reads[0]["reads"]
    }
    saved = ss.load_commit(store, reads[0]["commit"])
    manifests = sum(len(store.get(o)) for o in [saved.id, *saved.shard_ids.values()])  # read by every restore first
    for name, per_rank in figures.items():
        for rank, (read, share) in enumerate(per_rank):
            assert reads[rank]["reads"][name]["equal"], (name, rank)
            assert share <= read <= 1.25 * share, (name, rank, read, share)
            assert (
                reads[rank]["reads"][name]["reported"] + manifests == read
            )  # Restored.bytes_read: the tensor bytes the storage served
    whole = READ[0] * READ[1] * 4
    lc = ss.load_commit(store, reads[0]["commit"])
    copied = []
    for k in range(4):  # copy --shard K, its object reads counted at the source's storage
        counter = ReadCounter(store.storage)
        dst = ss.open_store(str(tmp_path / f"slot{k}"))
        ss.copy_commit(ss.Store(counter, create=False), dst, lc.id, slot=k)
        copied.append(counter.bytes)
        manifests = sum(len(store.get(o)) for o in [lc.id, *lc.shard_ids.values()])
        assert whole / 4 <= counter.bytes - manifests <= 1.25 * whole / 4, (k, counter.bytes)
        assert ss.verify(dst, [lc.id], slot=k).ok
    print("restore bytes read / share per rank:", figures, "; copy --shard K bytes:", copied, "of", whole)


def test_partial_placement_is_refused_at_save_and_restore_naming_the_tensor(runs):
    _, results = runs
    for r in results:
        msg = r["strided"]["partial"]
        assert "'summed'" in msg and "Partial" in msg and "not saved state" in msg
        assert "'rows'" in r["strided"]["partial_restore"] and "Partial" in r["strided"]["partial_restore"]
        assert r["strided"]["partial_untouched"]
        assert (
            "'reordered'" in r["strided"]["order"]
            and "not its placements' left-to-right order" in r["strided"]["order"]
        )


def test_peak_memory_during_save_is_the_slice_plus_the_blocks_in_flight(runs):
    """Each rank's resident set during a save grows by the staging arena (the blocks in flight)
    and a small allowance, not by the tensor: the slice itself was resident before."""
    store, results = runs
    whole = BIG[0] * BIG[1] * 4
    batch = 2 * BLOCK_BYTES
    # What a save allocates besides the arena (Python objects, the description and id tables),
    # and, for a process's first save, once: thread pools, Gloo's pair buffers, allocator
    # heap (measured here: 3.5-4 MiB over the arena for the first save, under 1 MiB after).
    allowance = {"first save": 8 * MiB, "second save": 2 * MiB}
    figures: dict = {k: [] for k in allowance}
    for r in results:
        for m, kind in zip(r["memory"], allowance):
            increase = m["peak"] - m["before"]
            figures[kind].append(
                f"+{increase / MiB:.1f} MiB (staged {m['exchange']['peak_staged'] / MiB:.0f}, slice {m['slice'] / MiB:.0f})"
            )
            # the staged buffers of one batch (blocks assembled, column strips received, pieces
            # sent), carved from one arena that is reused batch after batch
            assert m["exchange"]["arena_bytes"] == m["exchange"]["peak_staged"] <= 2 * batch
            assert m["exchange"]["peak_staged"] > 0  # this split stages: every block comes from 4 ranks
            assert increase <= m["exchange"]["peak_staged"] + allowance[kind], figures
            assert increase < whole / 4  # not the whole tensor, not even another slice
    for step in range(2):
        assert len({r["memory"][step]["commit"] for r in results}) == 1
    print(
        f"peak RSS increase during save per rank: {figures}; whole tensor {whole / MiB:.0f} MiB, batch {batch / MiB:.0f} MiB"
    )
