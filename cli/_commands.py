"""The handlers of the ``shardstore`` subcommands (see ``shardstore_cli.shardstore_cli`` for the parser).

Each handler is ``cmd_<name>(args) -> int``: it builds one JSON-able document from the
library's results, prints it (``--json``) or its text rendering (``shardstore_cli._render``) on stdout,
and returns an exit code of the one table (``shardstore_cli.exit_codes``). Errors propagate as
shardstore's typed errors; ``main`` maps them to exit codes by that table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

import shardstore as ss
from shardstore.checkpoint.info import check_info
from shardstore.errors import ManifestError, ObjectNotFound, ShardstoreError, TargetNotFound
from shardstore.format.bounded import check_json_nesting
from shardstore.format.manifest import MAX_MANIFEST_BYTES, decode_config
from shardstore.format.names import check_ref_name
from shardstore.format.tensors import expected_nbytes

from ._output import bar as _bar
from ._output import emit as _emit
from ._output import note
from ._render import (
    jsonable,
    marker_doc,
    render_cat,
    render_diff,
    render_log,
    render_log_oneline,
    render_refs,
    render_show,
    render_verify,
)
from .exit_codes import Exit

__all__ = [
    "UsageError",
    "cmd_verify", "cmd_diff", "cmd_log", "cmd_show", "cmd_cat", "cmd_refs", "cmd_export", "cmd_import",
    "parse_size", "parse_layout", "add_storage_option", "apply_storage_options",
]  # fmt: skip


class UsageError(Exception):
    """Bad command-line arguments (exit 2)."""

    def __init__(self, message: str, parser: argparse.ArgumentParser) -> None:
        super().__init__(message)
        self.parser = parser


# -- helpers ---------------------------------------------------------------------------


def _note(args: argparse.Namespace, message: str) -> None:
    if not args.quiet and not args.json:
        note(message)


def _progress(bar: tqdm) -> Callable[[str, int, int], None]:
    def tick(name: str, nbytes: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
        bar.update(nbytes)

    return tick


def add_storage_option(p: argparse.ArgumentParser) -> None:
    """``--storage-option KEY=VALUE`` (repeatable): options for every S3 store the command opens."""
    p.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="S3 store option, e.g. endpoint_url=http://10.0.0.9:9000 or client_kwargs.region_name=eu-west-1 "
        '(repeatable; merged over SHARDSTORE_STORAGE_OPTIONS; README "Storage options")',
    )


def add_slot_option(p: argparse.ArgumentParser, what: str) -> None:
    """``--slot K`` (``--shard K``, its old name, kept as an alias): ``what`` slot K's objects."""
    p.add_argument("--slot", "--shard", dest="slot", type=int, metavar="K", help=f"{what} (--shard: old name)")


def apply_storage_options(args: argparse.Namespace) -> None:
    """Make ``--storage-option`` reach every store this process (and any worker it starts) opens."""
    from shardstore.backends.options import ENV, environment_with

    texts = getattr(args, "storage_option", None) or []
    if texts:
        try:
            os.environ[ENV] = environment_with(texts)
        except (ValueError, ss.ShardstoreError) as e:
            raise UsageError(f"--storage-option: {e}", getattr(args, "parser", None)) from None  # type: ignore[arg-type]


def _open(url: str, *, create: bool = False) -> ss.Store:
    return ss.open_store(url, create=create)


def _gc_markers(store: ss.Store) -> list[dict[str, Any]]:
    """The gc markers present, with holder and age (SPEC.md §19.2): a running gc, or one that died."""
    from shardstore.store.gc_fence import gc_markers

    return [marker_doc(m) for m in gc_markers(store)]


def _refs_by_commit(store: ss.Store) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in store.ref_names():
        try:
            cid = store.ref(name)
        except ss.ShardstoreError:
            continue  # verify reports a ref that does not parse as a problem
        if cid is not None:
            out.setdefault(cid, []).append(name)
    return out


# -- commands --------------------------------------------------------------------------


def _check_slot(store: ss.Store, targets: list[str], slot: int) -> None:
    """``--slot K`` names a slot of every commit asked for (or every ref's commit), as ``copy --slot`` requires."""
    heads = [store.resolve(t) for t in targets] if targets else sorted(set(store.refs().values()))
    for cid in heads:
        n = len(store.commit(cid).layout)
        if slot >= n:
            raise TargetNotFound(f"commit {cid} in {store.url} has slots 0..{n - 1}; it has no slot {slot}")


