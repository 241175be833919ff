"""Capacity planner: estimate each slot's peak memory and choose the layer assignment.

The estimate of a slot is a sum of named terms (bytes), each a count of FP32 tensors:

- ``weights``, ``grads``, ``exp_avg``, ``exp_avg_sq``: one FP32 copy each of every
  parameter the slot owns (the numerical profile keeps all four in FP32 and never
  offloads optimizer state);
- ``reference``: one FP32 copy of the same parameters of the frozen reference model
  when distillation is on (the reference is partitioned like the student);
- ``activations``: what the forward keeps for the backward, per decoder layer per
  microbatch ``ACT_PER_HIDDEN`` (B, T, C) tensors and ``ACT_PER_INTERMEDIATE`` (B, T, I)
  tensors (counted from `model.py`: the layer input, both RMSNorm outputs and their
  float32 intermediates, q/k/v and their rotated and repeated copies, the attention output
  and its reshaped copy, the residual, and the SwiGLU gate, up, silu and product), times
  the microbatches in flight (the synchronous schedule runs every microbatch's forward
  before any backward, so all of them are in flight); slot 0 adds the embedding output
  per microbatch and the head's logits, log-softmax and their gradient for one microbatch
  (the head runs one microbatch at a time);
- ``casts`` (the ``bf16-autocast`` profile, docs/SHARDTRAIN-FORMATS.md §5): autocast's bfloat16 copy of
  every weight a matrix product uses (2 bytes per parameter), kept by each microbatch's
  graph for its backward, so once per microbatch in flight; with recomputation the
  blocks' copies once (a recomputed block casts its weights again, one block at a time),
  the output head's still per microbatch (it is not recomputed); and with
  recomputation ``activations`` keep only each block's input and output per microbatch
  plus one block's whole activations (the block being recomputed);
- ``scratch``: AdamW's temporaries while it updates one tensor (two FP32 tensors of the
  slot's largest parameter, `shardtrain.optim`);
- ``reserve``: a fixed allowance for what is not modelled, `DEFAULT_RESERVE` unless
  given. On CPU it is dominated by what torch's first forward and backward map whatever
  the model's size (kernels, allocator arenas, autograd's engine): measured on the 2-core
  development VM as 84-85 MiB of peak RSS beyond the modelled terms, above the resident
  size of a fresh process that has imported torch and loaded its job (the baseline the
  admission check takes); 80 MiB is the default (``tests/test_planner.py`` checks the
  whole estimate against a measured peak). Workers the local launcher forks from its
  forkserver, which has already imported torch and touched much of it, pay about 50 MiB
  less (a 1-worker run of the default job used 54 MB above admission against a 107 MB
  estimate; a fresh process, 111 MB), so for them the estimate errs on the safe side.

`plan` chooses the contiguous assignment of layers to slots that minimises the highest
estimated utilisation (estimate / capacity) over slots, with one capacity per slot.
Slot 0 holds the embedding, the final norm and the output head, and may own no layers;
every other slot owns at least one (`Partition`'s rule). The search is an exact dynamic
program over (slots used, layers covered), O(n L^2): the optimum, not a heuristic.
On a tie each slot starts at the earliest layer that achieves the optimum, so the answer
is deterministic. `for_job` reads the microbatch shape from a prepared job.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from shardtrain.engine.model import LlamaConfig
from shardtrain.engine.partition import Partition
from shardtrain.errors import ConfigError
from shardtrain.job.job import PreparedJob

__all__ = [
    "ACT_PER_HIDDEN",
    "ACT_PER_INTERMEDIATE",
    "DEFAULT_RESERVE",
    "MemoryModel",
    "SlotEstimate",
    "Plan",
    "for_job",
    "plan",
    "parse_bytes",
    "utilisation",
]

FP32 = 4
ACT_PER_HIDDEN = 16
ACT_PER_INTERMEDIATE = 4
HEAD_COPIES = 3  # logits, log-softmax, their gradient: (B, T, V) each, one microbatch at a time
DEFAULT_RESERVE = 80 * 2**20


@dataclasses.dataclass(frozen=True)
class SlotEstimate:
    """One slot's estimated peak, term by term (bytes), and the parameters it holds."""

    slot: int
    layers: tuple[int, int]  # half-open [start, stop)
    parameters: int
    weights: int
    grads: int
    moments: int  # both Adam moments
    reference: int
    activations: int
    reserve: int
    casts: int = 0  # bf16-autocast's weight copies
    scratch: int = 0  # AdamW's per-tensor temporaries
    # Host memory, not the device's: what the memory tiers on this worker's host hold at most, its
    # own slot's stored state and that of the slots it keeps replicas of (SPEC.md §19.3), each for
    # the commits a tier keeps plus the one being written. Not in `total` (the device's peak): on
    # the CPU admission adds it, on an accelerator it is checked against the host's memory.
    tier: int = 0

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.grads
            + self.moments
            + self.reference
            + self.activations
            + self.casts
            + self.scratch
            + self.reserve
        )

    @property
    def modelled(self) -> int:
        """The estimate without the reserve: what the terms account for."""
        return self.total - self.reserve


