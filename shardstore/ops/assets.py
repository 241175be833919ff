"""Tokenizer asset sets carried with a commit: the files a model needs besides its tensors.

A Hugging Face directory holds, beside ``config.json`` and its safetensors files, the
files its tokenizer is built from (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``, a chat template in ``chat_template.jinja``, ...). ``import``
keeps them, ``export`` gives them back, so a model goes in and comes out whole.

Each file is an object (named by the BLAKE3 of its bytes, SPEC.md §4). An *asset index*
object, the canonical encoding of ``{"type": "assets", "version": 1, "files": [{"name",
"object", "size"}, ...]}`` sorted by name, lists them, and the pin ``assets/<commit id>``
holds the index and every file (SPEC.md §14.1), so gc keeps them and ``copy --pin``
moves them. The pin binds a set to an immutable commit without changing the commit's id:
a commit a run trains from an import carries its import's set through its parent chain
(`commit_assets` walks it, as far as the store holds it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ..errors import ManifestError, ObjectNotFound, ObjectTooLarge, StateMismatch
from ..format.bounded import read_regular_file
from ..format.names import check_oid
from ..format.tensors import hash_bytes
from ..store import Store

__all__ = ["ASSET_FILES", "AssetFile", "AssetIndex", "read_asset_files", "put_assets", "commit_assets", "assets_pin"]

#: The files of a Hugging Face tokenizer (and chat template) that travel with the weights.
ASSET_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
_MAX_ASSET_BYTES = 64 << 20  # real tokenizer.json files reach ~20 MB
_MAX_INDEX_BYTES = 64 << 10
_MAX_CHAIN = 100_000  # parents walked looking for a set


class AssetFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: Literal[ASSET_FILES]  # type: ignore[valid-type]
    object: Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]
    size: Annotated[int, Meta(ge=0, le=_MAX_ASSET_BYTES)]


class AssetIndex(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag="assets", tag_field="type"):
    version: int
    files: tuple[AssetFile, ...]


_ENC = msgspec.json.Encoder(order="sorted")
_DEC = msgspec.json.Decoder(AssetIndex)


def assets_pin(commit: str) -> str:
    return f"assets/{check_oid(commit, what='commit id')}"


def read_asset_files(src_dir: str) -> dict[str, bytes]:
    """The asset files present in `src_dir` (regular files, each bounded), by name."""
    out = {}
    for name in ASSET_FILES:
        path = os.path.join(src_dir, name)
        if os.path.lexists(path):
            out[name] = read_regular_file(path, _MAX_ASSET_BYTES)
    return out


def put_assets(store: Store, commit: str, files: Mapping[str, bytes]) -> str:
    """Store `files` and their index, durable, and pin them as ``assets/<commit>``; return the index id."""
    unknown = sorted(set(files) - set(ASSET_FILES))
    if unknown:
        raise ManifestError(f"not tokenizer asset file names: {unknown} (known: {list(ASSET_FILES)})")
    held = store.pinned(assets_pin(commit))
    if held is not None:  # one set a commit: a second index would make its readers pick one of two
        have = {e.name: e.object for e in _index_of(store, commit, held).files}
        want = {n: hash_bytes(bytes(files[n])) for n in files}
        if have != want:
            differ = sorted(n for n in set(have) | set(want) if have.get(n) != want.get(n))
            raise StateMismatch(
                f"commit {commit} already carries a tokenizer asset set (pin {assets_pin(commit)}) that differs "
                f"in {differ}: a set is bound to the commit id, which tokenizer files do not change; import "
                "with another --step or --job for a commit of its own (the commit is unchanged, no ref moved)"
            )
    entries = tuple(AssetFile(name=n, object=store.put(bytes(files[n])), size=len(files[n])) for n in sorted(files))
    index = store.put(_ENC.encode(AssetIndex(version=1, files=entries)))
    store.sync()  # durable before the pin names them
    store.add_to_pin(assets_pin(commit), [index, *(e.object for e in entries)])
    return index


def _index_of(store: Store, commit: str, ids: tuple[str, ...]) -> AssetIndex:
    found: list[tuple[str, AssetIndex]] = []
    for oid in ids:
        try:
            index = _DEC.decode(bytes(store.get(oid, limit=_MAX_INDEX_BYTES)))
        except (ObjectTooLarge, msgspec.DecodeError, UnicodeDecodeError):
            continue  # an asset file, not the index
        if index.version != 1:
            raise ManifestError(f"asset index {oid} of commit {commit}: version {index.version} is not supported")
        if not {e.object for e in index.files} <= set(ids):
            raise ManifestError(f"pin {assets_pin(commit)}: its index {oid} names files the pin does not keep")
        found.append((oid, index))
    if len(found) > 1:  # two sets (a union of two pins): which one is the commit's is unknown
        raise ManifestError(
            f"pin {assets_pin(commit)} holds {len(found)} asset indexes ({', '.join(o for o, _ in found)}), "
            "not one: the commit's tokenizer set is ambiguous; unpin it and import again"
        )
    if found:
        return found[0][1]
    raise ManifestError(f"pin {assets_pin(commit)} holds no asset index")


def commit_assets(store: Store, commit: str) -> dict[str, bytes] | None:
    """The asset set of `commit` or of its nearest ancestor that has one (None: no set), verified.

    An ancestor absent from `store` ends the walk with no set: a copy brings a commit without
    its history (the parent is a pointer, SPEC.md §19.1), and such a commit is valid."""
    cid: str | None = commit
    for _ in range(_MAX_CHAIN):
        if cid is None:
            return None
        ids = store.pinned(assets_pin(cid))
        if ids is not None:
            index = _index_of(store, cid, ids)
            out = {}
            for e in index.files:
                try:
                    data = bytes(store.get(e.object, limit=_MAX_ASSET_BYTES))  # re-hashed on read
                except ObjectNotFound:
                    raise ObjectNotFound(f"asset {e.name} (object {e.object}) of commit {cid} is missing") from None
                if len(data) != e.size:
                    raise ManifestError(
                        f"asset {e.name} (object {e.object}): {len(data)} bytes, its index says {e.size}"
                    )
                out[e.name] = data
            return out
        parent = store.commit(cid).parent
        if parent is not None and not store.has(parent):
            return None  # a copied commit's history stayed behind: nothing further to search
        cid = parent
    raise ManifestError(f"commit {commit}'s parent chain is longer than {_MAX_CHAIN}")
