"""Reading a commit and its shard manifests, and their structural checks (SPEC.md §16, §17):
everything about a commit that can be judged from its manifests alone, before any tensor
byte is read. ``load_commit`` raises the first problem; ``verify`` collects them all.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec

from .. import errors
from ..errors import (
    BindingError,
    CommitProtocolError,
    CorruptObject,
    CursorError,
    GridError,
    InvalidName,
    LayoutError,
    ManifestError,
    ObjectNotFound,
    ObjectTooLarge,
    ShardstoreError,
    TensorMismatch,
    failure_report,
    raise_peer,
)
from ..format.canonical import sorted_unique
from ..format.grid import grid_problems, payload_blocks
from ..format.manifest import (
    FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    CommitManifest,
    ShardManifest,
    TensorEntry,
    banded,
    decode_manifest,
    shard_version,
    tensor_payloads,
)
from ..format.roots import learned_root
from ..format.slices import commit_slice_problems, shard_slice_problems
from ..format.tensors import hash_bytes
from ..state.extras import extras_rules
from ..store import Store
from .rules import commit_rules, shard_rules, state_problems

__all__ = [
    "Problem",
    "LoadedCommit",
    "shard_problems",
    "commit_problems",
    "repeated_shards",
    "load_commit",
    "read_commit",
    "pinned_commits",
]

#: The algorithms of the canonical Adam form (SPEC.md §9), which a writer names only over Adam groups (§12).
_ADAM = ("adam", "adamw")


@dataclass(frozen=True)
class Problem:
    """One thing wrong, with the typed error that describes it."""

    error: ShardstoreError
    commit: str | None = None
    object: str | None = None
    tensor: str | None = None

    @property
    def kind(self) -> str:
        return type(self.error).__name__

    def __str__(self) -> str:
        return str(self.error)


@dataclass
class LoadedCommit:
    """A commit and its shard manifests, all structurally verified."""

    id: str
    commit: CommitManifest
    shards: dict[int, ShardManifest]
    shard_ids: dict[int, str]

    def entries(self) -> dict[str, TensorEntry]:
        return {e.name: e for s in self.shards.values() for e in s.entries}

    def owner(self) -> dict[str, int]:
        return {name: lay.slot for lay in self.commit.layout for name in lay.tensors}


def shard_problems(shard: ShardManifest, sid: str, commit_id: str | None = None) -> Iterator[Problem]:
    """Rules a shard manifest must satisfy on its own."""

    def p(err: type[ShardstoreError], msg: str, tensor: str | None = None) -> Problem:
        where = f"shard manifest {sid}" + (f" of commit {commit_id}" if commit_id else "")
        t = f", tensor {tensor!r}" if tensor else ""
        return Problem(err(f"{where}{t}: {msg}"), commit_id, sid, tensor)

    if shard.slot >= shard.slots:
        yield p(LayoutError, f"slot {shard.slot} is not below slot count {shard.slots}")
    names = [e.name for e in shard.entries]
    if not sorted_unique(names):
        yield p(ManifestError, "tensor entries are not sorted by name and unique (SPEC.md §Shard manifest)")
    gnames = [g.name for g in shard.groups]
    if not sorted_unique(gnames):
        yield p(ManifestError, "optimizer groups are not sorted by name and unique")
    kinds = [r.kind for r in shard.rng]
    if not sorted_unique(kinds):
        yield p(ManifestError, "RNG entries are not sorted by kind and unique")
    if shard.algorithm == "none" and shard.groups:
        yield p(ManifestError, "algorithm 'none' with optimizer groups")
    if shard.algorithm in _ADAM and not shard.groups:
        yield p(
            ManifestError,
            f"algorithm {shard.algorithm!r} with no optimizer groups: a writer writes 'none' (SPEC.md §Binding)",
        )
    used: set[str] = set()
    for e in shard.entries:
        o = e.optim
        if o is None:
            continue
        used.add(o.group)
        if shard.algorithm == "none":
            yield p(ManifestError, "optimizer state under algorithm 'none'", e.name)
        if o.group not in gnames:
            yield p(ManifestError, f"group {o.group!r} is not among the shard's groups {gnames}", e.name)
        if o.birth + o.age != shard.step:
            yield p(
                CursorError,
                f"Adam age {o.age} does not equal global step {shard.step} minus birth {o.birth} (SPEC.md §Optimizer state)",
                e.name,
            )
        has = (o.exp_avg is not None, o.exp_avg_sq is not None)
        if has[0] != has[1]:
            yield p(ManifestError, "exactly one Adam moment is present", e.name)
        if o.age > 0 and not has[0]:
            yield p(CursorError, f"Adam age {o.age} > 0 but no moments are stored", e.name)
        if has[0] != (o.moment_dtype is not None):
            yield p(ManifestError, "moment_dtype must be set exactly when moments are present", e.name)
    whole = (
        shard.version == FORMAT_VERSION
    )  # version 1: a tensor of any size may be one object, as format 1 wrote it (SPEC.md §5.1)
    for e in shard.entries:
        for role, payload, dtype in tensor_payloads(e):
            for msg in grid_problems(payload, dtype, e.shape, bands=banded(shard.version), whole=whole):
                yield p(GridError, f"{role} payload: {msg} (SPEC.md §Chunked payloads)", e.name)
        for msg in state_problems(e, shard.version):
            yield p(GridError, f"{msg} (SPEC.md §Chunked payloads)", e.name)
    if set(gnames) - used:
        yield p(ManifestError, f"groups {sorted(set(gnames) - used)} are not used by any tensor entry")
    for err, msg, tensor in shard_rules(shard):  # buffers and the torch form (SPEC.md §Buffers, §Optimizer state)
        yield p(err, msg, tensor)
    for msg in extras_rules(shard.extras):
        yield p(ManifestError, msg)
    for msg in shard_slice_problems(shard):
        yield p(ManifestError, msg)


def commit_problems(
    commit: CommitManifest, cid: str, shards: dict[int, ShardManifest], shard_ids: dict[int, str]
) -> Iterator[Problem]:
    """Rules binding a commit to its shard manifests, and the learned-state root."""

    def p(err: type[ShardstoreError], msg: str, obj: str | None = None, tensor: str | None = None) -> Problem:
        t = f", tensor {tensor!r}" if tensor else ""
        o = f", shard manifest {obj}" if obj and obj != cid else ""
        return Problem(err(f"commit {cid}{o}{t}: {msg}"), cid, obj or cid, tensor)

    versions = {s.version for s in shards.values()}
    if len(shards) == len(commit.layout) and versions and commit.version != max(versions):
        yield p(
            ManifestError,
            f"commit has version {commit.version} but its shard manifests need version {max(versions)} (SPEC.md §Versioning)",
        )
    slots = [lay.slot for lay in commit.layout]
    if slots != list(range(len(slots))):
        yield p(
            LayoutError, f"layout slots {slots} are not exactly 0..{len(slots) - 1} in order (SPEC.md §Commit manifest)"
        )
    gnames = [g.name for g in commit.optimizer.groups]
    if not sorted_unique(gnames):
        yield p(ManifestError, "optimizer groups are not sorted by name and unique")
    if commit.optimizer.algorithm in _ADAM and not gnames:
        yield p(
            ManifestError,
            f"algorithm {commit.optimizer.algorithm!r} with no optimizer groups: a writer writes 'none' (SPEC.md §Binding)",
        )
    groups = {g.name: g for g in commit.optimizer.groups}
    for err, msg, obj in commit_rules(commit, shards):  # the torch form and extras (SPEC.md §9.1, §9.3)
        yield p(err, msg, obj)
    owners: dict[str, int] = {}
    for lay in commit.layout:
        if not sorted_unique(list(lay.tensors)):
            yield p(ManifestError, f"slot {lay.slot}'s tensor list is not sorted and unique")
        for name in lay.tensors:
            if name in owners:
                yield p(
                    LayoutError, f"owned twice, by slots {owners[name]} and {lay.slot} (SPEC.md §Layout)", tensor=name
                )
            else:
                owners[name] = lay.slot
    all_entries: list[TensorEntry] = []
    used_groups: set[str] = set()
    for lay in commit.layout:
        sid = lay.shard
        shard = shards.get(lay.slot)
        if shard is None:
            continue  # reported by the caller as a missing object
        binding = {
            "job": (shard.job, commit.job),
            "step": (shard.step, commit.step),
            "parent": (shard.parent, commit.parent),
            "config": (shard.config, commit.config),
            "slot": (shard.slot, lay.slot),
            "slots": (shard.slots, len(commit.layout)),
        }
        if (shard.groups or shard.torch_optimizer is not None) and shard.algorithm != commit.optimizer.algorithm:
            binding["algorithm"] = (shard.algorithm, commit.optimizer.algorithm)
        for fieldname, (have, want) in binding.items():
            if have != want:
                yield p(
                    BindingError,
                    f"shard's {fieldname} is {have!r} but the commit's is {want!r} (SPEC.md §Binding)",
                    sid,
                )
        for g in shard.groups:
            if groups.get(g.name) != g:
                yield p(BindingError, f"group {g.name!r} differs from the commit's optimizer group of that name", sid)
            used_groups.add(g.name)
        names = [e.name for e in shard.entries]
        if names != list(lay.tensors):
            missing = sorted(set(lay.tensors) - set(names))
            extra = sorted(set(names) - set(lay.tensors))
            yield p(
                LayoutError,
                f"layout of slot {lay.slot} and its shard disagree: in layout only {missing[:5]}, in shard only {extra[:5]}",
                sid,
            )
        if banded(shard.version) and not banded(commit.version) and shard_version(shard.entries, bands=True) > 1:
            yield p(
                BindingError,
                f"shard of version {shard.version} puts chunked payloads on the row-band grid, "
                f"but the commit is version {commit.version} (the tile grid): a commit uses one grid (SPEC.md §Versioning)",
                sid,
            )
        all_entries.extend(shard.entries)
    if set(groups) - used_groups and len(shards) == len(commit.layout):
        yield p(ManifestError, f"optimizer groups {sorted(set(groups) - used_groups)} are used by no tensor")
    yield from _sizes_agree(cid, all_entries)
    if len(shards) == len(commit.layout):
        for msg, tensor, slot in commit_slice_problems(shards, {e.name: e for e in all_entries}):
            yield p(LayoutError, msg, shard_ids.get(slot), tensor)
        c = commit
        root = learned_root(
            step=c.step,
            data_cursor=c.data_cursor,
            config=c.config,
            optimizer=c.optimizer,
            entries=all_entries,
            extras=c.extras,
            bands=banded(c.version),
        )
        if root != commit.learned_root:
            yield p(
                ManifestError,
                f"learned-state root is {commit.learned_root} but the shards give {root} (SPEC.md §Roots)",
            )


def repeated_shards(commit: CommitManifest, cid: str) -> Iterator[Problem]:
    """A shard manifest binds one slot (its ``slot`` field), so a layout naming one shard
    manifest in several slots can never verify: refused before any shard manifest is read."""
    seen: dict[str, int] = {}
    for lay in commit.layout:
        if lay.shard in seen:
            yield Problem(
                LayoutError(f"commit {cid}: slots {seen[lay.shard]} and {lay.slot} name the same shard manifest {lay.shard} (SPEC.md §Layout)"),
                cid, lay.shard,
            )  # fmt: skip
            return
        seen[lay.shard] = lay.slot


def _sizes_agree(cid: str, entries: Iterable[TensorEntry]) -> Iterator[Problem]:
    """Every entry naming one object implies the same byte size (the object has one size)."""
    sizes: dict[str, tuple[int, str]] = {}
    for e in entries:
        named = [
            (oid, n) for _, p, d in tensor_payloads(e) for oid, _box, n in payload_blocks(p, d, e.shape)
        ]  # blocks too
        for oid, n in named:
            first = sizes.setdefault(oid, (n, e.name))
            if first[0] != n:
                yield Problem(
                    TensorMismatch(
                        f"commit {cid}, tensor {e.name!r}: object {oid} is named with {n} bytes here and with {first[0]} bytes "
                        f"by tensor {first[1]!r}; an object has one size (SPEC.md §Verification)"
                    ),
                    cid, oid, e.name,
                )  # fmt: skip


def read_commit(
    store: Store,
    cid: str,
    found: list[Problem] | None,
    *,
    named: str = "",
    shards_read: Mapping[str, ShardManifest | ShardstoreError] | None = None,
    commit_read: CommitManifest | None = None,
    prefetch: Iterable[str] = (),
) -> LoadedCommit | None:
    """Read commit ``cid`` and its shard manifests, checking each structurally.

    With ``found`` None, the first problem is raised (``load_commit``); otherwise every
    problem is appended to ``found`` and None returned when the commit cannot be read as a
    whole (``verify``). ``named`` says which refs or target name the commit, for messages.
    ``shards_read``: shard manifests the caller already read back from ``store`` (verified
    against their ids), by id, or the typed error reading one raised (reported as a read here
    reports it): checked here as they are, not read again; ``commit_read``: the same for the
    commit. ``prefetch``: ids of shard manifests the commit is expected to name,
    read together with it (on S3 one round trip for all instead of one after the other). The
    shard manifests still to be read after the commit are read together too.
    """

    def report(problems: Iterable[Problem]) -> bool:
        problems = list(problems)
        if found is None and problems:
            raise problems[0].error
        if found is not None:
            found.extend(problems)
        return bool(problems)

    known: dict[str, ShardManifest | ShardstoreError] = dict(shards_read or {})
    early = [] if commit_read is not None else sorted(set(prefetch) - set(known))
    if early:
        read = _read_together(store, [cid], early)
        got: CommitManifest | ShardstoreError = read.pop(cid)  # type: ignore[assignment]
    else:
        read = {}
        try:
            got = commit_read if commit_read is not None else store.commit(cid)
        except ShardstoreError as e:
            got = e
    if isinstance(got, ShardstoreError):
        report([Problem(type(got)(f"commit {cid}{named}: {got}"), cid, cid)])
        return None
    commit = got
    if report(repeated_shards(commit, cid)):
        return None
    later = sorted({lay.shard for lay in commit.layout} - set(known) - set(read))
    read.update(_read_together(store, [], later))
    shards: dict[int, ShardManifest] = {}
    ids: dict[int, str] = {}
    for lay in commit.layout:
        shard = known[lay.shard] if lay.shard in known else read[lay.shard]
        if isinstance(shard, ShardstoreError):
            report(
                [
                    Problem(
                        type(shard)(f"commit {cid}, slot {lay.slot}, shard manifest {lay.shard}: {shard}"),
                        cid,
                        lay.shard,
                    )
                ]
            )
            continue
        assert isinstance(shard, ShardManifest)
        shards[lay.slot] = shard
        ids[lay.slot] = lay.shard
        report(shard_problems(shard, lay.shard, cid))
    report(commit_problems(commit, cid, shards, ids))
    return LoadedCommit(cid, commit, shards, ids)


#: Manifests read at once by ``read_commit`` (a round trip each on S3).
_READ_THREADS = 8


def _read_together(
    store: Store, commits: list[str], shards: list[str]
) -> dict[str, CommitManifest | ShardManifest | ShardstoreError]:
    """Each of ``commits`` (commit manifests) and ``shards`` (shard manifests) read, or the typed
    error reading it raised; several at once when there are several."""

    def one(job: tuple[str, bool]) -> CommitManifest | ShardManifest | ShardstoreError:
        oid, is_commit = job
        try:
            return store.commit(oid) if is_commit else store.shard(oid)
        except ShardstoreError as e:
            return e

    jobs = [(c, True) for c in commits] + [(s, False) for s in shards]
    if len(jobs) > 1 and store.lists_sizes():  # reads are round trips there (S3); locally, one after the other
        with ThreadPoolExecutor(max_workers=min(_READ_THREADS, len(jobs))) as pool:
            results = list(pool.map(one, jobs))
    else:
        results = [one(j) for j in jobs]
    return {oid: r for (oid, _), r in zip(jobs, results)}


def load_commit(store: Store, target: str, *, group: Any = None) -> LoadedCommit:
    """Resolve ``target``, read and structurally verify the commit and all its shard manifests.

    Raises the first problem found. Reads manifests only (never tensor payloads). A full commit
    id is looked up as a ref (a ref name wins, SPEC.md §14) and read as a commit at once, the
    reading kept only if no such ref exists: one round trip on S3 where there were three
    (where reads are round trips: ``Store.lists_sizes``).

    ``group``: a process group whose ranks load the commit together (a collective: every rank of
    it calls this with the same ``target``): the manifests are read once in the group, not once
    per rank (SPEC.md §16.3). Group rank 0 resolves ``target`` and reads the commit manifest,
    whose bytes every rank receives (so every rank loads the same commit, even if a ref moves
    meanwhile); the shard manifests are split among the ranks, each reading its share, and
    all-gathered; every rank verifies every manifest's bytes against its id before decoding
    it and runs the same checks, so the result is the one each would have read on its own. A
    failure on any rank (a missing or corrupt manifest, bytes from a peer that do not hash to
    their id, a problem of the commit) is raised on every rank, by type, naming it. The group's
    backend must carry CPU tensors (Gloo), as a restore by exchange's does. None, or a group of
    one process: the load on its own, above.
    """
    if group is not None:
        from . import collective  # torch.distributed: imported only for a group

        if collective.world(group) > 1:
            return _load_commit_grouped(store, target, group)
    if _FULL_ID.fullmatch(target) is not None and store.lists_sizes():  # reads are round trips (S3)
        with ThreadPoolExecutor(max_workers=2) as pool:
            as_ref = pool.submit(store.ref, target)
            as_id = pool.submit(_read_together, store, [target], [])
            value = as_ref.result()  # a ref that does not parse raises, as resolve does
            guess = as_id.result()[target]
        if value is None and isinstance(guess, CommitManifest):
            lc = read_commit(store, target, None, commit_read=guess)
            assert lc is not None
            return lc
    cid = store.resolve(target)  # a ref, a prefix, a suffix; or a full id that did not read as a commit
    lc = read_commit(store, cid, None, named=f" (named by {target!r})" if target != cid else "")
    assert lc is not None  # with found=None every problem raises
    return lc


_FULL_ID = re.compile(r"[0-9a-f]{64}")


class _Read(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One shard manifest as the rank assigned it sends it to the group: its bytes as read and
    verified, or the type name and message of the error reading it raised."""

    oid: str
    data: bytes = b""
    error: tuple[str, str] | None = None


