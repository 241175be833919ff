"""Copying commits between stores: local → S3 → a fresh local store, one slot at a time.

The central test follows a replacement host: a two-slot commit is pushed from a local
store to S3, the local store is lost, and only slot 1's objects come back to a fresh
local store, from which slot 1's tensors and AdamW state restore bitwise. Repeating the
copy transfers nothing. Other tests: corrupted source bytes are never written under
their id, refs at the destination move by compare-and-swap, bad slots are named.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from typing import Any

import pytest
import torch

import shardstore as ss
import shardstore.backends.local as local_backend
from shardstore import CorruptObject, ObjectNotFound, RefConflict, TargetNotFound
from shardstore.ops.transfer import commit_closure, copy_commit
from shardstore.store import object_key

try:
    from tests.s3_server import S3Server, s3_server  # noqa: F401  (fixture)
except ImportError:  # pragma: no cover
    from s3_server import S3Server, s3_server  # type: ignore[no-redef]  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SLOT0 = ["a.bias", "a.weight"]
SLOT1 = ["b.bias", "b.weight"]


def two_slot_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential()
    model.add_module("a", torch.nn.Linear(6, 16))
    model.add_module("b", torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 6)).square().mean().backward()
        opt.step()
    return model, opt


def save_two_slots(store: ss.Store, model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    states = [ss.capture(model, opt, names=SLOT0), ss.capture(model, opt, names=SLOT1)]
    return ss.save_slots(store, states, info=ss.CommitInfo(step=2, config={"width": 16, "lr": 0.01}))


@pytest.fixture
def s3_store(s3_server: S3Server) -> ss.Store:  # noqa: F811
    return ss.open_store(s3_server.url(), **s3_server.options)


def test_local_to_s3_and_slot_1_back_restores_bitwise(tmp_path: Any, s3_store: ss.Store) -> None:
    model, opt = two_slot_model()
    local = ss.open_store(str(tmp_path / "host"))
    cid = save_two_slots(local, model, opt)
    everything = set(local.objects())

    pushed = copy_commit(local, s3_store, "main", ref="main")
    assert pushed.commit == cid and pushed.objects_skipped == 0
    assert set(s3_store.objects()) == everything and s3_store.ref("main") == cid
    assert ss.verify(s3_store).ok

    shutil.rmtree(tmp_path / "host")  # the host is lost
    fresh = ss.open_store(str(tmp_path / "replacement"))
    pulled = copy_commit(s3_store, fresh, cid[:12], slot=1, ref="main")
    lc = ss.load_commit(fresh, "main")
    assert set(fresh.objects()) == commit_closure(lc, slot=1).ids() < everything
    assert pulled.objects_copied == len(commit_closure(lc, slot=1).ids())

    params = dict(model.named_parameters())
    targets = {n: torch.zeros_like(params[n]).requires_grad_() for n in SLOT1}
    fresh_opt = torch.optim.AdamW(list(targets.values()), lr=0.5)
    restored = ss.restore(fresh, "main", targets, fresh_opt)
    assert restored.tensors == SLOT1 and restored.step == 2
    for n in SLOT1:
        p, q = params[n], targets[n]
        assert torch.equal(p, q), n
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], fresh_opt.state[q][k]), (n, k)
    assert fresh_opt.param_groups[0]["lr"] == 1e-2 and fresh_opt.param_groups[0]["weight_decay"] == 0.05

    again = copy_commit(s3_store, fresh, cid, slot=1, ref="main")
    assert again.objects_copied == 0 and again.bytes_copied == 0
    assert again.objects_skipped == pulled.objects_copied and again.bytes_skipped == pulled.bytes_copied

    with pytest.raises(ObjectNotFound):  # slot 0's tensors never came back
        ss.restore(fresh, "main", {n: torch.zeros_like(params[n]) for n in SLOT0})


def test_copy_everything_then_nothing(tmp_path: Any) -> None:
    model, opt = two_slot_model(1)
    src = ss.open_store(str(tmp_path / "a"))
    cid = save_two_slots(src, model, opt)
    dst = ss.open_store(f"memory://transfer-{uuid.uuid4().hex}")
    first = copy_commit(src, dst, "main", threads=4)
    assert first.objects_copied == len(set(src.objects())) and dst.refs() == {}
    assert first.bytes_copied == sum(src.object_size(o) or 0 for o in src.objects())
    assert ss.verify(dst, [cid]).ok
    second = copy_commit(src, dst, "main")
    assert (second.objects_copied, second.objects_skipped) == (0, first.objects_copied)


def test_parent_is_a_pointer_not_part_of_the_closure(tmp_path: Any) -> None:
    model, opt = two_slot_model(2)
    src = ss.open_store(str(tmp_path / "a"))
    first = save_two_slots(src, model, opt)
    with torch.no_grad():
        model.a.weight.add_(1.0)
    second = save_two_slots(src, model, opt)
    assert src.commit(second).parent == first
    dst = ss.open_store(str(tmp_path / "b"))
    copy_commit(src, dst, "main", ref="main")
    assert not dst.has(first) and ss.verify(dst).ok


def test_corrupt_source_object_is_never_written(tmp_path: Any) -> None:
    model, opt = two_slot_model(3)
    src = ss.open_store(str(tmp_path / "a"))
    cid = save_two_slots(src, model, opt)
    victim = ss.load_commit(src, cid).shards[1].entries[0].param
    path = tmp_path / "a" / object_key(victim)
    raw = bytearray(path.read_bytes())
    raw[0] ^= 1
    path.chmod(0o644)
    path.write_bytes(bytes(raw))
    dst = ss.open_store(str(tmp_path / "b"))
    with pytest.raises(CorruptObject, match=f"tensor 'b.bias', parameter object {victim}"):
        copy_commit(src, dst, cid, ref="main")
    assert not dst.has(victim) and not dst.has(cid) and dst.ref("main") is None
    copy_commit(src, dst, cid, slot=0)  # slot 0 does not need the corrupt object


def test_a_failed_copy_into_a_local_store_leaves_nothing_of_its_batch(tmp_path: Any) -> None:
    """A local destination gets a batch's objects written without an fsync each and made durable
    and visible together at the batch's barrier: a copy that fails in the batch (a corrupt
    source object) leaves none of the batch's objects and no temporary file behind."""
    model, opt = two_slot_model(3)
    src = ss.open_store(str(tmp_path / "a"))
    cid = save_two_slots(src, model, opt)
    victim = ss.load_commit(src, cid).shards[1].entries[0].param
    path = tmp_path / "a" / object_key(victim)
    path.chmod(0o644)
    path.write_bytes(b"\0" + path.read_bytes()[1:])
    dst = ss.open_store(str(tmp_path / "b"))
    with pytest.raises(CorruptObject):
        copy_commit(src, dst, cid, threads=1)  # one at a time: the objects before the corrupt one are written first
    assert list(dst.objects()) == []
    assert not os.listdir(tmp_path / "b" / "tmp")


