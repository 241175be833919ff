"""Differences between two commits (SPEC.md §Diff).

Buffers, the state of any torch optimizer and extras are compared by ``state_diff``.

``diff(store, a, b)`` compares two structurally verified commits and returns a
``CommitDiff``: per tensor added, removed or changed (dtype, shape, payload, moments,
Adam cursor, group), tensors whose owning slot moved, optimizer group changes, whether
the learned-state roots are equal, and every other commit field that differs (including
top-level model config keys and RNG object ids per slot). Unchanged tensors are only
named. ``diff(a, a)`` is empty, and ``diff(b, a)`` equals ``diff(a, b).mirrored()``.

With ``stats=True`` each changed payload (parameter, ``exp_avg``, ``exp_avg_sq``) of a
tensor whose shape did not change is read back (verified) and compared in float64, one
tensor at a time and in bounded chunks, so memory stays near one tensor. The statistics
keep both norms so that the mirror of a diff is exact: relative L2 change is
``|after - before| / |before|``, a derived property.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ..errors import ManifestError
from ..format.grid import read_whole
from ..format.lazy import torch
from ..format.manifest import MAX_MANIFEST_BYTES, Payload, TensorEntry, decode_config
from ..format.tensors import expected_nbytes
from ..state.optim import hyper_of
from ..store import Store
from ..verification.commits import LoadedCommit, load_commit
from .state_diff import extras_changes, hyper_groups, state_changes, state_pairs

__all__ = ["TensorStats", "TensorDiff", "Moved", "GroupDiff", "FieldDiff", "CommitDiff", "diff", "ROLES"]

#: Payload roles of a tensor entry, in report order.
ROLES = ("param", "exp_avg", "exp_avg_sq")
#: Elements compared per chunk when computing statistics (bounds temporary memory).
_CHUNK = 1 << 22

Status = Literal["added", "removed", "changed"]
_MIRROR_STATUS: dict[str, Status] = {"added": "removed", "removed": "added", "changed": "changed"}
_MISSING = object()


@dataclass(frozen=True)
class TensorStats:
    """How one payload changed: max |after - before| and the L2 norms needed for relative change."""

    max_abs_diff: float
    diff_l2: float
    before_l2: float
    after_l2: float

    @property
    def rel_l2(self) -> float:
        """|after - before|_2 / |before|_2 (0 if both are zero, inf if only ``before`` is)."""
        if self.before_l2 == 0.0:
            return 0.0 if self.diff_l2 == 0.0 else math.inf
        return self.diff_l2 / self.before_l2

    def mirrored(self) -> TensorStats:
        return replace(self, before_l2=self.after_l2, after_l2=self.before_l2)


@dataclass(frozen=True)
class TensorDiff:
    """One tensor that was added, removed or changed; ``before``/``after`` are its entries (or None)."""

    name: str
    status: Status
    before: TensorEntry | None
    after: TensorEntry | None
    slot_before: int | None
    slot_after: int | None
    changes: tuple[str, ...] = ()
    stats: dict[str, TensorStats] = field(default_factory=dict)

    @property
    def age(self) -> tuple[int | None, int | None]:
        """Adam age before and after (None where the tensor or its optimizer state is absent)."""
        return _age(self.before), _age(self.after)

    def mirrored(self) -> TensorDiff:
        return TensorDiff(
            self.name,
            _MIRROR_STATUS[self.status],
            self.after,
            self.before,
            self.slot_after,
            self.slot_before,
            self.changes,
            {k: v.mirrored() for k, v in self.stats.items()},
        )


@dataclass(frozen=True)
class Moved:
    """A tensor present in both commits whose owning slot differs."""

    name: str
    slot_before: int
    slot_after: int

    def mirrored(self) -> Moved:
        return Moved(self.name, self.slot_after, self.slot_before)


@dataclass(frozen=True)
class GroupDiff:
    """An optimizer group added, removed, or with different hyperparameters (as floats)."""

    name: str
    before: dict[str, float] | None
    after: dict[str, float] | None

    def mirrored(self) -> GroupDiff:
        return GroupDiff(self.name, self.after, self.before)


@dataclass(frozen=True)
class FieldDiff:
    """Any other commit field that differs, by dotted name (``step``, ``config.hidden_size``, ``rng.1.torch``)."""

    name: str
    before: Any
    after: Any

    def mirrored(self) -> FieldDiff:
        return FieldDiff(self.name, self.after, self.before)


@dataclass(frozen=True)
class CommitDiff:
    """Everything that differs between commit ``a`` (before) and commit ``b`` (after)."""

    a: str
    b: str
    learned_roots: tuple[str, str]
    slots: tuple[int, int]
    tensors: tuple[TensorDiff, ...]
    unchanged: tuple[str, ...]
    moved: tuple[Moved, ...]
    groups: tuple[GroupDiff, ...]
    fields: tuple[FieldDiff, ...]

    @property
    def learned_root_equal(self) -> bool:
        return self.learned_roots[0] == self.learned_roots[1]

    @property
    def layout_changed(self) -> bool:
        return bool(self.moved) or self.slots[0] != self.slots[1]

    @property
    def empty(self) -> bool:
        """True when nothing differs at all (not even the layout or an RNG object)."""
        return not (self.tensors or self.moved or self.groups or self.fields) and self.slots[0] == self.slots[1]

    def by_status(self, status: Status) -> list[TensorDiff]:
        return [t for t in self.tensors if t.status == status]

    def mirrored(self) -> CommitDiff:
        """The diff with ``a`` and ``b`` exchanged (what ``diff(store, b, a)`` returns)."""
        return CommitDiff(
            self.b,
            self.a,
            (self.learned_roots[1], self.learned_roots[0]),
            (self.slots[1], self.slots[0]),
            tuple(t.mirrored() for t in self.tensors),
            self.unchanged,
            tuple(m.mirrored() for m in self.moved),
            tuple(g.mirrored() for g in self.groups),
            tuple(f.mirrored() for f in self.fields),
        )


def _age(e: TensorEntry | None) -> int | None:
    return None if e is None or e.optim is None else e.optim.age


def _entry_changes(x: TensorEntry, y: TensorEntry) -> tuple[str, ...]:
    out = [k for k in ("dtype", "shape", "param", "kind") if getattr(x, k) != getattr(y, k)]
    out += state_changes(x.state, y.state)
    ox, oy = x.optim, y.optim
    if (ox is None) != (oy is None):
        out.append("optimizer state")
    elif ox is not None and oy is not None:
        out += [
            k
            for k in ("group", "age", "birth", "moment_dtype", "exp_avg", "exp_avg_sq")
            if getattr(ox, k) != getattr(oy, k)
        ]
    return tuple(out)


def _role(e: TensorEntry, role: str) -> tuple[Payload, str] | None:
    """(payload, dtype) of one payload of an entry, or None if absent."""
    if role == "param":
        return e.param, e.dtype
    o = e.optim
    if o is None or o.moment_dtype is None:
        return None
    oid = o.exp_avg if role == "exp_avg" else o.exp_avg_sq
    return None if oid is None else (oid, o.moment_dtype)


def _pair_stats(x: torch.Tensor, y: torch.Tensor) -> TensorStats:
    """Statistics of y - x in float64, chunk by chunk (exactly antisymmetric in x and y)."""
    xf, yf = x.reshape(-1), y.reshape(-1)
    max_abs, d2, a2, b2 = 0.0, 0.0, 0.0, 0.0
    for i in range(0, xf.numel(), _CHUNK):
        xa = xf[i : i + _CHUNK].to(torch.float64)
        yb = yf[i : i + _CHUNK].to(torch.float64)
        d = yb - xa
        m = float(d.abs().max())
        if not math.isnan(max_abs) and (math.isnan(m) or m > max_abs):  # NaN sticks, in any chunk order
            max_abs = m
        d2 += float(torch.dot(d, d))
        a2 += float(torch.dot(xa, xa))
        b2 += float(torch.dot(yb, yb))
    return TensorStats(max_abs, math.sqrt(d2), math.sqrt(a2), math.sqrt(b2))


def _tensor_stats(store: Store, x: TensorEntry, y: TensorEntry) -> dict[str, TensorStats]:
    if tuple(x.shape) != tuple(y.shape):
        return {}
    out: dict[str, TensorStats] = {}
    for role in ROLES:
        rx, ry = _role(x, role), _role(y, role)
        if rx is None or ry is None or rx[0] == ry[0]:
            continue
        tx = read_whole(store, rx[0], rx[1], x.shape, what=f"{role} of tensor {x.name!r}")
        ty = read_whole(store, ry[0], ry[1], y.shape, what=f"{role} of tensor {y.name!r}")
        out[role] = _pair_stats(tx, ty)
        del tx, ty
    for key, (a, b) in state_pairs(x.state, y.state).items():  # the torch form's state tensors
        tx = read_whole(
            store, a.object, a.dtype, a.shape, what=f"optimizer state {a.key!r} of tensor {x.name!r}"
        )  # blocks too (format 3)
        ty = read_whole(store, b.object, b.dtype, b.shape, what=f"optimizer state {b.key!r} of tensor {y.name!r}")
        out[f"state {key}"] = _pair_stats(tx, ty)
        del tx, ty
    return out


def _config(store: Store, oid: str | None) -> dict[str, Any] | None:
    if oid is None:
        return None
    return decode_config(store.get(oid, limit=MAX_MANIFEST_BYTES), what=f"model config object {oid}")


def _field_diffs(store: Store, la: LoadedCommit, lb: LoadedCommit) -> list[FieldDiff]:
    ca, cb = la.commit, lb.commit
    out: list[FieldDiff] = []
    for name in ("version", "job", "schedule", "profile", "step", "data_cursor", "parent", "transition", "config"):
        va, vb = getattr(ca, name), getattr(cb, name)
        if va != vb:
            out.append(FieldDiff(name, va, vb))
    if ca.optimizer.algorithm != cb.optimizer.algorithm:
        out.append(FieldDiff("optimizer.algorithm", ca.optimizer.algorithm, cb.optimizer.algorithm))
    if ca.config != cb.config:
        try:
            xa, xb = _config(store, ca.config) or {}, _config(store, cb.config) or {}
        except ManifestError:
            xa, xb = {}, {}  # not a decodable config: the id difference above says enough
        for key in sorted(set(xa) | set(xb)):
            if xa.get(key, _MISSING) != xb.get(key, _MISSING):
                out.append(FieldDiff(f"config.{key}", xa.get(key), xb.get(key)))
    if ca.optimizer.torch_optimizer != cb.optimizer.torch_optimizer:
        na, nb = (c.optimizer.torch_optimizer.class_name if c.optimizer.torch_optimizer else None for c in (ca, cb))
        if na != nb:
            out.append(FieldDiff("optimizer.class", na, nb))
    out += [FieldDiff(*d) for d in extras_changes(store, "extra", ca.extras, cb.extras)]
    for s in sorted(set(la.shards) | set(lb.shards)):
        xa = la.shards[s].extras if s in la.shards else ()
        xb = lb.shards[s].extras if s in lb.shards else ()
        out += [FieldDiff(*d) for d in extras_changes(store, f"slot_extra.{s}", xa, xb)]
    ra = {(s, r.kind): r.object for s, sh in la.shards.items() for r in sh.rng}
    rb = {(s, r.kind): r.object for s, sh in lb.shards.items() for r in sh.rng}
    for s, kind in sorted(set(ra) | set(rb)):
        va, vb = ra.get((s, kind)), rb.get((s, kind))
        if va != vb:
            out.append(FieldDiff(f"rng.{s}.{kind}", va, vb))
    sa, sb = (
        _slices(la),
        _slices(lb),
    )  # what each slot held of sharded tensors (SPEC.md §15.5): layout, not learned state
    for key in sorted(set(sa) | set(sb)):
        if sa.get(key) != sb.get(key):
            out.append(FieldDiff(f"slices.{key[0]}.{key[1]}", sa.get(key), sb.get(key)))
    return out


def _slices(lc: LoadedCommit) -> dict[tuple[int, str], str]:
    """(slot, tensor) → its recorded boxes as index ranges, ``[0:5, 0:131072]``."""
    out: dict[tuple[int, str], list[str]] = {}
    for s, shard in lc.shards.items():
        for x in shard.slices:
            out.setdefault((s, x.name), []).append(
                "[" + ", ".join(f"{a}:{a + n}" for a, n in zip(x.start, x.shape)) + "]"
            )
    return {k: " ".join(v) for k, v in out.items()}


def _group_diffs(la: LoadedCommit, lb: LoadedCommit) -> list[GroupDiff]:
    ga = {g.name: g for g in la.commit.optimizer.groups}
    gb = {g.name: g for g in lb.commit.optimizer.groups}
    out = []
    for name in sorted(set(ga) | set(gb)):
        x, y = ga.get(name), gb.get(name)
        if x != y:
            out.append(
                GroupDiff(name, None if x is None else vars(hyper_of(x)), None if y is None else vars(hyper_of(y)))
            )
    ta, tb = (hyper_groups(c.commit.optimizer.torch_optimizer) for c in (la, lb))
    for name in sorted(set(ta) | set(tb)):
        if ta.get(name) != tb.get(name):
            out.append(GroupDiff(name, ta.get(name), tb.get(name)))
    return out


def _stats_bytes(x: TensorEntry, y: TensorEntry) -> int:
    """Bytes ``_tensor_stats`` will read for this pair (for progress reporting)."""
    if tuple(x.shape) != tuple(y.shape):
        return 0
    total = 0
    for role in ROLES:
        rx, ry = _role(x, role), _role(y, role)
        if rx is not None and ry is not None and rx[0] != ry[0]:
            total += expected_nbytes(rx[1], x.shape) + expected_nbytes(ry[1], y.shape)
    return total + sum(2 * expected_nbytes(a.dtype, a.shape) for a, _ in state_pairs(x.state, y.state).values())


def diff(
    store: Store, a: str, b: str, *, stats: bool = False, progress: Callable[[str, int, int], None] | None = None
) -> CommitDiff:
    """Compare commit ``a`` (before) with commit ``b`` (after); targets as for ``Store.resolve``.

    Both commits and their shard manifests are verified structurally first; with
    ``stats`` the changed payloads are read (and re-hashed) one tensor at a time, and
    ``progress(tensor name, bytes read, total bytes)`` is called after each tensor.
    """
    la, lb = load_commit(store, a), load_commit(store, b)
    ea, eb = la.entries(), lb.entries()
    oa, ob = la.owner(), lb.owner()
    tensors: list[TensorDiff] = []
    unchanged: list[str] = []
    moved: list[Moved] = []
    for name in sorted(set(ea) | set(eb)):
        x, y = ea.get(name), eb.get(name)
        if x is None:
            tensors.append(TensorDiff(name, "added", None, y, None, ob[name]))
            continue
        if y is None:
            tensors.append(TensorDiff(name, "removed", x, None, oa[name], None))
            continue
        if oa[name] != ob[name]:
            moved.append(Moved(name, oa[name], ob[name]))
        changes = _entry_changes(x, y)
        if not changes:
            unchanged.append(name)
            continue
        tensors.append(TensorDiff(name, "changed", x, y, oa[name], ob[name], changes))
    if stats:
        pairs = [(i, t.before, t.after) for i, t in enumerate(tensors) if t.before is not None and t.after is not None]
        total = sum(_stats_bytes(x, y) for _, x, y in pairs)
        for i, x, y in pairs:
            tensors[i] = replace(tensors[i], stats=_tensor_stats(store, x, y))
            if progress is not None:
                progress(x.name, _stats_bytes(x, y), total)
    return CommitDiff(
        la.id,
        lb.id,
        (la.commit.learned_root, lb.commit.learned_root),
        (len(la.commit.layout), len(lb.commit.layout)),
        tuple(tensors),
        tuple(unchanged),
        tuple(moved),
        tuple(_group_diffs(la, lb)),
        tuple(_field_diffs(store, la, lb)),
    )
