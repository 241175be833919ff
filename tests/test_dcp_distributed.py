"""``shardstore.dcp`` under real Gloo groups: DCP's own save and load, FSDP2, resharding,
async saves and a failure injected at every call on every rank (SPEC.md §9.4).

One group of 3 processes (``gloo_group.run_group``) serves every check:

- ranks 0 and 1, as a group of their own: FSDP2 (``dtensor_models.Net``) trains 2 AdamW steps
  and ``dcp.save``s ``get_state_dict(model, opt)`` through ``StoreWriter`` (``c2``); the same
  state through ``dcp.async_save`` in thread mode (ref ``thread``); then once per DCP call and
  rank that runs it, a ``StoreWriter`` that fails
  there (as DCP's own ``FaultyStorageWriter`` tests do), a ref moved by someone else during
  the save, and a failing ref move;
- all 3 ranks: FSDP2 over 3 ranks (10 rows: 4, 4, 2) ``dcp.load``s ``c2`` through
  ``StoreReader``, each rank counting the object bytes it read;
- rank 2 alone (``no_dist``): a plain model loads it.

``async_save`` in process mode starts a fresh interpreter per rank (about 20 s), so it has a
2-rank group of its own, marked ``long``.

The model's ``fc1.weight`` is 10 x 131072 float32: each rank's chunk of it is 2.5 MiB, one
object, so which chunks a rank's load plan overlaps decides exactly which objects it reads.
"""

from __future__ import annotations

import math
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dtensor_models import Net
from dtensor_models import adamw as _opt
from dtensor_models import fsdp as _fsdp
from dtensor_models import train as _train
from gloo_group import run_group
from read_counter import ReadCounter
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardstore as ss
from shardstore.backends.local import LocalStorage
from shardstore.dcp import StoreReader, StoreWriter
from shardstore.format.dcp import dcp_extra

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

#: Every call DCP makes on a storage writer, and which ranks make it (0 is the coordinator).
CALLS = {
    "reset": (0, 1),  # made because the saves pass checkpoint_id; before DCP's first collective (below)
    "set_up_storage_writer": (0, 1),
    "prepare_local_plan": (0, 1),
    "prepare_global_plan": (0,),
    "write_data": (0, 1),
    "write_data_future": (0, 1),  # the returned future fails, not the call
    "finish": (0,),
}


class Faulty(StoreWriter):
    """A ``StoreWriter`` that raises in one DCP call on one rank (``fail``: (call, rank))."""

    def __init__(self, *args, fail: tuple[str, int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail = fail

    def _maybe(self, call: str) -> None:
        if self.fail == (call, dist.get_rank()):
            raise RuntimeError(f"injected failure in {call} on rank {dist.get_rank()}")

    def reset(self, checkpoint_id=None):
        self._maybe("reset")
        return super().reset(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        self._maybe("set_up_storage_writer")
        return super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan):
        self._maybe("prepare_local_plan")
        return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans):
        self._maybe("prepare_global_plan")
        return super().prepare_global_plan(plans)

    def write_data(self, plan, planner):
        self._maybe("write_data")
        fut = super().write_data(plan, planner)
        if self.fail == ("write_data_future", dist.get_rank()):
            fut = torch.futures.Future()
            fut.set_exception(RuntimeError("injected failure in write_data's future"))
        return fut

    def finish(self, metadata, results):
        self._maybe("finish")
        return super().finish(metadata, results)


def _state(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"step": 2, "note": "dcp"}}


