"""No untrusted deserialisation (issue 8, part 7).

Static: no module of ``shardstore/``, ``shardtrain/`` or ``cli/`` calls ``pickle.load(s)``,
``eval``, ``exec``, ``yaml.load``, ``np.load(..., allow_pickle=True)``, ``torch.load``,
``marshal.load(s)`` or ``shelve.open`` (an AST scan, so comments and strings do not count).

Live: a pickle whose ``__reduce__`` would create a marker file is planted in every
byte-carrying slot — a tensor object (as the stored bytes of a real commit), each RNG
kind, the model config object, a shard manifest, a commit manifest, a ref and the store
config — and every reader is run on it: the marker never appears; loads either refuse
with a typed error or return the bytes as data.
"""

from __future__ import annotations

import ast
import os
import pickle
from typing import Any

import torch

import shardstore as ss
from shardstore.format.manifest import encode
from shardstore.format.rng import restore_rng

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = {
    ("pickle", "load"),
    ("pickle", "loads"),
    ("marshal", "load"),
    ("marshal", "loads"),
    ("yaml", "load"),
    ("torch", "load"),
    ("shelve", "open"),
    ("dill", "load"),
    ("dill", "loads"),
}


def _weights_only_dcp_bytes(path: str, f: ast.Attribute, node: ast.Call) -> bool:
    """The one exception, and only in that form: torchtitan's manager (shardstore/torchtitan.py)
    loads DCP's bytes items — non-tensor values DCP itself pickled at save, which DCP's default
    planner would unpickle in full — with ``torch.load(..., weights_only=True)``, torch's
    restricted unpickler, so a pickle naming any class or function is refused (tested in
    tests/test_adapter_torchtitan.py). Any other ``torch.load`` anywhere, or this one without
    ``weights_only=True``, fails the scan."""
    return (
        os.path.relpath(path, ROOT) == os.path.join("shardstore", "torchtitan.py")
        and (f.value.id, f.attr) == ("torch", "load")
        and any(
            k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
            for k in node.keywords
        )
    )


def _calls(path: str) -> list[str]:
    bad = []
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("eval", "exec", "__import__"):
            bad.append(f"{path}:{node.lineno} {f.id}(")
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in FORBIDDEN:
            if not _weights_only_dcp_bytes(path, f, node):
                bad.append(f"{path}:{node.lineno} {f.value.id}.{f.attr}(")
        if (
            isinstance(f, ast.Attribute)
            and f.attr == "load"
            and any(
                k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                for k in node.keywords
            )
        ):
            bad.append(f"{path}:{node.lineno} load(allow_pickle=...)")
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            )
            if any(n in ("pickle", "cPickle", "dill", "marshal", "shelve") for n in names):
                bad.append(f"{path}:{node.lineno} imports a pickle-family module")
    return bad


def test_no_untrusted_deserialisation_in_the_code() -> None:
    files = [
        os.path.join(d, f)
        for pkg in ("shardstore", "shardtrain", "cli")
        for d, _, fs in os.walk(os.path.join(ROOT, pkg))
        for f in fs
        if f.endswith(".py")
    ]
    assert len(files) > 20
    bad = [b for f in files for b in _calls(f)]
    assert bad == [], bad


class Boom:
    marker = ""

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


def _payload(marker: str) -> bytes:
    b = Boom()
    b.marker = marker
    return pickle.dumps(b, protocol=2)


def test_planted_pickles_are_never_executed(tmp_path: Any) -> None:
    marker = str(tmp_path / "PWNED")
    evil = _payload(marker)
    root = str(tmp_path / "s")
    store = ss.open_store(root)
    # a tensor object holding the pickle's bytes, in a real commit: it loads as data
    t = torch.frombuffer(bytearray(evil), dtype=torch.uint8)
    cid = ss.save(store, {"w": t}, step=0, rng=False)
    out = {"w": torch.zeros(len(evil), dtype=torch.uint8)}
    ss.restore(store, cid, out)
    assert bytes(out["w"].numpy()) == evil
    outcomes = []

    def attempt(fn: Any) -> None:
        try:
            fn()
            outcomes.append("data")
        except ss.ShardstoreError as e:
            outcomes.append(type(e).__name__)

    oid = store.put(evil)
    # every RNG kind, directly and through a restore of a commit naming it
    for kind in ("python", "numpy", "torch"):
        attempt(lambda: restore_rng({kind: evil}))
    lc = ss.load_commit(store, cid)
    shard = lc.shards[0]
    forged = type(shard)(
        **{
            **{f: getattr(shard, f) for f in shard.__struct_fields__},
            "rng": (ss.manifest.RngEntry(kind="python", object=oid),),
        }
    )
    sid = store.put(encode(forged))
    commit = lc.commit
    forged_commit = type(commit)(
        **{
            **{f: getattr(commit, f) for f in commit.__struct_fields__},
            "layout": (ss.manifest.SlotLayout(slot=0, shard=sid, tensors=commit.layout[0].tensors),),
            "config": None,
        }
    )
    attempt(lambda: ss.restore(store, store.put(encode(forged_commit)), out, rng=True))
    # the config object, manifests, a ref, the store config
    attempt(lambda: ss.manifest.decode_config(evil))
    attempt(lambda: store.shard(oid))
    attempt(lambda: store.commit(oid))
    attempt(lambda: ss.load_commit(store, oid))
    assert not ss.verify(store, [oid]).ok
    with open(os.path.join(root, "refs", "evil"), "wb") as f:
        f.write(evil)
    attempt(lambda: store.ref("evil"))
    assert any("evil" in str(p) for p in ss.verify(store).problems)
    with open(os.path.join(root, "config"), "wb") as f:
        f.write(evil)
    attempt(lambda: ss.open_store(root, create=False))
    assert not os.path.exists(marker), "a planted pickle was executed"
    assert len(outcomes) == 10 and "data" not in outcomes, outcomes