def cmd_verify(args: argparse.Namespace) -> int:
    if args.slot is not None and args.slot < 0:
        raise UsageError(f"--slot must be a slot number >= 0, got {args.slot}", args.parser)
    store = _open(args.store)
    if args.slot is not None:
        _check_slot(store, args.targets, args.slot)
    with _bar(args, "verify") as bar:
        report = ss.verify(store, args.targets or None, deep=not args.quick, slot=args.slot, progress=bar.update)
    problems = [
        {"kind": p.kind, "object": p.object, "tensor": p.tensor, "commit": p.commit, "message": str(p.error)}
        for p in report.problems
    ]
    doc = {
        "ok": report.ok,
        "deep": not args.quick,
        "slot": args.slot,
        "commits": report.commits,
        "objects_checked": report.objects_checked,
        "bytes_hashed": report.bytes_hashed,
        "problems": problems,
        "refs_by_commit": _refs_by_commit(store),
        "gc_markers": _gc_markers(store),
    }
    _emit(args, doc, render_verify)
    return Exit.OK if report.ok else Exit.PROBLEMS


def cmd_diff(args: argparse.Namespace) -> int:
    from shardstore.ops.diff import diff

    with _bar(args, "diff --stats") as bar:
        d = diff(_open(args.store), args.a, args.b, stats=args.stats, progress=_progress(bar))
    doc = jsonable(d)
    for t, td in zip(doc["tensors"], d.tensors):
        for role, st in td.stats.items():
            t["stats"][role]["rel_l2"] = jsonable(st.rel_l2)
    doc.update(
        empty=d.empty,
        learned_root_equal=d.learned_root_equal,
        layout_changed=d.layout_changed,
        counts={s: len(d.by_status(s)) for s in ("changed", "added", "removed")} | {"unchanged": len(d.unchanged)},
    )

    def render(doc: dict[str, Any]) -> str:
        text = render_diff(doc)
        return text + "".join(f"\n  same     {name}" for name in d.unchanged) if args.all and not d.empty else text

    _emit(args, doc, render)
    return Exit.OK


def _default_target(store: ss.Store, parser: argparse.ArgumentParser) -> str:
    refs = store.refs()
    if "main" in refs:
        return "main"
    if len(refs) == 1:
        return next(iter(refs))
    raise UsageError(f"give a target: the store has no ref 'main' and {len(refs)} other refs", parser)


def cmd_log(args: argparse.Namespace) -> int:
    if args.max_count is not None and args.max_count < 0:
        raise UsageError(f"-n/--max-count must be >= 0, got {args.max_count}", args.parser)
    store = _open(args.store)
    cid: str | None = store.resolve(args.target or _default_target(store, args.parser))
    commits: list[dict[str, Any]] = []
    missing = None
    while cid is not None and (args.max_count is None or len(commits) < args.max_count):
        try:
            c = store.commit(cid)
        except ObjectNotFound as e:
            if not commits:  # the target resolved (a ref names it) but the commit is gone: a broken store, as in show
                via = f" (named by {args.target!r})" if args.target and args.target != cid else ""
                raise ObjectNotFound(f"commit {cid}{via}: {e}") from None
            missing = cid
            break
        commits.append(
            {"id": cid, "step": c.step, "transition": c.transition, "learned_root": c.learned_root, "parent": c.parent}
        )
        if getattr(
            args, "oneline", False
        ):  # the journal's time and loss: advisory notes, never trusted (SPEC.md §19.2)
            note = _journal_note(store, cid)
            commits[-1].update(time=note.get("time"), loss=note.get("loss"))
        cid = c.parent
    _emit(
        args,
        {"commits": commits, "missing_parent": missing},
        render_log_oneline if getattr(args, "oneline", False) else render_log,
    )
    return Exit.OK


#: Journal times ``log --oneline`` shows: seconds since the epoch before the year 10000 (UTC).
_TIME_LIMIT = 253_402_300_800


def _journal_note(store: ss.Store, cid: str) -> dict[str, Any]:
    """A commit's journal note (``journal/<id>.json``), or {} if it has none or it does not parse (it is advisory)."""
    try:
        note = json.loads(bytes(store.storage.read(f"journal/{cid}.json", limit=1 << 20)))
    except (ShardstoreError, OSError, ValueError, RecursionError):  # RecursionError: nested past the parser
        return {}
    if not isinstance(note, dict):
        return {}
    return {  # numbers only, finite (NaN is no JSON for --json), a time gmtime can show (years 1970-9999)
        k: v
        for k, v in note.items()
        if k in ("time", "loss")
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
        and (k != "time" or 0 <= v < _TIME_LIMIT)
    }


