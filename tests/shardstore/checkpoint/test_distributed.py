"""The commit protocol over a real Gloo process group (two worker processes)."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
import torch._dynamo  # noqa: F401  before any group: see shardtrain.workers.launch.init_from_env
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import START_METHOD, TinyNet, make_optimizer, train_steps
from gloo_group import free_port

import shardstore as ss

try:
    from tests.s3_server import s3_server  # noqa: F401  (fixture)
except ImportError:  # pragma: no cover
    from s3_server import s3_server  # type: ignore[no-redef]  # noqa: F401


def _owned(model: torch.nn.Module, rank: int) -> list[str]:
    names = [n for n, _ in model.named_parameters()]
    return names[:3] if rank == 0 else names[3:]


class Position:
    """A stateful object (issue 13): commit-wide (a schedule) or one rank's own (a loader position)."""

    def __init__(self, pos: int) -> None:
        self.pos = pos

    def state_dict(self) -> dict:
        return {"pos": self.pos, "lr": [0.5 * self.pos]}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


class _Unstorable:
    def state_dict(self) -> dict:
        return {"fn": len}


def _save_trainer_state(store: ss.Store, model: torch.nn.Module, mine: dict, rank: int, result: dict) -> None:
    """Issue 13 on the distributed path: SGD's torch form, commit-wide and per-slot extras, and a rank
    whose commit-wide extras differ from rank 0's refused by every rank."""
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4, generator=torch.Generator().manual_seed(0))).sum().backward()
    sgd.step()
    info = ss.CommitInfo(step=3)
    result["trainer"] = ss.save_distributed(
        store, mine, sgd, info=info, ref="trainer", extra={"sched": Position(7)}, slot_extra={"loader": Position(rank)}
    )
    try:
        ss.save_distributed(store, mine, sgd, info=info, ref="trainer", extra={"sched": Position(7 + rank)})
    except ss.CommitProtocolError as e:
        result["differ"] = str(e)
    bad = {"loader": _Unstorable()} if rank == 1 else {"loader": Position(rank)}
    try:
        ss.save_distributed(store, mine, sgd, info=info, ref="trainer", slot_extra=bad)
    except ss.CommitProtocolError as e:
        result["unstorable"] = str(e)


