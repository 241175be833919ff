"""``shardstore.torchtitan.ShardstoreCheckpointManager`` with torchtitan's own components.

torchtitan's full ``Trainer`` needs an accelerator, so the tests drive its training loop's calls
themselves, with its pieces: a tiny Llama 3 (``torchtitan.models.llama3``; its inner attention is
torchtitan's ``ScaledDotProductAttention``, since FlexAttention has no backward on the CPU),
``OptimizersContainer`` (AdamW), ``LRSchedulersContainer`` (warmup then decay),
``ParallelAwareDataloader`` (torchdata's ``StatefulDataLoader``) over a small stateful token
dataset, and a train state shaped as torchtitan's ``Trainer.state_dict()`` (``step``,
``ntokens_seen``). A run trains to ``STEPS`` calling ``checkpointer.save(step)`` after each
step, as ``Trainer.train`` does; a resumed run calls ``checkpointer.load()`` first.

- One process (default selection): an uninterrupted run against one stopped at step 4 and
  resumed by new objects and a new manager, bitwise; the optimizer container stored whole;
  ``keep_latest_k`` through refs, then ``gc``; refusals; async thread mode; import isolation;
  the README example.
- Two Gloo ranks with FSDP2 (``long``): the same comparison, the resumed run in fresh
  processes, each rank's shards compared bitwise; and ``async_with_pinned_mem`` (DCP's
  checkpoint process).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn as nn

pytest.importorskip("torchtitan.components.checkpointer", reason="torchtitan is the framework under test")
pytest.importorskip("torchdata", reason="torchtitan's ParallelAwareDataloader is a torchdata StatefulDataLoader")
pytest.importorskip("triton", reason="torchtitan.models imports triton (.ci/run installs it)")

from gloo_group import run_group  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig  # noqa: E402
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer  # noqa: E402

import shardstore as ss  # noqa: E402
from shardstore.format.dcp import TensorItem, dcp_extra, decode_document  # noqa: E402
from shardstore.torchtitan import ShardstoreCheckpointManager  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*set_vital.*")

ROOT = Path(__file__).resolve().parents[2]
DIM, HEADS, VOCAB, SEQ, BATCH = 16, 2, 64, 8, 2
STEPS, STOP = 4, 2  # the uninterrupted run's length; where the interrupted one stops (a checkpoint step)


# -- torchtitan's pieces, tiny ---------------------------------------------------------------


def tiny_llama() -> nn.Module:
    """Llama 3 as torchtitan builds it (fused QKV, RoPE, SwiGLU, RMSNorm), two layers of width 16."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model, Llama3TransformerBlock

    init = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    ones = {"weight": nn.init.ones_}

    def block():
        return Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=DIM, param_init=ones),
            ffn_norm=RMSNorm.Config(normalized_shape=DIM, param_init=ones),
            attention=make_gqa_config(
                dim=DIM,
                n_heads=HEADS,
                wqkv_param_init=init,
                wo_param_init=init,
                inner_attention=ScaledDotProductAttention.Config(),
                fuse_qkv=True,
                rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=10000, scaling="none"),
            ),
            feed_forward=make_ffn_config(dim=DIM, hidden_dim=32, w1_param_init=init, w2w3_param_init=init),
        )

    config = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init={"weight": partial(nn.init.normal_, std=1.0)}
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=ones),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=init),
        layers=[block(), block()],
    )
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    return model


class Tokens(IterableDataset, Stateful):
    """Sample ``i`` of data-parallel rank ``r``: SEQ + 1 tokens drawn from seed ``1000 r + i``."""

    def __init__(self, rank: int = 0) -> None:
        self.rank, self.i = rank, 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(1000 * self.rank + self.i)
            self.i += 1
            t = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            yield t[:-1], t[1:]

    def state_dict(self) -> dict:
        return {"sample_idx": self.i}

    def load_state_dict(self, state_dict: dict) -> None:
        self.i = state_dict["sample_idx"]


