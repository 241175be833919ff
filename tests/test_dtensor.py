"""DTensor state over real Gloo process groups: FSDP2 and tensor parallelism, saved without
gathering and restored into any split (SPEC.md §Chunked payloads, §Block exchange).

One group of 3 processes (``gloo_group.run_group``) serves every check (starting processes is the expensive
part):

- ranks 0 and 1, as a group of their own: FSDP2 trains 3 AdamW steps and saves (``c2``, and
  again through ``AsyncSaver.save_distributed`` while training goes on); the same ranks keep training
  (``uninterrupted``), and a fresh FSDP2 model restored from ``c2`` trains the same steps
  (``resumed2``); ``c2`` is restored into tensor parallelism splitting on dim 0 and on
  dim 1 and saved again (``tp0``, ``tp1``), and into a plain model per rank saved as two
  pipeline slots (``pp``);
- rank 2: the same state restored into a plain model and saved whole by one process;
- all 3 ranks: FSDP2 (10 rows over 3: 4, 4, 2) restores ``c2`` and the 1-process save of
  the same state, saves again (``c3``, into a store that already holds every block) and
  trains on (``resumed3``).

The model's ``fc1.weight`` is 10 x 131072 float32 (5 MiB: two column tiles of 10 x 65536,
SPEC.md §5.1), so every row split above cuts both tiles and the exchange moves pieces between
ranks; and every rank restoring a row split of it reads both tiles (a tensor of two tiles
cannot serve a row split and a column split both; ``tests/test_dtensor_mesh.py`` measures the
reads of a 64 MiB weight of 4 x 4 tiles at each rank's share).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dtensor_models import WIDE, Net
from dtensor_models import adamw as _opt
from dtensor_models import fsdp as _fsdp
from dtensor_models import train as _train
from gloo_group import run_group

import shardstore as ss
from shardstore.format.grid import payload_blocks
from shardstore.format.manifest import tensor_payloads
from shardstore.sharded.dtensor import BATCH_BYTES, last_exchange


def _equal_to_plain(model, opt, plain, popt) -> bool:
    """Every parameter and both moments, gathered (``full_tensor``), bitwise equal to a plain model's."""
    ok = True
    for (n, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        ok &= torch.equal(p.full_tensor(), q)
        for k in ("exp_avg", "exp_avg_sq"):
            ok &= torch.equal(opt.state[p][k].full_tensor(), popt.state[q][k])
        ok &= float(opt.state[p]["step"]) == float(popt.state[q]["step"])
    return bool(ok)


def _info(step: int) -> ss.CommitInfo:
    return ss.CommitInfo(step=step, job="dtensor-test")


def _two(rank: int, store: ss.Store, mesh, group, async_group) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    out: dict = {}
    m = _fsdp(mesh)
    opt = _opt(m)
    _train(m, opt, 3, seed=1)
    c2 = ss.save_distributed(store, m, opt, info=_info(3), rng=False, ref="main", group=group)
    out["exchange"] = vars(last_exchange()).copy()
    saver = ss.AsyncSaver(store)  # the same state, snapshot now, saved while training goes on
    saver.save_distributed(m, opt, info=_info(3), group=async_group, rng=False, ref=None, parent=None)
    plain, popt = Net(), None
    popt = _opt(plain)
    ss.restore(store, c2, plain, popt)
    out["saved_equals_plain_restore"] = _equal_to_plain(m, opt, plain, popt)
    _train(m, opt, 2, seed=7)
    out["async"] = saver.close()
    out["uninterrupted"] = ss.save_distributed(
        store, m, opt, info=_info(5), rng=False, ref=None, parent=c2, group=group
    )

    m2 = _fsdp(mesh)
    opt2 = _opt(m2)
    r = ss.restore(store, c2, m2, opt2)
    out["bytes_read"] = r.bytes_read
    out["share"] = sum(p.to_local().numel() * 4 * 3 for p in m2.parameters())  # param + 2 moments, fp32
    _train(m2, opt2, 2, seed=7)
    out["resumed2"] = ss.save_distributed(store, m2, opt2, info=_info(5), rng=False, ref=None, parent=c2, group=group)

    for key, plan in (
        ("tp0", {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}),  # fc1.weight Shard(0); fc2.bias Replicate
        ("tp1", {"fc1": RowwiseParallel(), "fc2": ColwiseParallel()}),  # fc1.weight Shard(1): 65536 columns each
    ):
        tp = parallelize_module(Net(), mesh, plan)
        topt = _opt(tp)
        ss.restore(store, c2, tp, topt)
        out[f"{key}_placements"] = str(tp.fc1.weight.placements)
        out[f"{key}_equals_plain"] = _equal_to_plain(tp, topt, plain, popt)
        out[key] = ss.save_distributed(store, tp, topt, info=_info(3), rng=False, ref=None, parent=None, group=group)

    mine = {n: p for n, p in plain.named_parameters() if n.startswith("fc1" if rank == 0 else "fc2")}
    out["pp"] = ss.save_distributed(store, mine, popt, info=_info(3), rng=False, ref=None, parent=None, group=group)
    out["c2"] = c2
    return out


def _three(rank: int, store: ss.Store, mesh, pair) -> dict:
    from torch.distributed.device_mesh import DeviceMesh

    out: dict = {}
    c2, c1 = store.ref("main"), store.ref("single")
    plain = Net()
    popt = _opt(plain)
    ss.restore(store, c2, plain, popt)
    m3 = _fsdp(mesh)
    opt3 = _opt(m3)
    r = ss.restore(store, c2, m3, opt3)
    out["local_rows"] = m3.fc1.weight.to_local().shape[0]
    out["bytes_read"] = r.bytes_read
    out["share"] = sum(p.to_local().numel() * 4 * 3 for p in m3.parameters())
    out["restored_equals_plain"] = _equal_to_plain(m3, opt3, plain, popt)
    mb = _fsdp(mesh)
    optb = _opt(mb)
    ss.restore(store, c1, mb, optb)  # the commit a single process wrote
    out["from_single_equals_plain"] = _equal_to_plain(mb, optb, plain, popt)
    dist.barrier()
    before = set(store.objects()) if rank == 0 else set()
    out["c3"] = ss.save_distributed(store, m3, opt3, info=_info(3), rng=False, ref=None, parent=None)
    if rank == 0:
        out["new_objects"] = sorted(set(store.objects()) - before)
    _train(m3, opt3, 2, seed=7)
    out["resumed3"] = ss.save_distributed(store, m3, opt3, info=_info(5), rng=False, ref=None, parent=c2)
    out["errors"] = _refusals(rank, store, m3, mesh)
    out["buffers"] = _buffers(rank, store, mesh)
    # FSDP2 on a sub-mesh (ranks 0 and 1) inside a 3-rank save, as a pipeline stage would be:
    # each entry must be recorded by a rank that holds the tensor, never by rank 2.
    sub, sopt = {}, None
    if rank < 2:
        sub = _fsdp(DeviceMesh.from_group(pair, "cpu"))
        sopt = _opt(sub)
        ss.restore(store, c2, sub, sopt)
    out["submesh"] = ss.save_distributed(store, sub, sopt, info=_info(3), rng=False, ref=None, parent=None)
    return out


def _buffers(rank: int, store: ss.Store, mesh) -> list[str]:
    """FSDP2 leaves buffers (BatchNorm's running stats) whole on every rank: equal ones are
    written once; ones that differ between ranks are refused, naming the tensor."""
    from torch.distributed.fsdp import fully_shard

    bn = torch.nn.Sequential(torch.nn.Linear(8, 10), torch.nn.BatchNorm1d(10))
    fully_shard(bn, mesh=mesh)
    bopt = _opt(bn)
    bn(torch.randn(4, 8, generator=torch.Generator().manual_seed(3))).sum().backward()  # the same batch on every rank
    bopt.step()
    out = [ss.save_distributed(store, bn, bopt, info=_info(1), rng=False, ref=None, parent=None)]
    if rank == 2:
        with torch.no_grad():
            bn[1].running_mean.add_(1.0)
    try:
        ss.save_distributed(store, bn, bopt, info=_info(1), rng=False, ref=None, parent=None)
    except ss.CommitProtocolError as e:
        out.append(str(e))
    return out


def _refusals(rank: int, store: ss.Store, model, mesh) -> list[str]:
    """Typed refusals: a Partial placement on one rank fails the save on every rank (the ref
    stays); a DTensor handed to the one-process save and to AsyncSaver."""
    from torch.distributed.tensor import DTensor, Partial

    out = []
    before = store.ref("main")
    mine = dict(model.named_parameters())
    if rank == 1:
        mine["partial"] = DTensor.from_local(torch.ones(2, 2), mesh, [Partial()], run_check=False)
    try:
        ss.save_distributed(store, mine, None, info=_info(3), rng=False)
    except ss.CommitProtocolError as e:
        out.append(f"CommitProtocolError: {e}")
    out.append(f"ref unmoved: {store.ref('main') == before}")
    out.append(_disagreements(rank, store, mesh))
    for save in (
        lambda: ss.save(store, model, step=3, rng=False, ref=None),
        lambda: ss.AsyncSaver(store).save(model, step=3, rng=False, ref=None),
    ):
        try:
            save()
        except ss.TensorMismatch as e:
            out.append(f"TensorMismatch: {e}")
    return out


def _disagreements(rank: int, store: ss.Store, mesh) -> list[str]:
    """Ranks that disagree on a tensor (issue 26): rank 2 omits a DTensor ranks 0-1 hold; passes a
    plain (7,) tensor for it; or a DTensor of another global shape. Every rank's error names the
    ranks and the shapes on each side."""
    from torch.distributed.tensor import DTensor, Shard

    def local(rows: int) -> DTensor:  # rows 2r, 2r+1 of a [6, 4] (or [rows, 4]) float32 tensor, on the 3-rank mesh
        return DTensor.from_local(
            torch.full((2, 4), float(rank)),
            mesh,
            [Shard(0)],
            run_check=False,
            shape=torch.Size((rows, 4)),
            stride=(4, 1),
        )

    cases = [
        {} if rank == 2 else {"d": local(6)},  # rank 2 omits it: rows 4-5 unheld
        {"d": torch.zeros(7)} if rank == 2 else {"d": local(6)},  # a plain tensor against DTensor slices
        {"d": local(8 if rank == 2 else 6)},  # different global shapes
    ]
    out = []
    for state in cases:
        try:
            ss.save_distributed(store, state, None, info=_info(3), rng=False, ref=None, parent=None)
            out.append("saved")
        except ss.CommitProtocolError as e:
            out.append(str(e))
    return out


def _readme_example(root: str) -> str:
    """README's "From torch.distributed.checkpoint to shardstore" block, run on this group's 3 ranks.

    Its ``init_process_group``/``destroy_process_group`` lines are dropped: the group exists.
    """
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = re.search(r"## From torch.distributed.checkpoint to shardstore.*?```python\n(.*?)```", readme, re.S).group(1)
    for line in ('dist.init_process_group("gloo")\n', "dist.destroy_process_group()\n"):
        assert line in code
        code = code.replace(line, "")
    ns: dict = {}
    exec(compile(code.replace("/tmp/fsdp-store", root), "README.md", "exec"), ns)  # noqa: S102 - our own README
    return ns["commit"]


def _body(rank: int, world: int, root: str) -> dict:
    """One group of 3 does everything: ranks 0 and 1 first form a 2-rank group."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    store = ss.open_store(root)
    pair = dist.new_group([0, 1])
    async_pair = dist.new_group([0, 1])  # the background save's own group (AsyncSaver.save_distributed)
    result: dict = {}
    if rank < 2:
        result["two"] = _two(rank, store, DeviceMesh.from_group(pair, "cpu"), pair, async_pair)
    dist.barrier()
    if rank == 2:  # meanwhile nothing; now the same state saved whole by one process
        plain = Net()
        popt = _opt(plain)
        ss.restore(store, "main", plain, popt)
        result["single"] = ss.save(store, plain, popt, step=3, job="dtensor-test", rng=False, ref="single", parent=None)
    dist.barrier()
    result["three"] = _three(rank, store, init_device_mesh("cpu", (world,)), pair)
    result["readme"] = _readme_example(f"{root}-readme")
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dtensor")
    root = str(tmp / "store")
    store = ss.open_store(root)
    results = run_group(_body, 3, tmp, root)
    readme = ([r["readme"] for r in results], root + "-readme")
    return store, [r["two"] for r in results[:2]], [r["three"] for r in results], results[2]["single"], readme


def test_readme_fsdp2_example_runs(runs):
    commits, root = runs[4]
    assert len(set(commits)) == 1
    store = ss.open_store(root, create=False)
    assert store.ref("main") == commits[0] and ss.verify(store).ok
    assert len(ss.load_commit(store, commits[0]).entries()["0.weight"].param) == 2  # 4096 x 512 float32: 2 blocks


def _tensor_objects(store: ss.Store, cid: str) -> set[str]:
    lc = ss.load_commit(store, cid)
    return {
        oid
        for e in lc.entries().values()
        for _, p, d in tensor_payloads(e)
        for oid, _, _ in payload_blocks(p, d, e.shape)
    }


def test_fsdp2_save_is_the_trained_state_and_continues_bitwise(runs):
    store, two, _, _, _ = runs
    assert all(r["saved_equals_plain_restore"] for r in two)
    assert two[0]["c2"] == two[1]["c2"] == store.ref("main")
    # AsyncSaver.save_distributed: snapshot, training went on, the background commit is the same one
    assert two[0]["async"] == two[1]["async"] == two[0]["c2"]
    # 2 -> 2: a fresh FSDP2 model restored from the commit trains to the very same state
    # (equal commit ids: every tensor byte, Adam age and group equal).
    assert two[0]["resumed2"] == two[0]["uninterrupted"] == two[1]["resumed2"]
    assert ss.verify(store).ok
    c2 = ss.load_commit(store, two[0]["c2"])
    assert (
        c2.commit.version == 4 and len(c2.entries()["fc1.weight"].param) == 2
    )  # 4: the tile grid (SPEC.md §5.1); slices recorded


def test_fsdp2_on_three_ranks_and_a_plain_model_restore_it_bitwise(runs):
    _, _, three, _, _ = runs
    assert [r["local_rows"] for r in three] == [4, 4, 2]  # uneven: 10 rows over 3 ranks
    assert all(r["restored_equals_plain"] for r in three)
    assert all(r["from_single_equals_plain"] for r in three)  # and the other way round


def test_tensor_parallel_on_dim_0_and_dim_1_restores_bitwise(runs):
    _, two, _, _, _ = runs
    assert two[0]["tp0_placements"] == "(Shard(dim=0),)" and two[0]["tp1_placements"] == "(Shard(dim=1),)"
    assert all(r["tp0_equals_plain"] and r["tp1_equals_plain"] for r in two)


def test_one_learned_state_root_and_one_set_of_objects_for_every_split(runs):
    store, two, three, single, _ = runs
    commits = {
        "1 process": single,
        "FSDP2 x2": two[0]["c2"],
        "FSDP2 x3 (uneven)": three[0]["c3"],
        "TP dim 0": two[0]["tp0"],
        "TP dim 1": two[0]["tp1"],
        "2 pipeline slots": two[0]["pp"],
        "FSDP2 on ranks 0-1 of a 3-rank save": three[0]["submesh"],
    }
    roots = {k: store.commit(c).learned_root for k, c in commits.items()}
    assert len(set(roots.values())) == 1, roots
    # The full root binds the layout, and each rank's shard manifest records the slices it held
    # (SPEC.md §15.5): FSDP2 and the two TP splits on 2 ranks are three commits of one learned state.
    assert len(set(commits.values())) == len(commits)
    objects = {k: _tensor_objects(store, c) for k, c in commits.items()}
    assert all(o == objects["1 process"] for o in objects.values())
    assert len(objects["1 process"]) == 3 * (
        2 + 3
    )  # fc1.weight: 2 blocks; 3 small tensors: 1 each; x (param, 2 moments)
    assert ss.verify(store).ok


def test_second_save_from_three_ranks_writes_no_tensor_bytes(runs):
    store, _, three, _, _ = runs
    c3 = three[0]["c3"]
    lc = ss.load_commit(store, c3)
    assert set(three[0]["new_objects"]) <= {c3, *lc.shard_ids.values()}


def test_save_moves_only_cut_pieces_and_stages_at_most_one_batch(runs):
    _, two, _, _, _ = runs
    ex = [r["exchange"] for r in two]
    # 10 rows over 2 ranks (5, 5); the two column tiles hold 5 rows of each rank, so the tied
    # slices take turns: each rank owns one tile and receives the other rank's 5 rows of it, for
    # fc1.weight and both moments (3 x 5 rows x 256 KiB each way); the small tensors' halves go
    # to whichever rank owns them
    half = 5 * (WIDE // 2) * 4
    assert all(e["bytes_sent"] >= 3 * half for e in ex) and sum(e["bytes_received"] for e in ex) == sum(
        e["bytes_sent"] for e in ex
    )
    assert ex[0]["bytes_sent"] + ex[1]["bytes_sent"] < 2 * 3 * half + 3 * 4096  # no byte travels twice
    assert sum(e["bytes_hashed"] for e in ex) == 3 * 4 * sum(p.numel() for p in Net().parameters())  # each block once
    assert all(e["peak_staged"] <= BATCH_BYTES for e in ex)
    print("exchange per rank:", ex)


def test_restore_reads_about_each_ranks_share(runs):
    _, two, three, _, _ = runs
    whole = 3 * 4 * sum(p.numel() for p in Net().parameters())
    for r in two + three:
        # whole blocks that overlap the slice: every row split of fc1.weight overlaps both of its
        # column tiles, so each rank reads all of fc1.weight and its moments (and whole each small
        # tensor it holds part of), never more than the checkpoint
        assert r["share"] <= r["bytes_read"] <= whole and r["bytes_read"] >= 3 * 4 * 10 * WIDE
    print("restore bytes read per rank / share:", [(r["bytes_read"], r["share"]) for r in two + three])


def test_unsupported_or_misplaced_dtensors_are_refused_by_type(runs):
    _, _, three, _, _ = runs
    for rank, r in enumerate(three):
        protocol, unmoved, disagree, one_process, async_saver = r["errors"]
        omitted, plain, shapes = disagree
        assert (
            "'d'" in omitted
            and "ranks [0, 1] hold no part" not in omitted
            and "rank 2 of the group holds no part of it" in omitted
        )
        assert (
            "rank 0 at [0, 0] of extent [2, 4], rank 1 at [2, 0] of extent [2, 4]" in omitted
            and "cover 16 of 24" in omitted
        )
        assert "ranks [0, 1] hold DTensor slices of a float32[6, 4] tensor, but rank 2: plain float32[7]" in plain
        assert (
            "ranks disagree on its global dtype and shape (ranks [0, 1]: float32[6, 4]; rank 2: float32[8, 4])"
            in shapes
        )
        assert protocol.startswith("CommitProtocolError") and "phase 'write shard' failed on rank(s) [1]" in protocol
        assert ("Partial" in protocol) == (rank == 1)  # the failing rank says why; nobody waits
        assert unmoved == "ref unmoved: True"
        assert one_process.startswith("TensorMismatch") and "save_distributed" in one_process
        assert async_saver.startswith("TensorMismatch") and "save_distributed" in async_saver


def test_fsdp2_buffers_are_written_once_and_must_agree(runs):
    store, _, three, _, _ = runs
    commits = {r["buffers"][0] for r in three}
    (cid,) = commits
    lc = ss.load_commit(store, cid)
    assert {n: e.kind for n, e in lc.entries().items() if e.kind == "buffer"} == {
        "1.running_mean": "buffer",
        "1.running_var": "buffer",
        "1.num_batches_tracked": "buffer",
    }
    assert sorted(n for lay in lc.commit.layout for n in lay.tensors) == sorted(lc.entries())  # each once
    plain = torch.nn.Sequential(torch.nn.Linear(8, 10), torch.nn.BatchNorm1d(10))
    ss.restore(store, cid, plain)
    assert int(plain[1].num_batches_tracked) == 1
    for r in three:
        assert "'1.running_mean'" in r["buffers"][1] and "different values" in r["buffers"][1]


def test_two_to_three_continuation_matches_within_tolerance(runs):
    store, two, three, _, _ = runs
    a, b = Net(), Net()
    ss.restore(store, two[0]["uninterrupted"], a)
    ss.restore(store, three[0]["resumed3"], b)
    bitwise = True
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-9, msg=n)
        bitwise &= torch.equal(p, q)
    # FSDP2 on 3 ranks reduce-scatters gradients in another order than on 2: not always bitwise
    print("2 -> 3 continuation bitwise equal to the uninterrupted 2-rank run:", bitwise)
