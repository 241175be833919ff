"""Admission: each worker checks its slot's estimate against memory it really has free.

Advertised capacity is not proof of available memory, so before a worker allocates its
stage it compares the planner's estimate of its slot (`planner.SlotEstimate.total`) with
what is free on its device *now*: on CUDA, the free bytes `torch.cuda.mem_get_info`
reports; on the CPU, the host's available memory (``MemAvailable`` in /proc/meminfo,
which counts reclaimable page cache; the free page count where there is no /proc). A
worker whose estimate exceeds that refuses with `AdmissionError` naming its slot, the
estimate and the free bytes; the lifecycle runs the check on every worker through its
collective gate, so one refusal stops the whole group before anything is allocated or
committed. ``SHARDTRAIN_FREE_MEMORY`` overrides the free figure for tests: a byte count
for every slot, or ``slot=bytes,...`` for some.

After training, each worker's actual peak (CUDA: `torch.cuda.max_memory_allocated`;
CPU: the peak resident set size, and its increase over the resident size at admission,
which is what the estimate predicts) and the parameters it held are gathered and written
to the store's journal for the run's last commit (unhashed, SPEC.md §19.2).
"""

from __future__ import annotations

import os
import resource
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from shardtrain.errors import AdmissionError, JobError
from shardtrain.reshape.planner import SlotEstimate

__all__ = ["FREE_MEMORY_ENV", "Usage", "free_memory", "admit", "peak_bytes", "gather_usage", "journal_record"]

FREE_MEMORY_ENV = "SHARDTRAIN_FREE_MEMORY"


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's estimate beside what it really used."""

    slot: int
    estimate: int  # bytes, the planner's estimate of this slot's peak
    free: int  # bytes free on the device at admission
    baseline: int  # resident bytes (CPU) or allocated bytes (CUDA) at admission
    peak: int  # peak resident bytes (CPU) or peak allocated bytes (CUDA)
    parameters: int  # elements this worker held
    parameter_bytes: int
    tier_bytes: int = 0  # bytes its host's memory tier held of its own slot (SPEC.md §19.3)
    replica_bytes: int = 0  # bytes its host's memory tier held of the slots it is buddy of
    tier_estimate: int = 0  # the planner's bound on those two together (`SlotEstimate.tier`)
    restore_memory: int = 0  # bytes of objects its start's restore read from its memory tier
    restore_peers: int = 0  # ... from its buddies' replicas
    restore_store: int = 0  # ... from the durable store

    @property
    def used(self) -> int:
        """The peak above the baseline: what the estimate predicts."""
        return self.peak - self.baseline


def _override(slot: int) -> int | None:
    raw = os.environ.get(FREE_MEMORY_ENV)
    if not raw:
        return None
    try:
        if "=" not in raw:
            return int(raw)
        parts = {int(k): int(v) for k, v in (p.split("=", 1) for p in raw.split(","))}
    except ValueError:
        raise JobError(f"{FREE_MEMORY_ENV}={raw!r}: expected BYTES or SLOT=BYTES[,SLOT=BYTES...]") from None
    return parts.get(slot)


def _host_available() -> int:
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f.read(1 << 16).decode("ascii", "replace").splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_memory(device: torch.device, slot: int = 0) -> int:
    """Bytes free for this worker now (or the test override for `slot`)."""
    override = _override(slot)
    if override is not None:
        return override
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return _host_available()


def _current(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read(4096).split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return peak_bytes(device)


def _reset_peak(device: torch.device) -> None:
    """Start the peak afresh at the current size (Linux: `clear_refs` 5 resets `VmHWM`)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "wb") as f:
            f.write(b"5")
    except OSError:
        pass  # not Linux (or not allowed): the lifetime peak is reported, an over-estimate


def peak_bytes(device: torch.device) -> int:
    """Peak allocated bytes on CUDA; the process's peak resident set size on the CPU.

    On Linux the peak is the address space's high-water mark (`VmHWM`), which admission
    resets when it measures the baseline, so that a spike before admission (importing,
    loading the job) is not taken for the slot's own peak; `ru_maxrss` cannot be reset.
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f.read(1 << 16).splitlines():
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, IndexError, ValueError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def admit(slot: int, estimate: SlotEstimate, device: torch.device, held: int = 0) -> tuple[int, int]:
    """(free bytes, baseline bytes) if `estimate` fits what is free; AdmissionError otherwise.

    The memory tiers' share (`estimate.tier`, host memory) counts less what the host's tiers
    already hold (`held`: a restarted worker's tier keeps its start, and tmpfs pages are not
    free memory): on the CPU it is added to the device's peak, on an accelerator it is checked
    against the host's available memory on its own."""
    free = free_memory(device, slot)
    tier = max(0, estimate.tier - held)
    need = estimate.total + (tier if device.type == "cpu" else 0)
    if need > free:
        raise AdmissionError(
            f"slot {slot}: estimated peak {need:,} bytes (weights {estimate.weights:,}, grads "
            f"{estimate.grads:,}, Adam moments {estimate.moments:,}, reference {estimate.reference:,}, activations "
            f"{estimate.activations:,}, bf16 casts {estimate.casts:,}, optimizer scratch {estimate.scratch:,}, reserve "
            f"{estimate.reserve:,}{_tier_terms(estimate, held) if device.type == 'cpu' else ''}) exceeds the "
            f"{free:,} bytes free on {device}; refused before allocating (layers {estimate.layers[0]}:"
            f"{estimate.layers[1]}; plan another partition with shardtrain plan, or use more workers)"
        )
    if device.type != "cpu" and tier:
        host = free_memory(torch.device("cpu"), slot)
        if tier > host:
            raise AdmissionError(
                f"slot {slot}: the memory tiers on its host would hold {tier:,} more bytes "
                f"({_tier_terms(estimate, held).lstrip(', ')}) than the {host:,} bytes of host memory available; "
                f"refused before allocating (keep fewer commits with --memory-tier-commits, fewer --peer-replicas, "
                f"or --memory-tier on another directory)"
            )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _reset_peak(device)  # the peak recorded later is this worker's own, from here on
    return free, _current(device)


def _tier_terms(estimate: SlotEstimate, held: int) -> str:
    if not estimate.tier:
        return ""
    return f", memory tiers {estimate.tier:,} less {min(held, estimate.tier):,} they hold already"


def gather_usage(mine: Usage, rank: int, world: int) -> list[Usage]:
    """Every worker's `Usage`, in slot order (a collective when world > 1)."""
    fields = (
        "slot",
        "estimate",
        "free",
        "baseline",
        "peak",
        "parameters",
        "parameter_bytes",
        "tier_bytes",
        "replica_bytes",
        "tier_estimate",
        "restore_memory",
        "restore_peers",
        "restore_store",
    )
    row = torch.tensor([getattr(mine, f) for f in fields], dtype=torch.int64)
    if world == 1:
        return [mine]
    rows = [torch.zeros_like(row) for _ in range(world)]
    dist.all_gather(rows, row)
    return [Usage(**dict(zip(fields, (int(v) for v in r.tolist())))) for r in rows]


def journal_record(usages: list[Usage]) -> dict[str, Any]:
    """The journal entry of a run's workers: estimate, free (the budget admitted against),
    baseline, peak and parameters per slot, and each slot's parameter coverage (its share of
    the model's parameters; every parameter has one owner, so the shares sum to 1)."""
    total = sum(u.parameters for u in usages)
    return {
        "workers": [
            {**msgspec.to_builtins(u), "used": u.used, "coverage": u.parameters / total if total else 0.0}
            for u in usages
        ]
    }