def cmd_show(args: argparse.Namespace) -> int:
    from shardstore.format.grid import payload_blocks
    from shardstore.format.manifest import tensor_payloads
    from shardstore.ops.state_diff import extra_state_view, hyper_groups
    from shardstore.state.optim import hyper_of
    from shardstore.state.torch_optim import state_objects

    store = _open(args.store)
    lc = ss.load_commit(store, args.target)
    layout = []
    for lay in lc.commit.layout:
        shard = lc.shards[lay.slot]
        nbytes = elements = objects = 0
        for e in shard.entries:
            n = expected_nbytes(e.dtype, e.shape)
            elements += n // expected_nbytes(e.dtype, (1,))
            nbytes += n
            if e.optim is not None and e.optim.moment_dtype is not None and e.optim.exp_avg is not None:
                nbytes += 2 * expected_nbytes(e.optim.moment_dtype, e.shape)
            nbytes += sum(size for _, size, _ in state_objects(e))
            objects += sum(
                len(payload_blocks(p, d, e.shape)) for _, p, d in tensor_payloads(e)
            )  # blocks of chunked payloads
            objects += sum(1 for _ in state_objects(e))
        layout.append(
            {
                "slot": lay.slot,
                "shard": lay.shard,
                "tensors": len(shard.entries),
                "elements": elements,
                "bytes": nbytes,
                "objects": objects,
            }
        )
    totals = {k: sum(s[k] for s in layout) for k in ("tensors", "elements", "bytes", "objects")}
    dtypes: dict[str, int] = {}  # what the commit holds, beside the profile its writer named
    for e in lc.entries().values():
        dtypes[e.dtype] = dtypes.get(e.dtype, 0) + 1
    spec = lc.commit.optimizer
    optimizer = {
        "algorithm": spec.algorithm,
        "class": spec.torch_optimizer.class_name if spec.torch_optimizer else None,
        "groups": {g.name: vars(hyper_of(g)) for g in spec.groups} | hyper_groups(spec.torch_optimizer),
        "state_keys": sorted(
            {t.key for e in lc.entries().values() if e.state for t in (*e.state.tensors, *e.state.scalars)}
        ),
    }
    buffers = [
        {"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "slot": lc.owner()[e.name]}
        for e in sorted(lc.entries().values(), key=lambda e: e.name)
        if e.kind == "buffer"
    ]
    extras = [{"key": x.key, "slot": None, "state": extra_state_view(store, x)} for x in lc.commit.extras]
    extras += [
        {"key": x.key, "slot": s, "state": extra_state_view(store, x)}
        for s, sh in sorted(lc.shards.items())
        for x in sh.extras
    ]
    doc = {
        "id": lc.id,
        "refs": _refs_by_commit(store).get(lc.id, []),
        "commit": lc.commit,
        "optimizer": optimizer,
        "buffers": buffers,
        "extras": extras,
        "layout": layout,
        "totals": totals,
        "dtypes": dict(sorted(dtypes.items())),
    }
    _emit(args, jsonable(doc), render_show)
    return Exit.OK


def cmd_cat(args: argparse.Namespace) -> int:
    store = _open(args.store)
    oid = store.resolve(args.id)
    size = store.object_size(oid)
    if size is None:
        raise TargetNotFound(f"object {oid} is not in {store.url}")
    if size > MAX_MANIFEST_BYTES:  # a tensor: nothing cat decodes is this large; never read it whole
        raise ManifestError(
            f"object {oid} ({size} bytes) is over the {MAX_MANIFEST_BYTES}-byte manifest limit: not a manifest, a model config or JSON (a tensor?)"
        )
    try:
        data = store.get(oid, limit=MAX_MANIFEST_BYTES)
    except ObjectNotFound:
        raise TargetNotFound(f"object {oid} is not in {store.url}") from None
    kind: str
    try:
        value: Any = ss.decode(data, what=f"object {oid}")
        kind = type(value).__name__
    except ManifestError:
        try:
            value, kind = decode_config(data), "model config"
        except ManifestError:
            try:
                check_json_nesting(data, 64, f"object {oid}")
                value, kind = json.loads(bytes(data)), "json"
            except (ValueError, ManifestError):
                raise ManifestError(
                    f"object {oid} ({len(data)} bytes) is not a manifest, a model config or JSON (a tensor or RNG state?)"
                ) from None
    _emit(args, {"id": oid, "kind": kind, "value": jsonable(value)}, render_cat)
    return Exit.OK


def _readable(kind: str, names: Any, read: Any, broken: list[str]) -> dict[str, Any]:
    """name -> value for every name whose value reads; a line in ``broken`` for each that does not."""
    out: dict[str, Any] = {}
    for name in names:
        try:
            value = read(name)
        except ss.ShardstoreError as e:
            broken.append(f"{kind} {name!r}: {type(e).__name__}: {e}")
            continue
        if value is not None:
            out[name] = value
    return out


def cmd_refs(args: argparse.Namespace) -> int:
    store = _open(args.store)
    if getattr(args, "break_lock", None):
        return _break_lock(args, store)
    broken: list[str] = []
    refs: dict[str, str] = _readable("ref", store.ref_names(), store.ref, broken)
    pins: dict[str, list[str]] = {
        n: list(ids) for n, ids in _readable("pin", store.pin_names(), store.pinned, broken).items()
    }
    doc: dict[str, Any] = {"refs": refs, "pins": pins, "gc_markers": _gc_markers(store)}
    if broken:
        doc["broken"] = broken
    _emit(args, doc, render_refs)
    for line in broken:  # the others are listed above; the store is still damaged: exit 1
        note(f"shardstore refs: error: {line}")
    return Exit.ERROR if broken else Exit.OK


def _break_lock(args: argparse.Namespace, store: ss.Store) -> int:
    """``refs --break-lock NAME``: remove a lock file whose writer is gone (SPEC.md §Refs)."""
    from shardstore.format.names import check_ref_name

    name = check_ref_name(args.break_lock)
    brk = getattr(store.storage, "break_lock", None)
    if brk is None:
        raise UsageError(
            f"store {store.url} keeps no ref lock files (its refs move by conditional requests)", args.parser
        )
    holder = brk(f"refs/{name}")
    who = "no holder recorded" if holder is None else f"held by process {holder['pid']} on host {holder['host']!r}"
    _emit(
        args, {"ref": name, "lock_removed": True, "holder": holder}, lambda d: f"removed the lock of ref {name} ({who})"
    )
    return Exit.OK


_SIZE = re.compile(r"^(\d+)\s*([KMGT]i?B?|B)?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'5GB' -> 5*10**9, '512MiB' -> 512*2**20, '1000' -> 1000."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 512MiB, 1000000)")
    unit = (m.group(2) or "B").upper().rstrip("B") or "B"
    scale = {
        "B": 1,
        "K": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
        "KI": 2**10,
        "MI": 2**20,
        "GI": 2**30,
        "TI": 2**40,
    }[unit]
    value = int(m.group(1)) * scale
    if value < 1:
        raise argparse.ArgumentTypeError("size must be positive")
    return value


def parse_layout(text: str) -> list[tuple[int, int]]:
    """'0:2,2:4' -> [(0, 2), (2, 4)]: one half-open decoder-layer range per slot."""
    try:
        return [(int(a), int(b)) for a, b in (part.split(":") for part in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a layout: {text!r} (e.g. 0:2,2:4, one START:STOP layer range per slot)"
        ) from None


def cmd_export(args: argparse.Namespace) -> int:
    from shardstore.ops.interchange import export_commit

    store = _open(args.store)
    with _bar(args, "export") as bar:
        result = export_commit(
            store, args.target, args.out_dir, with_optimizer=args.with_optimizer,
            max_shard_bytes=args.max_shard_size, overwrite=args.force, weights_only=args.weights_only,
            progress=_progress(bar),
        )  # fmt: skip
    doc = jsonable(result)

    def render(d: dict[str, Any]) -> str:
        head = f"exported commit {d['commit']}: {d['tensors']} tensors, {d['bytes']} bytes of weights{' and moments' if args.with_optimizer else ''}"
        return "\n".join([head, *(f"  {os.path.join(d['out_dir'], f)}" for f in d["files"])])

    _emit(args, doc, render)
    return Exit.OK


def cmd_import(args: argparse.Namespace) -> int:
    from shardstore.ops.assets import commit_assets
    from shardstore.ops.interchange import import_directory

    if args.slots is not None and args.slots < 1:
        raise UsageError(f"--slots must be >= 1, got {args.slots}", args.parser)
    try:  # every argument is checked before the store is opened or anything is written
        check_ref_name(args.ref)
        check_info(ss.CommitInfo(step=args.step, job=args.job, transition="import"))
    except ss.ShardstoreError as e:
        raise UsageError(str(e), args.parser) from None
    store = _open(args.store, create=True)
    with _bar(args, "import") as bar:
        cid = import_directory(
            store, args.src_dir, ref=args.ref, slots=args.slots or 1, layout=args.layout, job=args.job,
            step=args.step, verify=not args.no_verify, progress=_progress(bar), dtype=args.dtype, assets=not args.no_assets,
        )  # fmt: skip
    lc = ss.load_commit(store, cid)
    entries = lc.entries().values()
    doc = {
        "commit": cid,
        "ref": args.ref,
        "slots": len(lc.commit.layout),
        "tensors": len(entries),
        "bytes": sum(expected_nbytes(e.dtype, e.shape) for e in entries),
        "source": args.src_dir,
        "assets": sorted(commit_assets(store, cid) or {}) if not args.no_assets else [],
    }
    _emit(args, doc, lambda d: d["commit"])
    _note(
        args,
        f"imported {doc['tensors']} tensors ({doc['bytes']} bytes) into {doc['slots']} slot(s); ref {args.ref} -> {cid}",
    )
    return Exit.OK
