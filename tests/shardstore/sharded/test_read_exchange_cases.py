"""Restore by exchange (SPEC.md §16.2), the cases the first tests left out, over one real
Gloo group of 4 processes (a 2 x 2 mesh where one is needed):

- DTensors of several parts per rank (``_StridedShard``, §15.4: runs of rows replicated over
  one mesh dim, runs of columns with rows split on the other) and FSDP2 on TP: each needed block read once in the group, every local tensor bitwise
  ``distribute_tensor``'s;
- plain tensors each rank holds a different set of, read in batches of one block (the
  batches' count and each rank's work in them uneven): a scalar, an empty tensor, a
  destination that is not contiguous, two names of one payload (the same key: one
  description, both filled), a tensor only some ranks hold;
- a version 2 commit's row bands restored into column strips;
- a storage error on one rank reading an empty tensor's block (read by each rank needing
  it): every rank raises, none waits for the group's timeout;
- a failure after a batch's agreement, in its transfer (a received piece's copy into its
  destination, a receive's wait), on one rank, in a batch before others: every rank raises.
"""

from __future__ import annotations

import tarfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dtensor_models import WIDE
from gloo_group import run_group_on_store
from read_counter import ReadCounter

import shardstore as ss
from shardstore.errors import GridError, StorageError
from shardstore.format.grid import payload_blocks
from shardstore.sharded import read_exchange
from shardstore.sharded.placement import part_views
from shardstore.sharded.read_exchange import ONE, TILES, Needed, decode_descriptions, plan_group_read
from shardstore.store.keys import object_key

#: A version 2 commit (row bands) of ``tests/data/v3_store.tar.gz`` (``test_legacy_store.py``'s ADAM).
V2_COMMIT = "aa1b164db53e041efa7c76fd29d2b02b0b8ce2d496a605b7633cb0e436d5c60f"
#: The group's timeout: a rank left waiting fails the test in this long, not the suite's.
TIMEOUT_S = 30


