"""Partitions: validation, ownership, partition-independent initialisation, allocation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardtrain_helpers import tiny_config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardtrain import Partition, PartitionError, build_stage, canonical_parameter_names, parameter_inventory


def test_constructors_agree() -> None:
    a = Partition.from_ranges([(0, 1), (1, 3), (3, 4)], 4)
    assert a == Partition.from_boundaries([1, 3], 4)
    assert a.num_slots == 3 and a.layers(1) == range(1, 3)
    assert Partition.even(5, 2).ranges == (range(0, 3), range(3, 5))
    assert Partition.from_ranges([(0, 0), (0, 4)], 4).layers(0) == range(0, 0)  # slot 0 may hold no layers


@pytest.mark.parametrize(
    ("ranges", "layers", "message"),
    [
        ([(0, 2), (3, 4)], 4, r"slot 1: range \[3, 4\) leaves a gap after the previous slot"),
        ([(0, 2), (1, 4)], 4, r"slot 1: range \[1, 4\) overlaps the previous slot"),
        ([(0, 2), (2, 3)], 4, r"covers layers \[0, 3\) but the model has 4 layers"),
        ([(0, 2), (2, 2), (2, 4)], 4, r"slot 1: owns no layers"),
        ([(0, 3), (3, 2)], 2, r"slot 1: range \[3, 2\) is reversed"),
        ([(1, 4)], 4, r"slot 0: range \[1, 4\) leaves a gap"),
        ([], 4, "at least one slot"),
        ([(0, 4.0)], 4, "must be an int"),
        ([(0, 1, 2)], 4, "expected a \\(start, stop\\) pair"),
        ([(0, 4)], 0, "num_layers must be >= 1"),
    ],
)
def test_invalid_partitions_are_rejected(ranges: list, layers: int, message: str) -> None:
    with pytest.raises(PartitionError, match=message):
        Partition.from_ranges(ranges, layers)


def test_invalid_boundaries_and_even_splits() -> None:
    with pytest.raises(PartitionError, match="non-decreasing"):
        Partition.from_boundaries([3, 1], 4)
    with pytest.raises(PartitionError, match="non-decreasing"):
        Partition.from_boundaries([5], 4)
    with pytest.raises(PartitionError, match="cannot split 2 layers into 3"):
        Partition.even(2, 3)
    with pytest.raises(PartitionError, match="slot 3 does not exist"):
        Partition.even(4, 2).layers(3)
    with pytest.raises(PartitionError, match="partition is for 4 layers but the config has 2"):
        Partition.even(4, 2).owned_parameter_names(tiny_config(layers=2), 0)
    with pytest.raises(PartitionError, match="no slot owns parameter 'model.bogus'"):
        Partition.even(4, 2).owner(tiny_config(), "model.bogus")


@pytest.mark.parametrize("tied", [True, False])
def test_canonical_order_is_model_order(tied: bool) -> None:
    config = tiny_config(tied=tied)
    whole = build_stage(config, Partition.even(4, 1), 0, seed=0)
    assert tuple(n for n, _ in whole.named_parameters()) == canonical_parameter_names(config)
    names = canonical_parameter_names(config)
    assert names[0] == "model.embed_tokens.weight" and ("lm_head.weight" in names) != tied


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=3), st.booleans())
def test_slots_tile_the_parameters(cuts: list[int], tied: bool) -> None:
    config = tiny_config(tied=tied)
    try:
        partition = Partition.from_boundaries(sorted(cuts), 4)
    except PartitionError:
        return  # a non-zero slot left empty; rejection is tested above
    owned = [partition.owned_parameter_names(config, s) for s in range(partition.num_slots)]
    flat = [n for names in owned for n in names]
    assert sorted(flat) == sorted(canonical_parameter_names(config))  # each owned exactly once
    for slot, names in enumerate(owned):
        assert all(partition.owner(config, n) == slot for n in names)


def test_initialisation_does_not_depend_on_the_partition() -> None:
    config = tiny_config(tied=False)
    values: dict[str, torch.Tensor] = {}
    for partition in (Partition.even(4, 1), Partition.even(4, 2), Partition.from_boundaries([1, 3], 4)):
        for slot in range(partition.num_slots):
            for name, p in build_stage(config, partition, slot, seed=9).named_parameters():
                if name in values:
                    assert torch.equal(values[name], p), name
                values[name] = p.detach().clone()
    assert len(values) == len(canonical_parameter_names(config))
    other = build_stage(config, Partition.even(4, 1), 0, seed=10)
    assert not torch.equal(other.model.layers["0"].mlp.up_proj.weight, values["model.layers.0.mlp.up_proj.weight"])


def test_a_float64_stage_is_the_float32_stage_widened() -> None:
    """`build_stage(dtype=float64)` (parity tests) holds exactly the float32 build's values."""
    config = tiny_config()
    partition = Partition.even(4, 2)
    for slot in range(2):
        narrow = dict(build_stage(config, partition, slot, seed=9).named_parameters())
        wide = dict(build_stage(config, partition, slot, seed=9, dtype=torch.float64).named_parameters())
        assert set(wide) == set(narrow)
        assert all(p.dtype == torch.float64 and torch.equal(p, narrow[n].double()) for n, p in wide.items())
    with pytest.raises(PartitionError, match="floating-point dtype"):
        build_stage(config, partition, 0, seed=9, dtype=torch.int64)


class _AllocationRecorder(TorchDispatchMode):
    """Records every distinct non-meta storage that an aten op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                s = t.untyped_storage()
                self.storages[s.data_ptr()] = s.nbytes()
        return out


@pytest.mark.parametrize("tied", [True, False])
def test_a_slot_allocates_only_what_it_owns(tied: bool) -> None:
    config = tiny_config(tied=tied)
    partition = Partition.from_boundaries([1, 3], 4)
    for slot in range(3):
        with _AllocationRecorder() as rec:
            stage = build_stage(config, partition, slot, seed=1)
        params = dict(stage.named_parameters())
        assert tuple(params) == partition.owned_parameter_names(config, slot)
        owned = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params.values()}
        assert rec.storages == owned  # nothing else was ever allocated, not even temporarily
        assert parameter_inventory(stage) == {n: 4 * p.numel() for n, p in params.items()}