def test_a_corrupt_block_is_named_by_tensor_role_and_block(tmp_path: Any) -> None:
    """Regression: copy named a corrupt object "data object <id>" only; now the tensor, role
    and block, as verify names them."""
    src = ss.open_store(str(tmp_path / "a"))
    w = torch.arange(1100 * 1000, dtype=torch.float32).reshape(1100, 1000)  # 4.4 MB: two blocks (distinct bytes)
    cid = ss.save(src, {"w": w}, step=0, rng=False)
    payload = ss.load_commit(src, cid).shards[0].entries[0].param
    assert len(payload) == 2
    victim = payload[1].object
    path = tmp_path / "a" / object_key(victim)
    path.chmod(0o644)
    data = path.read_bytes()
    path.write_bytes(bytes([data[0] ^ 1]) + data[1:])  # one bit flipped
    with pytest.raises(CorruptObject, match=f"tensor 'w', parameter block 1 object {victim} read from"):
        copy_commit(src, ss.open_store(str(tmp_path / "b")), cid)


def test_destination_ref_moves_by_compare_and_swap(tmp_path: Any, monkeypatch: Any) -> None:
    model, opt = two_slot_model(4)
    src = ss.open_store(str(tmp_path / "a"))
    cid = save_two_slots(src, model, opt)
    dst = ss.open_store(str(tmp_path / "b"))
    other = dst.put(b"someone else's commit id")
    real_ref = dst.ref

    def stale_then_real(name: str) -> str | None:
        value = real_ref(name)
        if name != "main":
            return value
        dst.set_ref(name, other, expected=value)  # another writer moves it in between
        monkeypatch.setattr(dst, "ref", real_ref)
        return value

    monkeypatch.setattr(dst, "ref", stale_then_real)
    with pytest.raises(RefConflict):
        copy_commit(src, dst, cid, ref="main")
    assert dst.ref("main") == other and dst.has(cid)  # objects stay; gc reclaims them if unwanted