class TrainState(Stateful):
    """What torchtitan's ``Trainer`` saves as ``train_state`` (its own ``state_dict()``)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step, self.ntokens_seen = state_dict["step"], state_dict["ntokens_seen"]


class Run:
    """One training run's objects, wired as torchtitan's ``Trainer.__init__`` wires them."""

    def __init__(self, store: str, *, rank: int = 0, world: int = 1, mesh=None, **checkpoint) -> None:
        self.model = tiny_llama()
        if mesh is not None:  # FSDP2 as torchtitan's apply_fsdp: each block, then the root
            from torch.distributed.fsdp import fully_shard

            for block in self.model.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.optimizers = OptimizersContainer(
            OptimizersContainer.Config(
                implementation="for-loop",  # fused is CUDA-only
                param_groups=[
                    ParamGroupConfig(
                        pattern=r".*",
                        optimizer_name="AdamW",
                        optimizer_kwargs={"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
                    )
                ],
            ),
            model_parts=[self.model],
        )
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=STEPS
        )
        self.dataloader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=BATCH)
        self.train_state = TrainState()
        self.checkpointer = ShardstoreCheckpointManager.Config(
            enable=True, store=store, **{"interval": 1, "keep_latest_k": 0, **checkpoint}
        ).build(
            dataloader=self.dataloader,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=None,
        )

    def train(self, upto: int) -> None:
        """``Trainer.train``'s loop: load, then step and ``save(step)`` until ``upto``."""
        self.checkpointer.load()
        batches = iter(self.dataloader)
        while self.train_state.step < upto:
            self.train_state.step += 1
            x, y = next(batches)  # (BATCH, SEQ) each
            self.optimizers.zero_grad()
            loss = nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
            loss.backward()
            self.optimizers.step()
            self.lr_schedulers.step()
            self.train_state.ntokens_seen += y.numel()
            self.checkpointer.save(self.train_state.step, last_step=False)
        self.checkpointer.close()

    def digests(self) -> dict[str, str]:
        """Every parameter and optimizer value this rank holds, as a digest of its exact bytes
        (a DTensor: its local shard), with the scheduler's, loader's and train state's values."""
        out = {f"model.{k}": _digest(v) for k, v in self.model.state_dict().items()}
        out.update({f"optimizer.{k}": _digest(v) for k, v in self.optimizers.state_dict().items()})
        out["lr_scheduler"] = repr(self.lr_schedulers.state_dict())
        out["lr"] = repr([g["lr"] for o in self.optimizers for g in o.param_groups])
        # torchtitan's loader hands over {"dp_rank_<r>": its StatefulDataLoader's state, pickled, "world_size": n}
        out["dataloader"] = repr({k: _digest(v) for k, v in self.dataloader.state_dict().items()})
        out["position"] = repr(self.dataloader.dataset.state_dict())  # where the run's own iteration got to
        out["train_state"] = repr(self.train_state.state_dict())
        return out


def _digest(v) -> str:
    if isinstance(v, bytes):
        return "bytes:" + hashlib.sha256(v).hexdigest()
    if not isinstance(v, torch.Tensor):
        return repr(v)
    t = v.to_local() if hasattr(v, "to_local") else v
    t = t.detach().contiguous().reshape(-1)
    return f"{t.dtype}{list(t.shape)}:" + hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


# -- one process --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """An uninterrupted run to STEPS; one stopped at STOP (keep_latest_k=2) and resumed to STEPS
    by new objects, a new manager and ``load()``."""
    tmp = tmp_path_factory.mktemp("titan")
    whole = Run(str(tmp / "whole"))
    whole.train(STEPS)
    first = Run(str(tmp / "resumed"), keep_latest_k=2)
    first.train(STOP)
    stopped = first.digests()
    resumed = Run(str(tmp / "resumed"), keep_latest_k=2)
    resumed.train(STEPS)
    return {"tmp": tmp, "whole": whole, "resumed": resumed, "stopped": stopped}


def test_resumes_bitwise_through_load(single):
    whole, resumed = single["whole"].digests(), single["resumed"].digests()
    assert whole.keys() == resumed.keys() and len(whole) > 30
    assert [k for k in whole if whole[k] != resumed[k]] == []
    assert whole["train_state"] == "{'step': 4, 'ntokens_seen': 64}"
    assert whole["lr_scheduler"] == "{'last_epoch': 4}"
    # the resumed run really did start from step 2's state (not from scratch, not from step 4)
    assert single["stopped"]["train_state"] == "{'step': 2, 'ntokens_seen': 32}"
    assert single["stopped"]["model.norm.weight"] != whole["model.norm.weight"]


def test_the_optimizer_container_is_stored_whole(single):
    """Issue 34's silent loss: every per-parameter state tensor and group value of the container."""
    run = single["whole"]
    store = ss.open_store(str(single["tmp"] / "whole"))
    lc = ss.load_commit(store, "step-4")
    x = dcp_extra(lc.commit.extras)
    doc = decode_document(store.get(x.state), "test")
    held = run.optimizers.state_dict()
    per_param = [k for k in held if k.startswith("state.")]
    assert len(per_param) == 3 * sum(1 for _ in run.model.parameters())  # step, exp_avg, exp_avg_sq each
    assert {f"optimizer.{k}" for k in held} <= set(doc.items)
    entries = lc.entries()
    for k in per_param:  # each a tensor entry of the commit (the moments, and the 0-d `step`)
        assert isinstance(doc.items[f"optimizer.{k}"], TensorItem)
        assert tuple(entries[f"optimizer.{k}"].shape) == tuple(held[k].shape)
    assert ss.verify(store, ["step-4"]).ok