class _FailingReads:
    """A Storage whose reads of ``keys`` raise StorageError (one rank's disk or network)."""

    def __init__(self, inner, keys) -> None:
        self.inner, self.keys = inner, set(keys)

    def _check(self, key: str) -> None:
        if key in self.keys:
            raise StorageError(f"injected: {key} could not be read")

    def read(self, key, *args, **kwargs):
        self._check(key)
        return self.inner.read(key, *args, **kwargs)

    def read_hashed(self, key, *args, **kwargs):
        self._check(key)
        return self.inner.read_hashed(key, *args, **kwargs)

    def read_into(self, key, *args, **kwargs):
        self._check(key)
        return self.inner.read_into(key, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _keys(store: ss.Store, cid: str) -> dict[str, int]:
    out = {}
    for e in ss.load_commit(store, cid).entries().values():
        out.update({object_key(o): n for o, _, n in payload_blocks(e.param, e.dtype, e.shape)})
    return out


def _strided(rank: int, store: ss.Store, mesh) -> dict:
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    g = torch.Generator().manual_seed(7)
    full = {
        "rows": torch.randn(10, WIDE, generator=g),  # 2 column tiles; each rank 2 runs of rows, replicated on dp
        "fsdp_tp": torch.randn(12, WIDE, generator=g),  # FSDP2 on TP: a run of rows each, no replicas
        "cols": torch.randn(12, WIDE, generator=g),  # 2 runs of columns each, rows split on the other dim
        "few": torch.randn(3, WIDE, generator=g),  # rows 2, 1 on dp, then 1, 1 and 1, 0 on tp: one rank holds none
    }
    placements = {
        "rows": (Replicate(), _StridedShard(0, split_factor=2)),
        "fsdp_tp": (_StridedShard(0, split_factor=2), Shard(0)),
        "cols": (_StridedShard(1, split_factor=2), Shard(0)),
        "few": (Shard(0), Shard(0)),
    }
    if rank == 0:
        ss.save(store, full, step=0, job="read-exchange-cases", rng=False, ref="strided", parent=None)
    dist.barrier()
    cid = store.ref("strided")
    dests = {
        k: distribute_tensor(torch.zeros_like(v), mesh, placements[k], src_data_rank=None) for k, v in full.items()
    }
    parts = {k: len(part_views(t)) for k, t in dests.items()}
    counter = ReadCounter(store.storage)
    r = ss.restore(ss.Store(counter, create=False), cid, dests, group=dist.group.WORLD)
    want = {k: distribute_tensor(v, mesh, placements[k], src_data_rank=None) for k, v in full.items()}
    return {
        "few_rows": dests["few"].to_local().shape[0],
        "parts": parts,
        "equal": {k: torch.equal(dests[k].to_local(), want[k].to_local()) for k in full},
        "keys": dict(counter.keys),
        "bytes_read": r.bytes_read,
        "blocks": _keys(store, cid),
    }


def _plain(rank: int, store: ss.Store) -> dict:
    g = torch.Generator().manual_seed(8)
    full = {
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "t": torch.randn(12, WIDE, generator=g),  # 2 tiles; restored into a transposed (non-contiguous) tensor
        "a": torch.full((12, WIDE), 2.0),  # "a" and "b": one payload, one key
        "b": torch.full((12, WIDE), 2.0),
        "w": torch.randn(6, WIDE, generator=g),  # one block
    }
    if rank == 0:
        ss.save(store, full, step=0, job="read-exchange-cases", rng=False, ref="plain", parent=None)
    dist.barrier()
    holds = {  # what each rank's destinations hold: uneven work, and rank 3 almost nothing
        0: ["scalar", "empty", "t", "a"],
        1: ["empty", "t", "b", "w"],
        2: ["scalar", "a", "b", "w"],
        3: ["scalar"],
    }[rank]
    dests = {}
    for k in holds:
        dests[k] = torch.zeros(WIDE, 12).T if k == "t" else torch.zeros_like(full[k])
    old = read_exchange.BATCH_BYTES
    read_exchange.BATCH_BYTES = 1  # every block a batch of its own
    try:
        ss.restore(store, "plain", dests, group=dist.group.WORLD)
    finally:
        read_exchange.BATCH_BYTES = old
    stats = read_exchange.last_group_read()
    return {
        "equal": {k: torch.equal(dests[k], full[k]) for k in holds},
        "t_contiguous": dests["t"].is_contiguous() if "t" in dests else None,
        "batches": stats.batches,
        "received": stats.pieces_received,
    }


def _bands(rank: int, root: str, mesh) -> dict:
    """A version 2 commit's row bands (``tests/data/v3_store.tar.gz``: ``w`` is 3 x 524288 float32 in
    bands of 2 rows and 1) restored into column strips (Shard(1) on 4 ranks), alone and by exchange."""
    from torch.distributed.tensor import Shard, distribute_tensor

    if rank == 0:
        with tarfile.open(Path(__file__).resolve().parents[2] / "data" / "v3_store.tar.gz") as tar:
            tar.extractall(root, filter="data")
    dist.barrier()
    store = ss.open_store(root, create=False)
    got = []
    for group in (None, dist.group.WORLD):
        dest = distribute_tensor(torch.full((3, 524288), 7.0), mesh, (Shard(1),), src_data_rank=None)
        r = ss.restore(store, V2_COMMIT, {"w": dest}, group=group)
        got.append((dest.to_local(), r.bytes_read))
    stats = read_exchange.last_group_read()
    return {
        "equal": torch.equal(got[0][0], got[1][0]) and not bool((got[1][0] == 7.0).any()),
        "alone": got[0][1],
        "exchange": got[1][1],
        "blocks_read": stats.blocks_read,
        "received": stats.pieces_received,
    }


def _replicated_strips(rank: int, store: ss.Store, mesh) -> dict:
    """4096 x 1024 float32 (4 tiles of 1024 full rows) into (Replicate(), Shard(1)) on the 2 x 2 mesh:
    each rank's strip of 512 columns is not contiguous in a tile and is held by 2 ranks; a tile's
    reader sends the other strip to both of its holders, copied out once."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(10))
    if rank == 0:
        ss.save(store, {"s": full}, step=0, job="read-exchange-cases", rng=False, ref="strips", parent=None)
    dist.barrier()
    dest = distribute_tensor(torch.zeros(4096, 1024), mesh, (Replicate(), Shard(1)), src_data_rank=None)
    ss.restore(store, "strips", {"s": dest}, group=dist.group.WORLD)
    stats = read_exchange.last_group_read()
    want = distribute_tensor(full, mesh, (Replicate(), Shard(1)), src_data_rank=None)
    return {"equal": torch.equal(dest.to_local(), want.to_local()), "copied": stats.bytes_copied_out,
            "sent": stats.bytes_sent, "blocks_read": stats.blocks_read}  # fmt: skip


def _versions(rank: int, store: ss.Store) -> dict:
    """A parameter every rank holds whole (one block: rank 0 reads it, the others receive it straight
    into theirs): its version counter moves on every rank, as a restore on its own moves it (an
    in-place write), so autograd refuses a graph that saved the old values."""
    full = torch.randn(4, WIDE, generator=torch.Generator().manual_seed(9))
    if rank == 0:
        ss.save(store, {"v": full}, step=0, job="read-exchange-cases", rng=False, ref="v", parent=None)
    dist.barrier()
    out = {}
    for how, group in (("alone", None), ("exchange", dist.group.WORLD)):
        v = torch.nn.Parameter(torch.zeros(4, WIDE))
        y = (v * v).sum()  # saves v for its backward
        before = v._version
        ss.restore(store, "v", {"v": v}, group=group)
        try:
            y.backward()
            refused = False
        except RuntimeError as e:
            refused = "modified by an inplace operation" in str(e)
        out[how] = {"moved": v._version > before, "refused": refused, "equal": torch.equal(v.detach(), full)}
    return out


def _buffer_fails(rank: int, store: ss.Store) -> dict:
    """Rank 2 cannot allocate the buffer it receives a piece through (its destination is transposed;
    the failure injected where the buffer's dtype is looked up): every rank raises, none waits."""
    full = torch.randn(4, WIDE, generator=torch.Generator().manual_seed(12))
    if rank == 0:
        ss.save(store, {"v": full}, step=0, job="read-exchange-cases", rng=False, ref="buf", parent=None)
    dist.barrier()
    dest = torch.zeros(WIDE, 4).T if rank == 2 else torch.zeros(4, WIDE)
    real = read_exchange.torch_dtype

    def no_memory(name: str):
        raise MemoryError("injected: no memory for a receive buffer")

    if rank == 2:  # it reads nothing (rank 0 reads the one block): its only lookup is the buffer's
        read_exchange.torch_dtype = no_memory
    t0 = time.monotonic()
    try:
        ss.restore(store, "buf", {"v": dest}, group=dist.group.WORLD)
        got = None
    except Exception as ex:  # noqa: BLE001 - the test looks at the type
        got = [type(ex).__name__, str(ex)]
    finally:
        read_exchange.torch_dtype = real
    return {"error": got, "s": time.monotonic() - t0}


def _empty_read_fails(rank: int, store: ss.Store) -> dict:
    if rank == 0:
        ss.save(
            store, {"e": torch.zeros(0, 4), "w": torch.randn(8, 4)}, step=0, job="x", rng=False, ref="e", parent=None
        )
    dist.barrier()
    e = ss.load_commit(store, "e").entries()["e"]
    key = object_key(payload_blocks(e.param, e.dtype, e.shape)[0][0])
    failing = ss.Store(_FailingReads(store.storage, [key] if rank == 1 else []), create=False)
    t0 = time.monotonic()
    try:
        ss.restore(failing, "e", {"e": torch.zeros(0, 4), "w": torch.zeros(8, 4)}, group=dist.group.WORLD)
        got = None
    except Exception as ex:  # noqa: BLE001 - the test looks at the type
        got = [type(ex).__name__, str(ex)]
    return {"error": got, "s": time.monotonic() - t0}


def _transfer_fails(rank: int, store: ss.Store, how: str) -> dict:
    """Three tensors of one block each, every one a batch of its own; rank 0 reads the first batch's
    block (ties: the lowest rank) and the others receive it. Then one rank fails in that batch's
    transfer, after its agreement, with two batches still to come:

    - ``copy``: rank 2's destinations are inference tensors, transposed, so it receives through a
      buffer and copying it into place raises (a RuntimeError of torch's, not one injected);
    - ``wait``: rank 1's first receive completes, then its wait raises (injected).

    Every rank must raise at once, the others naming the failed rank, none waiting for the group's
    timeout in the next batch's collectives."""
    g = torch.Generator().manual_seed(13)
    full = {k: torch.randn(4, WIDE, generator=g) for k in ("x", "y", "z")}
    if rank == 0:
        ss.save(store, full, step=0, job="read-exchange-cases", rng=False, ref=how, parent=None)
    dist.barrier()
    if how == "copy" and rank == 2:
        with torch.inference_mode():
            dests = {k: torch.zeros(WIDE, 4).T for k in full}
    else:
        dests = {k: torch.zeros(4, WIDE) for k in full}
    real_irecv = dist.irecv
    failed = []

    class _FailingWait:
        def __init__(self, work) -> None:
            self.work = work

        def wait(self, *args, **kwargs):
            self.work.wait(*args, **kwargs)  # the bytes arrived (the peer's send completes), then it fails
            if not failed:
                failed.append(True)
                raise RuntimeError("injected: a receive's wait failed")
            return True

    def irecv(*args, **kwargs):
        return _FailingWait(real_irecv(*args, **kwargs))

    if how == "wait" and rank == 1:
        dist.irecv = irecv
    old = read_exchange.BATCH_BYTES
    read_exchange.BATCH_BYTES = 1  # every block a batch of its own
    t0 = time.monotonic()
    try:
        ss.restore(store, how, dests, group=dist.group.WORLD)
        got = None
    except Exception as ex:  # noqa: BLE001 - the test looks at the type
        got = [type(ex).__name__, str(ex)]
    finally:
        read_exchange.BATCH_BYTES = old
        dist.irecv = real_irecv
    return {"error": got, "s": time.monotonic() - t0, "batches": read_exchange.last_group_read().batches}


def _body(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    store = ss.open_store(root)
    mesh = init_device_mesh("cpu", (2, 2))
    out = {"strided": _strided(rank, store, mesh), "plain": _plain(rank, store)}
    out["versions"] = _versions(rank, store)
    out["strips"] = _replicated_strips(rank, store, mesh)
    out["bands"] = _bands(rank, root + "-v2", init_device_mesh("cpu", (world,)))
    dist.barrier()
    # last: before their fixes, these left ranks waiting for the group's timeout
    out["buffer_fails"] = _buffer_fails(rank, store)
    dist.barrier()
    out["empty_read_fails"] = _empty_read_fails(rank, store)
    for how in ("copy", "wait"):
        dist.barrier()
        out[f"{how}_fails"] = _transfer_fails(rank, store, how)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_group_on_store(_body, 4, tmp_path_factory.mktemp("read_exchange_cases"), timeout_s=TIMEOUT_S)[1]


def test_dtensors_of_several_parts_each_block_read_once(runs):
    res = [r["strided"] for r in runs]
    assert all(r["parts"]["rows"] == r["parts"]["cols"] == 2 for r in res), [r["parts"] for r in res]
    assert [r["few_rows"] for r in res] == [1, 1, 1, 0]
    assert all(all(r["equal"].values()) for r in res), [r["equal"] for r in res]
    blocks = res[0]["blocks"]
    read: dict[str, int] = {}
    for r in res:
        for k, n in r["keys"].items():
            if k in blocks:
                read[k] = read.get(k, 0) + n
    assert read == dict.fromkeys(blocks, 1)  # every rank needs some of every block: each read once
    assert sum(r["bytes_read"] for r in res) == sum(blocks.values())


def test_plain_tensors_held_unevenly_in_batches_of_one_block(runs):
    res = [r["plain"] for r in runs]
    assert all(all(r["equal"].values()) for r in res), [r["equal"] for r in res]
    assert res[0]["t_contiguous"] is False and res[1]["t_contiguous"] is False
    assert len({r["batches"] for r in res}) == 1 and res[0]["batches"] > 2  # the same batches on every rank
    assert sum(r["received"] for r in res) > 0


def test_row_bands_of_a_version_2_commit_into_column_strips(runs):
    res = [r["bands"] for r in runs]
    assert all(r["equal"] for r in res), res
    assert sorted(r["blocks_read"] for r in res) == [0, 0, 1, 1]  # 2 bands, each read once in the group
    assert sum(r["exchange"] for r in res) == res[0]["alone"] == 3 * 524288 * 4  # alone: both bands, each rank
    assert sum(r["received"] for r in res) == 2 * 3  # each band's strip to the 3 ranks not reading it


def test_a_piece_received_in_place_moves_the_version_counter_as_a_read_does(runs):
    res = [r["versions"] for r in runs]
    assert all(r["alone"] == {"moved": True, "refused": True, "equal": True} for r in res), res
    assert all(r["exchange"] == {"moved": True, "refused": True, "equal": True} for r in res), res


def test_a_strip_sent_to_its_replicas_is_copied_out_once(runs):
    res = [r["strips"] for r in runs]
    assert all(r["equal"] for r in res), res
    assert [r["blocks_read"] for r in res] == [1, 1, 1, 1]
    strip = 1024 * 512 * 4
    # each tile's reader sends its own strip to its replica (one copy) and the other strip to both
    # of that strip's holders (one copy, sent twice): 2 copies, 3 sends per tile
    assert [(r["copied"], r["sent"]) for r in res] == [(2 * strip, 3 * strip)] * 4, res


def test_a_receive_buffer_that_cannot_be_allocated_fails_every_rank(runs):
    res = [r["buffer_fails"] for r in runs]
    assert res[2]["error"] is not None and res[2]["error"][0] == "MemoryError", res
    others = [r for i, r in enumerate(res) if i != 2]
    assert all(r["error"] is not None and "injected" in r["error"][1] and "rank 2" in r["error"][1] for r in others)
    assert all(r["s"] < TIMEOUT_S / 2 for r in res), res  # raised, not a wait for the group's timeout


def test_a_failed_empty_block_read_on_one_rank_fails_every_rank(runs):
    res = [r["empty_read_fails"] for r in runs]
    assert all(r["error"] is not None for r in res), res
    assert all(r["error"][0] == "StorageError" and "injected" in r["error"][1] for r in res), res
    assert all("rank 1" in r["error"][1] for i, r in enumerate(res) if i != 1), res
    assert all(r["s"] < TIMEOUT_S / 2 for r in res), res  # raised, not a wait for the group's timeout


@pytest.mark.parametrize("how, failed, error", [("copy", 2, "RuntimeError"), ("wait", 1, "RuntimeError")])
def test_a_failure_in_a_batch_transfer_on_one_rank_fails_every_rank(runs, how, failed, error):
    """After a batch's agreement: a received piece's copy into place, or a receive's wait, fails on
    one rank in the first of three batches; every rank raises there, none goes on to the next batch."""
    res = [r[f"{how}_fails"] for r in runs]
    assert res[failed]["error"] is not None and res[failed]["error"][0] == error, res
    if how == "copy":
        assert "inference tensor" in res[failed]["error"][1], res
    else:
        assert "injected" in res[failed]["error"][1], res
    others = [r for i, r in enumerate(res) if i != failed]
    assert all(r["error"] is not None and f"rank {failed}" in r["error"][1] for r in others), res
    assert all(r["error"][1].startswith(res[failed]["error"][1][:30]) for r in others), res
    assert [r["batches"] for r in res] == [1] * 4, res  # every rank stopped in the first batch
    assert all(r["s"] < TIMEOUT_S / 2 for r in res), res  # raised, not a wait for the group's timeout


_K = "ab" * 32


@pytest.mark.parametrize(
    "needed, says",
    [
        (Needed(_K, 7, "float32", (4, 4), (((0, 0), (4, 4)),)), "grid kind 7"),
        (Needed(_K, TILES, "float33", (4096, 1024), (((0, 0), (10, 1024)),)), "dtype 'float33'"),
        (Needed(_K, ONE, "float32", (-4, 4), (((0, 0), (4, 4)),)), "shape [-4, 4]"),
        (Needed(_K, ONE, "float32", (4,) * 17, (((0,) * 17, (1,) * 17),)), "dims"),
        (Needed(_K, TILES, "float32", (4096, 1024), (((0,), (10,)),)), "box"),
        (Needed(_K, TILES, "float32", (4096, 1024), (((0, -5), (10, 1024)),)), "box"),
        (Needed(_K, ONE, "float32", (4, 4), (((0, 0), (10**15, 4)),)), "box"),
        (Needed(_K, TILES, "float32", (4096, 1024), (((0, 0), (10, 1024)), ((0,), (1,)))), "box"),
    ],
)
def test_a_malformed_description_is_a_grid_error_naming_the_rank(needed, says):
    """A rank is trusted, but what it describes is checked before the plan uses it: a typed
    error naming the rank and what is wrong, on every rank alike (the plan is the same on each)."""
    fine = Needed("cd" * 32, TILES, "float32", (4096, 1024), (((0, 0), (4096, 1024)),))
    with pytest.raises(GridError, match=r"rank 1") as e:
        plan_group_read([[fine], [needed]])
    assert says in str(e.value)


_BAD = b'[{"key": "k", "kind": 1, "dtype": "float32", "shape": [4], "boxes": [[[0], [%s]]]}]'


@pytest.mark.parametrize(
    "raw", [b"not json", b'[{"key": 1}]', b"[]" * 3, b'{"x": [1, 2]}', _BAD % b"-1", _BAD % str(2**64).encode()]
)
def test_a_description_that_does_not_decode_is_a_grid_error_naming_the_rank(raw):
    with pytest.raises(GridError, match=r"rank 2"):
        decode_descriptions([b"[]", b"[]", raw])
