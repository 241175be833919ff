"""Error hierarchy of shardtrain: one base class, one subclass per failure mode.

Every error the trainer raises for bad input or a failed peer is a `ShardtrainError`, so
callers (the CLI, a test) can catch the family and map each class to an exit code. Asserts
are kept for internal invariants only.
"""

from __future__ import annotations

__all__ = [
    "ShardtrainError",
    "ConfigError",
    "PartitionError",
    "BatchError",
    "MessageError",
    "PeerFailureError",
    "OptimizerStateError",
    "LaunchError",
    "WorkerFailedError",
    "qualified_name",
    "JobError",
    "ResumeError",
    "RunAborted",
    "TransitionError",
    "AdmissionError",
    "RoleError",
    "DistillError",
    "NonFiniteStep",
]


class ShardtrainError(Exception):
    """Base class of every error shardtrain raises on purpose."""


class ConfigError(ShardtrainError, ValueError):
    """A model or trainer configuration is inconsistent or out of range."""


class PartitionError(ShardtrainError, ValueError):
    """A partition leaves a layer unowned, owns one twice, or is otherwise malformed."""


class BatchError(ShardtrainError, ValueError):
    """A batch has mismatched shapes, out-of-range tokens, or invalid target weights."""


class MessageError(ShardtrainError):
    """A point-to-point message header disagrees with what the receiver expects."""


class PeerFailureError(ShardtrainError):
    """A peer died, hung past the timeout, or its connection broke mid-step."""


class OptimizerStateError(ShardtrainError, ValueError):
    """Optimizer state to import does not fit this optimizer's parameters and groups."""


class LaunchError(ShardtrainError):
    """The launch environment (torchrun variables, ports, backend) is unusable."""


class WorkerFailedError(ShardtrainError):
    """One or more locally launched worker processes failed or did not finish in time."""

    def __init__(self, failures: dict[int, str], raised: dict[int, tuple[str, ...]] | None = None) -> None:
        self.failures = dict(sorted(failures.items()))
        # rank -> the qualified names of the class of the exception that worker raised and of
        # its bases (its MRO); absent for a worker that died or hung without raising one.
        self.raised = dict(sorted((raised or {}).items()))
        lines = [f"rank {rank}: {msg}" for rank, msg in self.failures.items()]
        super().__init__("worker processes failed:\n" + "\n".join(lines))

    def ranks_raising(self, *classes: type[BaseException]) -> list[int]:
        """The ranks whose exception was an instance of one of ``classes`` (judged by the
        classes the worker recorded, as `isinstance` would)."""
        names = {qualified_name(c) for c in classes}
        return [rank for rank, mro in self.raised.items() if names.intersection(mro)]


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class: how a worker records the classes of what it raised."""
    return f"{cls.__module__}.{cls.__qualname__}"


class JobError(ShardtrainError, ValueError):
    """A prepared job file, one of its assets or records is malformed or does not match its hash."""


class ResumeError(ShardtrainError):
    """A commit cannot seed or resume this run: another job, schedule, model, cursor, or a refused ref."""


class RunAborted(ShardtrainError):
    """A run stopped before its last update (a peer was lost); the message names the last committed step."""


class TransitionError(ShardtrainError, ValueError):
    """A repartition or grow transition cannot be made from this commit with these arguments."""


class AdmissionError(ShardtrainError):
    """A worker's estimated peak memory exceeds the memory it really has free; it refused before allocating."""


class RoleError(ShardtrainError):
    """Final sets were asked for without a matching selection, or a selection came after finals were opened."""


class DistillError(ShardtrainError):
    """The frozen reference a cohort names cannot be found, restored or matched to the student's batch."""


class NonFiniteStep(ShardtrainError):
    """A step's loss or global gradient norm was not finite: the update was not applied (docs/SHARDTRAIN-FORMATS.md §3)."""
