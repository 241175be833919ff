"""The Hugging Face ``Trainer`` with its checkpoints in a store: ``ShardstoreTrainer`` and
``ShardstoreTrainerMixin`` (issue 31).

``Trainer`` saves a checkpoint as a directory of files — ``model.safetensors``, pickled
``optimizer.pt``/``scheduler.pt``/``scaler.pt``/``rng_state.pth`` and ``trainer_state.json`` —
and resumes by reading them back. Here each checkpoint is one commit of the store instead,
made by ``save_state_dict`` (SPEC.md §9.6) from one nested dict, its *tree*::

    {"kind": "transformers.Trainer", "version": 1,
     "model": model.state_dict(),               # every tensor a tensor entry (model/...)
     "trainer_state": {...},                    # TrainerState as trainer_state.json holds it
     "optimizer": optimizer.state_dict(), "scheduler": lr_scheduler.state_dict(),
     "scaler": grad_scaler.state_dict(),        # only when the Accelerator has a scaler
     "rng": {"python": ..., "numpy": ..., "torch": ..., "cuda:0": ...}}  # format.rng's bytes, as uint8

(``save_only_model=True`` leaves out the optimizer, scheduler, scaler and RNG, as Trainer
does; such a checkpoint exports but does not resume). Checkpoint N of a run is the ref
``<prefix>/checkpoint-N`` (Trainer's folder name under the run's ref prefix); nothing is
written to ``output_dir``. ``train(resume_from_checkpoint=True | ref | commit id)`` reads
the commit's tree first, then (once the model is built) its tensors in one verified read, the
weights straight into the model, and hands each part to Trainer where its own resume path
expects it, so the data position (Trainer skips the batches ``global_step`` says were consumed), the
RNG reload after that skip and the callbacks' state are Trainer's own code. ``save_total_limit``
deletes older checkpoint refs as Trainer deletes older folders (the newest and the best are
kept); those commits have no parent, so ``shardstore gc`` reclaims what only they held.
Without a limit each checkpoint's parent is the one the run saved or resumed from before it
(``shardstore log`` shows the run's history). ``export_pretrained`` writes a checkpoint's (or
the live) model as a ``from_pretrained`` directory with the tokenizer or processor the
trainer was given.

Trainer offers no public hook for where checkpoints go, and ``Trainer.train`` reads
``trainer_state.json`` from the checkpoint directory itself before any overridable method
runs. So ``train`` (public) resolves the target and passes Trainer no directory at all; the
resume is handed to the training loop by the private methods listed below, each of which
reads the commit's parts instead of files. They were verified against transformers 5.24.0,
the version pinned in constraints.txt; where a later version stops calling one of them, the
first training step (or the first ``on_save``) raises ``StateMismatch`` naming it, instead of
resuming or saving only in part.

This module imports transformers (so ``import shardstore`` never does) and sits above the rest
of the package: it uses only the dict-level API (``checkpoint.state_dict``), the store, names
and the RNG codec (``format.rng``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerState
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import SaveStrategy, compare_trainer_and_checkpoint_args

from .checkpoint.info import CommitInfo, check_info
from .checkpoint.state_dict import StoredStateDict, open_state_dict, save_state_dict
from .errors import StateMismatch, TargetNotFound, TensorMismatch, UnsupportedState
from .format.names import check_ref_name
from .format.rng import capture_rng, restore_rng
from .store import Store, open_store

__all__ = ["KIND", "VERSION", "ShardstoreTrainer", "ShardstoreTrainerMixin"]

logger = logging.getLogger(__name__)

#: The tree's ``kind`` and ``version``: a commit of anything else is refused by ``train``.
KIND = "transformers.Trainer"
VERSION = 1
_TRAINING_PARTS = ("optimizer", "scheduler", "rng")  # what save_only_model leaves out (and "scaler")
_PARTS = {"kind", "version", "model", "trainer_state", *_TRAINING_PARTS, "scaler"}
_CHECKPOINT = re.compile(r"checkpoint-([0-9]+)")


@dataclass
class _Resume:
    """A resume in progress: the commit's tree (each tensor a ``TensorRef`` until ``_load_resumed_model``
    reads them all, through ``opened``: the commit as opened, its manifests read once), and which
    parts Trainer has taken so far."""

    commit: str
    tree: dict[str, Any]
    opened: StoredStateDict
    applied: set[str] = field(default_factory=set)
    checked: bool = False  # the first step of this training loop found every part taken

    @property
    def token(self) -> str:
        """What Trainer carries as ``resume_from_checkpoint``: never a directory it could read."""
        return f"shardstore:{self.commit}"

    def expected(self) -> set[str]:
        return {"model", "trainer_state", *_TRAINING_PARTS} | ({"scaler"} & set(self.tree))


class ShardstoreTrainerMixin:
    """Put before a ``transformers.Trainer`` subclass (``class T(ShardstoreTrainerMixin, SFTTrainer)``)
    to keep its checkpoints in a store; ``ShardstoreTrainer`` is the mixin on ``Trainer`` itself.

    ``store``: a ``Store`` or a store path or URL (opened, created if absent). ``prefix``: the
    run's ref prefix; checkpoint N is ref ``<prefix>/checkpoint-N``. ``job``: the commits' job id.
    Every other argument is the Trainer's own.
    """

    def __init__(
        self,
        *args: Any,
        store: Store | str | os.PathLike[str],
        prefix: str = "trainer",
        job: str = "default",
        **kwargs: Any,
    ) -> None:
        if not isinstance(self, Trainer):
            raise TypeError(f"{type(self).__name__}: ShardstoreTrainerMixin goes with a transformers.Trainer class")
        self.store = store if isinstance(store, Store) else open_store(os.fspath(store))
        check_ref_name(f"{prefix}/checkpoint-0")  # InvalidName (and ManifestError for a job) now, not at the first save
        check_info(CommitInfo(step=0, job=job))
        self.checkpoint_prefix = prefix
        self.job = job
        self._resume: _Resume | None = None
        self._last_commit: str | None = None  # the parent of the next checkpoint (without save_total_limit)
        self._saved_step: int | None = None
        super().__init__(*args, **kwargs)
        self._refuse_unsupported()
        self.add_callback(_Guard(self))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if Trainer in mro and mro.index(ShardstoreTrainerMixin) > mro.index(Trainer):
            raise TypeError(
                f"{cls.__name__}: ShardstoreTrainerMixin must come before the transformers.Trainer class in the "
                "bases (class MyTrainer(ShardstoreTrainerMixin, SomeTrainer)), or Trainer's methods hide its own"
            )

    def _refuse_unsupported(self) -> None:
        args = self.args
        why = None
        if args.world_size > 1:
            why = f"a run of {args.world_size} processes (each holds its own RNG state; only one process is supported)"
        elif self.is_deepspeed_enabled or self.is_fsdp_enabled:
            why = "DeepSpeed or FSDP (their sharded checkpoints go through their own files)"
        elif args.device.type not in ("cpu", "cuda"):
            why = f"a run on {args.device.type} (its generator's state is not among those format.rng captures)"
        elif args.push_to_hub:
            why = "push_to_hub (checkpoints are commits of the store: export_pretrained one, then push that directory)"
        if why is not None:
            raise UnsupportedState(f"{type(self).__name__} cannot checkpoint {why} into {self.store.url}")

    # -- names ---------------------------------------------------------------------------

    def checkpoint_ref(self, step: int) -> str:
        """The ref of this run's checkpoint at global step ``step``: ``<prefix>/checkpoint-<step>``."""
        return f"{self.checkpoint_prefix}/checkpoint-{step}"

    def checkpoints(self) -> list[tuple[int, str]]:
        """This run's checkpoints in the store as (global step, ref), oldest first."""
        head = self.checkpoint_prefix + "/"
        found = []
        for name in self.store.ref_names():
            m = _CHECKPOINT.fullmatch(name[len(head) :]) if name.startswith(head) else None
            if m is not None:
                found.append((int(m.group(1)), name))
        return sorted(found)

    def _resolve(self, target: Any) -> str:
        if target is True:
            found = self.checkpoints()
            if not found:
                raise TargetNotFound(f"no checkpoint {self.checkpoint_ref(0)[:-1]}N in {self.store.url} to resume from")
            return self.store.resolve(found[-1][1])
        if isinstance(target, str):
            return self.store.resolve(target)
        raise TargetNotFound(
            f"resume_from_checkpoint={target!r}: expected True, a ref (such as {self.checkpoint_ref(8)!r}) or a "
            "commit id of the store"
        )

    # -- saving --------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # Overrides a private method of Trainer (verified with transformers 5.24.0): the one place
        # it saves a checkpoint (``_maybe_log_save_evaluate`` calls it, then ``on_save``). Mirrors
        # it: floating-point operation count, best checkpoint, callbacks' states, rotation.
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        step = self.state.global_step
        self._mark_best(step)
        if self.args.should_save:
            for cb in self.callback_handler.callbacks + [self.control]:
                if isinstance(cb, ExportableState):
                    name, cb_state = type(cb).__name__, cb.state()
                    if isinstance(self.state.stateful_callbacks[name], list):
                        self.state.stateful_callbacks[name].append(cb_state)
                    else:
                        self.state.stateful_callbacks[name] = cb_state
        parent = self._last_commit
        if self.args.save_total_limit or (parent is not None and not self.store.has(parent)):
            parent = None  # a rotated checkpoint must not be kept by its successor's parent link (SPEC.md §19.1)
        cid = save_state_dict(
            self.store, self._checkpoint_tree(), step=step, ref=self.checkpoint_ref(step), job=self.job, parent=parent
        )
        self._last_commit, self._saved_step = cid, step
        self._rotate()

    def _checkpoint_tree(self) -> dict[str, Any]:
        try:  # TrainerState exactly as trainer_state.json holds it, and as Trainer reads it back
            state = json.loads(json.dumps(dataclasses.asdict(self.state)))
        except (TypeError, ValueError) as e:
            raise UnsupportedState(f"TrainerState at global step {self.state.global_step}: {e}") from None
        tree: dict[str, Any] = {
            "kind": KIND,
            "version": VERSION,
            "model": self.model.state_dict(),
            "trainer_state": state,
        }
        if not self.args.save_only_model:
            tree["optimizer"] = self.optimizer.state_dict()
            tree["scheduler"] = self.lr_scheduler.state_dict()
            tree["rng"] = {k: torch.frombuffer(bytearray(v), dtype=torch.uint8) for k, v in capture_rng().items()}
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                tree["scaler"] = scaler.state_dict()
        return tree

    def _mark_best(self, step: int) -> None:
        best_step = self.state.best_global_step
        if best_step and self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST):
            best = self.checkpoint_ref(best_step)
            if best_step == step or self.store.ref(best) is not None:
                self.state.best_model_checkpoint = best

    def _rotate(self) -> None:
        """Delete the oldest checkpoint refs past ``save_total_limit``, keeping the newest and the
        best, as Trainer's ``rotate_checkpoints`` deletes folders (ordered by step)."""
        limit = self.args.save_total_limit
        if not self.args.should_save or limit is None or limit <= 0:
            return
        found = self.checkpoints()
        protected = {found[-1][1]} if found else set()
        if self.state.best_model_checkpoint is not None:
            protected.add(self.state.best_model_checkpoint)
        remaining = len(found)
        for _, name in found:
            if remaining <= max(limit, len(protected)):
                break
            if name not in protected:
                self._delete_ref(name)
                remaining -= 1

    def _delete_ref(self, name: str) -> None:
        cid = self.store.ref(name)
        if cid is not None:
            self.store.delete_ref(name, expected=cid)  # compare-and-delete: a ref moved meanwhile is kept

    # -- resuming ------------------------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``Trainer.train``, resuming from a checkpoint of the store: ``True`` (this run's newest
        checkpoint ref), a ref or a commit id (any target ``Store.resolve`` takes)."""
        if trial is not None:
            raise UnsupportedState(f"hyperparameter search trials: {type(self).__name__} keeps one run's checkpoints")
        self._resume = None
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            cid = self._resolve(resume_from_checkpoint)
            opened = self._open(cid, training=True)  # the bytes come later
            self._resume = _Resume(cid, opened.tree, opened)
            self._last_commit = cid
            stored_bs = self._resume.tree["trainer_state"].get("train_batch_size")
            if stored_bs is not None and self.args.auto_find_batch_size:
                self._train_batch_size = stored_bs  # as Trainer.train does from trainer_state.json
        try:
            out = super().train(  # type: ignore[misc]
                resume_from_checkpoint=None, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
            )
        finally:
            self._resume = None
        best = self.state.best_model_checkpoint
        if self.args.should_save and best is not None and self.args.save_total_limit == 1:
            for _, name in self.checkpoints():  # Trainer then keeps the best alone (its _finalize_training)
                if name != best:
                    self._delete_ref(name)
        return out

    def _read_tree(self, cid: str, *, training: bool) -> dict[str, Any]:
        """Commit ``cid``'s tree, every tensor verified as it is read; StateMismatch unless this adapter made it."""
        return self._open(cid, training=training).read()

    def _open(self, cid: str, *, training: bool) -> StoredStateDict:
        """Commit ``cid`` opened (``open_state_dict``: its tree with each tensor a ``TensorRef``, nothing
        read yet); StateMismatch unless this adapter made it."""
        opened = open_state_dict(self.store, cid)
        tree = opened.tree
        if not isinstance(tree, dict) or tree.get("kind") != KIND or tree.get("version") != VERSION:
            kind = tree.get("kind") if isinstance(tree, dict) else type(tree).__name__
            raise StateMismatch(
                f"commit {cid} is not a {KIND} checkpoint of version {VERSION} (its kind: {kind!r}); it was not made "
                f"by {type(self).__name__}"
            )
        unknown = sorted(set(tree) - _PARTS)
        missing = sorted({"model", "trainer_state", *(_TRAINING_PARTS if training else ())} - set(tree))
        if unknown:
            raise StateMismatch(f"checkpoint {cid} holds parts this version does not know: {unknown}")
        if missing:
            raise StateMismatch(
                f"checkpoint {cid} lacks {missing}: it was saved with save_only_model=True, and Trainer cannot resume "
                "from the model alone (export_pretrained exports it)"
            )
        return opened

    def _part(self, checkpoint: str | None, part: str) -> Any:
        """Part ``part`` of the resume in progress if ``checkpoint`` is its token, else None (a directory: Trainer's own)."""
        r = self._resume
        if r is None or checkpoint != r.token:
            return None
        r.applied.add(part)
        return r.tree.get(part)

    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        # Overrides a private method of Trainer (verified with transformers 5.24.0): ``train`` calls
        # it once the model is (re)built and before the Accelerator prepares it — where Trainer
        # loads a checkpoint's weights — with ``resume_from_checkpoint``, which the loop passes on
        # to the methods below. The model is loaded here, and the loop gets the resume's token.
        r = self._resume
        if r is not None:  # (again on each retry of auto_find_batch_size: the loop starts over)
            self._load_resumed_model(r)
            r.applied, r.checked = {"model"}, False
            kwargs["resume_from_checkpoint"] = r.token
        return super()._inner_training_loop(*args, **kwargs)  # type: ignore[misc]

    def _load_resumed_model(self, r: _Resume) -> None:
        """The resume's tensors, read: the weights straight into the model as built (this adapter's
        ``Trainer._load_from_checkpoint``), the optimizer's, scheduler's and RNG's into fresh tensors
        the later methods hand over; one read, every byte verified as it lands.

        The model's names are checked against the commit's first, and each tensor's dtype and
        shape by the read, before any byte lands in the model. Reading in place saves a fresh copy
        of the weights and the copy into the parameters; as with ``shardstore.restore``, a corrupt
        object found part way (``CorruptObject`` out of ``train``) leaves the model holding part of
        the checkpoint: the resume is to be repeated, never trained from. Each retry of
        ``auto_find_batch_size`` reads again: the attempt before may have stepped the optimizer's tensors."""
        live = self.model.state_dict()  # the model's own tensors (detached views), as Trainer would load into
        _check_names(live, r.tree["model"], r.commit)
        try:
            r.tree = r.opened.read(into={"model": live})
        except TensorMismatch as e:  # a weight of another dtype or shape: refused before any byte landed
            raise TensorMismatch(f"checkpoint {r.commit}: {e}") from None
        # each tensor is the model's own already (no copy); a module whose state_dict() hands out
        # copies gets them loaded here, as torch's load_state_dict would
        self.model.load_state_dict(r.tree["model"], strict=True)

    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: Any,
        trial: Any,
    ) -> tuple[int, int]:
        # Overrides a private method of Trainer (verified with transformers 5.24.0), which reads
        # trainer_state.json; this is its resume branch with the commit's TrainerState.
        stored = self._part(resume_from_checkpoint, "trainer_state")
        if stored is None:
            return super()._init_training_state(  # type: ignore[misc]
                max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
            )
        try:
            self.state = TrainerState(**stored)
        except TypeError as e:
            raise StateMismatch(f"checkpoint {self._resume.commit}: its TrainerState does not load: {e}") from None  # type: ignore[union-attr]
        best = self.state.best_model_checkpoint
        if best is not None and (not isinstance(best, str) or self.store.ref(best) is None):
            logger.warning("The best checkpoint %s recorded in the resumed state is gone; ignoring it.", best)
            self.state.best_model_checkpoint = None
        compare_trainer_and_checkpoint_args(self.args, self.state)
        self._load_callback_state()
        epochs_trained = int(self.state.global_step // num_update_steps_per_epoch)
        steps_trained_in_current_epoch = 0
        if not self.args.ignore_data_skip:
            steps_trained_in_current_epoch = self.state.global_step % num_update_steps_per_epoch
            steps_trained_in_current_epoch *= self.args.gradient_accumulation_steps
        self.state.init_training_references(self, max_steps, num_train_epochs, trial)
        return epochs_trained, steps_trained_in_current_epoch

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # Overrides a private method of Trainer (verified with transformers 5.24.0): called once
        # the optimizer and scheduler exist, after the Accelerator has prepared them.
        optimizer = self._part(checkpoint, "optimizer")
        if optimizer is None:
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        _check_optimizer(self.optimizer, optimizer, self._resume.commit)  # type: ignore[union-attr]
        self.optimizer.load_state_dict(optimizer)
        self.lr_scheduler.load_state_dict(self._part(checkpoint, "scheduler"))

    def _load_scaler(self, checkpoint: str | None) -> None:
        # Overrides a private method of Trainer (verified with transformers 5.24.0).
        r = self._resume
        if r is None or checkpoint != r.token:
            return super()._load_scaler(checkpoint)  # type: ignore[misc]
        stored, scaler = r.tree.get("scaler"), getattr(self.accelerator, "scaler", None)
        if (stored is None) != (scaler is None):
            raise StateMismatch(
                f"checkpoint {r.commit} {'holds no' if stored is None else 'holds a'} gradient scaler state, and this "
                f"run {'has' if scaler is not None else 'has no'} gradient scaler (mixed precision differs)"
            )
        if scaler is not None:
            scaler.load_state_dict(self._part(checkpoint, "scaler"))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        # Overrides a private method of Trainer (verified with transformers 5.24.0): called at the
        # start of the resumed epoch, or after skipping its consumed batches.
        rng = self._part(checkpoint, "rng")
        if rng is None:
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        restore_rng({k: t.numpy().tobytes() for k, t in rng.items()})  # every state checked before any is set

    def _load_best_model(self) -> None:
        # Overrides a private method of Trainer (verified with transformers 5.24.0): with
        # load_best_model_at_end, the best checkpoint is a ref of this run.
        best = self.state.best_model_checkpoint
        cid = self.store.resolve(best)
        _load_model(self.model, self._read_tree(cid, training=False)["model"], cid)

    # -- exporting -----------------------------------------------------------------------

    def export_pretrained(self, output_dir: str | os.PathLike[str], target: str | None = None) -> str | None:
        """Write a ``from_pretrained`` directory (safetensors weights, config, and the tokenizer or
        processor this trainer was given) of checkpoint ``target`` (a ref or commit id of the
        store), or of the live model when ``target`` is None; return the commit id exported.

        Unlike ``save_model`` it writes no ``training_args.bin`` (a pickle)."""
        model = self.accelerator.unwrap_model(self.model)
        cid, state_dict = None, None
        if target is not None:
            cid = self.store.resolve(target)
            state_dict = self._read_tree(cid, training=False)["model"]
            _check_model(model, state_dict, cid)
        model.save_pretrained(os.fspath(output_dir), state_dict=state_dict)
        tokenizer = self.processing_class
        if tokenizer is None:
            tokenizer = getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(os.fspath(output_dir))
        return cid


class ShardstoreTrainer(ShardstoreTrainerMixin, Trainer):
    """``transformers.Trainer`` with its checkpoints in a store (``ShardstoreTrainerMixin``)::

    trainer = ShardstoreTrainer(model=model, args=args, train_dataset=ds, store="/ckpt", prefix="runs/a")
    trainer.train()                                  # checkpoint N: ref runs/a/checkpoint-N
    trainer.train(resume_from_checkpoint=True)       # or a ref, or a commit id
    """


class _Guard(TrainerCallback):
    """Turns a Trainer that no longer calls this adapter's overrides into an error at once:
    a resume not wholly taken by the first step, a save Trainer announced but did not route here."""

    def __init__(self, trainer: ShardstoreTrainerMixin) -> None:
        self.trainer = trainer

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        r = self.trainer._resume
        if r is None or r.checked:
            return
        missing = sorted(r.expected() - r.applied)
        if missing:
            raise StateMismatch(
                f"resuming from {r.commit}: Trainer did not load {missing} through the methods "
                "shardstore.transformers overrides (verified with transformers 5.24.0)"
            )
        r.checked = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer._saved_step != state.global_step:
            raise StateMismatch(
                f"Trainer saved global step {state.global_step} without Trainer._save_checkpoint, which "
                "shardstore.transformers overrides (verified with transformers 5.24.0)"
            )


def _check_names(live: Mapping[str, Any], stored: Mapping[str, Any], commit: str) -> None:
    """StateMismatch unless the model's state dict ``live`` and the commit's model part name the same tensors."""
    missing, unexpected = sorted(set(live) - set(stored)), sorted(set(stored) - set(live))
    if missing or unexpected:
        raise StateMismatch(
            f"checkpoint {commit}: the model has tensors the commit lacks {missing[:5]}, or the commit has "
            f"tensors the model lacks {unexpected[:5]}"
        )


def _check_model(model: torch.nn.Module, stored: Mapping[str, Any], commit: str) -> dict[str, torch.Tensor]:
    """The model's state dict, once every name, dtype and shape matches the commit's (else raise, nothing written)."""
    live = model.state_dict()
    _check_names(live, stored, commit)
    for name, t in live.items():
        s = stored[name]
        if not isinstance(s, torch.Tensor) or s.dtype != t.dtype or s.shape != t.shape:
            got = f"{s.dtype}{list(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise TensorMismatch(f"checkpoint {commit}: model/{name} is {got}, the model's is {t.dtype}{list(t.shape)}")
    return live


def _load_model(model: torch.nn.Module, stored: Mapping[str, Any], commit: str) -> None:
    _check_model(model, stored, commit)
    model.load_state_dict(stored, strict=True)


def _check_optimizer(optimizer: Any, stored: Any, commit: str) -> None:
    """Refuse an optimizer state dict whose groups or state tensors do not fit ``optimizer``'s
    parameters (torch checks group sizes only, and pairs state with parameters by position)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    stored_sizes = [len(g.get("params", ())) for g in stored.get("param_groups", ())]
    if sizes != stored_sizes:
        raise StateMismatch(
            f"checkpoint {commit}: the optimizer's groups hold {sizes} parameters, the commit's {stored_sizes}"
        )
    for index, entry in stored.get("state", {}).items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            raise StateMismatch(f"checkpoint {commit}: optimizer state for parameter {index!r}, of {len(params)}")
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape != params[index].shape:
                raise TensorMismatch(
                    f"checkpoint {commit}: optimizer/state/{index}/{key} is {list(value.shape)}, its parameter's "
                    f"shape is {list(params[index].shape)}"
                )
