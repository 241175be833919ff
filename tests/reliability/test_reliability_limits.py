"""Limits a writer enforced and a reader did not (issue 25, hostile input).

- An extra's state document 100 levels deep, or holding 10^30 or -2^64, passed ``verify``
  and reached ``load_state_dict``: SPEC.md §9.3/§20's limits (64 levels, -2^63 <= n < 2^64)
  held only at save. The same integer range, written by the torch form (§9.1), is checked
  on reading too.
- ``shardtrain grow --append K`` allocated before bounding K, and a shard manifest over
  the 64 MiB a reader accepts was written (and left behind) before its read-back failed.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
import pytest
import torch
from conftest import TensorHolder

import shardstore as ss
from shardstore.format.manifest import ExtraEntry, StateScalar
from shardstore.verification.commits import shard_problems


class Holder:
    """An extra whose state is whatever a test planted."""

    def __init__(self) -> None:
        self.loaded: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loaded = sd


def _commit() -> tuple[ss.Store, torch.nn.Module, torch.optim.Optimizer, str]:
    store = ss.open_store(f"memory://limits/{uuid.uuid4().hex}")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return store, model, opt, ss.save(store, model, opt, step=1)


def _nested(levels: int) -> bytes:
    return b'{"x":' + b"[" * levels + b"0" + b"]" * levels + b"}"


@pytest.mark.parametrize(
    "document, message",
    [
        (_nested(100), "nested 101 levels deep"),  # 100 lists inside the top-level object
        (_nested(64), "nested deeper than 64 levels"),  # within the bracket bound, its leaf one level too deep
        (b'{"x":1000000000000000000000000000000}', "outside the 64-bit range"),
        (b'{"x":-18446744073709551616}', "outside the 64-bit range"),
        (b'{"x":18446744073709551616}', "outside the 64-bit range"),  # 2^64: one past the largest
    ],
    ids=["100-deep", "65-deep-leaf", "1e30", "-2^64", "2^64"],
)
def test_a_state_document_over_the_limits_is_refused_by_verify_and_restore(document: bytes, message: str) -> None:
    store, model, _, cid = _commit()
    lc = ss.load_commit(store, cid)
    planted = ExtraEntry(key="user", state=store.put(document), tensors=())
    forged = ss.write_commit(store, [lc.shard_ids[0]], info=ss.CommitInfo(step=1), parent=None, extras=(planted,))
    problems = ss.verify(store, [forged]).problems
    assert any(p.kind == "ManifestError" and message in str(p) and p.object == planted.state for p in problems), (
        problems
    )
    target, holder = torch.nn.Linear(3, 2), Holder()
    before = [t.clone() for t in target.state_dict().values()]
    with pytest.raises(ss.ManifestError, match=message):
        ss.restore(store, forged, target, extra={"user": holder})
    assert holder.loaded is None  # never reached load_state_dict
    assert all(torch.equal(a, b) for a, b in zip(before, target.state_dict().values()))  # refused before writing


def test_the_limits_themselves_still_round_trip() -> None:
    """The largest integers and the deepest nesting a writer accepts come back unchanged."""
    store, model, opt, _ = _commit()
    deep: Any = 0
    for _ in range(63):  # the leaf at depth 64 under the top-level object: the deepest allowed
        deep = [deep]

    class Edge(Holder):
        def state_dict(self) -> dict[str, Any]:
            return {"hi": 2**64 - 1, "lo": -(2**63), "deep": deep}

    cid = ss.save(store, model, opt, step=2, extra={"edge": Edge()})
    holder = Holder()
    ss.restore(store, cid, torch.nn.Linear(3, 2), extra={"edge": holder})
    assert holder.loaded == {"hi": 2**64 - 1, "lo": -(2**63), "deep": deep}
    assert ss.verify(store, [cid]).ok


def test_torch_form_integers_outside_the_range_are_refused_when_read() -> None:
    store, _, _, cid = _commit()
    lc = ss.load_commit(store, cid)
    shard = lc.shards[0]
    entries = list(shard.entries)
    j = next(k for k, e in enumerate(entries) if e.state is not None)
    st = entries[j].state
    scalar = msgspec.structs.replace(st, scalars=(StateScalar(key="n", value=10**30),))
    bad = msgspec.structs.replace(
        shard, entries=tuple(msgspec.structs.replace(e, state=scalar) if k == j else e for k, e in enumerate(entries))
    )
    assert any(
        "'n': integer 1000000000000000000000000000000 is outside the 64-bit range" in str(p)
        for p in shard_problems(bad, "x" * 64)
    )
    group = shard.torch_optimizer.groups[0]
    hyper = msgspec.structs.replace(group, hyper={**group.hyper, "lr_steps": (1, -(2**64))})
    bad = msgspec.structs.replace(
        shard, torch_optimizer=msgspec.structs.replace(shard.torch_optimizer, groups=(hyper,))
    )
    assert any(
        "hyperparameter 'lr_steps' holds an integer outside the 64-bit range" in str(p)
        for p in shard_problems(bad, "x" * 64)
    )


def _llama_commit(tmp_path: Any, layers: int = 2) -> tuple[ss.Store, str]:
    """A local store holding one untrained commit of a tiny shardtrain Llama (with its config): enough to grow."""
    from shardtrain_helpers import tiny_config

    from shardtrain.engine.partition import Partition, build_stage

    config = tiny_config(layers=layers)
    store = ss.open_store(str(tmp_path / "store"))
    stage = build_stage(config, Partition.even(layers, 1), 0, seed=0)
    return store, ss.save(store, stage, step=0, config=config.to_hf_dict(), rng=False)


def test_grow_bounds_append_before_allocating(tmp_path: Any, capsys: Any) -> None:
    """``--append 100000000`` died of MemoryError (checked by hand under ``ulimit -v``); now it is
    refused from the layer count alone, exit 5, nothing written."""
    from shardstore_cli.shardtrain_cli import main

    store, cid = _llama_commit(tmp_path)
    before = set(store.objects())
    code = main(["grow", "--store", store.url, "--commit", cid, "--append", "100000000"])
    err = capsys.readouterr().err
    assert code == 5, err
    assert "TransitionError: --append 100000000" in err and "commit manifest limit" in err
    assert set(store.objects()) == before


def test_a_manifest_over_the_readers_limit_is_refused_before_it_is_written(
    tmp_path: Any, capsys: Any, monkeypatch: Any
) -> None:
    """``grow --append 43000`` wrote a 67.5 MB shard manifest that its own read-back then refused,
    leaving it behind. With the limit made small (the same rule, without writing 64 MiB), the
    first shard manifest over it is refused (ObjectTooLarge, exit 5) and no object over it exists."""
    import shardstore.format.manifest.encoding as manifest  # the writer's check reads the limit there
    from shardstore_cli.shardtrain_cli import main

    store, cid = _llama_commit(tmp_path)
    lc = ss.load_commit(store, cid)
    manifests = [cid, lc.shard_ids[0], lc.commit.config]
    limit = max(store.object_size(o) for o in manifests) + 2048  # every manifest so far fits; 72 more entries do not
    before = set(store.objects())
    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", limit)
    code = main(["grow", "--store", store.url, "--commit", cid, "--append", "8"])
    err = capsys.readouterr().err
    assert code == 5, err
    assert "ObjectTooLarge: shard manifest of slot 0" in err and "refused before it is written" in err
    new = set(store.objects()) - before  # the zero projections and the grown config (gc collects them), no manifest
    assert [
        o
        for o in new
        if store.get(o)[:1] == b"{" and (store.object_size(o) > limit or b'"type":"shard"' in store.get(o))
    ] == []
    assert store.ref("main") == cid


class _Seventeen(torch.nn.Module):
    """A module whose one buffer has 17 dims: one more than any manifest holds."""

    def __init__(self) -> None:
        super().__init__()
        self.ok = torch.nn.Parameter(torch.ones(2))
        self.register_buffer("deep", torch.ones([1] * 17))


def test_a_tensor_of_more_dims_than_a_manifest_holds_is_refused_by_name_before_anything_is_written() -> None:
    """``save`` of a 17-dim tensor (SPEC.md §Limits: 16) wrote its objects, then a shard manifest
    its own decode check refused, naming only that manifest's object id: a typed error naming the
    tensor now comes before any write, for a model, a mapping and an extra alike."""
    store = ss.open_store(f"memory://limits-{uuid.uuid4().hex}")
    deep = torch.ones([1] * 17)
    cases = [
        (lambda: ss.save(store, {"w": deep, "v": torch.ones(2)}, step=0, rng=False), "tensor 'w'"),
        (lambda: ss.save(store, _Seventeen(), step=0, rng=False), "tensor 'deep'"),
        (lambda: ss.save(store, {"v": torch.ones(2)}, step=0, rng=False, extra={"x": TensorHolder(deep)}), "'x'"),
    ]
    for save, named in cases:
        with pytest.raises(ss.TensorMismatch, match=f"{named}.*shape \\[1(, 1){{16}}\\] is over the limits of 16 dims"):
            save()
        assert list(store.objects()) == [] and store.refs() == {}
    ss.save(store, {"w": torch.ones([1] * 16)}, step=0, rng=False)  # the limit itself is stored
    assert ss.verify(store).ok
