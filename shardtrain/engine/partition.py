"""Partition: which contiguous range of decoder layers each logical slot owns.

A partition of an L-layer model into n slots is n half-open layer ranges that tile
[0, L) in order. Slot 0 additionally owns the embedding, the final norm and the output
head (tied or not), so both gradient contributions of a tied embedding accumulate on one
parameter in one process. Only slot 0 may own no layers (it still has work to do).

This module also builds a slot's *stage*: the `Llama` piece holding exactly the slot's
parameters, constructed on the meta device and materialised only for what it owns. Each
parameter is initialised from its own generator seeded by a hash of (seed, parameter
name), so a 1-, 2- or 3-slot build of one config holds bitwise the same values by name.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import torch

from shardtrain.engine.model import Llama, LlamaConfig
from shardtrain.errors import PartitionError

__all__ = [
    "LAYER_PARAMETER_SUFFIXES",
    "Partition",
    "canonical_parameter_names",
    "build_stage",
    "init_parameters_",
    "parameter_seed",
    "parameter_inventory",
]

# Per-layer parameter names in the order a decoder layer registers them (= HF's order).
LAYER_PARAMETER_SUFFIXES: tuple[str, ...] = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


def _layer_names(layers: range) -> list[str]:
    return [f"model.layers.{i}.{suffix}" for i in layers for suffix in LAYER_PARAMETER_SUFFIXES]


def canonical_parameter_names(config: LlamaConfig) -> tuple[str, ...]:
    """Every parameter name of the model in canonical order.

    The order is model order, as Hugging Face's `named_parameters()` lists it: the
    embedding, then layers 0..L-1 (each in `LAYER_PARAMETER_SUFFIXES` order), then the
    final norm, then `lm_head.weight` when the head is untied. Global sums over parameters
    (the clipping norm) are taken in this order so they do not depend on the partition.
    """
    names = ["model.embed_tokens.weight", *_layer_names(range(config.num_hidden_layers)), "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return tuple(names)


def _as_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PartitionError(f"{what} must be an int, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Partition:
    """Contiguous layer ranges, one per slot, tiling [0, num_layers) in slot order."""

    num_layers: int
    ranges: tuple[range, ...]

    def __post_init__(self) -> None:
        _as_int(self.num_layers, "num_layers")
        object.__setattr__(self, "ranges", tuple(self.ranges))
        if self.num_layers < 1:
            raise PartitionError(f"num_layers must be >= 1, got {self.num_layers}")
        if not self.ranges:
            raise PartitionError("a partition needs at least one slot")
        expected_start = 0
        for slot, r in enumerate(self.ranges):
            if not isinstance(r, range) or r.step != 1:
                raise PartitionError(f"slot {slot}: layer range must be a contiguous range, got {r!r}")
            if r.start != expected_start:
                what = (
                    "overlaps the previous slot" if r.start < expected_start else "leaves a gap after the previous slot"
                )
                raise PartitionError(
                    f"slot {slot}: range [{r.start}, {r.stop}) {what} (expected it to start at layer {expected_start})"
                )
            if r.stop < r.start:
                raise PartitionError(f"slot {slot}: range [{r.start}, {r.stop}) is reversed")
            if r.stop == r.start and slot != 0:
                raise PartitionError(f"slot {slot}: owns no layers (only slot 0 may be empty)")
            expected_start = r.stop
        if expected_start != self.num_layers:
            raise PartitionError(
                f"partition covers layers [0, {expected_start}) but the model has {self.num_layers} layers"
            )

    @classmethod
    def from_ranges(cls, ranges: Sequence[tuple[int, int]], num_layers: int) -> Partition:
        """From explicit half-open (start, stop) pairs, one per slot: [(0, 2), (2, 4)]."""
        built = []
        for slot, pair in enumerate(ranges):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise PartitionError(f"slot {slot}: expected a (start, stop) pair, got {pair!r}")
            built.append(range(_as_int(pair[0], f"slot {slot} start"), _as_int(pair[1], f"slot {slot} stop")))
        return cls(num_layers, tuple(built))

    @classmethod
    def from_boundaries(cls, boundaries: Sequence[int], num_layers: int) -> Partition:
        """From the first layer of slots 1..n-1: [2] splits 4 layers as [0, 2) and [2, 4)."""
        cuts = [0, *(_as_int(b, "boundary") for b in boundaries), num_layers]
        for a, b in zip(cuts, cuts[1:]):
            if b < a:
                raise PartitionError(
                    f"boundaries must be non-decreasing within [0, {num_layers}], got {list(boundaries)}"
                )
        return cls(num_layers, tuple(range(a, b) for a, b in zip(cuts, cuts[1:])))

    @classmethod
    def even(cls, num_layers: int, num_slots: int) -> Partition:
        """Layers spread as evenly as possible; earlier slots get the remainder."""
        _as_int(num_slots, "num_slots")
        if not 1 <= num_slots <= num_layers:
            raise PartitionError(f"cannot split {num_layers} layers into {num_slots} non-empty slots")
        q, r = divmod(num_layers, num_slots)
        sizes = [q + (1 if s < r else 0) for s in range(num_slots)]
        starts = [sum(sizes[:s]) for s in range(num_slots)]
        return cls(num_layers, tuple(range(a, a + n) for a, n in zip(starts, sizes)))

    @property
    def num_slots(self) -> int:
        return len(self.ranges)

    def layers(self, slot: int) -> range:
        """The layer range slot `slot` owns."""
        if not 0 <= slot < self.num_slots:
            raise PartitionError(f"slot {slot} does not exist in a {self.num_slots}-slot partition")
        return self.ranges[slot]

    def owned_parameter_names(self, config: LlamaConfig, slot: int) -> tuple[str, ...]:
        """The parameters slot `slot` owns, in canonical order."""
        self._check_config(config)
        names = _layer_names(self.layers(slot))
        if slot == 0:
            names = ["model.embed_tokens.weight", *names, "model.norm.weight"]
            if not config.tie_word_embeddings:
                names.append("lm_head.weight")
        return tuple(names)

    def owner(self, config: LlamaConfig, name: str) -> int:
        """The slot that owns parameter `name`."""
        self._check_config(config)
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            for slot, r in enumerate(self.ranges):
                if index in r:
                    return slot
        elif name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            return 0
        raise PartitionError(f"no slot owns parameter {name!r}")

    def _check_config(self, config: LlamaConfig) -> None:
        if config.num_hidden_layers != self.num_layers:
            raise PartitionError(
                f"partition is for {self.num_layers} layers but the config has {config.num_hidden_layers}"
            )


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of parameter `name`: a hash of (seed, name), independent of layout."""
    digest = hashlib.blake2b(f"shardtrain-init-v1:{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_parameters_(module: torch.nn.Module, *, seed: int, std: float = 0.02) -> None:
    """Initialise every parameter in place: norms to one, matrices ~ N(0, std^2).

    Values are drawn in float32 on the CPU from a generator per parameter, so they are the
    same for any partition and any device the parameter lives on, and a parameter of
    another dtype holds the float32 draw converted (a float64 build is the float32 build
    widened exactly).
    """
    for name, param in module.named_parameters():
        if param.ndim == 1:
            param.fill_(1.0)
            continue
        gen = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name))
        if param.device.type == "cpu" and param.dtype == torch.float32:
            param.normal_(0.0, std, generator=gen)
        else:
            param.copy_(torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))


