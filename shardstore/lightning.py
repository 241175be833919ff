"""Lightning's checkpoints in a store: ``ShardstoreCheckpointIO``, a ``CheckpointIO`` plugin.

``Trainer(plugins=[ShardstoreCheckpointIO(url)])`` sends every checkpoint Lightning writes
(``ModelCheckpoint``, ``trainer.save_checkpoint``, ``OnExceptionCheckpoint``) to a store, and
every checkpoint it reads (``fit(ckpt_path=...)``, ``validate``/``test``/``predict``) back from
it. Importing ``shardstore`` never imports Lightning; importing this module does. Strategies
that save through paths of their own never call a ``CheckpointIO`` plugin, and their checkpoints
do not reach the store: ``FSDPStrategy(state_dict_type="sharded")`` writes a directory through
``torch.distributed.checkpoint`` itself, DeepSpeed through its engine. For sharded FSDP state, use
``FSDPStrategy(state_dict_type="full")`` with this plugin, or ``shardstore.dcp.StoreWriter`` /
``StoreReader`` with ``torch.distributed.checkpoint`` in a loop of your own.

**What a save stores.** Lightning hands ``save_checkpoint`` one dict — weights, optimizer and
scheduler ``state_dict()``s, loops' progress, callbacks' state, epoch, global step,
hyperparameters. It becomes one commit through ``save_state_dict`` (SPEC.md §9.6): each tensor a
tensor entry named by its key path, everything else the commit's tree, read back as exactly
its type and value; nothing is pickled. Lightning's ``AttributeDict`` and ``argparse.Namespace``
inside the dict are stored as dicts and come back as themselves (their key paths are listed
under the tree's key ``shardstore.lightning.types``); any other value the tree cannot hold
exactly is refused by its key path (``UnsupportedState``) before anything is written.
``read_state_dict`` gives the dict back with fresh tensors on the CPU, as ``torch.load``
would: Lightning loads the checkpoint before it builds optimizers, and ``load_state_dict``
of each optimizer and scheduler takes it from there.

**Reading into the module.** ``ShardstoreCheckpointIO(url, module=model)`` lets a resume skip
a copy of the weights: Lightning does not hand a ``CheckpointIO`` the module, so it is given
here. While ``model`` is attached to a Trainer whose strategy loads through this plugin
(``fit``/``validate``/``test``/``predict`` with ``ckpt_path``), ``load_checkpoint`` reads each
stored weight the module holds by name (a plain contiguous tensor, on the device a fresh one would
land on) straight into the module's own tensor (``read_state_dict(..., into=...)``): every dtype
and shape is checked, and every object's size, before any byte lands; the checkpoint's
``"state_dict"`` then holds the module's tensors, and Lightning's ``load_state_dict`` copies each
onto itself, which torch skips. A weight the module lacks, or holds otherwise, is read fresh; if
any dtype or shape differs, all of them are (nothing was written), and Lightning's own load
decides as without ``module``. A module whose ``state_dict()`` hands out copies is read into the
copies, which Lightning's load then copies in. The weights land before the module's
``on_load_checkpoint`` hook sees the checkpoint: a hook that drops a weight from it leaves that
weight as stored, not as initialised. While the module is attached, every ``load_checkpoint`` of
this plugin reads into it, as a resume does (``load_from_checkpoint`` never does): to look at a
checkpoint mid-run, use another plugin or ``read_state_dict``. A corrupt object found part way leaves the module holding
part of the checkpoint, as ``shardstore.restore`` does: the resume is to be repeated.

**Names.** A checkpoint path names a ref: ``prefix`` (default ``lightning``) and the
checkpoint's file name (``.../epoch=0-step=8.ckpt`` → ``lightning/epoch_3d0-step_3d8.ckpt``;
with ``root=``, the path under ``root``, one segment per directory). Each name is encoded
reversibly into a ref segment (``encode_segment``): letters, digits, ``.`` and ``-`` stay
(``.`` or ``-`` first is escaped), ``_`` is ``__``, every other character is ``_`` and two
lowercase hex digits per UTF-8 byte (``=`` → ``_3d``), and a segment ending ``.lock`` has
that dot escaped; a name whose segment exceeds 64 characters is refused (``InvalidName``).
``ref_for`` and ``path_for`` map both ways. Each commit is saved without a parent, so
deleting its ref lets ``shardstore gc`` reclaim what only it held.

**The file at the path.** Lightning's own file logic — ``ckpt_path="last"`` (it lists the
checkpoint directory), version suffixes, ``save_last="link"``, "is this checkpoint in my
directory" — needs a file at each checkpoint path. A save writes a *marker* there: one line
of JSON naming the commit, its ref and the store (``{"commit":…,"ref":…,"store":…,
"type":"shardstore-lightning-checkpoint","version":1}``, at most 4 KiB). Loading a path with a
marker loads the commit it names (as a file holds its own bytes, whatever was saved under
the same name since); a path with no file loads the ref its name maps to; anything else is a
target in the store (a ref name, a commit id or prefix, ``main~1``). ``remove_checkpoint``
deletes the marker, then the ref, if the ref still names the marker's commit.

**Loading a module.** ``LightningModule.load_from_checkpoint`` reads a path with
``torch.load``; ``ShardstoreCheckpointIO.load_from_checkpoint(cls, path, **kwargs)`` does the
same work from the store (Lightning's own hyperparameter and ``strict`` handling).
"""

