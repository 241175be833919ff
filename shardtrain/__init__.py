"""shardtrain: a compact Llama pipeline trainer on torch.distributed that keeps every
worker's state in a shardstore and never builds the whole model in one place.

Packages, each one concept, from the bottom up; each imports only those below it
(checked by import-linter):

- `errors` — the error hierarchy (the lowest layer).
- `engine` — one slot's share of the model and its step: `model` (a Llama decoder with
  Hugging Face names), `partition` (which slot owns which layers; building a slot's
  stage), `batch`, `loss` (CE plus KL on declared replay rows), `messages` and
  `pipeline` (the ring of activations and gradients), `schedule` (the order of each
  slot's microbatch actions: overlapped or synchronous, bitwise alike), `clipping` (a
  partition-independent global norm), `optim` (shard-local AdamW with per-parameter Adam
  age), `trainer` (one update) and `ring` (forward-only passes round the ring).
- `workers` — beside the engine: `launch` (torchrun or local worker processes) and
  `forkserver` (workers forked from a server that imported torch once).
- `job` — what a run is bound to: `job` (the prepared job binding tokenizer assets,
  records, schedule and recipe by hash), `recipe`, `tasks` and `tokenizer` (the embedded
  default's pieces) and `roles` (development and final sets, the selection record).
- `reshape` — adaptive shards: `regroup` (repartition commits), `grow` (identity blocks),
  `planner` (per-slot memory estimate, exact assignment) and `admission` (each worker's
  check).
- `run` — `lifecycle` (train with commits through shardstore, resume, fault handling),
  `committer` (a run's commits, written in the background from a staged copy), `distill`
  (the frozen reference, sharded like the student), `evaluate` (held-out loss, greedy
  generation with a per-stage KV cache, paired bootstrap), `gates` (gain, retention and
  generation gates) and `demo`.
"""

from shardtrain.engine.batch import Batch, Microbatch, split_microbatches
from shardtrain.engine.clipping import clip_coefficient, global_grad_norm, scale_grads_, squared_grad_norms
from shardtrain.engine.messages import Channel, MessageHeader, check_header
from shardtrain.engine.model import Llama, LlamaConfig
from shardtrain.engine.optim import AdamW, GroupConfig, Schedule, default_group, lr_multiplier
from shardtrain.engine.partition import (
    Partition,
    build_stage,
    canonical_parameter_names,
    init_parameters_,
    parameter_inventory,
)
from shardtrain.engine.pipeline import Pipeline
from shardtrain.engine.trainer import StepResult, Trainer
from shardtrain.errors import (
    AdmissionError,
    BatchError,
    ConfigError,
    JobError,
    LaunchError,
    MessageError,
    OptimizerStateError,
    PartitionError,
    PeerFailureError,
    ResumeError,
    RunAborted,
    ShardtrainError,
    TransitionError,
    WorkerFailedError,
)
from shardtrain.job.default_job import prepare_default
from shardtrain.job.job import PreparedJob, load_job
from shardtrain.reshape.grow import identity_check
from shardtrain.reshape.planner import MemoryModel, Plan, SlotEstimate, plan
from shardtrain.reshape.regroup import TransitionResult  # regroup() and grow() stay in their modules: same names
from shardtrain.run.evaluate import EvalReport, EvalSpec, evaluate
from shardtrain.run.lifecycle import RunResult, RunSpec, StepEvent, train
from shardtrain.workers.launch import WorkerContext, free_port, init_from_env, launch_local, run_worker, shutdown

__all__ = [
    "AdamW",
    "Batch",
    "BatchError",
    "Channel",
    "ConfigError",
    "GroupConfig",
    "LaunchError",
    "Llama",
    "LlamaConfig",
    "MessageError",
    "MessageHeader",
    "Microbatch",
    "OptimizerStateError",
    "Partition",
    "PartitionError",
    "PeerFailureError",
    "Pipeline",
    "Schedule",
    "ShardtrainError",
    "StepResult",
    "Trainer",
    "WorkerContext",
    "WorkerFailedError",
    "build_stage",
    "canonical_parameter_names",
    "check_header",
    "clip_coefficient",
    "default_group",
    "free_port",
    "global_grad_norm",
    "init_from_env",
    "init_parameters_",
    "launch_local",
    "lr_multiplier",
    "parameter_inventory",
    "run_worker",
    "scale_grads_",
    "shutdown",
    "split_microbatches",
    "squared_grad_norms",
    "JobError",
    "ResumeError",
    "RunAborted",
    "PreparedJob",
    "load_job",
    "prepare_default",
    "RunResult",
    "RunSpec",
    "StepEvent",
    "train",
    "EvalReport",
    "EvalSpec",
    "evaluate",
    "TransitionResult",
    "identity_check",
    "MemoryModel",
    "Plan",
    "SlotEstimate",
    "plan",
    "AdmissionError",
    "TransitionError",
]