def test_missing_slot_and_target_are_named(tmp_path: Any) -> None:
    model, opt = two_slot_model(5)
    src = ss.open_store(str(tmp_path / "a"))
    cid = save_two_slots(src, model, opt)
    dst = ss.open_store(str(tmp_path / "b"))
    with pytest.raises(TargetNotFound, match="no slot 2"):
        copy_commit(src, dst, cid, slot=2)
    with pytest.raises(TargetNotFound, match="nope"):
        copy_commit(src, dst, "nope")


def run_cli(argv: list[str]) -> int:
    """In this process, through the command line's ``main`` (which maps errors to exit codes)."""
    from shardstore_cli.shardstore_cli import main

    return main(argv)


def test_cli_copy_handler(tmp_path: Any, capsys: Any) -> None:
    model, opt = two_slot_model(6)
    src = str(tmp_path / "a")
    cid = save_two_slots(ss.open_store(src), model, opt)
    dst = str(tmp_path / "b")
    assert run_cli(["copy", src, dst, "main", "--shard", "1", "--ref", "pulled", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["commit"] == cid and doc["slot"] == 1 and doc["objects_skipped"] == 0 and doc["ref"] == "pulled"
    assert run_cli(["copy", src, dst, "main", "--shard", "1"]) == 0
    out = capsys.readouterr().out
    assert f"commit {cid} (slot 1)" in out and "copied   0 objects" in out
    assert run_cli(["copy", src, dst, "nosuchref"]) == 4
    assert "TargetNotFound" in capsys.readouterr().err
    assert run_cli(["copy", str(tmp_path / "nothing"), dst, "main"]) == 1
    assert run_cli(["copy", src, dst, "main", "--shard", "-1"]) == 2
    # Issue 24: a slot or pin the source lacks is refused before the destination store is created.
    fresh = tmp_path / "never"
    for extra in (["--shard", "2"], ["--shard", str(2**70)], ["--pin", "jobs/none"], ["--ref", "../x"]):
        assert run_cli(["copy", src, str(fresh), "main", *extra]) != 0, extra
        assert not fresh.exists(), extra
    capsys.readouterr()


def test_cli_copy_through_main_cli_to_s3(tmp_path: Any, s3_server: S3Server) -> None:  # noqa: F811
    model, opt = two_slot_model(7)
    src = str(tmp_path / "a")
    cid = save_two_slots(ss.open_store(src), model, opt)
    url = s3_server.url()
    cmd = [sys.executable, "-m", "shardstore_cli.shardstore_cli", "copy", src, url, cid[:10], "--ref", "main", "--json"]
    done = subprocess.run(cmd, env=s3_server.env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["commit"] == cid
    assert ss.open_store(url, **s3_server.options).ref("main") == cid


def test_pins_travel_with_a_commit_when_asked(tmp_path: Any, capsys: Any) -> None:
    model, opt = two_slot_model(7)
    src = ss.open_store(str(tmp_path / "a"))
    cid = save_two_slots(src, model, opt)
    job, asset = src.put(b"job file"), src.put(b"tokenizer asset")
    src.pin("jobs/j", [job, asset], expected=None)
    dst = ss.open_store(str(tmp_path / "b"))
    plain = copy_commit(src, dst, "main")
    assert dst.pin_names() == [] and not dst.has(job) and plain.pins == []  # not unless asked
    other = dst.put(b"already pinned here")
    dst.pin("jobs/j", [other], expected=None)
    result = copy_commit(src, dst, "main", pins=["jobs/j"], ref="main")
    assert result.pins == ["jobs/j"] and result.objects_copied == 2  # only the two pinned objects were missing
    assert dst.pinned("jobs/j") == tuple(sorted({job, asset, other}))  # merged with what dst held
    assert ss.verify(dst).ok and dst.ref("main") == cid
    with pytest.raises(TargetNotFound, match="no pin 'jobs/nope'"):
        copy_commit(src, dst, "main", pins=["jobs/nope"])
    fresh = str(tmp_path / "c")
    assert run_cli(["copy", str(tmp_path / "a"), fresh, "main", "--pin", "jobs/j", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pins"] == ["jobs/j"]
    assert ss.open_store(fresh).pinned("jobs/j") == tuple(sorted({job, asset}))


def test_a_pinned_commit_travels_whole_with_its_pin(tmp_path: Any) -> None:
    # A pin naming a commit keeps its whole closure (SPEC.md §14.1); `copy --pin` copied only
    # the commit manifest, then the pin's presence check refused with a GcRace blaming a gc
    # (after the ref had moved), however often the copy was run again.
    model, opt = two_slot_model(3)
    src = ss.open_store(str(tmp_path / "a"))
    cid = save_two_slots(src, model, opt)
    seed = ss.save(src, {"w": torch.arange(5.0)}, step=0, rng=False, ref=None)
    src.pin("keep/seed", [seed], expected=None)
    dst = ss.open_store(str(tmp_path / "b"))
    result = copy_commit(src, dst, "main", pins=["keep/seed"], ref="main")
    assert result.pins == ["keep/seed"] and seed in result.dependencies
    assert dst.pinned("keep/seed") == (seed,) and dst.ref("main") == cid
    assert commit_closure(ss.load_commit(dst, seed)).ids() <= set(dst.objects())
    assert ss.verify(dst).ok


def test_a_slot_copy_refuses_a_pin_naming_its_commit_before_writing(tmp_path: Any) -> None:
    # The pin keeps the commit's whole closure (SPEC.md §14.1), a slot copy brings one slot's:
    # the copy wrote slot 1's objects, moved the ref, then failed with a GcRace blaming a gc.
    model, opt = two_slot_model(5)
    src = ss.open_store(str(tmp_path / "a"))
    cid = save_two_slots(src, model, opt)
    src.pin("keep/x", [cid], expected=None)
    dst = ss.open_store(str(tmp_path / "b"))
    with pytest.raises(ss.StateMismatch, match="keep/x"):
        copy_commit(src, dst, "main", slot=1, pins=["keep/x"], ref="main")
    assert dst.refs() == {} and dst.pins() == {} and list(dst.objects()) == []
    fresh = str(tmp_path / "c")
    assert run_cli(["copy", src.url, fresh, "main", "--slot", "1", "--pin", "keep/x"]) == 5
    assert not os.path.exists(fresh)  # refused before the destination store was created
    assert copy_commit(src, dst, "main", pins=["keep/x"], ref="main").pins == ["keep/x"]  # whole: fine


@pytest.mark.parametrize("job", ["run:1", "j" * 100])
def test_copy_with_deps_of_a_job_no_pin_can_be_named_for(tmp_path: Any, job: str) -> None:
    # A valid job id (':' and up to 128 characters) that is no valid pin segment (SPEC.md §6): no
    # jobs/<job> or references/<job> pin can exist, yet the copy failed with InvalidName.
    src = ss.open_store(str(tmp_path / "a"))
    cid = ss.save(src, {"w": torch.ones(2)}, step=0, rng=False, job=job)
    dst = ss.open_store(str(tmp_path / "b"))
    result = copy_commit(src, dst, "main", with_deps=True, ref="main")
    assert result.dependencies == [] and result.pins == [] and dst.ref("main") == cid and ss.verify(dst).ok


def test_copy_bounds_the_bytes_its_threads_hold() -> None:
    """Copy reads each object into memory of its own (issue 12, item 6), so its threads are
    admitted by bytes: under the limit together, one larger object alone."""
    import threading
    import time

    from shardstore.ops.transfer import _ByteBudget

    budget = _ByteBudget(100)
    held, peak, lock = [0], [0], threading.Lock()

    def reader(n: int) -> None:
        budget.acquire(n)
        with lock:
            held[0] += n
            peak[0] = max(peak[0], held[0])
        time.sleep(0.01)
        with lock:
            held[0] -= n
        budget.release(n)

    threads = [threading.Thread(target=reader, args=(n,)) for n in [60, 60, 30, 30, 250, 10, 90]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert peak[0] <= 250 and budget.used == 0
    assert not any(t.is_alive() for t in threads)


def test_a_copy_from_s3_streams_each_object_into_its_file(tmp_path: Any, s3_store: ss.Store, monkeypatch: Any) -> None:
    """Into a local store, a copy from S3 writes each object into its temporary file piece by piece
    as it arrives, hashed on the way (``Store.receive``): no object is read whole into memory,
    the copy restores bitwise and leaves no temporary file; a corrupt object is refused and
    nothing of it stays (its temporary file removed)."""
    model, opt = two_slot_model(5)
    local = ss.open_store(str(tmp_path / "a"))
    cid = save_two_slots(local, model, opt)
    copy_commit(local, s3_store, cid, ref="main")
    whole: list[str] = []
    real = type(s3_store.storage).read_hashed

    def read_hashed(self: Any, key: str, *a: Any, **k: Any) -> Any:
        whole.append(key)
        return real(self, key, *a, **k)

    monkeypatch.setattr(type(s3_store.storage), "read_hashed", read_hashed)
    fresh = ss.open_store(str(tmp_path / "b"))
    done = copy_commit(s3_store, fresh, cid)
    data = set(commit_closure(ss.load_commit(local, cid), None).data)
    assert done.objects_copied == len(set(local.objects())) and data
    assert not [k for k in whole if k.rsplit("/", 1)[-1] in data]  # no data object was read whole
    assert set(fresh.objects()) == set(local.objects()) and ss.verify(fresh).ok
    assert not os.listdir(tmp_path / "b" / "tmp")
    back, _ = two_slot_model(9)
    ss.restore(fresh, cid, back)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))

    victim = ss.load_commit(local, cid).shards[0].entries[0].param
    s3_store.storage.delete(object_key(victim))
    s3_store.storage.write_once(object_key(victim), b"not the bytes of " + victim.encode())
    other = ss.open_store(str(tmp_path / "c"))
    with pytest.raises(CorruptObject, match=f"{victim} read from .* is corrupt"):
        copy_commit(s3_store, other, cid)
    assert not other.has(victim) and not os.listdir(tmp_path / "c" / "tmp")
    assert local_backend._unnamed.open == {}  # nor an unnamed one (no name in tmp/): its descriptor closed


def test_a_received_object_starts_over_when_its_read_does(tmp_path: Any) -> None:
    """``Store.receive``: a source whose read starts over (a retried request) has what the first
    attempt delivered dropped, so the object written is the second attempt's bytes alone; a
    source that hands over bytes of another id has its temporary file removed."""
    from shardstore.backends.local import LocalStorage
    from shardstore.format.tensors import hash_bytes

    class Restarting(LocalStorage):
        def read_piped(self, key: str, start: Any) -> int:
            data = bytes(self.read(key))
            start(len(data))(b"half of an attempt that failed")  # then the retry, from the first byte
            consume = start(len(data))
            for i in range(0, len(data), 7):
                consume(data[i : i + 7])
            return len(data)

    src = ss.Store(Restarting(str(tmp_path / "src")))
    blob = bytes(range(200)) * 3
    oid = src.put(blob)
    dst = ss.open_store(str(tmp_path / "dst"))
    batch = dst.write_batch()
    assert dst.receive(src, oid, batch=batch) == (oid, len(blob))
    batch.finish(dst.storage)
    assert bytes(dst.get(oid)) == blob
    assert dst.receive(src, oid, batch=dst.write_batch()) is None  # present: nothing read

    bad = hash_bytes(b"other")
    src.storage.write_once(object_key(bad), blob)  # bytes that do not hash to their name
    batch = dst.write_batch()
    assert dst.receive(src, bad, batch=batch) == (oid, len(blob))
    assert batch.pending == [] and not dst.has(bad) and not os.listdir(tmp_path / "dst" / "tmp")
    assert local_backend._unnamed.open == {}  # an unnamed tmp file has no name in tmp/: its descriptor closed
