"""Restore's name matching (issue 25, library): compiled and plain models restore into each
other, strict restores refuse unexpected tensors, tied versus untied weights are refused by
name, and RNG is restored when the commit holds it (``shardstore/state/restore_match.py``).

``torch.compile`` only wraps the module until its first call, so no test here compiles anything.
"""

from __future__ import annotations

import copy
import random
import re
import uuid

import pytest
import torch

import shardstore as ss
from shardstore.state.stateful import stateful


def _store() -> ss.Store:
    return ss.open_store(f"memory://restore-match/{uuid.uuid4().hex}")


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return [k.replace("_orig_mod.", "") for k in sa] == [k.replace("_orig_mod.", "") for k in sb] and all(
        torch.equal(x, y) for x, y in zip(sa.values(), sb.values())
    )


class Tied(torch.nn.Module):
    """An embedding and an output head that may share one weight (as Llama's tie_word_embeddings)."""

    def __init__(self, tied: bool, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        if tied:
            self.head.weight = self.embed.weight


@pytest.mark.parametrize("saved, into", [("compiled", "plain"), ("plain", "compiled"), ("compiled", "compiled")])
def test_compiled_and_plain_models_restore_into_each_other(saved: str, into: str) -> None:
    store = _store()
    src, dst = _net(0), _net(1)
    src_opt = torch.optim.AdamW(src.parameters(), lr=0.1)
    src(torch.randn(5, 3)).sum().backward()
    src_opt.step()
    saving = torch.compile(src) if saved == "compiled" else src
    cid = ss.save(store, saving, src_opt, step=1)
    assert not any("_orig_mod" in n for n in ss.load_commit(store, cid).entries())  # the names DCP's helpers give
    dst_opt = torch.optim.AdamW(dst.parameters(), lr=0.1)
    r = ss.restore(store, cid, torch.compile(dst) if into == "compiled" else dst, dst_opt)
    assert _same(src, dst) and r.skipped == [] and r.missing == []
    assert all(
        torch.equal(src_opt.state[p]["exp_avg"], dst_opt.state[q]["exp_avg"])
        for p, q in zip(src.parameters(), dst.parameters())
    )


def test_a_commit_holding_orig_mod_names_restores_into_a_plain_model() -> None:
    """Commits written before the rule named a compiled model's tensors with ``_orig_mod.``."""
    store, src, dst = _store(), _net(0), _net(1)
    old_names = {f"_orig_mod.{n}": t for n, t in src.state_dict().items()}  # a mapping is saved as named
    cid = ss.save(store, old_names, step=0)
    assert all(n.startswith("_orig_mod.") for n in ss.load_commit(store, cid).entries())
    ss.restore(store, cid, dst)
    assert _same(src, dst)
    again = {k: torch.zeros_like(v) for k, v in old_names.items()}  # a mapping spelled either way matches either way
    ss.restore(store, ss.save(store, src, step=1), again)
    assert all(torch.equal(again[f"_orig_mod.{n}"], t) for n, t in src.state_dict().items())


def test_strict_restore_refuses_unexpected_tensors_and_non_strict_names_them() -> None:
    store, src = _store(), _net(0)
    cid = ss.save(store, src, step=0)
    smaller = torch.nn.Sequential(torch.nn.Linear(3, 4))  # the commit's "1.*" and "2.*" tensors have no place
    before = smaller.state_dict()["0.weight"].clone()
    with pytest.raises(ss.StateMismatch, match=r"holds tensors the model does not: \['1.bias'.*\(7 unexpected\)"):
        ss.restore(store, cid, smaller)
    assert torch.equal(smaller.state_dict()["0.weight"], before)  # refused before a byte was written
    r = ss.restore(store, cid, smaller, strict=False)
    assert r.tensors == ["0.bias", "0.weight"] and r.skipped == [
        "1.bias",
        "1.num_batches_tracked",
        "1.running_mean",
        "1.running_var",
        "1.weight",
        "2.bias",
        "2.weight",
    ]
    assert torch.equal(smaller[0].weight, src[0].weight)
    bigger = _net(1)
    cid_small = ss.save(store, smaller, step=1)
    with pytest.raises(ss.StateMismatch, match=r"has no tensors named \['1.bias'"):
        ss.restore(store, cid_small, bigger)
    r = ss.restore(store, cid_small, bigger, strict=False)
    assert r.missing[:2] == ["1.bias", "1.num_batches_tracked"] and r.skipped == []
    # a name -> tensor mapping is a declared share (a pipeline stage): it covers its own names only
    share = {"0.weight": torch.zeros(4, 3), "0.bias": torch.zeros(4)}
    assert ss.restore(store, cid, share).skipped == [] and torch.equal(share["0.weight"], src[0].weight)


def test_tied_and_untied_mismatches_are_refused_by_name() -> None:
    store = _store()
    untied_cid = ss.save(store, Tied(tied=False), step=0)
    tied = Tied(tied=True, seed=1)
    with pytest.raises(ss.StateMismatch, match=r"the model ties 'head.weight' to 'embed.weight' .*saved untied"):
        ss.restore(store, untied_cid, tied)
    r = ss.restore(store, untied_cid, tied, strict=False)
    assert r.tensors == ["embed.weight"] and r.skipped == ["head.weight"]
    tied_cid = ss.save(store, Tied(tied=True), step=0)
    assert sorted(ss.load_commit(store, tied_cid).entries()) == ["embed.weight"]  # saved once
    with pytest.raises(ss.StateMismatch, match=r"'head.weight' may have been saved tied to 'embed.weight'"):
        ss.restore(store, tied_cid, Tied(tied=False, seed=2))
    ss.restore(store, tied_cid, Tied(tied=True, seed=2))  # tied into tied: fine


def test_restore_restores_rng_when_the_commit_holds_it_unless_told_not_to() -> None:
    store, model = _store(), _net(0)
    torch.manual_seed(123)
    random.seed(5)
    cid = ss.save(store, model, step=0)  # rng=True is save's default
    want = (torch.rand(3), random.random())
    torch.manual_seed(999)
    random.seed(9)
    r = ss.restore(store, cid, _net(1))
    assert r.rng_restored and torch.equal(torch.rand(3), want[0]) and random.random() == want[1]
    torch.manual_seed(999)
    assert not ss.restore(store, cid, _net(1), rng=False).rng_restored
    assert not torch.equal(torch.rand(3), want[0])
    no_rng = ss.save(store, model, step=1, rng=False)
    assert not ss.restore(store, no_rng, _net(1)).rng_restored


def test_a_generator_and_a_loader_holding_one_are_extras_without_pickle() -> None:
    """Their state is the generators' uint8 state tensors (get_state / set_state); SPEC.md §9.3."""
    from torch.utils.data import DataLoader, TensorDataset

    store, model = _store(), _net(0)
    gen = torch.Generator().manual_seed(7)
    loader = DataLoader(
        TensorDataset(torch.arange(10)), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(3)
    )
    next(iter(loader))  # an epoch begun: the sampler's generator moved
    cid = ss.save(store, model, step=0, extra={"gen": gen, "loader": loader})
    want_gen = torch.rand(4, generator=gen)
    want_order = [b[0].tolist() for b in loader]
    gen2 = torch.Generator().manual_seed(0)
    loader2 = DataLoader(
        TensorDataset(torch.arange(10)), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    r = ss.restore(store, cid, _net(1), extra={"gen": gen2, "loader": loader2})
    assert r.extras == ["gen", "loader"]
    assert torch.equal(torch.rand(4, generator=gen2), want_gen)
    assert [b[0].tolist() for b in loader2] == want_order  # the same next epoch
    plain = DataLoader(TensorDataset(torch.arange(10)), batch_size=3)  # no generator: nothing decides its order
    with pytest.raises(ss.StateMismatch, match=r"stored generators at \['generator'\], this loader has them at \[\]"):
        ss.restore(store, cid, _net(1), extra={"loader": plain})


class _ResumableSampler(torch.utils.data.Sampler):
    """A sampler that says where it stands (``state_dict()``), as a resumable sampler does."""

    def __init__(self, n: int) -> None:
        self.n, self.pos = n, 0

    def __iter__(self):
        return iter(range(self.pos, self.n))

    def __len__(self) -> int:
        return self.n - self.pos

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


def test_a_loaders_samplers_with_state_of_their_own_are_stored_with_it() -> None:
    """A plain DataLoader's sampler with ``state_dict()``, or a DistributedSampler's epoch, was
    silently left out of the loader's extra: save and restore both succeeded, and the restored
    loader started its sampler over (position 0, epoch 0)."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    store, data = _store(), list(range(8))
    sampler = _ResumableSampler(8)
    sampler.pos = 5
    dist = DistributedSampler(data, num_replicas=2, rank=0, seed=3)
    dist.set_epoch(7)
    cid = ss.save(
        store,
        _net(0),
        step=0,
        extra={"a": DataLoader(data, sampler=sampler), "b": DataLoader(data, sampler=dist, batch_size=2)},
    )
    sampler2, dist2 = _ResumableSampler(8), DistributedSampler(data, num_replicas=2, rank=0, seed=3)
    loader_a, loader_b = DataLoader(data, sampler=sampler2), DataLoader(data, sampler=dist2, batch_size=2)
    ss.restore(store, cid, _net(1), extra={"a": loader_a, "b": loader_b})
    assert sampler2.pos == 5 and [int(x) for x in loader_a] == [5, 6, 7]
    assert dist2.epoch == 7 and list(dist2) == list(dist)
    # a loader without such a sampler cannot take that state: refused before anything is written
    with pytest.raises(ss.StateMismatch, match="not this loader.s"):
        ss.restore(store, cid, _net(1), extra={"a": DataLoader(data)})
    # one without any keeps the document it had (same commit ids as before)
    plain = DataLoader(data, shuffle=True, generator=torch.Generator().manual_seed(3))
    assert stateful(plain).state_dict().keys() == {"generators"}


def test_a_stored_sampler_state_a_distributed_sampler_cannot_take_is_refused_before_any_write() -> None:
    """A loader saved with a resumable sampler and restored into one with a DistributedSampler at
    the same place: the stored state was found not to be an epoch only when the loader's state was
    installed, after the model's tensors had been read into it."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    store, data = _store(), list(range(8))
    sampler = _ResumableSampler(8)
    sampler.pos = 5
    cid = ss.save(store, _net(0), step=0, extra={"a": DataLoader(data, sampler=sampler)}, rng=False)
    model = _net(1)
    before = copy.deepcopy(model)
    dist = DistributedSampler(data, num_replicas=2, rank=0, seed=3)
    with pytest.raises(ss.StateMismatch, match=r"DataLoader.sampler: the stored state is not a DistributedSampler"):
        ss.restore(store, cid, model, extra={"a": DataLoader(data, sampler=dist)}, rng=False)
    assert _same(model, before) and dist.epoch == 0


def test_a_loader_document_from_before_samplers_were_stored_still_restores() -> None:
    """A commit written before a loader's samplers and dataset were stored has a document of its
    generators alone: restoring it into a loader with a DistributedSampler and a dataset with state
    restores the generators and leaves those as they are, as the code that wrote it did, rather
    than refusing every resume of such a commit."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    store, data = _store(), list(range(8))
    g = torch.Generator().manual_seed(5)
    cid = ss.save(store, _net(0), step=0, extra={"loader": DataLoader(data, shuffle=True, generator=g)})
    want = g.get_state()
    g.manual_seed(9)  # moved on: the restore must put it back
    dist = DistributedSampler(data, num_replicas=2, rank=0, seed=3)
    dist.set_epoch(4)
    older = DataLoader(data, sampler=dist, generator=g)
    ss.restore(store, cid, _net(1), extra={"loader": older})
    assert torch.equal(g.get_state(), want) and dist.epoch == 4
    # a document that has them still needs a loader that can take them (test above)


class _Counting(torch.utils.data.IterableDataset):
    """An iterable dataset that says how far it has gone (``state_dict()``)."""

    def __init__(self) -> None:
        self.i = 0

    def __iter__(self):
        while self.i < 8:
            self.i += 1
            yield self.i - 1

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, sd: dict) -> None:
        self.i = sd["i"]


def test_a_loaders_dataset_with_state_of_its_own_is_stored_or_refused() -> None:
    """A plain DataLoader over a dataset with ``state_dict()`` was saved without it: the restored
    loader started the data over. Without workers it is stored; with workers (whose copies hold the
    state) the save is refused."""
    from torch.utils.data import DataLoader

    store, data = _store(), _Counting()
    loader = DataLoader(data, batch_size=2)
    it = iter(loader)
    next(it), next(it)
    cid = ss.save(store, _net(0), step=0, extra={"loader": loader})
    data2 = _Counting()
    ss.restore(store, cid, _net(1), extra={"loader": DataLoader(data2, batch_size=2)})
    assert data2.i == 4 and [b.tolist() for b in DataLoader(data2, batch_size=2)] == [[4, 5], [6, 7]]
    with pytest.raises(ss.UnsupportedState, match="num_workers > 0"):
        ss.save(store, _net(0), step=1, extra={"loader": DataLoader(_Counting(), batch_size=2, num_workers=1)})
    assert store.ref("main") == cid


def test_a_dataset_inside_accelerates_iterable_dataset_shard_has_its_state_stored() -> None:
    """accelerate's ``prepare`` for several processes puts an iterable dataset inside an
    ``IterableDatasetShard``, which has no ``state_dict()`` of its own: the dataset's state (its
    position) was silently left out of the loader's extra, and the resumed loader started the data over."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    def prepared() -> tuple[_Counting, DataLoader]:
        data = _Counting()
        loader = prepare_data_loader(
            DataLoader(data, batch_size=2),
            num_processes=2,
            process_index=0,
            put_on_device=False,
            dispatch_batches=False,
        )
        return data, loader

    store = _store()
    data, loader = prepared()
    assert type(loader.dataset).__name__ == "IterableDatasetShard"
    data.i = 4
    cid = ss.save(store, _net(0), step=0, extra={"loader": loader}, rng=False)
    data2, loader2 = prepared()
    ss.restore(store, cid, _net(1), extra={"loader": loader2}, rng=False)
    assert data2.i == 4


def test_profile_reflects_what_the_commit_holds_unless_a_trainer_names_one(capsys: pytest.CaptureFixture[str]) -> None:
    from shardstore_cli.shardstore_cli import main

    store = ss.open_store(f"memory://restore-match/{uuid.uuid4().hex}")
    half = {
        "a": torch.zeros(2, dtype=torch.bfloat16),
        "b": torch.zeros(2, dtype=torch.float16),
        "n": torch.zeros(1, dtype=torch.int64),
    }
    mixed = ss.save(store, half, step=0)
    assert store.commit(mixed).profile == "bf16+fp16"
    assert (
        store.commit(ss.save(store, _net(0), step=1)).profile == "fp32"
    )  # unchanged for an fp32 model (same ids as before)
    assert store.commit(ss.save(store, half, step=2, profile="my-amp")).profile == "my-amp"
    assert main(["show", store.url, mixed]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\nprofile +bf16\+fp16\n", out) and re.search(
        r"\ntensor dtypes +bfloat16 \(1\), float16 \(1\), int64 \(1\)\n", out
    ), out
