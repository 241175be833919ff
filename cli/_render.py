"""Human-readable text for the ``shardstore`` command line.

Every command first builds one JSON-able document (what ``--json`` prints); the functions
here turn those same documents into text for people, so the two outputs never disagree.
They return strings; only ``shardstore_cli.shardstore_cli`` writes them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import time
from collections.abc import Sequence
from typing import Any

import msgspec

__all__ = [
    "jsonable",
    "human_bytes",
    "table",
    "render_verify",
    "render_diff",
    "render_log",
    "render_show",
    "render_refs",
    "render_cat",
    "render_copy",
    "render_gc",
    "render_unpin",
]


def jsonable(obj: Any, *, keep_nonfinite: bool = False) -> Any:
    """Plain JSON values from dataclasses, msgspec Structs, tuples and floats (non-finite as
    strings, unless `keep_nonfinite`: for rendering, where a number must stay a number)."""
    if isinstance(obj, msgspec.Struct):
        return jsonable(msgspec.to_builtins(obj), keep_nonfinite=keep_nonfinite)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name), keep_nonfinite=keep_nonfinite) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): jsonable(v, keep_nonfinite=keep_nonfinite) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v, keep_nonfinite=keep_nonfinite) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj) and not keep_nonfinite:
        return str(obj)
    return obj


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'; exact below 1 KiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, indent: str = "") -> str:
    """Left-aligned columns separated by two spaces (numbers right-aligned)."""
    cells = [[str(c) for c in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(isinstance(r[i], int) for r in rows) and bool(rows) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)]
        lines.append(indent + "  ".join(parts).rstrip())
    return "\n".join(lines)


def _num(x: Any) -> str:
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def render_verify(doc: dict[str, Any]) -> str:
    out = []
    for i, p in enumerate(doc["problems"], 1):
        refs = doc["refs_by_commit"].get(p["commit"] or "", [])
        out.append(f"problem {i}: {p['kind']}")
        out.append(f"  object: {p['object'] or '-'}")
        out.append(f"  tensor: {p['tensor'] or '-'}")
        out.append(f"  commit: {p['commit'] or '-'}" + (f" (ref {', '.join(refs)})" if refs else ""))
        out.append(f"  detail: {p['message']}")
    what = "re-hashed" if doc["deep"] else "checked (structure and sizes only)"
    scope = f", slot {doc['slot']} only" if doc["slot"] is not None else ""
    summary = (
        f"{len(doc['commits'])} commit(s), {doc['objects_checked']} object(s) {what}{scope}, "
        f"{human_bytes(doc['bytes_hashed'])} hashed"
    )
    n = len(doc["problems"])
    out += render_gc_markers(doc.get("gc_markers", []))
    out.append(f"ok: {summary}" if n == 0 else f"FAILED: {n} problem(s) in {summary}")
    return "\n".join(out)


def _entry_text(e: dict[str, Any] | None) -> str:
    if e is None:
        return "-"
    text = f"{e['dtype']}{list(e['shape'])}"
    if e["optim"] is not None:
        text += f" group {e['optim']['group']} age {e['optim']['age']}"
    return text


def _scalars(e: dict[str, Any]) -> dict[str, Any]:
    """A torch-form entry's scalar state, decoded for display."""
    st = e.get("state") or {}
    out = {}
    for x in st.get("scalars", []):
        v = x.get("value")
        out[x["key"]] = (
            struct.unpack(">d", bytes.fromhex(v[4:]))[0] if isinstance(v, str) and v.startswith("f64:") else v
        )
    return out


def _tensor_lines(t: dict[str, Any]) -> list[str]:
    b, a = t["before"], t["after"]
    if t["status"] == "added":
        return [f"  added    {t['name']}  {_entry_text(a)}  slot {t['slot_after']}"]
    if t["status"] == "removed":
        return [f"  removed  {t['name']}  {_entry_text(b)}  slot {t['slot_before']}"]
    details = []
    for key in ("dtype", "shape"):
        if key in t["changes"]:
            details.append(f"{key} {b[key]} -> {a[key]}")
    if "param" in t["changes"]:
        details.append("values")
    ob, oa = b["optim"] or {}, a["optim"] or {}
    for key in ("age", "birth", "group", "moment_dtype"):
        if key in t["changes"]:
            details.append(f"{'Adam age' if key == 'age' else key} {ob.get(key)} -> {oa.get(key)}")
    for key in ("exp_avg", "exp_avg_sq"):
        if key in t["changes"]:
            details.append(key)
    if "optimizer state" in t["changes"]:
        had = bool(ob) or b.get("state") is not None
        details.append("optimizer state " + ("removed" if had else "added"))
    if "kind" in t["changes"]:
        details.append(f"kind {b.get('kind', 'param')} -> {a.get('kind', 'param')}")
    sb, sa = _scalars(b), _scalars(a)
    for change in t["changes"]:
        if change.startswith("state "):
            key = change[len("state ") :]
            details.append(f"{change} {_num(sb[key])} -> {_num(sa[key])}" if key in sb and key in sa else change)
    lines = [f"  changed  {t['name']}  " + "; ".join(details)]
    for role, s in t["stats"].items():
        lines.append(f"           {role}: max |diff| {_num(s['max_abs_diff'])}, relative L2 change {_num(s['rel_l2'])}")
    return lines


