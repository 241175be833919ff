"""Evaluation roles: development and final sets, and the selection record that opens finals.

A prepared job declares its held-out sets before training (`EvalSet`, inside job.json
and so bound by the job id; each also carries the BLAKE3 digest of its record ids). Each
set has a **role** and a **kind**:

- ``development`` sets are what `evaluate` and `gate` use by default; a run may be
  aborted on them. Development retention may be records the model was exposed to (the
  declared replay conversations): they are development data only.
- ``final`` sets open only after a **selection**: `select` writes a selection object
  binding the job id and one candidate commit and pins it as ``selections/<job id>``
  (kept by gc). ``evaluate --final`` is refused unless the candidate it scores is the
  selected commit; the first final evaluation pins ``finals-opened/<job id>`` before any
  final record is read, and from then on a second selection for the job is refused.
  Final sets must be disjoint from every training and replay record, by record id and
  by prompt text, which `check_roles` enforces when the job is prepared and loaded.
- ``task`` sets hold new-task records (the gain and generation gates); ``retention``
  sets hold conversation records (the retention gate).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

import blake3
import msgspec
from msgspec import Meta

from shardstore import ObjectNotFound, RefConflict, RefNotFound, Store
from shardtrain.errors import JobError, RoleError
from shardtrain.job.tasks import Record

__all__ = [
    "DEVELOPMENT",
    "FINAL",
    "EvalSet",
    "Selection",
    "set_digest",
    "check_roles",
    "select",
    "selection",
    "open_finals",
    "finals_opened",
]

DEVELOPMENT, FINAL = "development", "final"
_VERSION = 1
_ENC = msgspec.json.Encoder(order="sorted")
Hex64 = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]
SetName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")]
Index = Annotated[int, Meta(ge=0, le=2**40)]


class EvalSet(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A held-out set: its role, its kind, its records (indices) and their digest."""

    name: SetName
    role: Literal["development", "final"]
    kind: Literal["task", "retention"]
    docs: Annotated[tuple[Index, ...], Meta(min_length=1)]
    digest: Hex64  # BLAKE3 of the canonical JSON list of the docs' record ids, in order


class Selection(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag="shardtrain-selection", tag_field="type"
):
    """The record that opens a job's final sets for one candidate commit (an object in the store)."""

    version: int
    job: Hex64
    commit: Hex64


def set_digest(records: Sequence[Record], docs: Sequence[int]) -> str:
    return blake3.blake3(_ENC.encode([records[d].id for d in docs])).hexdigest()


def _prompt(r: Record) -> str:
    return "\n".join(m.content for m in r.messages if m.role != "assistant")


def check_roles(sets: Sequence[EvalSet], records: Sequence[Record], trained: set[int]) -> None:
    """Refuse sets that are malformed, mislabelled, or (finals, task sets) overlap `trained`.

    `trained` is every record a schedule step names, replay included.
    """
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise JobError(f"held-out set names repeat: {names}")
    seen_ids = {records[d].id for d in trained if d < len(records)}
    seen_prompts = {_prompt(records[d]) for d in trained if d < len(records)}
    final_docs: set[int] = set()
    for s in sets:
        if any(d >= len(records) for d in s.docs) or len(set(s.docs)) != len(s.docs):
            raise JobError(f"held-out set {s.name!r} names a record twice or one outside the records file")
        if set_digest(records, s.docs) != s.digest:
            raise JobError(f"held-out set {s.name!r}: its records do not hash to the digest the job binds")
        if s.kind == "task" or s.role == FINAL:
            hit = [
                d for d in s.docs if d in trained or records[d].id in seen_ids or _prompt(records[d]) in seen_prompts
            ]
            if hit:
                raise JobError(
                    f"{s.role} {s.kind} set {s.name!r} overlaps the training and replay records (record "
                    f"{hit[0]}, id {records[hit[0]].id[:12]}, by index, record id or prompt); final sets and "
                    f"task sets must be disjoint from every trained record"
                )
        if s.role == FINAL:
            final_docs.update(s.docs)
    for s in sets:
        if s.role == DEVELOPMENT and final_docs & set(s.docs):
            raise JobError(f"development set {s.name!r} shares records with a final set")
    if not any(s.role == DEVELOPMENT for s in sets):
        raise JobError("the job declares no development set")