@dataclasses.dataclass(frozen=True)
class MemoryModel:
    """What decides a slot's memory: the model shape and the job's microbatch shape."""

    config: LlamaConfig
    seq_len: int  # the longest sequence of the job's schedule
    microbatch_size: int
    microbatches: int = 1  # microbatches in flight at once (all of a batch under the synchronous schedule)
    reference: bool = False  # a frozen reference model is partitioned across the same slots
    reserve: int = DEFAULT_RESERVE
    autocast: bool = False  # the bf16-autocast profile: bf16 weight copies per forward
    recompute: bool = False  # activation recomputation: blocks keep only their inputs
    tier_commits: int = 0  # commits each memory tier keeps (0: no memory tier)
    replicas: int = 0  # buddies each slot's new objects go to (their hosts' tiers keep them)

    def __post_init__(self) -> None:
        for name in ("seq_len", "microbatch_size", "microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"memory model: {name} must be an int >= 1, got {value!r}")
        if self.reserve < 0:
            raise ConfigError(f"memory model: reserve must be >= 0, got {self.reserve}")
        for name in ("tier_commits", "replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"memory model: {name} must be an int >= 0, got {value!r}")

    def layer_parameters(self) -> int:
        c, i, d = self.config.hidden_size, self.config.intermediate_size, self.config.dim_per_head
        h, kv = self.config.num_attention_heads, self.config.kv_heads
        return c * h * d * 2 + c * kv * d * 2 + 3 * c * i + 2 * c

    def fixed_parameters(self) -> int:
        """Slot 0's embedding, final norm and (when untied) output head."""
        v, c = self.config.vocab_size, self.config.hidden_size
        return v * c + c + (0 if self.config.tie_word_embeddings else v * c)

    def layer_activations(self, microbatches: int | None = None) -> int:
        tokens = self.microbatch_size * self.seq_len * (self.microbatches if microbatches is None else microbatches)
        return (
            FP32
            * tokens
            * (ACT_PER_HIDDEN * self.config.hidden_size + ACT_PER_INTERMEDIATE * self.config.intermediate_size)
        )

    def _largest(self, slot: int, layers: range) -> int:
        """Elements of the slot's largest parameter tensor."""
        c, i, d = self.config.hidden_size, self.config.intermediate_size, self.config.dim_per_head
        sizes = [c * i, c * self.config.num_attention_heads * d] if len(layers) else [0]
        return max(sizes + ([self.config.vocab_size * c] if slot == 0 else []))

    def fixed_activations(self) -> int:
        tokens = self.microbatch_size * self.seq_len
        return FP32 * (
            tokens * self.microbatches * self.config.hidden_size + HEAD_COPIES * tokens * self.config.vocab_size
        )

    def estimate(self, slot: int, layers: range) -> SlotEstimate:
        """The estimate of a slot owning `layers` (and, for slot 0, the embedding and head)."""
        params = len(layers) * self.layer_parameters() + (self.fixed_parameters() if slot == 0 else 0)
        if self.recompute and len(layers):  # each block keeps its input and output; one block is recomputed at a time
            tokens = self.microbatch_size * self.seq_len * self.microbatches
            acts = len(layers) * 2 * FP32 * tokens * self.config.hidden_size + self.layer_activations(1)
        else:
            acts = len(layers) * self.layer_activations()
        acts += self.fixed_activations() if slot == 0 else 0
        b = FP32 * params
        casts = 0
        if self.autocast:  # bf16 copies: the blocks' weights, and on slot 0 the head's matrix (never recomputed)
            head = self.config.vocab_size * self.config.hidden_size if slot == 0 else 0
            casts = 2 * (
                len(layers) * self.layer_parameters() * (1 if self.recompute else self.microbatches)
                + head * self.microbatches
            )
        return SlotEstimate(
            slot=slot,
            layers=(layers.start, layers.stop),
            parameters=params,
            weights=b,
            grads=b,
            moments=2 * b,
            reference=b if self.reference else 0,
            activations=acts,
            reserve=self.reserve,
            casts=casts,
            scratch=2 * FP32 * self._largest(slot, layers),
            tier=self.tier_held(b + 2 * b),
        )

    def tier_held(self, stored: int) -> int:
        """Bytes a memory tier holds at most of a slot whose commit stores `stored` bytes: the
        commits it keeps and the one being written (write-through lands a commit's objects before
        the oldest is evicted); 0 without a tier."""
        return (self.tier_commits + 1) * stored if self.tier_commits else 0

    def estimates(self, partition: Partition) -> tuple[SlotEstimate, ...]:
        """Every slot's estimate; with peer replicas, each slot's `tier` also counts the slots
        whose replicas its host keeps (slot s keeps those of s-1, ..., s-replicas, mod the slots)."""
        if partition.num_layers != self.config.num_hidden_layers:
            raise ConfigError(
                f"partition is for {partition.num_layers} layers, the model has {self.config.num_hidden_layers}"
            )
        own = tuple(self.estimate(s, partition.layers(s)) for s in range(partition.num_slots))
        n = len(own)
        buddies = min(self.replicas, n - 1) if self.tier_commits else 0
        return tuple(
            dataclasses.replace(e, tier=e.tier + sum(own[(e.slot - d) % n].tier for d in range(1, buddies + 1)))
            for e in own
        )


def for_job(
    job: PreparedJob,
    config: LlamaConfig | None = None,
    *,
    reference: bool | None = None,
    reserve: int = DEFAULT_RESERVE,
    tier_commits: int = 0,
    replicas: int = 0,
) -> MemoryModel:
    """The memory model of `job` (its longest scheduled sequence and its batch split), for
    `config` (default the job's; a grown commit's config has more layers). `reference`
    defaults to whether any cohort of the job distils toward a frozen reference;
    `tier_commits` and `replicas` are the run's memory tier (0: none) and peer replicas."""
    recipe = job.job.recipe
    if reference is None:
        reference = any(job.reference_of(c) is not None for c in {s.cohort for s in job.job.schedule.steps})
    docs = {d for step in job.job.schedule.steps for d in step.docs}
    seq_len = max((len(job.encoded(d)[0]) - 1 for d in docs), default=1)
    profile = job.job.profile
    return MemoryModel(
        config or job.config,
        seq_len=max(1, seq_len),
        microbatch_size=recipe.microbatch_size,
        microbatches=-(-recipe.batch_size // recipe.microbatch_size),
        reference=reference,
        reserve=reserve,
        autocast=profile is not None and profile.name == "bf16-autocast",
        recompute=profile is not None and profile.recompute,
        tier_commits=tier_commits,
        replicas=replicas,
    )


@dataclasses.dataclass(frozen=True)
class Plan:
    """The chosen assignment, each slot's estimate and capacity, and the highest utilisation."""

    partition: Partition
    estimates: tuple[SlotEstimate, ...]
    capacities: tuple[int, ...]
    max_utilisation: float

    def utilisations(self) -> tuple[float, ...]:
        return tuple(utilisation(e.total, c) for e, c in zip(self.estimates, self.capacities))


def utilisation(estimate: int, capacity: int) -> float:
    """estimate / capacity (the quantity the planner minimises the maximum of)."""
    return estimate / capacity


def plan(model: MemoryModel, capacities: Sequence[int]) -> Plan:
    """The contiguous assignment minimising max(estimate / capacity); capacity s is slot s's.

    Exact: dp[s][j] is the best achievable maximum utilisation of slots 0..s covering
    layers [0, j), and dp[s][j] = min over i of max(dp[s-1][i], util of slot s on [i, j)).
    """
    caps = tuple(int(c) for c in capacities)
    n, layers = len(caps), model.config.num_hidden_layers
    if n < 1:
        raise ConfigError("plan needs at least one worker capacity")
    if any(c <= 0 for c in caps):
        raise ConfigError(f"capacities must be positive, got {list(caps)}")
    if n - 1 > layers:
        raise ConfigError(f"cannot give {n - 1} slots after slot 0 at least one of {layers} layers each")

    def util(slot: int, start: int, stop: int) -> float:
        return utilisation(model.estimate(slot, range(start, stop)).total, caps[slot])

    inf = math.inf
    # dp[j]: best for slots 0..s covering [0, j); cut[s][j]: where slot s starts in it.
    dp = [util(0, 0, j) for j in range(layers + 1)]
    cuts: list[list[int]] = [[0] * (layers + 1)]
    for s in range(1, n):
        new = [inf] * (layers + 1)
        cut = [0] * (layers + 1)
        for j in range(s, layers + 1):  # slots 1..s own >= 1 layer each
            for i in range(s - 1, j):
                value = max(dp[i], util(s, i, j))
                if value < new[j]:  # strict: the earliest start wins a tie
                    new[j], cut[j] = value, i
        dp = new
        cuts.append(cut)
    bounds = [layers]
    for s in range(n - 1, 0, -1):
        bounds.append(cuts[s][bounds[-1]])
    bounds.append(0)
    bounds.reverse()
    partition = Partition(layers, tuple(range(a, b) for a, b in zip(bounds, bounds[1:])))
    estimates = model.estimates(partition)
    best = max(utilisation(e.total, c) for e, c in zip(estimates, caps))
    return Plan(partition, estimates, caps, best)


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'24GiB', '16 GB', '512MiB', '1048576' -> bytes (binary units for *iB, decimal otherwise)."""
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number) :]
    try:
        value = float(number)
    except ValueError:
        raise ConfigError(f"not a memory size: {text!r} (e.g. 24GiB, 512MiB)") from None
    if unit not in _UNITS or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"not a memory size: {text!r} (e.g. 24GiB, 512MiB)")
    return int(value * _UNITS[unit])