def render_diff(doc: dict[str, Any]) -> str:
    out = [f"diff {doc['a']} {doc['b']}"]
    if doc["empty"]:
        out.append("no differences")
        return "\n".join(out)
    ra, rb = doc["learned_roots"]
    out.append(f"learned-state root: equal ({ra})" if ra == rb else f"learned-state root: differs ({ra} -> {rb})")
    c = doc["counts"]
    out.append(
        f"tensors: {c['changed']} changed, {c['added']} added, {c['removed']} removed, {c['unchanged']} unchanged"
    )
    for t in doc["tensors"]:
        out.extend(_tensor_lines(t))
    sa, sb = doc["slots"]
    if doc["layout_changed"]:
        out.append(f"layout: {sa} slot(s) -> {sb} slot(s), {len(doc['moved'])} tensor(s) moved")
        for m in doc["moved"]:
            out.append(f"  moved    {m['name']}  slot {m['slot_before']} -> {m['slot_after']}")
    else:
        out.append(f"layout: unchanged ({sa} slot(s))")
    for g in doc["groups"]:
        if g["before"] is None or g["after"] is None:
            out.append(f"optimizer group {g['name']}: {'added' if g['before'] is None else 'removed'}")
            continue
        changed = [
            f"{k} {_num(g['before'][k])} -> {_num(g['after'][k])}"
            for k in g["before"]
            if g["before"][k] != g["after"].get(k)
        ]
        out.append(f"optimizer group {g['name']}: " + "; ".join(changed))
    if doc["fields"]:
        out.append("fields:")
        for f in doc["fields"]:
            out.append(
                f"  {f['name']}: {_num(f['before']) if f['before'] is not None else '-'} -> {_num(f['after']) if f['after'] is not None else '-'}"
            )
    return "\n".join(out)


def render_log(doc: dict[str, Any]) -> str:
    rows = [[c["id"], c["step"], c["transition"], c["learned_root"]] for c in doc["commits"]]
    text = table(["commit", "step", "kind", "learned-state root"], rows)
    if doc["missing_parent"]:
        text += f"\n(parent {doc['missing_parent']} is not in the store; history ends here)"
    return text


def render_log_oneline(doc: dict[str, Any]) -> str:
    """``log --oneline``: short id, step, kind, and the journal's time (UTC) and loss where it has them."""
    lines = []
    for c in doc["commits"]:
        when = "-" if c.get("time") is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(c["time"]))
        loss = "" if c.get("loss") is None else f"  loss {c['loss']:.4f}"
        lines.append(f"{c['id'][:12]}  step {c['step']:>6}  {c['transition']:<11}  {when}{loss}")
    if doc["missing_parent"]:
        lines.append(f"(parent {doc['missing_parent'][:12]} is not in the store; history ends here)")
    return "\n".join(lines)


def render_show(doc: dict[str, Any]) -> str:
    c = doc["commit"]
    fields = [
        ("commit", doc["id"]),
        ("refs", ", ".join(doc["refs"]) or "-"),
        ("transition", c["transition"]),
        ("step", c["step"]),
        ("parent", c["parent"] or "-"),
        ("job", c["job"]),
        ("schedule", c["schedule"] or "-"),
        ("profile", c["profile"]),
        ("tensor dtypes", ", ".join(f"{d} ({n})" for d, n in doc.get("dtypes", {}).items()) or "-"),
        ("data cursor", "-" if c["data_cursor"] is None else c["data_cursor"]),
        ("model config", c["config"] or "-"),
        ("learned-state root", c["learned_root"]),
        ("format version", c["version"]),
        (
            "optimizer",
            doc["optimizer"]["algorithm"]
            + (f" ({doc['optimizer']['class']})" if doc["optimizer"].get("class") else ""),
        ),
    ]
    width = max(len(k) for k, _ in fields)
    out = [f"{k.ljust(width)}  {v}" for k, v in fields]
    for name, h in doc["optimizer"]["groups"].items():
        out.append(f"{''.ljust(width)}  group {name}: " + ", ".join(f"{k} {_num(v)}" for k, v in h.items()))
    if doc["optimizer"].get("state_keys"):
        out.append(f"{''.ljust(width)}  per-parameter state: {', '.join(doc['optimizer']['state_keys'])}")
    bufs = doc.get("buffers", [])
    out.append(
        f"{'buffers'.ljust(width)}  {len(bufs)}"
        + "".join(f"\n{''.ljust(width)}  {b['name']} {b['dtype']}{b['shape']} slot {b['slot']}" for b in bufs)
    )
    xs = doc.get("extras", [])
    out.append(f"{'extras'.ljust(width)}  {len(xs) or '-'}")
    for x in xs:
        where = "commit-wide" if x["slot"] is None else f"slot {x['slot']}"
        out.append(f"{''.ljust(width)}  {x['key']} ({where}): " + _extra_summary(x))
    rows = [
        [s["slot"], s["shard"][:16], s["tensors"], s["elements"], human_bytes(s["bytes"]), s["objects"]]
        for s in doc["layout"]
    ]
    t = doc["totals"]
    rows.append(["total", "", t["tensors"], t["elements"], human_bytes(t["bytes"]), t["objects"]])
    out.append("")
    out.append(table(["slot", "shard manifest", "tensors", "parameters", "bytes", "tensor objects"], rows))
    return "\n".join(out)