_READS = msgspec.msgpack.Decoder(list[_Read])
#: The most bytes of a target group rank 0 resolves for the group (a ref name is far shorter).
_TARGET_BYTES = 4096
#: The most characters of a read error's message a rank sends for a shard manifest (UTF-8: at most 4 bytes each).
_MESSAGE_CHARS = 2048
#: A shard manifest's share of a rank's bytes beyond the manifest itself (its id, an error, framing).
_READ_OVERHEAD = 16384


def _load_commit_grouped(store: Store, target: str, group: Any) -> LoadedCommit:
    """``load_commit`` with the manifests read once in ``group`` (SPEC.md §16.3; more than one rank).

    1. group rank 0 resolves ``target`` and reads the commit manifest (verified, bounded) and
       broadcasts its id, the target and the bytes, or its failure;
    2. every rank checks it names that target, verifies the bytes against the id, decodes them and checks the layout names
       no shard manifest twice; the distinct shard manifest ids, sorted, are split round robin
       (rank r reads the ids at r, r + world, ...), each read verified and bounded;
    3. the shares are all-gathered (each rank's length first, checked against its bound:
       ``MAX_MANIFEST_BYTES`` and framing per manifest assigned to it), with every rank's failure
       flag: a rank that failed in 1 or 2 fails every rank;
    4. every rank verifies every manifest's bytes against its id (bytes from a peer are trusted
       exactly as bytes from storage) and decodes it; an error a reader met, or bytes that do not
       hash to their id, stands for that manifest as a failed read would; then ``read_commit``
       runs every check on what was received, and a failure flag is agreed once more.
    """
    from . import collective

    rank, size = collective.rank(group), collective.world(group)
    raw = b""
    failure: BaseException | None = None
    if rank == 0:
        try:
            name = target.encode()
            if len(name) > _TARGET_BYTES:
                raise InvalidName(f"target {target[:64]!r}... is over {_TARGET_BYTES} bytes")
            cid, commit_raw = _resolve_read(store, target)
            raw = b"\x00" + cid.encode() + len(name).to_bytes(4, "big") + name + commit_raw
        except Exception as e:  # noqa: BLE001 - sent to every rank, raised alike
            raw, failure = b"\x01" + failure_report(e), e
    got = collective.broadcast_from_first(
        raw, group, 69 + _TARGET_BYTES + MAX_MANIFEST_BYTES, f"loading commit {target!r}"
    )
    if got[:1] != b"\x00":
        if failure is not None:
            raise failure  # rank 0: its own error, with its traceback
        raise_peer([got[1:]], f"loading commit {target!r}")
    cid, k = got[1:65].decode(errors="replace"), int.from_bytes(got[65:69], "big")
    first, commit_raw = got[69 : 69 + k].decode(errors="replace"), got[69 + k :]
    named = f" (named by {target!r})" if target != cid else ""
    where = f"loading commit {cid}"
    error: BaseException | None = None
    ids: list[str] = []
    commit: CommitManifest | None = None
    mine = b""
    try:
        if first != target:
            raise CommitProtocolError(
                f"this rank loads target {target!r} and group rank 0 {first!r}: every rank of a group loading a "
                "commit names the same target (SPEC.md §16.3)"
            )
        if _FULL_ID.fullmatch(cid) is None:
            raise ManifestError(f"group rank 0 sends {cid!r} as the commit id {target!r} resolves to (SPEC.md §16.3)")
        h = hash_bytes(commit_raw)
        if h != cid:
            raise CorruptObject(
                f"commit {cid}{named}: its manifest as group rank 0 sent it, {len(commit_raw)} bytes, hashes to {h} "
                "(SPEC.md §16.3)"
            )
        try:
            commit = decode_manifest(commit_raw, CommitManifest, what=f"object {cid}")
        except ShardstoreError as e:
            raise type(e)(f"commit {cid}{named}: {e}") from None
        for problem in repeated_shards(commit, cid):
            raise problem.error
        ids = sorted({lay.shard for lay in commit.layout})
        mine = msgspec.msgpack.encode(_read_share(store, ids[rank::size]))
    except Exception as e:  # noqa: BLE001 - every rank learns of it in the gather
        error = e

    def bound(r: int) -> int:
        return len(ids[r::size]) * (MAX_MANIFEST_BYTES + _READ_OVERHEAD) + 16

    shares = collective.gather(mine, error, group, bound, where)
    assert commit is not None  # the gather raised otherwise
    lc: LoadedCommit | None = None
    try:
        received: dict[str, ShardManifest | ShardstoreError] = {}
        for r, share in enumerate(shares):
            received.update(_received(share, ids[r::size], r, where))
        lc = read_commit(store, cid, None, named=named, commit_read=commit, shards_read=received)
    except Exception as e:  # noqa: BLE001 - agreed below: every rank raises if any failed
        error = e
    collective.gather(b"", error, group, lambda r: 0, where)
    assert lc is not None  # with found=None every problem raises, and the gather raised it
    return lc


