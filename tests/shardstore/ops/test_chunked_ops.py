"""Export, diff and ``copy --slot K``'s selection over chunked state and slices (shardstore.ops):
export writes chunked optimizer state whole and diff compares it block by block; slot K's
selection is exactly the tiles its slices overlap (counted by hand: dim 0, dim 1, 2 x 2,
replicas, strided parts); diff reports the slices between two splits of one learned state.
"""

from __future__ import annotations

import uuid

import pytest
import torch
from chunk_vectors import (
    COLS,
    ROWS,
    slot_state,
)

import shardstore as ss

N = 4096  # the slot-K selection's uint8 [N, N]: 2 x 2 tiles


def test_export_and_diff_read_chunked_state_block_by_block(tmp_path):
    from safetensors.torch import load_file

    from shardstore.ops.diff import diff
    from shardstore.ops.interchange import export_commit

    store = ss.open_store(str(tmp_path / "s"))
    state, info = slot_state()
    a = ss.save_slots(store, [state], info=info, ref=None, parent=None)
    m = state.optim.params["w"].torch_state.tensors["momentum_buffer"]
    m[2, :3] += 1.0  # only block 1 (row 2) of the momentum changes
    b = ss.save_slots(store, [state], info=info, ref=None, parent=None)
    export_commit(store, b, str(tmp_path / "out"), with_optimizer=True, weights_only=True)  # no model config
    assert torch.equal(load_file(str(tmp_path / "out" / "optimizer.state.momentum_buffer.safetensors"))["w"], m)
    (w,) = diff(store, a, b, stats=True).tensors
    assert w.stats["state momentum_buffer"].max_abs_diff == 1.0


@pytest.mark.parametrize(
    "split, want",
    [
        ([[(0, 1366)], [(1366, 1366)], [(2732, 1364)]], [{0, 1}, {0, 1, 2, 3}, {2, 3}]),  # dim 0 over 3 slots (uneven)
        ([[(0, N, 0, N // 2)], [(0, N, N // 2, N // 2)]], [{0, 2}, {1, 3}]),  # dim 1 over 2: a column of tiles each
        (
            [
                [(0, N // 2, 0, N // 2)],
                [(0, N // 2, N // 2, N // 2)],
                [(N // 2, N // 2, 0, N // 2)],
                [(N // 2, N // 2, N // 2, N // 2)],
            ],
            [{0}, {1}, {2}, {3}],
        ),  # (Shard(0), Shard(1)) on 2 x 2: one tile each
        (
            [[(0, N // 2)], [(0, N // 2)], [(N // 2, N // 2)], [(N // 2, N // 2)]],
            [{0, 1}, {0, 1}, {2, 3}, {2, 3}],
        ),  # dim 0, replicated
        (
            [[(0, 1), (3000, 1)], [(1, 2999), (3001, 1095)]],
            [{0, 1, 2, 3}, {0, 1, 2, 3}],
        ),  # strided (SPEC.md §15.4 parts)
    ],
    ids=["dim0x3", "dim1x2", "2x2", "dim0x2-replicated", "strided-parts"],
)
def test_slot_k_selection_is_exactly_the_blocks_its_slices_overlap(split, want):
    """uint8 [4096, 4096] (16 MiB): 2 x 2 tiles of 2048 x 2048, in C order 0 (top left), 1, 2, 3.
    Slot k's selection (``copy --shard k``) is given by hand from the rows and columns its slices cover."""
    from shardstore.format.slices import make_slices
    from shardstore.ops.transfer import commit_closure

    t = torch.randint(0, 256, (N, N), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))

    def box(b):
        r0, nr, c0, nc = b if len(b) == 4 else (*b, 0, N)
        return (r0, c0), (nr, nc)

    states = [
        ss.SlotState({"t": t} if k == 0 else {}, slices=make_slices([("t", box(b)) for b in boxes]))
        for k, boxes in enumerate(split)
    ]
    store = ss.open_store(f"memory://state-{uuid.uuid4().hex}")
    lc = ss.load_commit(
        store,
        ss.save_slots(store, states, info=ss.CommitInfo(step=0, job="j", transition="init"), ref=None, parent=None),
    )
    blocks = lc.entries()["t"].param
    assert [(tuple(b.start), tuple(b.shape)) for b in blocks] == [((0, 0), (2048, 2048)), ((0, 2048), (2048, 2048)),
                                                                  ((2048, 0), (2048, 2048)), ((2048, 2048), (2048, 2048))]  # fmt: skip
    for k in range(len(split)):
        assert set(commit_closure(lc, k).data) == {blocks[i].object for i in want[k]}, k
        assert ss.verify(store, [lc.id], slot=k).ok


def test_diff_reports_slices_between_two_splits_of_one_learned_state():
    from shardstore.format.slices import make_slices
    from shardstore.ops.diff import diff

    store = ss.open_store(f"memory://state-{uuid.uuid4().hex}")
    w = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    info = ss.CommitInfo(step=0, job="vector-job", transition="init")

    def split(rows: int) -> str:
        states = [ss.SlotState({"w": w}, slices=make_slices([("w", ((0, 0), (rows, COLS)))])),
                  ss.SlotState({}, slices=make_slices([("w", ((rows, 0), (ROWS - rows, COLS)))]))]  # fmt: skip
        return ss.save_slots(store, states, info=info, ref=None, parent=None)

    a, b = split(2), split(1)
    d = diff(store, a, b)
    assert a != b and d.learned_root_equal and not d.tensors and not d.empty
    assert {(f.name, f.before, f.after) for f in d.fields} == {
        ("slices.0.w", "[0:2, 0:524288]", "[0:1, 0:524288]"),
        ("slices.1.w", "[2:3, 0:524288]", "[1:3, 0:524288]"),
    }
    assert not diff(store, a, a).fields