def _worker(rank: int, world: int, port: int, root: str, scenario: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        store = ss.open_store(root)
        model = TinyNet()
        opt = make_optimizer(model)
        train_steps(model, opt, 2)
        mine = {n: p for n, p in model.named_parameters() if n in _owned(model, rank)}
        result: dict[str, object] = {}
        try:
            if scenario == "save":
                cid = ss.save_distributed(store, mine, opt, info=ss.CommitInfo(step=2))
                result["commit"] = cid
                result["agreed"] = ss.agree_on_commit(store, "main")
                if rank == 0:  # the same state saved whole by one process, same kernels and threads
                    result["single"] = ss.save(store, model, opt, step=2, ref=None)
                _save_trainer_state(store, model, mine, rank, result)
            elif scenario == "fail":
                if rank == 1:
                    mine = {**mine, "bad": torch.zeros(2, dtype=torch.complex64)}
                ss.save_distributed(store, mine, opt, info=ss.CommitInfo(step=2))
            elif scenario == "disagree":
                ss.agree_on_commit(store, "a" if rank == 0 else "b")
            elif scenario == "group_key":  # one stage's AdamW has a group key of its own, the other's has none
                params = [p for n, p in model.named_parameters() if n in mine]
                adamw = torch.optim.AdamW([{"params": params, **({"lr_mult": 0.25} if rank == 0 else {})}], lr=0.5)
                model(torch.ones(1, 4)).sum().backward()
                adamw.step()
                stage = [f"stage{rank}"]  # each stage names its group
                result["commit"] = ss.save_distributed(
                    store, mine, adamw, info=ss.CommitInfo(step=1), rng=False, group_names=stage
                )
        except ss.ShardstoreError as e:
            result["error"] = type(e).__name__
            result["message"] = str(e)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(tmp_path, scenario: str) -> tuple[str, list[dict]]:
    root = str(tmp_path / "store")
    ss.open_store(root)
    out = str(tmp_path / "result")
    mp.start_processes(
        _worker, args=(2, free_port(), root, scenario, out), nprocs=2, join=True, start_method=START_METHOD
    )
    return root, [json.load(open(f"{out}.{r}")) for r in range(2)]


def test_two_ranks_commit_one_id_and_restore_anywhere(tmp_path):
    root, results = _run(tmp_path, "save")
    assert results[0]["commit"] == results[1]["commit"] == results[0]["agreed"] == results[1]["agreed"]
    store = ss.open_store(root)
    cid = results[0]["commit"]
    assert store.ref("main") == cid and ss.verify(store).ok
    assert [len(lay.tensors) for lay in store.commit(cid).layout] == [3, 5]
    # The same state saved whole by one process has the same learned-state root.
    single = results[0]["single"]
    assert single != cid and store.commit(single).learned_root == store.commit(cid).learned_root
    _check_trainer_state(store, results)
    whole, whole_opt = TinyNet(seed=4), None
    whole_opt = make_optimizer(whole)
    ss.restore(store, single, whole, whole_opt)
    fresh = TinyNet(seed=5)
    fresh_opt = make_optimizer(fresh)
    ss.restore(store, cid, fresh, fresh_opt)
    for (n, p), (_, q) in zip(whole.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q), n
        assert torch.equal(whole_opt.state[p]["exp_avg_sq"], fresh_opt.state[q]["exp_avg_sq"]), n


def _check_trainer_state(store: ss.Store, results: list[dict]) -> None:
    trainer = results[0]["trainer"]
    assert results[1]["trainer"] == trainer and store.ref("trainer") == trainer  # the refused save moved nothing
    assert all("phase 'acknowledge' failed on rank(s) [1]" in r["differ"] for r in results)
    assert "rank 1's commit-wide extras ['sched'] differ from rank 0's" in results[1]["differ"]
    assert all("phase 'write shard' failed on rank(s) [1]" in r["unstorable"] for r in results)  # nobody hangs
    assert "extra 'loader' at $.fn" in results[1]["unstorable"]
    lc = ss.load_commit(store, trainer)
    assert lc.commit.optimizer.torch_optimizer.class_name == "torch.optim.sgd.SGD"
    assert [x.key for x in lc.commit.extras] == ["sched"] and all(
        lc.shards[s].extras[0].key == "loader" for s in (0, 1)
    )
    model = TinyNet(seed=9)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched, loader = Position(0), Position(-1)
    ss.restore(store, trainer, model, sgd, extra={"sched": sched}, slot_extra={"loader": loader}, slot=1)
    assert sched.pos == 7 and loader.pos == 1 and len(sgd.state) == len(list(model.parameters()))


def test_a_failing_rank_fails_every_rank_and_the_ref_stays(tmp_path):
    root, results = _run(tmp_path, "fail")
    assert [r["error"] for r in results] == ["CommitProtocolError", "CommitProtocolError"]
    assert all("rank(s) [1]" in r["message"] for r in results)
    assert ss.open_store(root).ref("main") is None


def test_workers_naming_different_commits_refuse_to_restore(tmp_path):
    root = str(tmp_path / "store")
    store = ss.open_store(root)
    store.set_ref("a", ss.save(store, {"w": torch.zeros(1)}, step=0, ref=None), expected=None)
    store.set_ref("b", ss.save(store, {"w": torch.ones(1)}, step=0, ref=None), expected=None)
    out = str(tmp_path / "result")
    mp.start_processes(
        _worker, args=(2, free_port(), root, "disagree", out), nprocs=2, join=True, start_method=START_METHOD
    )
    results = [json.load(open(f"{out}.{r}")) for r in range(2)]
    assert [r["error"] for r in results] == ["CommitProtocolError", "CommitProtocolError"]
    assert "different commits" in results[0]["message"]


def test_protocol_buffers_own_their_memory():
    """The protocol's collective buffers must not keep a Python object alive: a Gloo thread
    releasing one at interpreter exit aborts the process (tests/stress_teardown.py shows it).
    A `torch.frombuffer` tensor's storage is the kind that cannot be resized."""
    from shardstore.checkpoint.distributed import _FAIL, _OK, _pack, _unpack

    oid = "ab" * 32
    t = _pack(_OK, oid)
    assert t.dtype == torch.uint8 and t.untyped_storage().resizable()
    assert _unpack(t) == (_OK, oid)
    assert _pack(_FAIL, None).untyped_storage().resizable()
    assert _unpack(_pack(_FAIL, None)) == (_FAIL, None)


def test_acknowledging_reads_the_commit_manifest_not_every_shard_manifest():
    """Regression (issue 33): each rank acknowledged by loading the whole commit, every slot's
    shard manifest with every rule, so a save on N ranks read N² shard manifests (at 16,384
    ranks, the whole commit's metadata on every rank). The coordinator checks every rule
    before it names the commit (SPEC.md §15, step 4); a rank now reads back the commit
    manifest, verified against its id, and nothing else."""
    from faults import OpLog

    from shardstore.backends.location import open_storage
    from shardstore.checkpoint.distributed import commit_state
    from shardstore.state.slot import capture
    from shardstore.store.keys import object_key

    phase = [""]
    reads: list[tuple[str, str]] = []
    log = OpLog(open_storage("memory://ack-reads"), hook=lambda n, op, key: reads.append((phase[0], key)))
    store = ss.Store(log)
    model = TinyNet(seed=1)
    opt = make_optimizer(model)
    train_steps(model, opt, 1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cid = commit_state(
            store,
            lambda: capture(model, opt),
            info=ss.CommitInfo(step=1),
            on_phase=lambda name: phase.__setitem__(0, name),
        )
    finally:
        dist.destroy_process_group()
    shard = store.commit(cid).layout[0].shard
    read_at = {key for p, key in reads if p == "acknowledge"}
    assert object_key(cid) in read_at  # the commit manifest is read back
    assert object_key(shard) not in read_at  # its shard manifests are not (phase "write commit" checked them)
    assert object_key(shard) in {key for p, key in reads if p == "write commit"}


def _config_requests_body(rank: int, world: int, url: str, options: dict) -> dict:
    """Four commits on S3: the first into a fresh store, the second with its config present, the
    third with rank 2's config not rank 0's, the fourth with RNG states. Each rank counts the
    requests its storage sends for the model config object's key, commit by commit, and for its
    RNG objects' keys in the fourth."""
    from collections import Counter

    from shardstore.format.manifest import encode_config
    from shardstore.format.tensors import hash_bytes
    from shardstore.store.keys import object_key

    store = ss.open_store(url, **options)
    config = {"hidden_size": 8, "model_type": "tiny"}
    key = object_key(hash_bytes(encode_config(config)))
    counts: dict[str, Counter[str]] = {}
    real = store.storage.transport.call  # type: ignore[attr-defined]
    now = [""]

    async def call(method: str, k: str, **kw):
        if k == key:
            counts.setdefault(now[0], Counter())[method] += 1
        return await real(method, k, **kw)

    store.storage.transport.call = call  # type: ignore[attr-defined]
    mine = {f"w{rank}": torch.full((4,), float(rank))}
    out: dict = {}
    for name in ("fresh", "present"):
        now[0] = name
        out[name] = ss.save_distributed(store, mine, info=ss.CommitInfo(step=1, config=config), rng=False)
    now[0] = "differs"
    other = dict(config, hidden_size=16) if rank == 2 else config
    try:
        ss.save_distributed(store, mine, info=ss.CommitInfo(step=2, config=other), rng=False)
        out["differs"] = "saved"
    except ss.CommitProtocolError as e:
        out["differs"] = str(e)
    out["after_differs"] = store.ref("main")
    # RNG: torch's generator seeded alike on every rank (as DTensor needs), Python's and NumPy's per rank
    import random

    import numpy as np

    from shardstore.format.rng import capture_rng

    torch.manual_seed(0)
    random.seed(rank)
    np.random.seed(rank)
    states = capture_rng()
    rng_keys = {object_key(hash_bytes(v)): k for k, v in states.items()}
    now[0] = "rng"
    rng_counts: Counter[str] = Counter()

    async def call_rng(method: str, k: str, **kw):
        if k in rng_keys:
            rng_counts[f"{rng_keys[k]} {method}"] += 1
        return await real(method, k, **kw)

    store.storage.transport.call = call_rng  # type: ignore[attr-defined]
    out["rng"] = ss.save_distributed(store, mine, info=ss.CommitInfo(step=3, config=config))
    shard = store.shard(store.commit(out["rng"]).layout[rank].shard)
    out["rng_named"] = {e.kind: e.object for e in shard.rng}
    out["rng_ids"] = {k: hash_bytes(v) for k, v in states.items()}
    out["rng_counts"] = dict(rng_counts)
    out["counts"] = {k: dict(v) for k, v in counts.items()}
    out["key"] = key
    return out


def test_the_model_config_object_is_written_once_per_commit_not_by_every_rank(tmp_path, s3_server):  # noqa: F811
    """Issue 33 item 2 (e): every rank's write_shard wrote the model config object create-only, so
    on S3 N ranks sent N PUTs to one key, each then answered 412 and followed by a HEAD and a
    CopyObject: 3 N requests on a key S3 cannot spread. The coordinator now writes it once, in
    the commit's first phase, before any shard manifest names it (SPEC.md §15); the other ranks
    name it by id. A rank whose config differs still fails every rank, the ref unmoved. The same
    for the torch RNG object every rank holds alike: the coordinator writes its RNG objects and
    broadcasts their ids before the ranks write, and a rank names an object with one of them."""
    from gloo_group import run_group

    url = s3_server.url()
    ss.open_store(url, **s3_server.options)
    got = run_group(_config_requests_body, 3, tmp_path, url, s3_server.options)
    assert got[0]["fresh"] == got[1]["fresh"] == got[2]["fresh"]
    assert got[0]["counts"]["fresh"] == {"put_object": 1}  # created once, by the coordinator
    assert got[0]["counts"]["present"] == {"put_object": 1, "head_object": 1, "copy_object": 1}  # 412: refreshed
    for g in got[1:]:
        assert "fresh" not in g["counts"] and "present" not in g["counts"], g["counts"]  # named, never written
    assert all("phase 'write commit' failed on rank(s) [0]" in g["differs"] for g in got), got
    store = ss.open_store(url, **s3_server.options)
    present = got[0]["present"]
    assert all(g["after_differs"] == present for g in got)  # the refused commit did not move the ref
    assert store.commit(present).config == got[0]["key"].rsplit("/", 1)[-1]
    # the torch RNG object, the same on every rank, is written by the coordinator alone (before it
    # broadcasts its id) and named by the others; each rank's own Python and NumPy objects by that rank
    assert got[0]["rng"] == got[1]["rng"] == got[2]["rng"] == store.ref("main")
    assert got[0]["rng_ids"]["torch"] == got[1]["rng_ids"]["torch"] == got[2]["rng_ids"]["torch"]
    assert got[0]["rng_counts"] == {"python put_object": 1, "numpy put_object": 1, "torch put_object": 1}
    for g in got[1:]:
        assert g["rng_counts"] == {"python put_object": 1, "numpy put_object": 1}, g["rng_counts"]
    for g in got:
        assert g["rng_named"] == g["rng_ids"]  # each slot's manifest names its own states' objects
    assert ss.verify(store).ok


def _tier_body(rank: int, world: int, root: str, tiers: str) -> dict:
    """Each rank saves through a store with its own memory tier above it (write-through, as
    shardtrain's committer writes), torch's generator alike on every rank, then reads the commit's
    manifests through it (as the committer's ``landed`` does before it holds the commit)."""
    import random

    import numpy as np

    from shardstore.backends.memory_tier import MemoryTier
    from shardstore.backends.tiers import TieredStorage
    from shardstore.format.closure import commit_closure

    own = MemoryTier(os.path.join(tiers, f"host{rank}"), rank)
    store = ss.Store(TieredStorage(ss.open_store(root).storage, [own], fill=own), create=False)
    torch.manual_seed(0)
    random.seed(rank)
    np.random.seed(rank)
    mine = {f"w{rank}": torch.full((4,), float(rank))}
    cid = ss.save_distributed(store, mine, info=ss.CommitInfo(step=1, config={"hidden_size": 8}))
    closure = commit_closure(ss.load_commit(store, cid), slot=rank)
    return {"missing": sorted(closure.labels.get(o, o) for o in closure.ids() if not own.has(o))}


def test_each_ranks_memory_tier_holds_its_slot_closure_with_objects_another_rank_wrote(tmp_path):
    """The model config and the RNG objects alike on every rank are written by the coordinator alone
    (SPEC.md §15); a rank naming them without writing them still holds its own copy in its memory
    tier (SPEC.md §19.3), as when it wrote them: a tier lacking them never holds the commit
    (``MemoryTier.holds``), so its buddies never hold the slot's replica and a replacement host
    reads its slot from the store (tests/shardtrain/run/test_tier_recovery.py)."""
    from gloo_group import run_group

    root = str(tmp_path / "store")
    ss.open_store(root)
    got = run_group(_tier_body, 2, tmp_path, root, str(tmp_path / "tiers"))
    assert [g["missing"] for g in got] == [[], []], got


def _on_phase_body(rank: int, world: int, root: str) -> dict:
    from shardstore.checkpoint.distributed import commit_state
    from shardstore.state.slot import capture

    store = ss.open_store(root)
    mine = {f"w{rank}": torch.full((3,), float(rank))}

    def on_phase(name: str) -> None:
        if rank == 1 and name == "write shard":
            raise RuntimeError("injected on rank 1")

    try:
        commit_state(store, lambda: capture(mine), info=ss.CommitInfo(step=1), on_phase=on_phase)
        return {"error": None, "ref": store.ref("main")}
    except ss.CommitProtocolError as e:
        return {"error": str(e), "ref": store.ref("main")}


def test_an_on_phase_hook_failing_as_the_shards_are_written_fails_every_rank_none_waits(tmp_path):
    """``on_phase`` raising on one rank fails that phase on every rank (its docstring): in "write
    shard" the rank still joins the phase's own collectives (the coordinator's RNG ids, the block
    exchange) before the phase's all-gather; skipping them left the peers in a collective it never
    joined (Gloo aborted the process, or the group timed out)."""
    from gloo_group import run_group

    root = str(tmp_path / "store")
    ss.open_store(root)
    got = run_group(_on_phase_body, 2, tmp_path, root, timeout_s=30)
    assert all("phase 'write shard' failed on rank(s) [1]" in (g["error"] or "") for g in got), got
    assert got[1]["error"].endswith("injected on rank 1") and all(g["ref"] is None for g in got)


def _dtensor_tier_body(rank: int, world: int, root: str, tiers: str) -> dict:
    """Each rank saves through its own write-through memory tier (dim-0 splits: one-block tensors
    whose block straddles both ranks' rows, a four-block one whose blocks each lie in one rank's
    rows; a replicated DTensor; a plain tensor both hold whole), holds the commit in that tier as
    shardtrain's committer does (``SlotTiers.landed``) and replicates it to its buddy."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from shardstore.backends.memory_tier import MemoryTier
    from shardstore.backends.tiers import TieredStorage
    from shardstore.checkpoint.replicas import replicate
    from shardstore.format.closure import commit_closure

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    full = {
        "small": torch.randn(10, 8, generator=g),  # one block: owned by one rank, half of it on the other
        "odd": torch.randn(3, 5, generator=g),
        "big": torch.randn(3 * 1024, 1024, generator=g),  # 12 MiB: four tiles of 768 rows, two on each rank
        "rep": torch.randn(6, generator=g),  # replicated: written by one replica, held whole by both
    }
    state = {n: distribute_tensor(t, mesh, [Replicate() if n == "rep" else Shard(0)]) for n, t in full.items()}
    state["buf"] = torch.arange(4.0)  # a plain tensor both hold whole: one records it (SPEC.md §15.2 step 4)
    host = os.path.join(tiers, f"host{rank}")
    own = MemoryTier(host, rank)
    store = ss.Store(TieredStorage(ss.open_store(root).storage, [own], fill=own), create=False)
    cid = ss.save_distributed(store, state, info=ss.CommitInfo(step=1), rng=False)
    closure = commit_closure(ss.load_commit(store, cid), slot=rank)
    missing = sorted(closure.labels.get(o, o) for o in closure.ids() if not own.has(o))
    own.hold(cid, closure.ids())
    report = replicate(
        dist.group.WORLD, slot=rank, commit=cid, objects=closure.ids(), own=own,
        tier_for=lambda s: MemoryTier(host, s), replicas=1,
    )  # fmt: skip
    kept = MemoryTier(host, (rank - 1) % world).objects()  # this host's copy of the other slot
    return {"missing": missing, "holds": own.holds(cid) is not None, "holds_buddys": report.held, "kept": len(kept)}


def test_a_memory_tier_keeps_the_dtensor_blocks_its_rank_holds_whole_that_another_rank_wrote(tmp_path):
    """SPEC.md §15.2, §19.3: a DTensor block is written by one owner rank, but it is in the slot
    closure (§15.5) of every rank whose slices it overlaps. A replica's block another replica wrote
    is kept in this rank's tier from its own bytes as it saves, and so is a plain tensor several
    ranks hold whole that another slot records (hashed by this rank). What a rank holds only part
    of (a block that straddles two ranks' slices) its tier lacks after the save; ``replicate``
    first fills it from the tier of the rank that wrote it (``replicas.complete``), so both tiers
    hold the commit and both buddies its replica (before, rank 1's tier never held its commit and
    its buddy held nothing)."""
    from gloo_group import run_group

    root = str(tmp_path / "store")
    ss.open_store(root)
    got = run_group(_dtensor_tier_body, 2, tmp_path, root, str(tmp_path / "tiers"))
    assert got[0]["missing"] == [], got  # rank 0 keeps the replicated block rank 1 wrote
    # rank 1, after its save: the two one-block tensors rank 0 owns (half of each on rank 1); the plain
    # tensor rank 0 records it kept from its own bytes, hashed
    assert got[1]["missing"] == ["tensor 'odd', parameter", "tensor 'small', parameter"]
    assert all(g["holds"] and g["holds_buddys"] and g["kept"] > 0 for g in got), got


def test_ranks_whose_adams_differ_in_a_group_key_of_their_own_commit_it(tmp_path):
    """Pipeline stages whose AdamW groups differ in a key of their own (``lr_mult`` on one stage):
    that rank saved the torch form, the other the Adam form, and every rank's save was refused
    (slots of different algorithms), where it had committed before. Every rank saves the torch
    form, and each stage's key and state restore."""
    root, results = _run(tmp_path, "group_key")
    assert "error" not in results[0], results[0]
    cid = results[0]["commit"]
    assert results[1]["commit"] == cid
    store = ss.open_store(root)
    assert ss.load_commit(store, cid).commit.optimizer.algorithm == "torch"
    model = TinyNet()
    stage0 = {n: p for n, p in model.named_parameters() if n in _owned(model, 0)}  # rank 0's stage, as saved
    adamw = torch.optim.AdamW([{"params": list(stage0.values()), "lr_mult": 0.5}], lr=0.5)
    ss.restore(store, cid, stage0, adamw, slot=0, rng=False, group_names=["stage0"])
    assert adamw.param_groups[0]["lr_mult"] == 0.25 and len(adamw.state) == len(stage0)