def _resolve_read(store: Store, target: str) -> tuple[str, bytes]:
    """The commit id ``target`` resolves to and its manifest's bytes, verified and bounded: what
    ``load_commit`` reads first, the same way (group rank 0, SPEC.md §16.3)."""
    if _FULL_ID.fullmatch(target) is not None and store.lists_sizes():  # reads are round trips (S3)
        with ThreadPoolExecutor(max_workers=2) as pool:
            as_ref = pool.submit(store.ref, target)
            as_id = pool.submit(_read_raw, store, target)
            value = as_ref.result()  # a ref that does not parse raises, as resolve does
            guess = as_id.result()
        if value is None and isinstance(guess, bytes) and _decodes(guess, CommitManifest):
            return target, guess
    cid = store.resolve(target)  # a ref, a prefix, a suffix; or a full id that did not read as a commit
    named = f" (named by {target!r})" if target != cid else ""
    got = _read_raw(store, cid)
    if isinstance(got, ShardstoreError):
        raise type(got)(f"commit {cid}{named}: {got}") from None
    return cid, got


def _decodes(raw: bytes, kind: type[Any]) -> bool:
    try:
        decode_manifest(raw, kind)
    except ShardstoreError:
        return False
    return True


def _read_raw(store: Store, oid: str) -> bytes | ShardstoreError:
    """The bytes of manifest ``oid``, verified against its id and at most ``MAX_MANIFEST_BYTES``
    (refused before it is read), or the typed error reading it raised."""
    try:
        return bytes(store.get(oid, limit=MAX_MANIFEST_BYTES))
    except ShardstoreError as e:
        return e