def test_keep_latest_k_moves_refs_and_gc_reclaims(single):
    store = ss.open_store(str(single["tmp"] / "resumed"))
    assert sorted(store.refs()) == ["step-3", "step-4"]  # step-1 and step-2 dropped at the later saves
    assert all(store.commit(c).parent is None for c in store.refs().values())
    result = ss.gc(store, grace_seconds=0, dry_run=False)
    assert result.deleted  # what only step-1 and step-2 held (their weights, moments, ...) is gone
    assert ss.verify(store, ["step-3", "step-4"]).ok
    whole = ss.open_store(str(single["tmp"] / "whole"))  # keep_latest_k=0 keeps every checkpoint
    assert sorted(whole.refs()) == ["step-1", "step-2", "step-3", "step-4"]


# A manager whose constructor refused is still finalized: its __del__ must not raise either.
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_refuses_what_it_cannot_honour(tmp_path):
    cfg = ShardstoreCheckpointManager.Config
    with pytest.raises(ss.UnsupportedState, match="last_save_in_hf"):
        cfg(enable=True, store=str(tmp_path), last_save_in_hf=True).build(
            dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={}
        )
    with pytest.raises(ValueError, match="Invalid async_mode"):
        cfg(enable=True, async_mode="sometimes")
    with pytest.raises(ss.InvalidName):
        cfg(enable=True, ref_prefix="../up")
    run = Run(str(tmp_path / "s"))
    with pytest.raises(ss.RefNotFound, match="load_step=3"):
        run.checkpointer.load(step=3)
    assert run.checkpointer.load() is False  # no checkpoint yet: a fresh start


def test_torchtitans_policies_hold(tmp_path):
    """The seed checkpoint (step 0, model only), the last step saved model-only in ``export_dtype``,
    and ``initial_load_path``: a run starting from torchtitan's own folder checkpoint."""
    from torchtitan.components.checkpointer import CheckpointManager

    url = str(tmp_path / "s")
    seed = Run(url)
    seed.checkpointer.save(0, last_step=True)  # what `create_seed_checkpoint` makes
    fresh = Run(url)
    with torch.no_grad():
        for p in fresh.model.parameters():
            p.zero_()
    assert fresh.checkpointer.load() is True  # step 0, the highest: only the model is loaded
    assert _digests(fresh.model) == _digests(seed.model) and fresh.train_state.step == 0

    last = Run(url, export_dtype="bfloat16")
    last.train(1)
    last.checkpointer.save(2, last_step=True)
    store = ss.open_store(url)
    doc = decode_document(store.get(dcp_extra(ss.load_commit(store, "step-2").commit.extras).state), "test")
    assert set(doc.items) == set(last.model.state_dict())  # the model only
    assert {i.dtype for i in doc.items.values()} == {"bfloat16"}

    folder = Run(str(tmp_path / "unused"))  # torchtitan's own manager writes its folder checkpoint
    folder.train(2)
    own = CheckpointManager.Config(enable=True, folder=str(tmp_path / "titan"), interval=1, keep_latest_k=0).build(
        dataloader=folder.dataloader,
        model_parts=[folder.model],
        optimizers=folder.optimizers,
        lr_schedulers=folder.lr_schedulers,
        states={"train_state": folder.train_state},
        sd_adapter=None,
    )
    assert own.save(2, last_step=False)
    start = Run(
        str(tmp_path / "new"), initial_load_path=str(tmp_path / "titan" / "step-2"), initial_load_model_only=False
    )
    assert start.checkpointer.load() is True  # the store is empty: torchtitan's folder is the start
    assert start.digests() == folder.digests()


def _digests(model: nn.Module) -> dict[str, str]:
    return {k: _digest(v) for k, v in model.state_dict().items()}


