"""The chunked vectors' state (SPEC.md §24): ``w``, float32 [3, 524288] (element i = i), with SGD
momentum w / 8, on version 4's tiles or version 3's row bands, and its ids from SPEC.md's rules
alone (``json``, ``array`` and ``blake3``, no shardstore). Shared by the chunked vectors'
tests (tests/shardstore/format/test_chunk_vectors.py), the chunked state's
(tests/shardstore/state/test_state_chunks.py), the slice check's (tests/shardstore/format/test_slices.py)
and export/diff/``copy --slot K`` over them (tests/shardstore/ops/test_chunked_ops.py).
"""

from __future__ import annotations

import functools
import json
from array import array

import blake3
import torch

import shardstore as ss
from shardstore.format.manifest import HyperGroup
from shardstore.state.optim import OptimState, ParamOpt, TorchParam

ROWS, COLS = (
    3,
    524288,
)  # float32 rows of 2 MiB: tiles of columns 0-262143 and the rest (row bands 0-1 and 2 in version 3)


TILES = [((0, 0), (ROWS, COLS // 2)), ((0, COLS // 2), (ROWS, COLS // 2))]  # SPEC.md §5.1, version 4


BANDS = [((0, 0), (2, COLS)), ((2, 0), (1, COLS))]  # versions 2 and 3


HYPER = {"dampening": 0, "foreach": None, "lr": "f64:3fb999999999999a", "maximize": False, "momentum": "f64:3feccccccccccccd",
         "nesterov": True, "weight_decay": 0}  # fmt: skip


def slot_state() -> tuple[ss.SlotState, ss.CommitInfo]:
    """``w`` (float32 [3, 524288], element i = i) with SGD state ``momentum_buffer`` = w / 8 (exact)."""
    w = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    optim = OptimState("torch", {}, {"w": ParamOpt("g0", 0, None, None, TorchParam("g0", {"momentum_buffer": w / 8}, {}))},
                       "torch.optim.sgd.SGD", {"g0": HyperGroup(name="g0", hyper=HYPER)})  # fmt: skip
    return ss.SlotState({"w": w}, optim), ss.CommitInfo(step=0, job="vector-job", transition="init")


@functools.lru_cache(maxsize=2)
def values(divisor: int) -> array:
    """The float32 elements ``i / divisor`` of the vectors' ``[ROWS, COLS]`` tensors (read-only: shared between tests)."""
    return array("f", range(ROWS * COLS)) if divisor == 1 else array("f", (i / divisor for i in range(ROWS * COLS)))


def blocks(values: array, boxes=TILES) -> list[dict]:
    """The payload of a float32 [ROWS, COLS] tensor on ``boxes``: each block's object is its
    box's elements in C order (each row of the box one byte range of the tensor)."""
    raw, row = values.tobytes(), COLS * 4
    out = []
    for (r0, c0), (nr, nc) in boxes:
        data = b"".join(raw[(r0 + i) * row + c0 * 4 : (r0 + i) * row + (c0 + nc) * 4] for i in range(nr))
        out.append({"object": blake3.blake3(data).hexdigest(), "shape": [nr, nc], "start": [r0, c0]})
    return out


def independent(boxes=TILES, version: int = 4) -> tuple[str, str]:
    """Shard manifest id and learned-state root of ``_state`` from SPEC.md's rules, without shardstore."""
    w = blocks(values(1), boxes)
    m = blocks(values(8), boxes)
    entry = {"dtype": "float32", "name": "w", "optim": None, "param": w, "shape": [ROWS, COLS],
             "state": {"group": "g0", "scalars": [], "tensors": [{"dtype": "float32", "key": "momentum_buffer", "object": m, "shape": [ROWS, COLS]}]}}  # fmt: skip
    torch_optimizer = {"class_name": "torch.optim.sgd.SGD", "groups": [{"hyper": HYPER, "name": "g0"}]}
    enc = lambda d: json.dumps(d, sort_keys=True, separators=(",", ":")).encode()  # noqa: E731
    shard = {"algorithm": "torch", "config": None, "entries": [entry], "groups": [], "job": "vector-job", "parent": None,
             "rng": [], "slot": 0, "slots": 1, "step": 0, "torch_optimizer": torch_optimizer, "type": "shard", "version": version}  # fmt: skip
    learned = {"config": None, "data_cursor": None, "step": 0, "tensors": [entry], "type": "learned", "version": version,
               "optimizer": {"algorithm": "torch", "groups": [], "torch_optimizer": torch_optimizer}}  # fmt: skip
    return blake3.blake3(enc(shard)).hexdigest(), blake3.blake3(enc(learned)).hexdigest()


def saved(store: ss.Store) -> str:
    state, info = slot_state()
    return ss.save_slots(store, [state], info=info, ref=None, parent=None)


# -- slices (format 3, SPEC.md §15.5): the chunked vector's w held by two slots, rows 0-1 and row 2 ---------


def slice_manifests(boxes, version: int) -> list[bytes]:
    """The two shard manifests of the slices vector, from SPEC.md's rules alone."""
    enc = lambda d: json.dumps(d, sort_keys=True, separators=(",", ":")).encode()  # noqa: E731
    entry = {"dtype": "float32", "name": "w", "optim": None, "param": blocks(values(1), boxes), "shape": [ROWS, COLS]}
    base = {"algorithm": "none", "config": None, "groups": [], "job": "vector-job", "parent": None, "rng": [], "slots": 2,
            "step": 0, "type": "shard", "version": version}  # fmt: skip
    s0 = base | {"slot": 0, "entries": [entry], "slices": [{"name": "w", "shape": [2, COLS], "start": [0, 0]}]}
    s1 = base | {
        "slot": 1,
        "entries": [],
        "version": 3,
        "slices": [{"name": "w", "shape": [1, COLS], "start": [2, 0]}],
    }  # no payload: 3
    return [enc(s0), enc(s1)]