from __future__ import annotations

import argparse
import os
import posixpath
import re
import tempfile
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Literal

import lightning.fabric.utilities.data as fabric_data
import lightning.pytorch as pl
import lightning.pytorch.utilities.parsing as pl_parsing
import msgspec
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem

from .checkpoint.state_dict import StoredStateDict, open_state_dict, save_state_dict
from .dcp.handle import StoreHandle
from .errors import (
    InvalidName,
    ManifestError,
    RefConflict,
    RefNotFound,
    StateMismatch,
    StorageError,
    TargetNotFound,
    TensorMismatch,
    UnsupportedState,
)
from .format.names import MAX_REF_DEPTH, check_oid, check_ref_name
from .state.documents import MAX_DEPTH, TensorRef, fill_tree
from .store import Store

__all__ = ["ShardstoreCheckpointIO", "encode_segment", "decode_segment", "TYPES_KEY", "MARKER_BYTES"]

TYPES_KEY = "shardstore.lightning.types"
"""The tree key under which a save lists the values it stored as dicts that come back as their own type."""
MARKER_BYTES = 4096
"""A marker file is at most this long; a longer file at a checkpoint path is not one."""
_SEGMENT_BYTES = 64  # a ref segment's length limit (SPEC.md §6)
_LITERAL = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.-")
_TOKEN = re.compile(r"__|_[0-9a-f]{2}|[A-Za-z0-9.-]")
# Types stored as a dict and rebuilt on load, by the tag the types list names them with.
_TYPES: dict[str, type] = {
    "attribute_dict": fabric_data.AttributeDict,
    "pytorch_attribute_dict": pl_parsing.AttributeDict,
    "namespace": argparse.Namespace,
}
_TAGS = {t: tag for tag, t in _TYPES.items()}


