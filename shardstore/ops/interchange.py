"""Export commits to, and import them from, Hugging Face style safetensors directories.

``export_commit`` writes a commit's weights as ``model.safetensors`` (or
``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json`` above
``max_shard_bytes``), its model config as ``config.json`` and the tokenizer asset set its
import carried (``shardstore.ops.assets``: on the commit or its nearest ancestor); buffers are tensors of the
model files, as in Hugging Face checkpoints. ``with_optimizer`` adds the Adam moments as
``optimizer.exp_avg*.safetensors`` / ``optimizer.exp_avg_sq*.safetensors`` (any other torch
optimizer's state tensors as ``optimizer.state.<key>*.safetensors``), the extras' tensors
as ``extras.safetensors``, and the cursors, hyperparameters, optimizer class, state
scalars and extras' states as ``optimizer.json``. Files are written by hand from the manifests and the verified object bytes,
one tensor at a time, through exclusive temporaries read back before they replace anything
(``safetensors_files``).

``import_directory`` is the reverse: it reads ``config.json`` and one or more safetensors
files (with or without an index), streams each tensor through ``safe_open``, stores it,
re-reads the object to verify it, and commits weights only (no optimizer state) with
transition ``import`` (pinning the directory's tokenizer files with it), optionally split over slots by contiguous decoder-layer ranges
(slot 0 also owns every tensor outside ``model.layers.N``: embedding, final norm, head).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from safetensors import SafetensorError

from ..checkpoint.info import CommitInfo, check_info, check_parent
from ..checkpoint.slots import AUTO, write_commit
from ..errors import InvalidName, LayoutError, ManifestError, StateMismatch, StorageError, TensorMismatch
from ..format.bounded import check_json_nesting, read_regular_file
from ..format.dcp import TensorItem, dcp_extra, decode_document, document_problems, tiling_problem, whole_payload
from ..format.grid import payload_blocks, put_payloads
from ..format.manifest import (
    MAX_MANIFEST_BYTES,
    Payload,
    ShardManifest,
    TensorEntry,
    decode_config,
    encode_config,
    shard_version,
)
from ..format.names import check_ref_name, check_tensor_name
from ..format.tensors import check_shape, expected_nbytes
from ..state.module import tensor_profile
from ..state.optim import hyper_of
from ..state.torch_optim import decode_value
from ..store import Store
from ..verification.commits import load_commit
from .assets import ASSET_FILES, commit_assets, put_assets, read_asset_files
from .safetensors_files import FROM_ST as _FROM_ST
from .safetensors_files import Item as _Item
from .safetensors_files import duplicate_keys as _duplicate_keys
from .safetensors_files import open_safetensors as _open
from .safetensors_files import write_file as _write_file
from .safetensors_files import write_safetensors as _write_safetensors
from .state_diff import extra_state_view, hyper_groups

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "ExportResult",
    "Progress",
    "export_commit",
    "import_directory",
    "read_config",
    "source_dtypes",
    "split_layers",
]

#: Hugging Face's default shard size ("5GB").
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
#: Largest config.json / index / header a reader will parse, and its deepest nesting.
_MAX_JSON_BYTES = 64 * 1024 * 1024
_MAX_JSON_DEPTH = 64

#: Called after each tensor with (tensor name, bytes of that tensor, total bytes of the operation).
Progress = Callable[[str, int, int], None]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPORTED = re.compile(
    r"^(model|optimizer\.exp_avg|optimizer\.exp_avg_sq|optimizer\.state\.[A-Za-z0-9_][A-Za-z0-9_.-]*|extras)(-\d{5}-of-\d{5})?"
    r"\.safetensors(\.index\.json)?$|^(config|optimizer)\.json$|^(" + "|".join(map(re.escape, ASSET_FILES)) + ")$"
)
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}\.safetensors$")


@dataclass(frozen=True)
class ExportResult:
    """What ``export_commit`` wrote: file names relative to ``out_dir``."""

    commit: str
    out_dir: str
    files: tuple[str, ...]
    tensors: int
    bytes: int
    sharded: bool


def _natural(name: str) -> list[Any]:
    """Sort key putting model.layers.2 before model.layers.10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _plan(prefix: str, items: list[_Item], max_shard_bytes: int) -> dict[str, list[_Item]]:
    """File name -> tensors, HF style: one file, or numbered shards filled greedily in name order."""
    shards: list[list[_Item]] = [[]]
    size = 0
    for it in sorted(items, key=lambda it: _natural(it.name)):
        if shards[-1] and size + it.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes
    if len(shards) == 1:
        return {f"{prefix}.safetensors": shards[0]}
    n = len(shards)
    return {f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors": s for i, s in enumerate(shards)}


def export_commit(
    store: Store,
    target: str,
    out_dir: str,
    *,
    with_optimizer: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    weights_only: bool = False,
    progress: Progress | None = None,
) -> ExportResult:
    """Write commit ``target`` as a Hugging Face style directory (see the module docstring).

    Refuses (StorageError) to replace existing files unless ``overwrite``, which removes them
    all before writing the first (a failed export leaves no earlier export's files beside its own). A commit without a
    model config is refused (StateMismatch) before anything is written: without ``config.json``
    the directory is not one transformers can load; ``weights_only`` writes its safetensors
    files (and, with ``with_optimizer``, the optimizer's) all the same. A DCP commit's tensors are
    written whole under their keys (``_dcp_items``), or the export is refused before anything is.
    """
    if max_shard_bytes < 1:
        raise ValueError("max_shard_bytes must be positive")
    lc = load_commit(store, target)
    if lc.commit.config is None and not weights_only:
        raise StateMismatch(
            f"commit {lc.id} holds no model config, so its export would lack config.json and transformers could not "
            "load the directory; save with config= (a Hugging Face config.to_dict()), or export with weights_only=True "
            "(--weights-only) to write the safetensors files alone"
        )
    entries = sorted(lc.entries().values(), key=lambda e: e.name)
    sets = {"model": _dcp_items(store, lc) if dcp_extra(lc.commit.extras) else _entry_items(entries)}
    if with_optimizer:
        for role in ("exp_avg", "exp_avg_sq") if lc.commit.optimizer.algorithm != "torch" else ():
            sets[f"optimizer.{role}"] = [
                _Item(e.name, e.optim.moment_dtype, tuple(e.shape), getattr(e.optim, role))
                for e in entries
                if e.optim is not None and e.optim.moment_dtype is not None and getattr(e.optim, role) is not None
            ]
        sets.update(_state_sets(lc, entries))
    for prefix, items in sets.items():  # every set's, a DCP commit's keys too, before anything is created
        if any(it.name == "__metadata__" for it in items):
            raise StateMismatch(
                f"tensor '__metadata__' of commit {lc.id} cannot be exported to {prefix}.safetensors: safetensors "
                "reserves the key for its header (SPEC.md §19.2); nothing was written"
            )
    files: dict[str, list[_Item]] = {}
    docs: dict[str, bytes] = {}
    for prefix, items in sets.items():
        plan = _plan(prefix, items, max_shard_bytes)
        files.update(plan)
        if len(plan) > 1:
            weight_map = {it.name: fname for fname, its in plan.items() for it in its}
            index = {
                "metadata": {"total_size": sum(it.nbytes for it in items)},
                "weight_map": dict(sorted(weight_map.items())),
            }
            docs[f"{prefix}.safetensors.index.json"] = json.dumps(index, indent=2).encode() + b"\n"
    if lc.commit.config is not None:
        config = decode_config(
            store.get(lc.commit.config, limit=MAX_MANIFEST_BYTES), what=f"model config object {lc.commit.config}"
        )
        docs["config.json"] = json.dumps(config, indent=2, sort_keys=True).encode() + b"\n"
    docs.update(commit_assets(store, lc.id) or {})  # the tokenizer files its import carried (shardstore.ops.assets)
    if with_optimizer:
        docs["optimizer.json"] = _optimizer_doc(lc.commit.step, lc.commit.optimizer, entries, _extras_doc(store, lc))
    os.makedirs(out_dir, exist_ok=True)
    names = [*files, *docs]
    # Files of an earlier export that this one would not replace (e.g. more shards) would
    # make the directory ambiguous: they count as a clash, and go with ``overwrite``.
    stale = [n for n in os.listdir(out_dir) if _EXPORTED.fullmatch(n) and n not in names]
    clash = [n for n in names if os.path.lexists(os.path.join(out_dir, n))] + stale
    if clash and not overwrite:
        raise StorageError(f"{out_dir} already holds {sorted(clash)[:3]}; refusing to overwrite")
    # Every file this export replaces goes before the first is written: an export that fails
    # part way then leaves no config.json (written last) beside new weights, never a
    # directory that mixes this commit's files with an earlier export's and looks complete.
    for n in clash:
        try:
            os.unlink(os.path.join(out_dir, n))
        except OSError as e:
            raise StorageError(f"{out_dir}: cannot remove {n} to overwrite it: {e.strerror or e}") from None
    total = sum(it.nbytes for its in files.values() for it in its)

    def tick(it: _Item) -> None:
        if progress is not None:
            progress(it.name, it.nbytes, total)

    for fname, items in files.items():
        _write_safetensors(store, os.path.join(out_dir, fname), items, tick)
    # config.json last: it is what makes the directory loadable, so it is there only once every
    # other file is (an export that fails, or is stopped, before it leaves none).
    for fname, raw in sorted(docs.items(), key=lambda d: d[0] == "config.json"):
        _write_file(os.path.join(out_dir, fname), raw)
    return ExportResult(lc.id, out_dir, tuple(names), len(sets["model"]), total, len(files) > len(sets))


def _entry_items(entries: list[TensorEntry]) -> list[_Item]:
    return [_Item(e.name, e.dtype, tuple(e.shape), e.param) for e in entries]


def _dcp_items(store: Store, lc: Any) -> list[_Item]:
    """A DCP commit's tensors (SPEC.md §9.4), each whole under its key: its chunks' blocks moved
    to their offsets, once the document holds to its commit and every tensor's chunks tile it
    exactly (checked for all before anything is created; StateMismatch naming the tensor)."""
    x = dcp_extra(lc.commit.extras)
    what = f"DCP document {x.state} of commit {lc.id}"
    doc = decode_document(store.get(x.state, limit=MAX_MANIFEST_BYTES), what)
    entries = lc.entries()
    problems = document_problems(doc, entries, x.tensors)
    if problems:
        raise ManifestError(f"{what}: {problems[0]} (SPEC.md §9.4)")
    items = sorted((fqn, item) for fqn, item in doc.items.items() if isinstance(item, TensorItem))
    for fqn, item in items:
        problem = tiling_problem(item)  # a key named __metadata__ is refused with every other set's (export_commit)
        if problem is not None:
            raise StateMismatch(
                f"DCP tensor {fqn!r} of commit {lc.id} cannot be exported whole: {problem} (SPEC.md §19.2); "
                "nothing was written"
            )
    return [_Item(fqn, item.dtype, tuple(item.size), whole_payload(item, entries)) for fqn, item in items]


def _state_sets(lc: Any, entries: list[TensorEntry]) -> dict[str, list[_Item]]:
    """The torch form's state tensors (``optimizer.state.<key>``) and the extras' tensors (``extras``: ``<extra>.<i>``, a slot's own ``slot<s>/<extra>.<i>``)."""
    out: dict[str, list[_Item]] = {}
    for e in entries:
        for t in e.state.tensors if e.state is not None else ():
            out.setdefault(f"optimizer.state.{t.key}", []).append(_Item(e.name, t.dtype, tuple(t.shape), t.object))
    extras = [
        _Item(f"{name}.{t.key}", t.dtype, tuple(t.shape), t.object) for name, x in _named_extras(lc) for t in x.tensors
    ]
    return out | ({"extras": extras} if extras else {})


def _named_extras(lc: Any) -> list[tuple[str, Any]]:
    """Every extra by its export name: a commit-wide one by its key, slot s's own as ``slot<s>/<key>``
    (``/`` is never in a key, so the two kinds cannot share a name; ``slot0.x`` is a valid key)."""
    return [
        *((x.key, x) for x in lc.commit.extras),
        *((f"slot{s}/{x.key}", x) for s, sh in sorted(lc.shards.items()) for x in sh.extras),
    ]


def _extras_doc(store: Store, lc: Any) -> dict[str, Any]:
    return {name: extra_state_view(store, x) for name, x in _named_extras(lc)}


def _optimizer_doc(step: int, optimizer: Any, entries: list[TensorEntry], extras: dict[str, Any]) -> bytes:
    doc = {
        "algorithm": optimizer.algorithm,
        "step": step,
        "groups": {g.name: vars(hyper_of(g)) for g in optimizer.groups} | hyper_groups(optimizer.torch_optimizer),
        "tensors": {
            e.name: {"group": e.optim.group, "birth": e.optim.birth, "age": e.optim.age}
            for e in entries
            if e.optim is not None
        },
    }
    if optimizer.torch_optimizer is not None:
        doc["class"] = optimizer.torch_optimizer.class_name
        doc["tensors"] = {
            e.name: {"group": e.state.group, "scalars": {x.key: decode_value(x.value) for x in e.state.scalars}}
            for e in entries
            if e.state is not None
        }
    if extras:
        doc["extras"] = (
            extras  # each tensor is named "tensor <dtype>[shape] <id>" here and "<extra>.<i>" in extras.safetensors
        )
    return json.dumps(doc, indent=2).encode() + b"\n"


# -- import ------------------------------------------------------------------------------


def _read_json(path: str) -> Any:
    """A user's JSON file, bounded: a regular file (never a device or FIFO) of at most
    ``_MAX_JSON_BYTES``, nested at most ``_MAX_JSON_DEPTH`` deep, checked before parsing."""
    raw = read_regular_file(path, _MAX_JSON_BYTES)
    check_json_nesting(raw, _MAX_JSON_DEPTH, path)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ManifestError(f"{path}: not readable JSON ({e})") from None


def _source_files(src_dir: str) -> tuple[list[str], dict[str, str] | None]:
    """The weight files of a HF directory and its index's weight map (None without an index).

    Without an index: ``model*.safetensors``, else every ``*.safetensors`` but ``optimizer.*``.
    """
    index_path = os.path.join(src_dir, "model.safetensors.index.json")
    weight_map: dict[str, str] | None = None
    if os.path.exists(index_path):
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ManifestError(f"{index_path}: no weight_map of tensor name -> file name")
        names = sorted(set(weight_map.values()))
    else:
        listing = sorted(os.listdir(src_dir))
        names = [n for n in listing if n.startswith("model") and n.endswith(".safetensors")]
        names = names or [n for n in listing if n.endswith(".safetensors") and not n.startswith("optimizer.")]
    for n in names:
        if _FILE_NAME.fullmatch(n) is None:
            raise InvalidName(f"weight file name {n!r} in {src_dir} is not a plain *.safetensors file name")
    if not names:
        raise ManifestError(f"{src_dir} holds no *.safetensors weight files")
    return names, weight_map


def _scan(src_dir: str) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """Tensor name -> (file, dtype, shape) from the files' headers (no data read)."""
    files, weight_map = _source_files(src_dir)
    out: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    for fname in files:
        path = os.path.join(src_dir, fname)
        with _open(path) as f:
            dups = _duplicate_keys(path)
            if dups:
                raise ManifestError(
                    f"{path}: its header holds {dups[0]!r} more than once; safetensors would read only the last"
                )
            for name in f.keys():
                check_tensor_name(name)
                sl = f.get_slice(name)
                st = sl.get_dtype()
                if st not in _FROM_ST:
                    raise TensorMismatch(
                        f"tensor {name!r} in {fname}: dtype {st} is not supported (SPEC.md §Tensor objects)"
                    )
                if name in out:
                    raise ManifestError(f"tensor {name!r} is in both {out[name][0]} and {fname}")
                shape = check_shape(
                    sl.get_shape(), f"tensor {name!r} in {fname}"
                )  # one no manifest could hold: refused
                out[name] = (fname, _FROM_ST[st], shape)
    if weight_map is not None:
        wrong = sorted(n for n in set(out) | set(weight_map) if weight_map.get(n) != out.get(n, ("",))[0])
        if wrong:
            raise ManifestError(
                f"{src_dir}: the index and the files disagree about {len(wrong)} tensors, e.g. {wrong[:3]}"
            )
    return out


def source_dtypes(src_dir: str) -> list[str]:
    """The dtypes of a Hugging Face directory's weights, from the files' headers (no data read)."""
    return sorted({d for _, d, _ in _scan(src_dir).values()})


def read_config(src_dir: str) -> dict[str, Any]:
    """A Hugging Face directory's config.json, bounded and checked to be a JSON object."""
    config = _read_json(os.path.join(src_dir, "config.json"))
    if not isinstance(config, dict):
        raise ManifestError(f"{src_dir}/config.json is not a JSON object")
    return config


def split_layers(num_layers: int, slots: int) -> list[tuple[int, int]]:
    """Contiguous half-open layer ranges, as even as possible; earlier slots take the remainder."""
    if not 1 <= slots <= max(num_layers, 1):
        raise LayoutError(f"cannot split {num_layers} decoder layers into {slots} non-empty slots")
    q, r = divmod(num_layers, slots)
    out, start = [], 0
    for s in range(slots):
        n = q + (1 if s < r else 0)
        out.append((start, start + n))
        start += n
    return out


def _check_layout(layout: Sequence[tuple[int, int]], num_layers: int) -> None:
    expect = 0
    for s, (a, b) in enumerate(layout):
        if a != expect or b < a or (b == a and s != 0):
            raise LayoutError(
                f"layout {list(layout)}: slot {s}'s range [{a}, {b}) must start at {expect} and be non-empty (slot 0 may be empty)"
            )
        expect = b
    if expect != num_layers:
        raise LayoutError(f"layout {list(layout)} covers layers [0, {expect}) but the model has {num_layers}")


def _owners(names: list[str], layout: Sequence[tuple[int, int]]) -> dict[str, int]:
    out = {}
    for n in names:
        m = _LAYER.match(n)
        i = int(m.group(1)) if m else None
        out[n] = 0 if i is None else next((s for s, (a, b) in enumerate(layout) if a <= i < b), -1)
        if out[n] < 0:
            raise LayoutError(f"tensor {n!r}: layer {i} is outside the layout {list(layout)}")
    return out


#: Source dtypes ``import_directory(dtype="float32")`` widens, exactly (every value of each is a float32 value).
_WIDENS_TO_F32 = ("bfloat16", "float16", "float32")


def _import_tensor(
    store: Store, path: str, name: str, dtype: str, shape: tuple[int, ...], verify: bool, to: str | None = None
) -> Payload:
    """Store one tensor of a safetensors file as its canonical blocks; return its payload.

    ``to`` (``"float32"``): a bfloat16/float16 tensor is widened to float32 on the way, one
    tensor at a time (the stored dtype is then ``to``).

    The file is opened for this tensor alone: safetensors maps the whole file, and pages
    touched through a mapping that stays open stay resident, which would make peak memory
    grow to the model size instead of the largest tensor.
    """
    with _open(path) as f:
        try:
            t = f.get_tensor(name)
        except SafetensorError as e:
            raise ManifestError(f"tensor {name!r} in {path}: unreadable ({e})") from None
        if tuple(t.shape) != shape or str(t.dtype).removeprefix("torch.") != dtype:
            raise TensorMismatch(
                f"tensor {name!r} in {path}: read {t.dtype}{list(t.shape)}, header says {dtype}{list(shape)}"
            )
        if to is not None and t.is_floating_point() and dtype != to:
            t = t.float()  # exact: _stored_dtype admitted only dtypes float32 holds every value of
            dtype = to
        payload = put_payloads(store, [t])[0]
        del t
    if verify:
        for oid, _box, nbytes in payload_blocks(payload, dtype, shape):
            data = store.get(
                oid, limit=nbytes
            )  # re-hash what the store now holds (an object already there may be anything)
            if len(data) != nbytes:
                raise TensorMismatch(f"tensor {name!r}: object {oid} holds {len(data)} bytes")
            del data
    return payload


def import_directory(
    store: Store,
    src_dir: str,
    *,
    ref: str | None = "main",
    slots: int = 1,
    layout: Sequence[tuple[int, int]] | None = None,
    job: str = "default",
    step: int = 0,
    parent: str | None = AUTO,
    verify: bool = True,
    progress: Progress | None = None,
    dtype: str | None = None,
    assets: bool = True,
) -> str:
    """Commit a Hugging Face style directory's weights (transition ``import``); return the commit id.

    ``layout``: one (start, stop) decoder-layer range per slot; otherwise ``slots`` even
    ranges. ``parent`` defaults to the commit ``ref`` points at; ``ref`` (None: none) is
    moved by compare-and-swap. ``verify`` re-reads and re-hashes each stored object.
    ``dtype="float32"`` widens bfloat16/float16 weights to float32, exactly, one tensor at
    a time (other floating dtypes are refused; the journal records the source dtypes).
    ``assets``: the directory's tokenizer files (``shardstore.ops.assets.ASSET_FILES``) are
    kept and pinned as ``assets/<commit id>``, before the ref moves.
    """
    if dtype not in (None, "float32"):
        raise ValueError(f"dtype must be None or 'float32', got {dtype!r}")
    if ref is not None:
        check_ref_name(ref)
    check_info(CommitInfo(step=step, job=job, transition="import"))  # arguments first, before any write
    config = read_config(src_dir)
    encode_config(config)  # refuse an unrepresentable config before writing anything
    tensors = _scan(src_dir)
    if dtype is not None:
        wide = sorted(
            {d for _, d, _ in tensors.values() if d.startswith(("float", "bfloat")) and d not in _WIDENS_TO_F32}
        )
        if wide:
            raise TensorMismatch(f"{src_dir}: {wide} tensors cannot be converted to {dtype} exactly")
    files = read_asset_files(src_dir) if assets else {}
    names = sorted(tensors)
    if layout is None and slots == 1:
        owner = dict.fromkeys(names, 0)
        nslots = 1
    else:
        num_layers = config.get("num_hidden_layers")
        if not isinstance(num_layers, int) or isinstance(num_layers, bool):
            raise ManifestError(f"{src_dir}/config.json has no integer num_hidden_layers to split layers by")
        layout = list(layout) if layout is not None else split_layers(num_layers, slots)
        _check_layout(layout, num_layers)
        owner = _owners(names, layout)
        nslots = len(layout)
    current = store.ref(ref) if ref is not None else None
    parent = current if parent is AUTO else parent
    check_parent(store, parent)
    # no trainer names a profile for an import: it is the floating dtypes the files hold (``tensor_profile``)
    info = CommitInfo(
        step=step,
        job=job,
        profile=tensor_profile(d for _, d, _ in tensors.values()),
        config=config,
        transition="import",
    )
    total = sum(expected_nbytes(d, s) for _, d, s in tensors.values())
    started = time.time()
    entries: list[list[TensorEntry]] = [[] for _ in range(nslots)]
    sources = sorted({d for _, d, _ in tensors.values()})
    for name in names:
        fname, src, shape = tensors[name]
        oid = _import_tensor(store, os.path.join(src_dir, fname), name, src, shape, verify, dtype)
        stored = dtype if dtype is not None and src in _WIDENS_TO_F32 else src
        entries[owner[name]].append(TensorEntry(name=name, dtype=stored, shape=shape, param=oid, optim=None))
        if progress is not None:
            progress(name, expected_nbytes(src, shape), total)
    config_id = store.put(encode_config(config))
    store.sync()  # objects are durable before any manifest names them
    shard_ids = [
        store.put_manifest(
            ShardManifest(
                version=shard_version(entries[s]),
                job=job,
                step=step,
                parent=parent,
                config=config_id,
                slot=s,
                slots=nslots,
                algorithm="none",
                groups=(),
                entries=tuple(entries[s]),
                rng=(),
            )
        )  # fmt: skip
        for s in range(nslots)
    ]
    store.sync()
    cid = write_commit(store, shard_ids, info=info, parent=parent)
    if files:
        put_assets(store, cid, files)
    if ref is not None:
        store.set_ref(ref, cid, expected=current)
    record = {
        "time": started,
        "seconds": time.time() - started,
        "host": socket.gethostname(),
        "source": os.path.abspath(src_dir),
        "source_dtypes": sources,
        "converted_to": dtype,
        "assets": sorted(files),
    }
    store.write_journal(cid, record)
    return cid