def _read_share(store: Store, oids: list[str]) -> list[_Read]:
    """This rank's share of a group's shard manifests (SPEC.md §16.3), each read and verified, or
    its error; several at once where reads are round trips (S3)."""
    if len(oids) > 1 and store.lists_sizes():
        with ThreadPoolExecutor(max_workers=min(_READ_THREADS, len(oids))) as pool:
            got = list(pool.map(lambda o: _read_raw(store, o), oids))
    else:
        got = [_read_raw(store, o) for o in oids]
    return [
        _Read(o, b"", (type(g).__name__[:128], str(g)[:_MESSAGE_CHARS]))
        if isinstance(g, ShardstoreError)
        else _Read(o, g)
        for o, g in zip(oids, got)
    ]


def _received(share: bytes, oids: list[str], r: int, where: str) -> dict[str, ShardManifest | ShardstoreError]:
    """Rank ``r``'s share as every rank checks it: exactly the manifests assigned to it, in order,
    each verified against its id and decoded (ManifestError naming the rank if the share is not
    that); a read error it reports, or bytes that do not hash to their id, stands for the manifest."""
    try:
        reads = _READS.decode(share)
    except msgspec.MsgspecError as e:
        raise ManifestError(
            f"rank {r} of the group {where}: its share of the shard manifests does not decode: {e}"
        ) from None
    if [x.oid for x in reads] != oids:
        raise ManifestError(
            f"rank {r} of the group {where} sends shard manifests {[x.oid for x in reads][:3]}, not the "
            f"{len(oids)} assigned to it {oids[:3]} (SPEC.md §16.3)"
        )
    out: dict[str, ShardManifest | ShardstoreError] = {}
    for x in reads:
        if x.error is not None:
            name, msg = x.error
            cls = getattr(errors, name, None)
            if not (isinstance(cls, type) and issubclass(cls, ShardstoreError)):
                cls = ShardstoreError
            out[x.oid] = cls(f"{msg} (read by rank {r} of the group)")
            continue
        if len(x.data) > MAX_MANIFEST_BYTES:
            out[x.oid] = ObjectTooLarge(
                f"object {x.oid} as rank {r} of the group sent it is {len(x.data)} bytes, over this reader's "
                f"limit of {MAX_MANIFEST_BYTES} (SPEC.md §Limits)"
            )
            continue
        h = hash_bytes(x.data)
        if h != x.oid:
            out[x.oid] = CorruptObject(
                f"object {x.oid} as rank {r} of the group sent it is corrupt: its {len(x.data)} bytes hash to {h} "
                "(SPEC.md §16.3)"
            )
            continue
        try:
            out[x.oid] = decode_manifest(x.data, ShardManifest, what=f"object {x.oid}")
        except ShardstoreError as e:
            out[x.oid] = e
    return out