def build_stage(
    config: LlamaConfig,
    partition: Partition,
    slot: int,
    *,
    seed: int,
    device: torch.device | str = "cpu",
    init_std: float = 0.02,
    dtype: torch.dtype = torch.float32,
) -> Llama:
    """The piece of the model that slot `slot` owns, initialised deterministically.

    Built on the meta device, so constructing it allocates nothing; `to_empty` then
    allocates storage for the piece's own parameters only, which are initialised by name.
    `dtype` is the parameters' (and so the activations' and messages') dtype: float32 is
    the numerical profile every commit records; float64 exists for parity tests, where it
    takes summation-order noise out of the comparison (RMSNorm still normalises in
    float32, as Hugging Face's does).
    """
    if not dtype.is_floating_point:
        raise PartitionError(f"a stage's parameters must have a floating-point dtype, got {dtype}")
    layers = partition.layers(slot)
    partition._check_config(config)
    with torch.device("meta"):
        piece = Llama(config, layers=layers, embedding=slot == 0, head=slot == 0).to(dtype=dtype)
    piece.to_empty(device=device)
    init_parameters_(piece, seed=seed, std=init_std)
    names = tuple(name for name, _ in piece.named_parameters())
    assert set(names) == set(partition.owned_parameter_names(config, slot)), names
    return piece


def parameter_inventory(module: torch.nn.Module) -> dict[str, int]:
    """Bytes of real (non-meta) storage behind each named parameter of `module`."""
    return {name: (0 if p.is_meta else p.untyped_storage().nbytes()) for name, p in module.named_parameters()}