class _Marker(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The file at a checkpoint path: the commit saved there, its ref, and the store (for people)."""

    type: Literal["shardstore-lightning-checkpoint"]
    version: Literal[1]
    commit: str
    ref: str
    store: str


_MARKER = msgspec.json.Decoder(_Marker)


def encode_segment(name: str) -> str:
    """The ref segment naming checkpoint name ``name`` (one path component); ``decode_segment`` inverts it.

    Letters, digits, ``.`` and ``-`` stand for themselves (but ``.`` or ``-`` first is escaped),
    ``_`` is written ``__``, any other character as ``_`` and two lowercase hex digits per byte
    of its UTF-8, and a trailing ``.lock`` as ``_2elock``. ``InvalidName`` if ``name`` is empty,
    ``.`` or ``..``, or its segment is longer than 64 characters (SPEC.md §6).
    """
    if not isinstance(name, str) or name in ("", ".", ".."):
        raise InvalidName(f"checkpoint name {name!r} cannot name a ref: it must be a non-empty file name")
    out: list[str] = []
    for i, ch in enumerate(name):
        if ch == "_":
            out.append("__")
        elif ch in _LITERAL and not (i == 0 and ch in ".-"):
            out.append(ch)
        else:
            try:
                out.extend(f"_{b:02x}" for b in ch.encode("utf-8"))
            except UnicodeEncodeError:
                raise InvalidName(f"checkpoint name {name!r} is not valid Unicode text") from None
    segment = "".join(out)
    if segment.endswith(".lock"):
        segment = segment[: -len(".lock")] + "_2elock"
    if len(segment) > _SEGMENT_BYTES:
        raise InvalidName(
            f"checkpoint name {name!r} encodes to the ref segment {segment!r}, {len(segment)} characters; a ref "
            f"segment holds at most {_SEGMENT_BYTES} (SPEC.md §6): choose a shorter ModelCheckpoint(filename=...)"
        )
    return segment


def decode_segment(segment: str) -> str:
    """The checkpoint name ``encode_segment`` wrote as ``segment``; ``InvalidName`` for any other text."""
    if not isinstance(segment, str):
        raise InvalidName(f"ref segment {segment!r} is not a string")
    raw, pos = bytearray(), 0
    while pos < len(segment):
        m = _TOKEN.match(segment, pos)
        if m is None:
            raise InvalidName(f"ref segment {segment!r} is not a checkpoint name's encoding (at character {pos})")
        token = m.group()
        raw += b"_" if token == "__" else bytes([int(token[1:], 16)]) if token[0] == "_" else token.encode()
        pos = m.end()
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidName(f"ref segment {segment!r} does not decode to UTF-8 text") from None
    if encode_segment(name) != segment:
        raise InvalidName(f"ref segment {segment!r} is not the canonical encoding of {name!r}")
    return name


def _text(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"a checkpoint path is a str or os.PathLike, not a {type(path).__name__}")
    return os.fspath(path)


def _is_url(text: str) -> bool:
    return "://" in text and not text.startswith("file://")


def _absolute(text: str) -> str:
    """``text`` normalised: a URL's path collapsed, a local path absolute with its directory's links resolved."""
    if _is_url(text):
        protocol, _, rest = text.partition("://")
        return f"{protocol}://{posixpath.normpath(rest)}"
    text = os.path.abspath(text.removeprefix("file://"))
    return os.path.join(os.path.realpath(os.path.dirname(text)), os.path.basename(text))


class ShardstoreCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` whose checkpoints are commits of a store (module docstring).

    ``store_or_url``: an open ``Store`` or a store URL (opened, and created if absent, on first
    use, in whichever process uses it: the plugin crosses to spawned processes as its URL).
    ``prefix``: the ref segments every checkpoint's ref starts with (one prefix per run or
    checkpoint directory, as a directory per run). ``root``: when given, a checkpoint's ref names
    its path under ``root`` (one segment per directory, ``filename="{epoch}/model"`` templates);
    by default only its file name. ``job``: the job id of the commits. ``threads``: writer
    threads (hashing and writing a save). ``read_threads``: objects in flight when loading
    (reads wait on the disk, so more than the cores: 8 was the deepest queue worth having,
    benchmarks/RESULTS.md "Design measurements"). ``module``: the ``LightningModule`` the Trainer
    fits; while it is attached to a Trainer loading through this plugin, a resume reads the
    stored weights straight into its own tensors (module docstring, "Reading into the module").
    """

    def __init__(
        self,
        store_or_url: Store | str | os.PathLike[str],
        *,
        prefix: str = "lightning",
        root: str | os.PathLike[str] | None = None,
        job: str = "lightning",
        storage_options: Mapping[str, Any] | None = None,
        threads: int = 4,
        read_threads: int = 8,
        module: torch.nn.Module | None = None,
    ) -> None:
        super().__init__()
        if module is not None and not isinstance(module, pl.LightningModule):
            raise TypeError(f"module is the LightningModule the Trainer fits, not a {type(module).__name__}")
        self.module = module
        check_ref_name(prefix)
        self.prefix = prefix
        self._room = MAX_REF_DEPTH - len(prefix.split("/"))
        if self._room < 1:
            raise InvalidName(f"prefix {prefix!r} leaves no ref segment for the checkpoint's name (at most 3 segments)")
        self.root = None if root is None else _absolute(_text(root)).rstrip("/")
        self.job = job
        self.threads = threads
        self.read_threads = read_threads
        self._handle = StoreHandle(store_or_url, storage_options)

    @property
    def store(self) -> Store:
        """The store (opened, and created if absent, on first use in this process)."""
        return self._handle.open(create=True)

    def __repr__(self) -> str:
        return f"ShardstoreCheckpointIO({self._handle.url!r}, prefix={self.prefix!r})"

    # -- names -----------------------------------------------------------------------------------

    def ref_for(self, path: str | os.PathLike[str]) -> str:
        """The ref checkpoint ``path`` is saved under (``InvalidName`` if its name cannot be one)."""
        text = _text(path)
        name = text.rsplit("/", 1)[-1] if _is_url(text) else os.path.basename(text)
        if name in ("", ".", ".."):  # a directory's path, not a checkpoint's: refused, never normalised away
            raise InvalidName(f"checkpoint path {text!r} does not end in a file name")
        if self.root is None:
            parts = [name]
        else:
            full = _absolute(text).rstrip("/")
            if not full.startswith(self.root + "/"):
                raise InvalidName(f"checkpoint path {text!r} is not under root {self.root!r}")
            parts = full[len(self.root) + 1 :].split("/")
        if len(parts) > self._room:
            raise InvalidName(
                f"checkpoint path {text!r} has {len(parts)} components under root {self.root!r}; a ref under prefix "
                f"{self.prefix!r} holds at most {self._room} (SPEC.md §6)"
            )
        return "/".join([self.prefix, *(encode_segment(p) for p in parts)])

    def path_for(self, ref: str) -> str:
        """The checkpoint path (with ``root``) or name (without) that ``ref_for`` maps to ``ref``."""
        check_ref_name(ref)
        head = self.prefix + "/"
        if not ref.startswith(head):
            raise InvalidName(f"ref {ref!r} is not under this plugin's prefix {self.prefix!r}")
        parts = [decode_segment(s) for s in ref[len(head) :].split("/")]
        if self.root is None:
            if len(parts) != 1:
                raise InvalidName(f"ref {ref!r} names a path under a root; this plugin maps file names only")
            return parts[0]
        return "/".join([self.root, *parts])

    # -- CheckpointIO ----------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Commit Lightning's checkpoint dict under ``ref_for(path)`` and write the marker at ``path``."""
        if storage_options is not None:
            raise TypeError(
                "Trainer.save_checkpoint(..., storage_options=...) does not apply to ShardstoreCheckpointIO: "
                "pass storage_options= to its constructor"
            )
        text = _text(path)
        ref = self.ref_for(text)  # before anything is written
        step = checkpoint.get("global_step")
        commit = save_state_dict(
            self.store,
            _to_tree(checkpoint),
            step=step if type(step) is int and step >= 0 else 0,
            ref=ref,
            job=self.job,
            parent=None,  # each checkpoint stands alone: deleting its ref frees it (SPEC.md §19.1)
            threads=self.threads,
        )
        marker = _Marker(
            type="shardstore-lightning-checkpoint", version=1, commit=commit, ref=ref, store=self.store.url
        )
        self._write_marker(text, marker)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's checkpoint dict from the commit ``path`` names (``resolve``), tensors fresh on the
        CPU or on ``map_location`` (a device or its name); with ``module=`` and that module attached to
        the Trainer loading through this plugin, its weights are the module's own tensors, read into
        (module docstring). Nothing is unpickled, so ``weights_only`` changes nothing."""
        return self._load(path, map_location, into_module=True)

    def _load(self, path: Any, map_location: Any, *, into_module: bool) -> dict[str, Any]:
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise TypeError(f"map_location is a torch.device or its name, not a {type(map_location).__name__}")
        commit = self.resolve(path)
        opened = open_state_dict(self.store, commit)  # manifests and tree read once, for the choice and the read
        into = self._into(opened, map_location) if into_module else None
        if into is not None:
            # the types list is checked before any byte lands in the module (a copy of the tree: nothing read)
            _from_tree(fill_tree(opened.tree, TensorRef), commit)
            try:
                return _from_tree(opened.read(threads=self.read_threads, into=into), commit)
            except (TensorMismatch, StateMismatch):
                pass  # refused before any byte landed in the module: read it fresh, as without ``module``
        return _from_tree(opened.read(map_location=map_location, threads=self.read_threads), commit)

    def _into(self, opened: StoredStateDict, map_location: Any) -> dict[str, Any] | None:
        """``{"state_dict": {name: the module's own tensor}}`` for each weight of the opened commit
        the module holds by that name, as a plain contiguous tensor on the device a fresh one would
        land on; None if there is none, or the module is not
        attached to a Trainer whose strategy loads through this plugin (a module being fitted)."""
        module = self.module
        if module is None:
            return None
        trainer = module._trainer  # LightningModule.trainer raises when detached; None is the answer here
        strategy = getattr(trainer, "strategy", None)
        # _checkpoint_io: the property would install a TorchCheckpointIO where none is set
        if strategy is None or strategy.lightning_module is not module or strategy._checkpoint_io is not self:
            return None
        device = torch.device("cpu" if map_location is None else map_location)
        stored = opened.tree.get("state_dict") if type(opened.tree) in (dict, OrderedDict) else None
        if type(stored) not in (dict, OrderedDict):
            return None  # not a resume's checkpoint (ddp_spawn hands back a bare state dict)
        live: dict[str, torch.Tensor] = {}
        for name, t in module.state_dict().items():
            s = stored.get(name)
            if (
                isinstance(s, TensorRef)
                and type(t) is torch.Tensor
                and t.device == device
                and t.is_contiguous()
                and t.numel() > 0
            ):  # its dtype and shape are checked by the read (TensorMismatch: read fresh instead)
                live[name] = t
        return {"state_dict": live} if live else None

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the marker at ``path``, then its ref if that still names the marker's commit (a
        link ``save_last="link"`` made is only unlinked); the commit is left to ``shardstore gc``."""
        text = _text(path)
        if not _is_url(text) and os.path.islink(text.removeprefix("file://")):
            os.remove(text.removeprefix("file://"))
            return
        marker = self._read_marker(text)
        if marker is not None:
            try:
                get_filesystem(text).rm(text)
            except OSError as e:
                raise StorageError(f"checkpoint {text}: the marker file could not be removed ({e})") from e
            ref, commit = marker.ref, marker.commit
        else:
            try:
                ref = self.ref_for(text)
            except InvalidName:
                return  # no marker, and a name no checkpoint of this plugin has
            commit = self.store.ref(ref)
        if commit is not None and self.store.ref(ref) == commit:
            try:
                self.store.delete_ref(ref, expected=commit)
            except (RefNotFound, RefConflict):
                pass  # moved meanwhile: the ref now holds another save of that name, which stays

    # -- resolving and loading -------------------------------------------------------------------

    def resolve(self, path: Any) -> str:
        """The commit id a checkpoint path, checkpoint name, ref name or commit id (or prefix) names.

        A marker file at ``path`` names its commit (a warning if that commit's ref has moved on:
        no ref then keeps it from gc); with no file at ``path``, its name's ref (``ref_for``);
        else ``path`` as a target in the store. ``TargetNotFound`` if none names a commit.
        """
        text = _text(path)
        marker = self._read_marker(text)
        store = self.store
        if marker is not None:
            if not store.has(marker.commit):
                raise TargetNotFound(
                    f"checkpoint {text} names commit {marker.commit} (ref {marker.ref}), which is not in {store.url}"
                )
            if store.ref(marker.ref) != marker.commit:
                warnings.warn(
                    f"checkpoint {text} names commit {marker.commit}, but its ref {marker.ref} has moved to "
                    f"{store.ref(marker.ref)}: no ref keeps the commit from shardstore gc",
                    stacklevel=2,
                )
            return marker.commit
        try:
            ref: str | None = self.ref_for(text)
        except InvalidName:
            ref = None
        commit = store.ref(ref) if ref is not None else None
        if commit is not None:
            return commit
        try:
            return store.resolve(text)
        except (TargetNotFound, InvalidName):
            raise TargetNotFound(
                f"{text!r} names no checkpoint: no marker file is there, "
                + (f"no ref {ref} is in {store.url}" if ref is not None else "it is not a checkpoint name")
                + ", and it is not a ref name or commit id of the store"
            ) from None

    def load_from_checkpoint(
        self,
        cls: type[pl.LightningModule] | type[pl.LightningDataModule],
        path: Any,
        *,
        map_location: str | torch.device | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """``cls.load_from_checkpoint(path, map_location=..., strict=..., **kwargs)`` for a checkpoint in the store.

        ``path`` is anything ``resolve`` takes. The module is built and filled by Lightning's own
        code (hyperparameters from the checkpoint, overridden by ``kwargs``; its ``strict`` rule;
        ``on_load_checkpoint``); only the ``torch.load`` is replaced, by ``read_state_dict``.
        """
        # Lightning's load_from_checkpoint past its torch.load (lightning/pytorch/core/saving.py,
        # _load_from_checkpoint): these two functions are its own steps, pinned with lightning 2.6.6.
        from lightning.pytorch.core.saving import _load_state
        from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint

        # another module than ``module``: never read into that one
        loaded = self._load(path, map_location, into_module=False)
        checkpoint = _pl_migrate_checkpoint(loaded, checkpoint_path=None)
        checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
        checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
        if issubclass(cls, pl.LightningDataModule):
            return _load_state(cls, checkpoint, **kwargs)
        model = _load_state(cls, checkpoint, strict=strict, **kwargs)
        first = next((t for t in checkpoint["state_dict"].values() if isinstance(t, torch.Tensor)), None)
        return model if first is None else model.to(first.device)

    # -- marker files ----------------------------------------------------------------------------

    def _read_marker(self, text: str) -> _Marker | None:
        """The marker at ``text``; None if nothing is there (or ``text`` is no path fsspec knows)."""
        try:
            fs = get_filesystem(text)
        except (ValueError, ImportError):
            return None
        try:
            if not fs.exists(text):
                return None
            if not fs.isfile(text):
                raise ManifestError(f"checkpoint {text} is a directory, not a shardstore checkpoint marker")
            with fs.open(text, "rb") as f:
                raw = f.read(MARKER_BYTES + 1)
        except OSError as e:
            raise StorageError(f"checkpoint {text}: the marker file could not be read ({e})") from e
        if len(raw) > MARKER_BYTES:
            raise ManifestError(
                f"checkpoint {text} is not a shardstore checkpoint marker (over {MARKER_BYTES} bytes: a file "
                "another CheckpointIO wrote?)"
            )
        try:
            marker = _MARKER.decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError) as e:
            raise ManifestError(f"checkpoint {text} is not a shardstore checkpoint marker ({e})") from None
        check_oid(marker.commit, what=f"commit id in checkpoint marker {text}")
        check_ref_name(marker.ref)
        return marker

    def _write_marker(self, text: str, marker: _Marker) -> None:
        data = msgspec.json.encode(marker, order="sorted") + b"\n"
        try:
            if _is_url(text):
                fs = get_filesystem(text)
                fs.makedirs(posixpath.dirname(text), exist_ok=True)
                fs.pipe_file(text, data)
                return
            local = text.removeprefix("file://")
            directory = os.path.dirname(os.path.abspath(local))
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".shardstore-marker-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, local)
            except BaseException:
                if os.path.exists(tmp):
                    os.remove(tmp)
                raise
        except OSError as e:
            raise StorageError(
                f"checkpoint {text}: commit {marker.commit} is saved under ref {marker.ref}, but its marker file "
                f"could not be written ({e})"
            ) from e


# -- AttributeDict and Namespace: stored as dicts, rebuilt on load --------------------------------------


def _to_tree(checkpoint: Mapping[Any, Any]) -> Any:
    """The checkpoint with each AttributeDict / Namespace as a dict, and their key paths under ``TYPES_KEY``."""
    if TYPES_KEY in checkpoint:
        raise UnsupportedState(f"state dict at $.{TYPES_KEY}: a key ShardstoreCheckpointIO keeps for itself")
    marks: list[list[Any]] = []
    tree = _plain(checkpoint, (), marks, 0)
    if marks and type(tree) in (dict, OrderedDict):
        tree[TYPES_KEY] = marks
    return tree


def _plain(v: Any, path: tuple[Any, ...], marks: list[list[Any]], depth: int) -> Any:
    if depth > MAX_DEPTH:
        return v  # save_state_dict refuses it, by its key path
    tag = _TAGS.get(type(v))
    if tag is not None:
        if all(type(k) in (str, int) for k in path):  # else the key is refused by save_state_dict
            marks.append([tag, list(path)])
        v = dict(vars(v)) if isinstance(v, argparse.Namespace) else dict(v)
    if type(v) is dict or type(v) is OrderedDict:
        items = [(k, _plain(x, (*path, k), marks, depth + 1)) for k, x in v.items()]
        return dict(items) if type(v) is dict else OrderedDict(items)
    if type(v) is list or type(v) is tuple:
        return type(v)(_plain(x, (*path, i), marks, depth + 1) for i, x in enumerate(v))
    return v


def _from_tree(state: dict[str, Any], commit: str) -> dict[str, Any]:
    """The checkpoint as saved: the values ``TYPES_KEY`` lists rebuilt as their types, the key removed."""
    marks = state.pop(TYPES_KEY, None)
    if marks is None:
        return state
    what = f"commit {commit}: the state dict's {TYPES_KEY}"
    if type(marks) is not list:
        raise ManifestError(f"{what} is not a list")
    trie: dict[Any, Any] = {}
    for mark in marks:
        if (
            type(mark) is not list
            or len(mark) != 2
            or mark[0] not in _TYPES
            or type(mark[1]) is not list
            or not mark[1]
            or any(type(k) not in (str, int) for k in mark[1])
        ):
            raise ManifestError(f"{what} holds {mark!r}, not [type, key path]")
        node = trie
        for k in mark[1]:
            node = node.setdefault(k, {})
        node[None] = mark[0]
    return _retype(state, trie, what, "$")


def _retype(v: Any, trie: dict[Any, Any], what: str, at: str) -> Any:
    for k, sub in trie.items():
        if k is None:
            continue
        if type(v) in (dict, OrderedDict) and k in v:
            v[k] = _retype(v[k], sub, what, f"{at}.{k}")
        elif type(v) in (list, tuple) and type(k) is int and 0 <= k < len(v):
            items = list(v)
            items[k] = _retype(items[k], sub, what, f"{at}[{k}]")
            v = type(v)(items)
        else:
            raise ManifestError(f"{what} names {at}[{k!r}], which the state dict does not hold")
    tag = trie.get(None)
    if tag is None:
        return v
    if type(v) is not dict or (tag == "namespace" and not all(type(k) is str for k in v)):
        raise ManifestError(f"{what} names {at} as a {tag}, but the state dict holds a {type(v).__name__} there")
    return argparse.Namespace(**v) if tag == "namespace" else _TYPES[tag](v)