def _selection_pin(job: str) -> str:
    return f"selections/{job}"


def _opened_pin(job: str) -> str:
    return f"finals-opened/{job}"


def selection(store: Store, job: str) -> Selection | None:
    """The job's current selection record, or None."""
    ids = store.pinned(_selection_pin(job))
    if not ids:
        return None
    try:
        raw = bytes(store.get(ids[0]))
    except ObjectNotFound:
        raise RoleError(f"pin {_selection_pin(job)} names object {ids[0][:12]}, which is missing") from None
    try:
        sel = msgspec.json.decode(raw, type=Selection)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise RoleError(f"selection object {ids[0][:12]} is malformed: {exc}") from None
    if sel.version != _VERSION or sel.job != job:
        raise RoleError(f"selection object {ids[0][:12]} is not a version-{_VERSION} selection for job {job[:12]}")
    return sel


def finals_opened(store: Store, job: str) -> bool:
    return store.pinned(_opened_pin(job)) is not None


def select(store: Store, job: str, commit: str) -> str:
    """Write and pin the selection of `commit` for `job`; return the selection object's id.

    Refused (`RoleError`) once the job's final sets were opened.
    """
    if finals_opened(store, job):
        current = selection(store, job)
        raise RoleError(
            f"job {job[:12]}'s final sets were already opened for commit "
            f"{current.commit[:12] if current else '?'}; a second selection is refused"
        )
    raw = _ENC.encode(Selection(version=_VERSION, job=job, commit=commit))
    try:  # what `selection` will read back, checked before it is written and pinned
        msgspec.json.decode(raw, type=Selection)
    except msgspec.ValidationError as exc:
        raise RoleError(f"not a selection of a job id and a commit id (64 hex digits each): {exc}") from None
    oid = store.put(raw)
    store.sync()
    previous = store.pinned(_selection_pin(job))
    store.pin(_selection_pin(job), [oid], expected=previous)  # compare-and-swap
    if finals_opened(store, job):  # an opening completed between the check above and the swap: undo it
        store.pin(_selection_pin(job), list(previous or ()), expected=[oid])
        raise RoleError(
            f"job {job[:12]}'s final sets were opened while this selection was being written; it is refused"
        )
    return oid


def open_finals(store: Store, job: str, candidate: str) -> Selection:
    """Check that `candidate` is the job's selected commit and record that finals were opened."""
    sel = selection(store, job)
    if sel is None:
        raise RoleError(
            f"job {job[:12]} has no selection record: run `shardtrain select --store {store.url} "
            f"--commit C` before evaluating its final sets"
        )
    if sel.commit != candidate:
        raise RoleError(
            f"job {job[:12]} selected commit {sel.commit[:12]}, not {candidate[:12]}; final sets open only "
            f"for the selected commit"
        )
    ids = store.pinned(_selection_pin(job))
    opened = store.pinned(_opened_pin(job))
    if opened is not None and set(opened) != set(ids or ()):
        raise RoleError(f"job {job[:12]}'s final sets were opened for another selection record than the current one")
    if opened is None:
        store.add_to_pin(_opened_pin(job), list(ids or ()))
        # A `select` racing with this opening may have replaced the selection in between:
        # the opening holds only if the selection it recorded is still the current one.
        if store.pinned(_selection_pin(job)) != ids or set(store.pinned(_opened_pin(job)) or ()) != set(ids or ()):
            # Undo this opening (compare-and-delete of what it wrote): left in place it would name
            # a selection that is no longer current, and refuse every later select and opening.
            try:
                store.unpin(_opened_pin(job), expected=list(ids or ()))
            except (RefConflict, RefNotFound):
                pass  # not ours any more: the check above raises all the same
            raise RoleError(
                f"job {job[:12]}'s selection changed while its final sets were being opened; "
                f"the opening was undone (select and the final sets are linearisable, README)"
            )
    return sel
