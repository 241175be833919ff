"""shardstore as torchtitan's checkpoint manager: ``ShardstoreCheckpointManager``.

torchtitan's trainer builds its checkpointer from ``config.checkpoint``, a
``BaseCheckpointManager.Config``, and calls only ``load(step)``, ``save(step, last_step)``,
``maybe_wait_for_staging`` and ``close``. This manager keeps that contract and torchtitan's
policies (``interval``, ``keep_latest_k``, ``last_save_model_only`` / ``export_dtype``,
``exclude_from_loading``, ``load_only``, ``async_mode``, the model-only step 0), and points the
DCP calls of torchtitan's own ``CheckpointManager`` at a store instead of a folder::

    config.checkpoint = ShardstoreCheckpointManager.Config(enable=True, store="s3://bucket/run-7")

What it saves is what torchtitan's manager saves: the ``states`` dict (``train_state``, ...) with
``model`` (torchtitan's ``ModelWrapper`` over the model parts, flattened to its keys),
``optimizer`` (the ``OptimizersContainer``, FQN-keyed), ``lr_scheduler`` and ``dataloader``,
through ``torch.distributed.checkpoint`` and ``shardstore.dcp.StoreWriter``: each rank writes its
own FSDP2 / TP shards, the coordinator commits (SPEC.md §9.4). A checkpoint is the ref
``step-N`` (``<ref_prefix>/step-N`` with a prefix), a commit of its own with no parent, so that
``keep_latest_k`` deleting the older refs (compare-and-delete) leaves ``shardstore gc`` free to
reclaim what only they held. ``load(-1)`` takes the highest step rank 0 finds; every rank then
loads that one commit (``agree_on_commit``).

DCP hands a storage layer every non-tensor value (a learning rate, the train step, the data
loader's position) as bytes it pickled with ``torch.save``; this manager loads them with torch's
weights-only unpickler (``torch.load(weights_only=True)``: numbers, strings, bytes, containers and
tensors, never a class or function a commit names), not DCP's default ``weights_only=False``.
torchtitan's ``ParallelAwareDataloader`` still ``pickle.loads`` the bytes of its own position that
it pickled itself: load only stores you trust.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torchtitan.components.checkpointer import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem

from .checkpoint.distributed import agree_on_commit
from .checkpoint.info import CommitInfo, check_info
from .dcp import StoreReader, StoreWriter
from .errors import RefConflict, RefNotFound, ShardstoreError, UnsupportedState
from .format.names import check_ref_name
from .store import Store, open_store

__all__ = ["ShardstoreCheckpointManager", "WeightsOnlyLoadPlanner"]

log = logging.getLogger(__name__)

_ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a bytes item (a non-tensor value DCP pickled at save)
    is unpickled by torch's weights-only unpickler: a pickle naming any other class or function
    is refused (``UnsupportedState``, naming its key), never run."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:  # torch raises UnpicklingError (a global it refuses, or no pickle at all)
            raise UnsupportedState(
                f"DCP bytes item {fqn!r}: not a pickle of plain values ({_why(exc)}); refused, it was not unpickled"
            ) from None
        if not self.flatten_state_dict:
            self.state_dict[fqn] = obj
            return
        *parents, last = self.mappings[fqn]  # the key path DCP flattened this value from
        node = self.original_state_dict
        for key in parents:
            node = node[key]
        node[last] = obj


class ShardstoreCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager, saving to and loading from a shardstore store.

    Built like torchtitan's ``CheckpointManager`` (the trainer calls ``config.checkpoint.build(...)``
    with the same keyword arguments). ``Config.store``: the store URL (a path, ``s3://...``);
    empty, the checkpoint folder itself (``base_folder``/``folder``) is the store. Options this
    manager cannot honour (a Hugging Face safetensors directory as the first or the last checkpoint)
    are refused at construction (``UnsupportedState``), never ignored.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        store: str = ""
        """Store URL (a path or ``s3://bucket/prefix``); empty: the checkpoint folder is the store."""

        ref_prefix: str = ""
        """Refs are ``<ref_prefix>/step-N`` (empty: ``step-N``): runs sharing a store take prefixes of their own."""

        job: str = "torchtitan"
        """The job id recorded in every commit (SPEC.md §6's job ids)."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """As torchtitan's: ``async`` saves in a thread, ``async_with_pinned_mem`` in DCP's checkpoint
        process after staging into pinned memory (shared memory only, where no accelerator is present)."""

        thread_count: int = 2
        """Objects hashed and written, or read and verified, at once by each rank."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            self.async_mode = self.async_mode.lower()  # type: ignore[assignment]
            if self.async_mode not in _ASYNC_MODES:
                raise ValueError(f"Invalid async_mode: {self.async_mode} (one of {', '.join(_ASYNC_MODES)})")
            if self.thread_count < 1:
                raise ValueError(f"thread_count must be at least 1, got {self.thread_count}")
            check_ref_name(_ref_name(self.ref_prefix, 0))  # InvalidName, before any save
            check_info(CommitInfo(step=0, job=self.job))  # ManifestError for a job id no commit can hold

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future: Future | None = None
        if not self.enable:
            return
        for option in ("initial_load_in_hf", "last_save_in_hf"):
            if getattr(config, option):
                raise UnsupportedState(
                    f"checkpoint.{option}: a Hugging Face safetensors directory is not a commit of a store; "
                    "ShardstoreCheckpointManager saves and loads commits only (export one with `shardstore export`)"
                )
        self.url = config.store or filesystem.join(base_folder, config.folder)
        self.ref_prefix = config.ref_prefix
        self.job = config.job
        self.interval = config.interval
        self.thread_count = config.thread_count
        self.states = states
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                DATALOADER: dataloader,
                LR_SCHEDULER: lr_schedulers,
            }
        )
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.keep_latest_k = config.keep_latest_k
        self.sd_adapter = sd_adapter
        self.async_mode = config.async_mode
        # DCP's coordination, the choice of the step to load and async saves run on a Gloo group of
        # the manager's own (CPU tensors, whatever backend the trainer's default group uses).
        self.pg = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None
        self.stager: DefaultStager | None = None
        self.staging_future: Future | None = None
        self._store: Store | None = None

    # -- torchtitan's contract -------------------------------------------------------------

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        if last_step:
            self._dcp_save(self._last_step_states(), curr_step, "disabled")
        else:
            self._dcp_save(self._flattened_states(self.states), curr_step, self.async_mode)
        if self.save_future is None:
            self._purge()
        return True

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        found = self._choose_step(step)
        if found is None:
            if not self.initial_load_path:
                return False  # a fresh start
            model_only = self.initial_load_model_only
            states = self._states_to_load(model_only)
            _typed(
                lambda: dcp.load(
                    states,
                    checkpoint_id=self.initial_load_path,
                    planner=WeightsOnlyLoadPlanner(),
                    process_group=self.pg,
                )
            )
        else:
            load_step, name = found
            store = self._open()
            commit = store.resolve(name) if self.pg is None else agree_on_commit(store, name, group=self.pg)
            states = self._states_to_load(load_step == 0)  # step 0: torchtitan's model-only seed checkpoint
            reader = StoreReader(self.url, target=commit, thread_count=self.thread_count)
            _typed(
                lambda: dcp.load(states, storage_reader=reader, planner=WeightsOnlyLoadPlanner(), process_group=self.pg)
            )
        # The model's keys are flattened into the top level: DCP filled its tensors in place, and
        # the wrapper loads them into the model parts (torchtitan's dcp_load does the same).
        self.states[MODEL].load_state_dict(states)
        return True

    def _maybe_wait_for_staging(self) -> None:
        if self.staging_future is not None:
            self.staging_future.result()
            self.staging_future = None

    def _wait_for_saving(self) -> None:
        assert self.save_future is not None
        future, self.save_future = self.save_future, None
        _typed(future.result)
        self._purge()

    def _close(self) -> None:
        try:
            self.maybe_wait_for_saving()  # an async save in flight lands (or raises) before the manager goes
        finally:
            stager = getattr(self, "stager", None)  # absent when the constructor refused before making it
            if stager is not None:
                stager.close()
                self.stager = None

    def __del__(self) -> None:
        if getattr(self, "save_future", None) is None:  # never wait for a save inside a finalizer
            self.close()

    # -- saving ----------------------------------------------------------------------------

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.load_only:
            return False
        if curr_step == 1 and self.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    def _dcp_save(self, states: dict[str, Any], step: int, mode: str) -> None:
        writer = StoreWriter(
            self.url, ref=_ref_name(self.ref_prefix, step), step=step, job=self.job, thread_count=self.thread_count
        )
        if mode == "disabled":
            _typed(lambda: dcp.save(states, storage_writer=writer, process_group=self.pg))
        elif mode == "async":
            self.save_future = dcp.async_save(states, storage_writer=writer, process_group=self.pg)
        else:
            if self.stager is None:
                pinned = torch.accelerator.is_available()  # pinned host memory needs a device to copy from
                self.stager = DefaultStager(
                    StagingOptions(
                        use_pinned_memory=pinned,
                        use_shared_memory=True,
                        use_async_staging=pinned,
                        use_non_blocking_copy=pinned,
                    )
                )
            got = dcp.async_save(
                states,
                storage_writer=writer,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            )
            if isinstance(got, AsyncSaveResponse):
                self.staging_future, self.save_future = got.staging_completion, got.upload_completion
            else:
                self.save_future = got

    def _last_step_states(self) -> dict[str, Any]:
        if not self.last_save_model_only:
            return self._flattened_states(self.states)
        return {
            k: v.to(self.export_dtype)
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != self.export_dtype
            else v
            for k, v in self.states[MODEL].state_dict().items()
        }

    def _purge(self) -> None:
        """Delete the refs of all but the ``keep_latest_k`` highest steps (rank 0; compare-and-delete:
        a ref moved meanwhile is kept). Their objects stay until ``shardstore gc`` finds them unreachable."""
        if self.keep_latest_k <= 0 or (self.pg is not None and dist.get_rank() != 0):
            return
        steps = self._steps()
        for step in sorted(steps)[: -self.keep_latest_k]:
            name, commit = steps[step]
            try:
                self._open().delete_ref(name, expected=commit)
            except (RefConflict, RefNotFound) as exc:
                log.warning("keep_latest_k: ref %s kept: %s", name, exc)

    # -- loading ---------------------------------------------------------------------------

    def _choose_step(self, step: int) -> tuple[int, str] | None:
        """The step to load and its ref, as rank 0 sees the store (None: no checkpoint yet)."""
        chosen = torch.tensor([-1], dtype=torch.int64)
        if self.pg is None or dist.get_rank() == 0:
            steps = self._steps()
            if step != -1 and step not in steps:
                chosen[0] = -2
            elif steps:
                chosen[0] = step if step != -1 else max(steps)
        if self.pg is not None:
            dist.broadcast(chosen, group_src=0, group=self.pg)
        if int(chosen) == -2:
            raise RefNotFound(
                f"checkpoint.load_step={step}: store {self.url} has no ref {_ref_name(self.ref_prefix, step)!r}"
            )
        if int(chosen) == -1:
            return None
        return int(chosen), _ref_name(self.ref_prefix, int(chosen))

    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return self.states[MODEL].state_dict()
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise ValueError(f"{key} not found in state_dict.")
        return self._flattened_states({k: v for k, v in self.states.items() if k not in self.exclude_from_loading})

    # -- the store -------------------------------------------------------------------------

    def _open(self) -> Store:
        if self._store is None:  # a load-only run never creates a store
            self._store = open_store(self.url, create=not self.load_only)
        return self._store

    def _steps(self) -> dict[int, tuple[str, str]]:
        """Every checkpoint of this run in the store: step -> (ref name, commit id)."""
        pattern = re.compile(re.escape(_ref_name(self.ref_prefix, 0)[: -len("0")]) + r"(0|[1-9][0-9]*)")
        found = {}
        for name, commit in self._open().refs().items():
            m = pattern.fullmatch(name)
            if m:
                found[int(m.group(1))] = (name, commit)
        return found

    @staticmethod
    def _flattened_states(states: Mapping[str, Any]) -> dict[str, Any]:
        """torchtitan's layout: the model's keys at the top level, every other state under its key."""
        flat = {k: v for k, v in states.items() if k != MODEL}
        if MODEL in states:
            flat.update(states[MODEL].state_dict())
        return flat


def _why(exc: Exception) -> str:
    """The line of torch's weights-only error that names what it refused (``Unsupported global: ...``)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if "WeightsUnpickler error" in line]
    return (named or lines or [type(exc).__name__])[0].split(" was not an allowed global")[0]


def _ref_name(prefix: str, step: int) -> str:
    return f"{prefix}/step-{step}" if prefix else f"step-{step}"


def _typed(call: Any) -> Any:
    """``call()``; a ``CheckpointException`` (DCP's report of a failure on some rank) that carries a
    shardstore error is raised as that error, so a caller sees the same typed error on every rank."""
    try:
        return call()
    except CheckpointException as exc:
        for rank in sorted(exc.failures):
            err = exc.failures[rank][0]
            if isinstance(err, ShardstoreError):
                raise err from exc
        raise