def test_loading_refuses_a_pickled_object(tmp_path):
    """A bytes item naming a class (here one of this module) is refused, never unpickled."""
    url = str(tmp_path / "s")
    run = Run(url, interval=8)
    run.train(1)
    run.train_state.ntokens_seen = _Opaque()  # DCP pickles it with torch.save, by reference to its class
    run.checkpointer.save(8)
    with pytest.raises(
        ss.UnsupportedState,
        match=r"'train_state.ntokens_seen'.*Unsupported global: GLOBAL test_adapter_torchtitan._Opaque\); refused",
    ):
        Run(url).checkpointer.load(step=8)
    assert _Opaque.made == 1  # made once, before the save: never by the load


class _Opaque:
    made = 0

    def __init__(self) -> None:
        type(self).made += 1


def test_async_mode_saves_in_a_thread(tmp_path):
    url = str(tmp_path / "s")
    run = Run(url, async_mode="async", keep_latest_k=2)
    run.train(3)  # each save waits for the one before; close() for the last
    store = ss.open_store(url)
    assert sorted(store.refs()) == ["step-2", "step-3"] and store.commit(store.ref("step-3")).step == 3
    back = Run(url)
    back.train(3)
    assert back.digests() == run.digests()


def test_the_manager_module_imports_torchtitan():
    """``shardstore.torchtitan`` imports torchtitan (this module does: ``from shardstore.torchtitan
    import ...`` above); that ``import shardstore`` does not: tests/shardstore/test_adapters_layer.py."""
    assert "torchtitan" in sys.modules


def test_readme_example_runs(tmp_path, capsys):
    """The README's torchtitan section, run as written (in this process: torchtitan is imported already)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"### Using shardstore from torchtitan\s.*?```python\n(.*?)```", readme, re.S).group(1)
    exec(compile(block.replace("/tmp/titan-store", str(tmp_path / "store")), "README.md", "exec"), {})
    assert capsys.readouterr().out == "refs ['step-2', 'step-3'] resumed at 3 True\n"


# -- two Gloo ranks, FSDP2 ----------------------------------------------------------------------


def _fsdp_run(rank: int, world: int, url: str, upto: int, checkpoint: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    run = Run(url, rank=rank, world=world, mesh=init_device_mesh("cpu", (world,)), **checkpoint)
    run.train(upto)
    out = run.digests()
    out["pid"] = str(os.getpid())
    out["sharded"] = repr(
        [type(p).__name__ for p in run.model.parameters()] == ["DTensor"] * len(list(run.model.parameters()))
    )
    return out


@pytest.mark.long
def test_fsdp2_on_two_ranks_resumes_bitwise_in_fresh_processes(tmp_path):
    whole = run_group(_fsdp_run, 2, tmp_path, str(tmp_path / "whole"), STEPS, {}, timeout_s=300)
    run_group(_fsdp_run, 2, tmp_path, str(tmp_path / "resumed"), STOP, {"keep_latest_k": 2}, timeout_s=300)
    resumed = run_group(_fsdp_run, 2, tmp_path, str(tmp_path / "resumed"), STEPS, {"keep_latest_k": 2}, timeout_s=300)
    for rank in (0, 1):
        assert whole[rank].pop("pid") != resumed[rank].pop("pid")  # fresh processes
        assert whole[rank]["sharded"] == "True"
        assert [k for k in whole[rank] if whole[rank][k] != resumed[rank][k]] == []
    assert whole[0]["model.norm.weight"] != whole[1]["model.norm.weight"]  # each rank holds its own shard
    store = ss.open_store(str(tmp_path / "resumed"))
    assert sorted(store.refs()) == ["step-3", "step-4"]
    lc = ss.load_commit(store, "step-4")
    assert len(lc.commit.layout) == 2  # one shard manifest per rank: each wrote its own shards
    assert ss.verify(store, ["step-3", "step-4"]).ok


@pytest.mark.long
def test_async_with_pinned_mem_saves_from_dcp_checkpoint_process(tmp_path):
    url = str(tmp_path / "s")
    saved = run_group(_fsdp_run, 2, tmp_path, url, STOP, {"async_mode": "async_with_pinned_mem"}, timeout_s=300)
    store = ss.open_store(url)
    assert sorted(store.refs()) == ["step-1", "step-2"]
    journal = json.loads((Path(url) / "journal" / f"{store.ref('step-2')}.json").read_text())
    assert journal["pid"] not in {int(r["pid"]) for r in saved}  # committed by DCP's checkpoint process
    back = run_group(_fsdp_run, 2, tmp_path, url, STOP, {}, timeout_s=300)
    for a, b in zip(saved, back):
        a.pop("pid"), b.pop("pid")
    assert back == saved