def _full(sd: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP state dict, gathered (``full_tensor``), by flattened key."""
    out = {}
    for part in ("model", "optim"):
        flat = {f"{part}.{k}": v for k, v in sd[part].items()} if part == "model" else _flatten_optim(sd[part])
        for k, v in flat.items():
            out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return out


def _flatten_optim(osd: dict) -> dict[str, torch.Tensor]:
    return {f"optim.{p}.{k}": v for p, s in osd["state"].items() for k, v in s.items() if isinstance(v, torch.Tensor)}


def _save_two(rank: int, root: str, tmp: str, pair, async_pair) -> dict:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import DeviceMesh

    out: dict = {}
    store = ss.open_store(root)
    m = _fsdp(DeviceMesh.from_group(pair, "cpu"))
    opt = _opt(m)
    _train(m, opt, 2, seed=1)
    sd = _state(m, opt)
    full = _full(sd)
    if rank == 0:
        save_file(full, f"{tmp}/reference.safetensors")
    writer = StoreWriter(root, ref="main", step=2)
    md = dcp.save(sd, storage_writer=writer, process_group=pair)
    out["c2"] = store.ref("main")
    out["last_commit"] = writer.last_commit  # the coordinator's writer names it; the others' None
    out["metadata_equal"] = StoreReader(root, out["c2"]).read_metadata() == md
    f = dcp.async_save(
        sd,
        storage_writer=StoreWriter(root, ref="thread", step=2),
        process_group=async_pair,
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
    )
    f.result(timeout=300)
    out["thread"] = store.ref("thread")
    out["faults"] = _faults(rank, root, sd, pair)
    return out


def _faults(rank: int, root: str, sd: dict, pair) -> list[dict]:
    """One save per (call, rank) that runs it, failing there; then a save during which another
    writer moves the ref, and one whose ref move itself fails. Every rank raises each time, and
    the ref stays where it was (where the other writer put it, for the second)."""
    store = ss.open_store(root)
    cases = [(call, r) for call, ranks in CALLS.items() for r in ranks] + [("moved", 0), ("set_ref", 0)]
    other = ss.save(store, {"x": torch.zeros(1)}, step=0, job="other", rng=False, ref=None, parent=None)
    out = []
    for call, r in cases:
        before = store.ref("main")
        writer = Faulty(root, ref="main", step=3, fail=(call, r))
        if call == "moved" and rank == 0:  # another writer moves the ref while this save runs
            writer.prepare_global_plan = _then(
                writer.prepare_global_plan, lambda: store.set_ref("main", other, expected=before)
            )
        if call == "set_ref" and rank == 0:  # the compare-and-swap itself fails (a storage error)
            writer.handle.open(create=True).set_ref = _raise
        # DCP calls reset before its first collective and does not tell the other ranks it failed: they
        # wait in that collective until the group's timeout. Those saves run on a group of their own
        # with a short timeout (and never used again), so the other rank raises too, seconds later.
        group = dist.new_group([0, 1], timeout=timedelta(seconds=3)) if call == "reset" else pair
        raised = ""
        try:
            dcp.save(sd, checkpoint_id="main", storage_writer=writer, process_group=group)
        except BaseException as e:  # DCP raises CheckpointException (a BaseException) naming each rank's failure
            raised = type(e).__name__
        dist.barrier(group=pair)
        now = store.ref("main")
        out.append({"case": f"{call}@{r}", "raised": raised, "ref": now, "before": before, "other": other})
        dist.barrier(group=pair)
        if call == "moved" and rank == 0:
            store.set_ref("main", before, expected=now)  # put it back for the next case
        dist.barrier(group=pair)
    return out


def _then(fn, after):
    def run(*args, **kwargs):
        result = fn(*args, **kwargs)
        after()
        return result

    return run


def _raise(*args, **kwargs):
    raise ss.StorageError("injected: the ref move failed")


def _boxes(sd: dict, rank: int, world: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each flattened key's box of the global tensor this rank holds (FSDP2: rows ``torch.chunk`` gives it)."""
    out = {}
    flat = {f"model.{k}": v for k, v in sd["model"].items()} | _flatten_optim(sd["optim"])
    for k, v in flat.items():
        shape = tuple(v.shape)
        if hasattr(v, "to_local") and shape:
            per = math.ceil(shape[0] / world)
            start = min(rank * per, shape[0])
            out[k] = ((start,) + (0,) * (len(shape) - 1), tuple(v.to_local().shape))
        else:
            out[k] = ((0,) * len(shape), shape)
    return out


def _expected_reads(store: ss.Store, cid: str, boxes: dict) -> int:
    """Object bytes a load of ``boxes`` must read: the commit, its shard manifests and DCP document,
    every bytes item, and each chunk (one object each here) whose box meets a box the rank holds."""
    lc = ss.load_commit(store, cid)
    x = dcp_extra(lc.commit.extras)
    n = store.object_size(cid) + sum(store.object_size(s) for s in lc.shard_ids.values()) + store.object_size(x.state)
    n += sum(math.prod(t.shape) for t in x.tensors)
    md = StoreReader(store, cid).read_metadata()
    for fqn, item in md.state_dict_metadata.items():
        if not hasattr(item, "chunks"):
            continue
        start, extent = boxes[fqn.replace("optim.state.", "optim.", 1)]
        for c in item.chunks:
            meets = all(max(a, o) < min(a + e, o + s) for a, e, o, s in zip(start, extent, c.offsets, c.sizes))
            if meets or not extent:  # a 0-d tensor: its one chunk
                n += math.prod(c.sizes) * torch.tensor([], dtype=item.properties.dtype).element_size()
    return n


def _load_three(rank: int, world: int, root: str, tmp: str, cid: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    counter = ReadCounter(LocalStorage(root))
    store = ss.Store(counter, create=False)
    m = _fsdp(init_device_mesh("cpu", (world,)))
    opt = _opt(m)
    sd = _state(m, opt)
    before = counter.bytes
    dcp.load(sd, storage_reader=StoreReader(store, cid))
    read = counter.bytes - before
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    ref = load_file(f"{tmp}/reference.safetensors")
    got = _full(_state(m, opt))
    return {
        "rows": m.fc1.weight.to_local().shape[0],
        "bitwise": sorted(ref) == sorted(got) and all(torch.equal(ref[k], got[k]) for k in ref),
        "extra": [sd["extra"]["step"], sd["extra"]["note"]],
        "read": read,
        "expected": _expected_reads(ss.open_store(root), cid, _boxes(sd, rank, world)),
    }


def _load_one(root: str, tmp: str, cid: str) -> dict:
    m = Net()
    opt = _opt(m)
    sd = _state(m, opt)
    dcp.load(sd, storage_reader=StoreReader(root, cid), no_dist=True)
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    ref = load_file(f"{tmp}/reference.safetensors")
    got = _full(_state(m, opt))
    return {"bitwise": sorted(ref) == sorted(got) and all(torch.equal(ref[k], got[k]) for k in ref)}


def _body(rank: int, world: int, root: str, tmp: str) -> dict:
    pair = dist.new_group([0, 1])
    async_pair = dist.new_group([0, 1], backend="gloo")  # async_save's own group: training keeps the other
    result: dict = {}
    if rank < 2:
        result["two"] = _save_two(rank, root, tmp, pair, async_pair)
    dist.barrier()
    cid = ss.open_store(root).ref("main")
    result["three"] = _load_three(rank, world, root, tmp, cid)
    dist.barrier()
    if rank == 2:
        result["one"] = _load_one(root, tmp, cid)
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    root = str(tmp / "store")
    results = run_group(_body, 3, tmp, root, str(tmp), timeout_s=300)
    return ss.open_store(root, create=False), results


def test_fsdp2_save_is_one_commit_that_verifies(runs):
    store, results = runs
    two = [r["two"] for r in results[:2]]
    c2 = two[0]["c2"]
    assert two[1]["c2"] == c2 and two[0]["last_commit"] == c2 and two[1]["last_commit"] is None
    assert all(t["metadata_equal"] for t in two)  # what dcp.save returned is what the reader reads back
    lc = ss.load_commit(store, c2)
    assert len(lc.commit.layout) == 2 and lc.commit.parent is None and lc.commit.step == 2
    names = {s: sorted(e.name for e in lc.shards[s].entries) for s in lc.shards}
    assert "model.fc1.weight:0:0" in names[0] and "model.fc1.weight:5:0" in names[1]  # each rank's own chunk
    assert ss.verify(store).ok


def test_async_save_in_thread_mode_makes_the_same_commit(runs):
    _, results = runs
    two = [r["two"] for r in results[:2]]
    assert two[0]["thread"] == two[1]["thread"] == two[0]["c2"]  # the same state, parent None: the same commit


def test_a_failure_in_any_call_on_any_rank_leaves_the_ref(runs):
    _, results = runs
    two = [r["two"] for r in results[:2]]
    c2 = two[0]["c2"]
    for rank_faults in (t["faults"] for t in two):
        assert [f["case"] for f in rank_faults] == [f"{c}@{r}" for c, rs in CALLS.items() for r in rs] + [
            "moved@0",
            "set_ref@0",
        ]
        for f in rank_faults:
            assert f["raised"] and f["before"] == c2, f
            if not f["case"].startswith("reset"):  # DCP's collectives carry the failure to every rank
                assert f["raised"] == "CheckpointException", f
            assert f["ref"] == (f["other"] if f["case"] == "moved@0" else c2), f


def test_fsdp2_on_three_ranks_loads_bitwise_reading_only_what_its_plan_overlaps(runs):
    _, results = runs
    three = [r["three"] for r in results]
    assert [t["rows"] for t in three] == [4, 4, 2]
    assert all(t["bitwise"] for t in three)
    assert all(t["extra"] == [2, "dcp"] for t in three)
    assert [t["read"] for t in three] == [t["expected"] for t in three]
    # rank 2 (rows 8-9) reads only the 2.5 MiB chunk rank 1 wrote of each fc1 tensor; rank 1 (rows 4-7) both
    assert three[1]["read"] - three[2]["read"] > 3 * (5 * 131072 * 4) * 0.99


def test_one_process_loads_it_bitwise(runs):
    _, results = runs
    assert results[2]["one"]["bitwise"]


def _process_mode(rank: int, world: int, root: str) -> dict:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh

    m = _fsdp(init_device_mesh("cpu", (world,)))
    opt = _opt(m)
    _train(m, opt, 2, seed=1)
    sd = _state(m, opt)
    dcp.save(sd, storage_writer=StoreWriter(root, ref="main", step=2))
    async_group = dist.new_group([0, 1], backend="gloo")
    writer = StoreWriter(root, ref="process", step=2)  # crosses into DCP's checkpoint process as its URL
    f = dcp.async_save(
        sd, storage_writer=writer, process_group=async_group, async_checkpointer_type=AsyncCheckpointerType.PROCESS
    )
    f.result(timeout=300)
    store = ss.open_store(root)
    return {"main": store.ref("main"), "process": store.ref("process")}


@pytest.mark.long
def test_async_save_in_process_mode_makes_the_same_commit(tmp_path):
    """``async_save`` in process mode pickles the writer into a checkpoint process of DCP's own
    (a fresh interpreter per rank: about 20 s on 2 cores, hence ``long``)."""
    root = str(tmp_path / "store")
    results = run_group(_process_mode, 2, tmp_path, root, timeout_s=300)
    assert results[0] == results[1] and results[0]["process"] == results[0]["main"] is not None
    assert ss.verify(ss.open_store(root, create=False)).ok