def _is_commit(store: Store, oid: str) -> bool | None:
    """Whether object ``oid`` is a commit manifest (its bytes decode as one); None if it is absent."""
    size = store.object_size(oid)
    if size is None:
        return None
    if size > MAX_MANIFEST_BYTES:
        return False  # no reader accepts a manifest this large
    try:
        raw = store.get(oid, verify=False, limit=MAX_MANIFEST_BYTES)  # a rotted commit still names its closure
    except ObjectNotFound:
        return None
    try:
        decode_manifest(raw, CommitManifest, what=f"object {oid}")
    except ShardstoreError:
        return False  # a job file, a tokenizer, tensor bytes: kept as the object it is
    return True


def pinned_commits(
    store: Store, pins: Mapping[str, Iterable[str]], known: dict[str, bool] | None = None, *, threads: int = 4
) -> dict[str, list[str]]:
    """The commits among the objects ``pins`` (pin name → object ids) name, each with the
    names of the pins naming it: a pinned commit keeps its whole closure, as one a ref names
    does (SPEC.md §14.1), so gc walks it and ``verify`` checks it.

    An object is a commit if it is present, at most ``MAX_MANIFEST_BYTES`` and decodes as a
    commit manifest (every other pinned object is read once, bounded; an absent one is left
    out: there is nothing of it to keep or check). ``known`` caches that verdict by object
    id across calls (an object's bytes never change)."""
    names: dict[str, list[str]] = {}
    for name in sorted(pins):
        for oid in pins[name]:
            names.setdefault(oid, []).append(name)
    cache: dict[str, bool] = {} if known is None else known
    fresh = [oid for oid in sorted(names) if oid not in cache]
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:  # a GET each on S3; at most threads × 64 MiB held
        for oid, verdict in zip(fresh, pool.map(lambda o: _is_commit(store, o), fresh)):
            if verdict is not None:
                cache[oid] = verdict
    return {oid: names[oid] for oid in sorted(names) if cache.get(oid, False)}