def _extra_summary(x: dict[str, Any]) -> str:
    """An extra's state on one line; a DCP document (SPEC.md §9.4) as what it holds, not in full."""
    from shardstore.format.dcp import DCP_EXTRA

    state = x["state"]
    if x["key"] == DCP_EXTRA and x["slot"] is None and isinstance(state.get("items"), dict):
        items = state["items"].values()
        tensors = [i for i in items if isinstance(i, dict) and i.get("kind") == "tensor"]
        chunks = sum(len(i.get("chunks", [])) for i in tensors)
        return f"DCP metadata: {len(tensors)} tensors in {chunks} chunks, {len(items) - len(tensors)} bytes items"
    return ", ".join(f"{k} {_num(v)}" for k, v in state.items())


def render_refs(doc: dict[str, Any]) -> str:
    lines = [f"{cid}  {name}" for name, cid in doc["refs"].items()]
    lines += [f"pin {name}: {len(ids)} objects kept by gc" for name, ids in doc.get("pins", {}).items()]
    lines += render_gc_markers(doc.get("gc_markers", []))
    return "\n".join(lines)


def marker_doc(m: Any) -> dict[str, Any]:
    """A gc marker (``gc_fence.MarkerInfo``) as ``refs``, ``verify`` and ``gc --break-marker`` report it."""
    return {
        "marker": m.key,
        "nonce": m.nonce,
        "holder": m.holder,
        "holder_state": m.state,
        "created": m.created,
        "age_seconds": None if m.age is None else round(m.age, 3),
        "idle_seconds": round(m.idle, 3),
        "stale": m.stale,
        "blocks_writers": m.blocks,
        "description": m.describe(),
    }


def render_gc_markers(markers: list[dict[str, Any]]) -> list[str]:
    """One line per gc marker present, and how to remove one that blocks although its gc is gone."""
    lines = [f"gc marker {m['description']}" for m in markers]
    blocking = [m for m in markers if m["blocks_writers"] and m["holder_state"] != "alive"]
    if blocking:
        lines.append(
            f"  ref moves wait while a gc marker blocks; if its gc is gone: "
            f"shardstore gc STORE --break-marker {blocking[0]['nonce']}"
        )
    return lines


def render_cat(doc: dict[str, Any]) -> str:
    """The decoded object alone, as indented JSON (``--json`` adds its id and kind)."""
    return json.dumps(doc["value"], indent=2)


def render_copy(doc: dict[str, Any]) -> str:
    which = "all slots" if doc["slot"] is None else f"slot {doc['slot']}"
    out = [
        f"commit {doc['commit']} ({which}) -> {doc['dst']}",
        f"  copied   {doc['objects_copied']} objects, {human_bytes(doc['bytes_copied'])}",
        f"  present  {doc['objects_skipped']} objects, {human_bytes(doc['bytes_skipped'])} (not sent)",
    ]
    if doc["ref"] is not None:
        out.append(f"  ref {doc['ref']} -> {doc['commit']}")
    out += [f"  pin {name}" for name in doc["pins"]]
    out += [f"  with dependency commit {dep}" for dep in doc.get("dependencies", ())]
    return "\n".join(out)


def render_gc(doc: dict[str, Any]) -> str:
    verb = "would delete" if doc["dry_run"] else "deleted"
    out = [f"{verb}  {d['object']}  {human_bytes(d['bytes'])}" for d in doc["deleted"]]
    out.append(
        f"{len(doc['reachable_commits'])} reachable commits, {doc['reachable_objects']} reachable objects "
        f"({doc['pinned_objects']} pinned)"
    )
    out.append(f"{verb} {len(doc['deleted'])} unreachable objects, {human_bytes(doc['bytes_freed'])}")
    young, named = len(doc["kept_young"]), len(doc["kept_named_by_young"])
    if young + named:
        out.append(
            f"kept {young + named} unreachable objects: {young} younger than {doc['grace_seconds']:g}s, "
            f"{named} named by a younger manifest (a save in progress?)"
        )
    if doc["tmp_deleted"]:
        out.append(f"{verb} {len(doc['tmp_deleted'])} stale tmp files")
    if doc.get("intents_dropped"):
        out.append(
            f"{'would drop' if doc['dry_run'] else 'dropped'} {len(doc['intents_dropped'])} intents of writers of this host "
            "that no longer run (their commits are no longer kept for them)"
        )
    return "\n".join(out)


def render_unpin(doc: dict[str, Any]) -> str:
    return f"unpinned {doc['unpinned']} ({doc['objects']} objects; gc may now collect them)"
