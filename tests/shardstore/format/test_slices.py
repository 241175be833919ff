"""The slice check (SPEC.md §15.5, shardstore.format.slices): forged slices refused naming
tensor and slot; the sweep agrees with the pairwise check it replaced and tiling_defect with
counting every element (Hypothesis); tens of thousands of slices, and full-width rows above
half-height columns, checked in linear work without comparing boxes.
"""

from __future__ import annotations

import uuid

import msgspec
import pytest
import torch
from chunk_vectors import (
    COLS,
    ROWS,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

import shardstore as ss


@pytest.mark.parametrize(
    "forge, message",
    [
        (lambda s0, s1: (s0, ()), "cover 1048576 of its 1572864 elements"),  # slot 1's row unheld
        (lambda s0, s1: (s0, (msgspec.structs.replace(s1[0], start=(1, 0)),)), "overlap but are not the same box"),
        (lambda s0, s1: (s0, (msgspec.structs.replace(s1[0], name="v"),)), "which the commit does not hold"),
        (lambda s0, s1: (s0, (msgspec.structs.replace(s1[0], shape=(2, COLS)),)), "lies outside shape"),
    ],
)
def test_forged_slices_are_refused_naming_tensor_and_slot(forge, message):
    from shardstore.format.slices import make_slices

    store = ss.open_store(f"memory://state-{uuid.uuid4().hex}")
    w = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    info = ss.CommitInfo(step=0, job="vector-job", transition="init")
    s0, s1 = make_slices([("w", ((0, 0), (2, COLS)))]), make_slices([("w", ((2, 0), (1, COLS)))])
    a, b = forge(s0, s1)
    with pytest.raises(ss.LayoutError, match=message):
        ss.save_slots(
            store, [ss.SlotState({"w": w}, slices=a), ss.SlotState({}, slices=b)], info=info, ref=None, parent=None
        )


def _pairwise_slice_problems(shards, entries):
    """The pairwise check commit_slice_problems made before it swept (kept as the oracle)."""
    import math

    from shardstore.format.grid import intersect

    held: dict = {}
    for slot, shard in sorted(shards.items()):
        for x in shard.slices:
            e = entries.get(x.name)
            if e is None:
                yield "unheld", x.name, slot
                continue
            box = (tuple(x.start), tuple(x.shape))
            if len(box[0]) != len(e.shape) or any(s + n > d for s, n, d in zip(box[0], box[1], e.shape)):
                yield "outside", x.name, slot
                continue
            held.setdefault(x.name, {}).setdefault(box, []).append(slot)
    for name, boxes in sorted(held.items()):
        regions = sorted(boxes.items())
        clash = next(
            ((a, b) for i, (a, _) in enumerate(regions) for b, _ in regions[i + 1 :] if intersect(a, b) is not None),
            None,
        )
        if clash is not None:
            yield "overlap", name, None
            continue
        if sum(math.prod(b[1]) for b, _ in regions) != math.prod(entries[name].shape):
            yield "cover", name, regions[0][1][0]


def _kind(message: str) -> str:
    return next(
        k
        for k, word in (
            ("unheld", "does not hold"),
            ("outside", "lies outside"),
            ("overlap", "overlap"),
            ("cover", "cover"),
        )
        if word in message
    )


def _shards(boxes_by_slot):
    from types import SimpleNamespace

    from shardstore.format.manifest import Slice

    return {
        s: SimpleNamespace(slices=tuple(Slice(name=n, start=b[0], shape=b[1]) for n, b in bs))
        for s, bs in boxes_by_slot.items()
    }


def test_slice_check_agrees_with_the_pairwise_check():
    """On small random boxes (replicas, gaps, overlaps, empty and outside boxes), the check
    accepts and refuses exactly what the pairwise check did; where that found no overlap it
    reports the gap, and where it found one it reports an overlap or (when the slices also
    leave an element uncovered) that gap."""
    from types import SimpleNamespace

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from shardstore.format.slices import commit_slice_problems

    @st.composite
    def case(draw):
        shape = tuple(draw(st.lists(st.integers(1, 4), max_size=3)))

        def box():  # inside the shape, or one past it on a dim; sometimes empty
            start = tuple(draw(st.integers(0, d)) for d in shape)
            return start, tuple(draw(st.integers(0, d - a + draw(st.integers(0, 1)))) for a, d in zip(start, shape))

        n = draw(st.integers(1, 4))
        return shape, {
            s: [(draw(st.sampled_from(["w", "w", "v"])), box()) for _ in range(draw(st.integers(0, 6)))]
            for s in range(n)
        }

    @settings(max_examples=300, deadline=None, derandomize=True, database=None)
    @given(case())
    def check(c):
        shape, by_slot = c
        shards, entries = _shards(by_slot), {"w": SimpleNamespace(shape=shape)}
        got = list(commit_slice_problems(shards, entries))
        want = list(_pairwise_slice_problems(shards, entries))
        assert [n for _, n, _ in got] == [n for _, n, _ in want]
        for (m, _, slot), (k, _, w) in zip(got, want):
            assert _kind(m) == k or (k, _kind(m)) == ("overlap", "cover"), (m, k)
            if _kind(m) != "overlap":
                assert slot == w or k == "overlap"

    check()


def _coverage(boxes, shape):
    """Element → how many of ``boxes`` cover it (every element of ``shape``)."""
    import itertools

    return {
        x: sum(all(a <= i < a + n for i, a, n in zip(x, *b)) for b in boxes)
        for x in itertools.product(*(range(d) for d in shape))
    }


@st.composite
def _tilings(draw):
    """(shape, distinct boxes): an exact cover made by cutting boxes in two, then perhaps
    one box dropped, moved, grown or added, and some empty boxes."""
    shape = tuple(draw(st.lists(st.integers(1, 5), max_size=3)))
    boxes = [((0,) * len(shape), shape)]
    for _ in range(draw(st.integers(0, 8))):
        (start, extent) = boxes.pop(draw(st.integers(0, len(boxes) - 1)))
        cuttable = [k for k, n in enumerate(extent) if n > 1]
        if not cuttable:
            boxes.append((start, extent))
            continue
        k = draw(st.sampled_from(cuttable))
        c = draw(st.integers(1, extent[k] - 1))
        boxes.append((start, extent[:k] + (c,) + extent[k + 1 :]))
        boxes.append((start[:k] + (start[k] + c,) + start[k + 1 :], extent[:k] + (extent[k] - c,) + extent[k + 1 :]))
    change = draw(st.sampled_from(["none", "none", "drop", "move", "grow", "add"]))
    if shape and change != "none":
        i = draw(st.integers(0, len(boxes) - 1))
        start, extent = boxes[i]
        k = draw(st.integers(0, len(shape) - 1))
        if change == "drop":
            boxes.pop(i)
        elif change == "move" and start[k] > 0:
            boxes[i] = (start[:k] + (start[k] - 1,) + start[k + 1 :], extent)
        elif change == "grow" and start[k] + extent[k] < shape[k]:
            boxes[i] = (start, extent[:k] + (extent[k] + 1,) + extent[k + 1 :])
        elif change == "add":
            a = tuple(draw(st.integers(0, d - 1)) for d in shape)
            boxes.append((a, tuple(draw(st.integers(1, d - x)) for x, d in zip(a, shape))))
    boxes += [((0,) * len(shape), (0,) * len(shape))] * draw(st.integers(0, 1)) if shape else []
    return shape, sorted(set(boxes))


@given(_tilings())
@example(
    ((3, 3), [((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 1), (1, 1)), ((1, 2), (2, 1)), ((2, 0), (1, 2))])
)  # pinwheel
@example(((3, 3), [((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 0), (1, 2))]))  # pinwheel, no centre
@example(((), [((), ())]))
@example(((), []))
@settings(max_examples=400, deadline=None, derandomize=True, database=None)
def test_tiling_defect_agrees_with_counting_every_element(case):
    """tiling_defect is None exactly when every element is covered once; an overlap it names
    is two boxes sharing an element, a gap an element none covers, and it names a gap when no
    element is covered twice (brute force over every element of small tensors)."""
    from shardstore.format.grid import intersect
    from shardstore.format.slices import Gap, Overlap, tiling_defect

    shape, boxes = case
    count = _coverage(boxes, shape)
    got = tiling_defect(boxes, shape)
    assert (got is None) == all(c == 1 for c in count.values()), (got, count)
    if isinstance(got, Overlap):
        assert got.first < got.second and intersect(boxes[got.first], boxes[got.second]) is not None
    if isinstance(got, Gap):
        assert count[got.element] == 0
    if got is not None and max(count.values(), default=0) <= 1:
        assert isinstance(got, Gap)


def _counting(monkeypatch):
    """Counters of the slice check's work: box comparisons and fingerprint terms."""
    import shardstore.format.slices as slices
    from shardstore.format.grid import intersect

    calls = {"intersect": 0, "term": 0}

    def counted(a, b):
        calls["intersect"] += 1
        if calls["intersect"] > 100_000:
            raise AssertionError("the slice check compares boxes pairwise")
        return intersect(a, b)

    term = slices._term

    def counted_term(*args):
        calls["term"] += 1
        return term(*args)

    monkeypatch.setattr(slices, "intersect", counted)
    monkeypatch.setattr(slices, "_term", counted_term)
    return calls


def test_twenty_thousand_slices_are_checked_without_comparing_pairs(monkeypatch):
    """Regression: every pair of slices was compared (4,000 slices: 11.8 s; a 64 MiB manifest
    holds ~800,000). A 100 x 200 mesh's slices, each held twice, make ~40,000 records: the
    check accepts them, and refuses one moved row or one missing slice, comparing no boxes and
    with work linear in the number of distinct slices."""
    from types import SimpleNamespace

    import shardstore.format.slices as slices

    calls = _counting(monkeypatch)
    rows, cols = 100, 200
    boxes = [("w", ((3 * i, 2 * j), (3, 2))) for i in range(rows) for j in range(cols)]
    entries = {"w": SimpleNamespace(shape=(3 * rows, 2 * cols))}
    by_slot = {0: boxes, 1: boxes[::-1]}  # replicas: identical boxes held by two slots
    assert list(slices.commit_slice_problems(_shards(by_slot), entries)) == []
    moved = boxes[:-1] + [("w", ((3 * rows - 4, 2 * cols - 2), (3, 2)))]  # overlaps its upper neighbour
    assert [_kind(m) for m, _, _ in slices.commit_slice_problems(_shards({0: moved}), entries)] == ["overlap"]
    assert [_kind(m) for m, _, _ in slices.commit_slice_problems(_shards({0: boxes[1:]}), entries)] == ["cover"]
    strips = [("w", ((0, j), (3 * rows, 1))) for j in range(2 * cols)] + [
        ("w", ((0, 0), (1, 2 * cols)))
    ]  # a row across every strip
    assert [_kind(m) for m, _, _ in slices.commit_slice_problems(_shards({0: strips}), entries)] == ["overlap"]
    assert calls["intersect"] == 0 and calls["term"] <= 4 * (3 * rows * cols + len(strips)), calls


@pytest.mark.parametrize("defect", ["none", "missing column", "moved column", "row across the columns"])
def test_full_width_rows_above_half_height_columns_are_checked_in_linear_work(defect, monkeypatch):
    """Regression (issue 30): 4,000 full-width rows over the top half of a tensor and 4,000
    half-height columns under them (an exact cover, 8,000 slices) made the check hold every
    column at once while it swept the rows' dim: quadratic, 2,000 slices 5.6 s, a 2 MB
    manifest ~30 min, in every reader. Now it compares no boxes, computes one fingerprint
    term per slice when they tile, and at most a few per slice to name a defect."""
    from types import SimpleNamespace

    import shardstore.format.slices as slices

    calls = _counting(monkeypatch)
    half = 4000
    rows = [("w", ((i, 0), (1, half))) for i in range(half)]
    cols = [("w", ((half, j), (half, 1))) for j in range(half)]
    boxes, want = {
        "none": (rows + cols, []),
        "missing column": (rows + cols[:1999] + cols[2000:], ["cover"]),
        "moved column": (rows + cols[:-1] + [("w", ((half - 1, half - 1), (half, 1)))], ["overlap"]),
        "row across the columns": (rows + cols + [("w", ((2 * half - 1, 0), (1, half)))], ["overlap"]),
    }[defect]
    entries = {"w": SimpleNamespace(shape=(2 * half, half))}
    got = list(slices.commit_slice_problems(_shards({0: boxes[::2], 1: boxes[1::2]}), entries))
    assert [_kind(m) for m, _, _ in got] == want
    if defect == "missing column":
        assert "none covers the element at [4000, 1999]" in got[0][0]
    assert calls["intersect"] == 0
    assert calls["term"] <= (len(boxes) + 1 if defect == "none" else 4 * len(boxes)), calls
