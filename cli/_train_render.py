"""Human-readable text for the ``shardtrain`` command line.

Each function turns a command's JSON-able document (what ``--json`` prints, through
``shardstore_cli._output.emit``) into text for people, so the two outputs never disagree.
They return strings; only the command line writes them.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "render_prepare",
    "render_train",
    "render_report",
    "render_select",
    "render_transition",
    "render_plan",
    "render_demo",
    "render_restore",
]


def render_prepare(doc: dict[str, Any]) -> str:
    text = f"{doc['job']}\njob {doc['id']}\nschedule {doc['schedule']}\nsteps {doc['steps']}"
    if "profile" in doc:  # what the job computes in, and what it starts from (``describe``)
        label = doc["profile"] + ("+recompute" if doc.get("recompute") else "")
        text += f"\nprofile {label}\nseed {doc.get('seed') or '(fresh init)'}"
    if doc.get("seed_store"):
        text += f"\nseed store {doc['seed_store']}"
    return text


def render_train(doc: list[dict[str, Any]]) -> str:
    """The commits the run made (slot 0's record; every worker's is the same)."""
    return "\n".join(f"step {c['step']}: {c['id']}" for c in doc[0]["commits"])


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def render_restore(worker: dict[str, Any]) -> str:
    """Where one worker's restore read its start commit's objects from, in words."""
    got = worker["restore"]
    return (
        f"worker {worker['rank']}: restored its slot of {worker['start_commit'][:12]} reading "
        f"{_size(got['memory'])} from its memory tier, {_size(got['peers'])} from peers and "
        f"{_size(got['store'])} from the store"
    )


def render_report(doc: dict[str, Any]) -> str:
    """An evaluation report: per-commit losses and generation, comparisons, a few generated cases."""
    names = [s["name"] for s in doc["commits"][0]["losses"]]
    lines = ["commit        step  " + "  ".join(f"{n + ' loss':>12}" for n in names) + "  generated correct"]
    for c in doc["commits"]:
        losses = "  ".join(f"{s['loss']:>12.4f}" for s in c["losses"])
        correct = sum(case["correct"] for case in c["cases"])
        lines.append(
            f"{c['commit'][:12]}  {c['step']:>4}  {losses}  {correct:>3}/{len(c['cases'])}"
            f"  ({c['tokens_per_second']:.0f} tok/s)"
        )
    for cmp in doc["comparisons"]:
        lines.append(
            f"{cmp['set']}: {cmp['commit'][:12]} - {cmp['baseline'][:12]} = {cmp['diff']:+.4f} nats/token, "
            f"one-sided 95% bounds [{cmp['lower']:+.4f}, {cmp['upper']:+.4f}] (paired bootstrap)"
        )
    for case in doc["commits"][-1]["cases"][:4]:
        mark = "ok" if case["correct"] else "wrong"
        lines.append(f"  {case['prompt']!r} -> {case['generated']!r} (expected {case['expected']!r}: {mark})")
    return "\n".join(lines)


def render_select(doc: dict[str, Any]) -> str:
    return (
        f"selection {doc['selection']}: job {doc['job']} -> commit {doc['commit']} (pinned as selections/{doc['job']})"
    )


def render_transition(kind: str, doc: dict[str, Any]) -> str:
    """A repartition or grow commit: its parent, layout, learned-state root and new objects."""
    ranges = ",".join(f"{a}:{b}" for a, b in doc["partition"])
    return "\n".join(
        [
            f"{kind} commit {doc['commit']}",
            f"parent {doc['parent']} (step {doc['step']})",
            f"layout {len(doc['partition'])} workers, layers {ranges}",
            f"learned-state root {doc['learned_root']}"
            + (" (equal to the parent's)" if doc["learned_root"] == doc["parent_learned_root"] else ""),
            f"{doc['new_objects']} new objects",
        ]
    )


def render_plan(doc: dict[str, Any]) -> str:
    tiers = any(r.get("tier") for r in doc["slots"])
    lines = ["slot  layers   parameters      estimate      capacity  utilisation" + ("   host tiers" if tiers else "")]
    for r in doc["slots"]:
        lines.append(
            f"{r['slot']:>4}  {r['layers'][0]:>2}:{r['layers'][1]:<3}  {r['parameters']:>11,}  "
            f"{r['estimate'] / 2**20:>9.1f} MiB  {r['capacity'] / 2**20:>9.0f} MiB  {r['utilisation']:>10.1%}"
            + (f"  {r['tier'] / 2**20:>7.1f} MiB" if tiers else "")
        )
    ranges = ",".join(f"{a}:{b}" for a, b in doc["partition"])
    lines.append(f"--partition {ranges}  (highest utilisation {doc['max_utilisation']:.1%})")
    if tiers:
        lines.append(
            "host tiers: host memory the memory tiers hold at most for the slot and the replicas it keeps "
            "(checked at admission; on the CPU it adds to the estimate)"
        )
    return "\n".join(lines)


def render_demo(doc: dict[str, Any]) -> str:
    """The demo's closing lines: the development report, the time of each phase, the store."""
    lines = [] if doc["report"] is None else [render_report(doc["report"])]
    times = ", ".join(f"{k} {v:.1f} s" for k, v in doc["timings"].items())
    lines.append(f"demo finished in {doc['seconds']:.1f} s ({times})")
    lines.append(f"store: {doc['store']} (check it: shardstore verify {doc['store']})")
    return "\n".join(lines)
