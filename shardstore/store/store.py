"""The store: objects named by their BLAKE3 hash, manifests, refs and the journal (SPEC.md §Store layout).

A ``Store`` wraps one ``Storage`` backend and owns the key layout::

    config                      the store config (a StoreConfig manifest)
    objects/<id[:2]>/<id>       immutable objects; b3sum of the file equals its name
    refs/<name>                 "<commit id>\\n", moved only by compare-and-swap
    pins/<name>                 a PinManifest: objects gc keeps though no commit names them
    journal/<commit id>.json    unhashed notes (times, hosts, durations); never trusted

Everything read back is re-hashed before it is used. Names and ids are validated before
they become keys.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..backends.base import (
    BatchedWrites,
    Buffer,
    CachesWrites,
    HashedReads,
    ListedSizes,
    PipedReads,
    Storage,
    StreamedWrites,
)
from ..backends.location import open_storage
from ..errors import (
    CorruptObject,
    InvalidName,
    ManifestError,
    ObjectNotFound,
    ObjectTooLarge,
    RefConflict,
    RefNotFound,
    ShardstoreError,
    StoreConfigError,
    TargetNotFound,
)
from ..format.lazy import torch
from ..format.manifest import (
    FORMAT_VERSION,
    MAX_ENTRIES,
    MAX_MANIFEST_BYTES,
    CommitManifest,
    PinManifest,
    ShardManifest,
    StoreConfig,
    check_writable,
    decode,
    decode_manifest,
    encode,
)
from ..format.names import check_oid, check_oid_prefix, split_revision
from ..format.tensors import dtype_name, expected_nbytes, hash_bytes, new_hasher, tensor_bytes, tensor_from_bytes
from . import tensors as tensors_io
from .gc_fence import fenced_move
from .keys import object_key, pin_key, ref_key

__all__ = ["Store", "open_store", "manifest_bytes", "object_key", "ref_key", "pin_key"]

M = TypeVar("M")
_REF_BYTES = 65


class Store:
    """A content-addressed store of training state on one storage backend."""

    def __init__(self, storage: Storage, *, create: bool = True) -> None:
        self.storage = storage
        self.url = storage.url
        self.config = self._open_config(create)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def _open_config(self, create: bool) -> StoreConfig:
        try:
            raw = self._read_or_none("config", limit=4096)  # a store config is a few dozen bytes
        except ObjectTooLarge as e:
            raise StoreConfigError(str(e)) from None
        if raw is None:
            if not create:
                raise StoreConfigError(f"{self.url} is not a shardstore store (no config object)")
            mine = encode(StoreConfig(version=FORMAT_VERSION))
            wrote = self.storage.write_once("config", mine)
            self.storage.sync()
            # A config this call created holds exactly ``mine``; one another opener created first is read.
            raw = mine if wrote else self._read_or_none("config", limit=4096)
            if raw is None:
                raise StoreConfigError(f"{self.url}: the store config just written cannot be read back")
        try:
            cfg = decode_manifest(raw, StoreConfig, what=f"store config of {self.url}")
        except ManifestError as e:
            raise StoreConfigError(str(e)) from None
        return cfg

    # -- objects -----------------------------------------------------------------------

    def put(self, data: Buffer) -> str:
        """Store ``data`` as an object and return its id (a no-op if it exists)."""
        oid = hash_bytes(data)
        self.storage.write_once(object_key(oid), data)
        return oid

    def name_written(self, oid: str, data: Buffer) -> str:
        """``oid``, the id of ``data`` (the caller hashed it): an object another writer of the same
        commit wrote and made durable, which this writer names without writing it (SPEC.md §15: the
        model config, RNG objects alike on every slot). Nothing is sent to the store; a
        write-through cache above it (a memory tier, SPEC.md §19.3) keeps it as if written here,
        so the cache holds this writer's slot closure whole (``CachesWrites``)."""
        if isinstance(self.storage, CachesWrites):
            self.storage.keep_named(object_key(oid), data)
        return oid

    def put_with_id(self, oid: str, data: Buffer, *, batch: tensors_io.WriteBatch | None = None) -> bool:
        """Store ``data`` under an id the caller already computed (e.g. while copying). True if written.

        With ``batch`` (``write_batch()``) on a backend with batched writes (local), the object is
        written without waiting for the disk and becomes durable and visible at ``batch.finish``."""
        key = object_key(oid)
        if batch is None or not isinstance(self.storage, BatchedWrites):
            return self.storage.write_once(key, data)
        tmp = self.storage.begin_write(key, data)
        if tmp is None:
            return False  # present (and refreshed)
        with batch.lock:
            batch.pending.append((key, tmp))
        return True

    def receive(
        self, src: Store, oid: str, *, batch: tensors_io.WriteBatch, size: int | None = None
    ) -> tuple[str, int] | None:
        """Copy object ``oid`` from ``src`` into ``batch`` piece by piece as it arrives, hashing each
        piece on its way into the object's temporary file (a ``PipedReads`` source, a
        ``StreamedWrites`` destination: S3 into a local store), never holding it whole.

        Returns (the digest the bytes had, their size); the object joins ``batch`` (durable and
        visible at ``batch.finish``) only if the digest is ``oid`` and, where given, the size is
        ``size``: otherwise its temporary file is removed, for the caller to say what was wrong.
        None, with nothing read, where either backend lacks the path or the object is already
        here (refreshed): the caller reads and writes it the usual way (``read_hashed``,
        ``put_with_id``)."""
        key = object_key(oid)
        if not isinstance(src.storage, PipedReads) or not isinstance(self.storage, StreamedWrites):
            return None
        pending = self.storage.open_write(key)
        if pending is None:
            return None
        hashers: list[Any] = []

        def start(total: int) -> Callable[[Buffer], None]:
            pending.restart()  # a retried read starts again from its first byte
            h = new_hasher()
            hashers[:] = [h]

            def consume(piece: Buffer) -> None:
                h.update(piece)
                pending.write(piece)

            return consume

        try:
            n = src.storage.read_piped(key, start)
            got = str(hashers[0].hexdigest()) if hashers else hash_bytes(b"")
            if got != oid or (size is not None and n != size):
                pending.discard()
                return got, n
            tmp = pending.close()
        except BaseException:
            pending.discard()
            raise
        with batch.lock:
            batch.pending.append((key, tmp))
        return got, n

    def ensure(self, oid: str, *, listed: int | None = None) -> int | None:
        """The size of object ``oid`` if present (None if absent), made young again first.

        The one way a writer relies on an object it did not write (copy finding it at the
        destination, a save or import deduplicating against it): the refresh makes gc's
        grace period protect it until a manifest names it (SPEC.md §19.1). Backends without
        ``touch`` (test wrappers) fall back to ``size``. ``listed``: the size ``object_sizes``
        just found it with, on a backend that lists (``ListedSizes``): refreshed without asking
        its size again (S3: the copy onto itself, no HEAD first)."""
        key = object_key(oid)
        if listed is not None and isinstance(self.storage, ListedSizes):
            return listed if self.storage.refresh(key, listed) else None
        touch = getattr(self.storage, "touch", None)
        return touch(key) if touch is not None else self.storage.size(key)

    def has(self, oid: str) -> bool:
        return self.storage.exists(object_key(oid))

    def object_size(self, oid: str) -> int | None:
        return self.storage.size(object_key(oid))

    def get(self, oid: str, *, verify: bool = True, limit: int | None = None) -> Buffer:
        """The bytes of object ``oid``; CorruptObject unless they hash to ``oid``.

        ``limit``: ObjectTooLarge for an object over ``limit`` bytes, before it is read (every
        reader of a manifest, config or RNG state passes its limit; SPEC.md §Limits)."""
        if not verify:
            if limit is not None:
                self._check_size(oid, limit)
            return self.storage.read(object_key(oid))
        data, got = self.read_hashed(oid, limit=limit)
        if got != oid:
            raise CorruptObject(f"object {oid} is corrupt: its {len(data)} bytes hash to {got} (SPEC.md §Objects)")
        return data

    def _check_size(self, oid: str, limit: int) -> None:
        n = self.storage.size(object_key(oid))
        if n is None:
            raise ObjectNotFound(f"object {oid} is missing from store {self.url}")
        if n > limit:
            raise ObjectTooLarge(f"object {oid} is {n} bytes, over this reader's limit of {limit} (SPEC.md §Limits)")

    def read_hashed(self, oid: str, *, limit: int | None = None) -> tuple[Buffer, str]:
        """The stored bytes of ``oid`` and the BLAKE3 digest they really have (unchecked).

        A backend with ``read_hashed`` (local, S3) hashes while the bytes stream in, into
        memory of their own, and refuses an object over ``limit`` before allocating it;
        otherwise the size is checked, then the bytes are read and hashed.
        """
        key = object_key(oid)
        if isinstance(self.storage, HashedReads):
            data, got = self.storage.read_hashed(key, new_hasher, limit)
            return data, str(got)
        if limit is not None:
            self._check_size(oid, limit)
        data = self.storage.read(key)
        return data, hash_bytes(data)

    def objects(self) -> Iterator[str]:
        """Every object id present (not only reachable ones)."""
        for key in self.storage.list("objects"):
            name = key.rsplit("/", 1)[-1]
            if len(name) == 64:
                yield name

    def object_sizes(self, oids: Iterable[str], *, threads: int = 8) -> dict[str, int]:
        """The byte sizes of those of ``oids`` that are present (an absent one is left out): one
        set of listings where the backend has them (``ListedSizes``: S3, a page answers for up to
        a thousand objects), else a ``size`` each, ``threads`` at a time."""
        ids = sorted(set(oids))
        if isinstance(self.storage, ListedSizes):
            listed = self.storage.sizes([object_key(o) for o in ids])
            return {o: listed[object_key(o)] for o in ids if object_key(o) in listed}
        if threads > 1 and len(ids) > 1:
            with ThreadPoolExecutor(max_workers=threads) as pool:
                sizes = list(pool.map(self.object_size, ids))
        else:
            sizes = [self.object_size(o) for o in ids]
        return {o: n for o, n in zip(ids, sizes) if n is not None}

    def present(self, oids: Iterable[str], *, threads: int = 8) -> set[str]:
        """Those of ``oids`` that are present: ``object_sizes``' listings where the backend has
        them, else ``has`` each, ``threads`` at a time (the gc fence's presence check)."""
        ids = sorted(set(oids))
        if isinstance(self.storage, ListedSizes):
            return set(self.object_sizes(ids))
        if threads > 1 and len(ids) > 1:
            with ThreadPoolExecutor(max_workers=threads) as pool:
                found = list(pool.map(self.has, ids))
        else:
            found = [self.has(o) for o in ids]
        return {o for o, ok in zip(ids, found) if ok}

    def lists_sizes(self) -> bool:
        """Whether ``object_sizes`` asks the backend once for many objects (``ListedSizes``) rather
        than once per object: then asking ahead saves a request per object. Such a backend (S3)
        is one where every read is a round trip, so independent reads are worth sending together."""
        return isinstance(self.storage, ListedSizes)

    def sync(self) -> None:
        self.storage.sync()

    # -- tensors -----------------------------------------------------------------------

    def put_tensor(self, t: torch.Tensor) -> str:
        return self.put(tensor_bytes(t))

    def get_tensor(self, oid: str, dtype: str, shape: tuple[int, ...], *, what: str = "tensor") -> torch.Tensor:
        """A verified tensor viewing the object's bytes (read into memory of its own, then hashed).

        An object larger than ``dtype`` x ``shape`` is corrupt (appended bytes: CorruptObject, as
        verify says) and refused before it is read, so a grown file is never read whole (SPEC.md §Limits)."""
        try:
            data = self.get(oid, limit=expected_nbytes(dtype, tuple(shape)))
        except ObjectTooLarge as e:
            raise CorruptObject(f"{what}: {e}: longer than its dtype and shape, refused unread") from None
        except (CorruptObject, ObjectNotFound) as e:  # name the tensor (and block) it was read for
            raise type(e)(f"{what}: {e}") from None
        return tensor_from_bytes(data, dtype, tuple(shape), f"{what} (object {oid})")

    def put_tensors(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        threads: int = tensors_io.WRITE_THREADS,
        batch: tensors_io.WriteBatch | None = None,
    ) -> list[str]:
        """Store each tensor's bytes as an object; return the ids in order (``store.tensors.put_tensors``).
        With ``batch`` (``write_batch()``), they become durable and visible at ``batch.finish(store.storage)``."""
        return tensors_io.put_tensors(self.storage, tensors, threads=threads, batch=batch)

    def put_all(self, datas: Sequence[Buffer], *, threads: int = 2) -> list[str]:
        """Store each of ``datas`` as an object, as one batch (``put_tensors``: one durability
        barrier for all of them, ``threads`` at a time); return the ids in order."""
        return tensors_io.put_tensors(self.storage, datas, threads=threads)

    def write_batch(self) -> tensors_io.WriteBatch:
        """A batch of object writes made durable together (``store.tensors.WriteBatch``). End it
        with ``finish`` or, on failure, ``abandon``: on a local store its objects are unnamed tmp
        files until then, each holding a descriptor (and its disk space) until the batch ends."""
        return tensors_io.WriteBatch()

    def hash_object(self, oid: str, *, threads: int = 1) -> tuple[str, int]:
        """(BLAKE3 hex digest, size) of the stored bytes of ``oid``, streamed where the backend allows.

        ``threads``: BLAKE3's own threads for this one object (1 when objects are hashed in a pool).
        """
        key = object_key(oid)
        if isinstance(self.storage, HashedReads):
            got, n = self.storage.hash_object(key, lambda: new_hasher(threads), threads=threads)
            return str(got), int(n)
        data = self.storage.read(key)
        return hash_bytes(data, threads=threads), len(data)

    def arrival(self, oid: str) -> int | None:
        """Object ``oid``'s place in the order a peer is sending copies to this process (a backend
        with ``arrival``: ``TieredStorage`` over ``PeerCopies``), None when none is coming: a
        restore reads such objects in that order (``format.grid.run_reads``). Never waits."""
        arrival = getattr(self.storage, "arrival", None)
        return None if arrival is None else arrival(object_key(oid))

    def read_ahead(self, oid: str) -> None:
        """Start fetching object ``oid``, about to be read, without waiting (``store.tensors.read_ahead``)."""
        tensors_io.read_ahead(self.storage, oid)

    def read_into(self, oid: str, dest: torch.Tensor, *, what: str = "tensor") -> None:
        """Fill ``dest`` in place with object ``oid``'s bytes, verifying size and hash
        (``store.tensors.read_into``: straight from the file where the backend allows)."""
        tensors_io.read_into(
            self.storage,
            oid,
            dest,
            what=what,
            whole=lambda: self.get_tensor(oid, dtype_name(dest.dtype, what), tuple(dest.shape), what=what),
        )

    # -- manifests ---------------------------------------------------------------------

    def put_manifest(self, manifest: ShardManifest | CommitManifest) -> str:
        return self.put(manifest_bytes(manifest))

    def get_manifest(self, oid: str, kind: type[M]) -> M:
        data = self.get(oid, limit=MAX_MANIFEST_BYTES)
        return decode_manifest(data, kind, what=f"object {oid}")

    def get_any_manifest(self, oid: str) -> Any:
        return decode(self.get(oid, limit=MAX_MANIFEST_BYTES), what=f"object {oid}")

    def commit(self, oid: str) -> CommitManifest:
        return self.get_manifest(oid, CommitManifest)

    def shard(self, oid: str) -> ShardManifest:
        return self.get_manifest(oid, ShardManifest)

    # -- refs --------------------------------------------------------------------------

    def _read_or_none(self, key: str, limit: int = MAX_MANIFEST_BYTES) -> bytes | None:
        """The bytes at a ref or pin key, or None if it is absent; ObjectTooLarge past ``limit``,
        before allocating (``Storage.read``'s limit), and checked again here after the read."""
        try:
            data = bytes(self.storage.read(key, limit=limit))
        except ObjectNotFound:
            return None
        if len(data) > limit:
            raise ObjectTooLarge(
                f"{key} in {self.url} is {len(data)} bytes, over this reader's limit of {limit} (SPEC.md §Limits)"
            )
        return data

    def _names_under(self, prefix: str) -> list[str]:
        """Ref or pin names under ``prefix`` (lock files of writers in progress excluded), sorted."""
        return sorted(key[len(prefix) + 1 :] for key in self.storage.list(prefix) if not key.endswith(".lock"))

    def _ref_raw(self, name: str) -> bytes | None:
        return self._read_or_none(ref_key(name), limit=4096)  # a ref is 65 bytes; anything near this is malformed

    @staticmethod
    def _parse_ref(name: str, raw: bytes) -> str:
        if len(raw) != _REF_BYTES or not raw.endswith(b"\n"):
            raise ManifestError(
                f"ref {name!r} is malformed: expected a commit id and a newline, found {len(raw)} bytes"
            )
        return check_oid(raw[:64].decode("ascii", "replace"), what=f"commit id in ref {name!r}")

    def ref(self, name: str) -> str | None:
        """The commit id ref ``name`` points at, or None if there is no such ref."""
        raw = self._ref_raw(name)
        return None if raw is None else self._parse_ref(name, raw)

    def ref_names(self) -> list[str]:
        """Every ref name present (lock files of writers in progress excluded), sorted."""
        return self._names_under("refs")

    def refs(self) -> dict[str, str]:
        """Every ref and its commit id; ManifestError if a ref does not parse."""
        out: dict[str, str] = {}
        for name in self.ref_names():
            value = self.ref(name)
            if value is not None:
                out[name] = value
        return out

    def set_ref(self, name: str, new: str, *, expected: str | None, needs: set[str] | None = None) -> None:
        """Move ref ``name`` from ``expected`` (None: must not exist) to ``new``; RefConflict otherwise
        (GcRace if ``new``'s closure, or ``needs``, is not all present: behind the gc fence, SPEC.md §19.2)."""
        check_oid(new, what="commit id")
        exp = None if expected is None else (check_oid(expected, what="expected commit id") + "\n").encode()
        fenced_move(
            self,
            commit=new,
            objects=sorted(needs or ()),
            move=lambda: self.storage.swap(ref_key(name), exp, (new + "\n").encode()),
        )

    def delete_ref(self, name: str, *, expected: str) -> None:
        """Delete ref ``name`` if it points at ``expected``: a compare-and-delete, so a ref moved
        meanwhile is kept (RefConflict), never deleted with the commit it moved to."""
        if self.ref(name) != expected:
            raise RefNotFound(f"ref {name!r} does not point at {expected}")
        self.storage.delete_if(ref_key(name), (check_oid(expected, what="expected commit id") + "\n").encode())

    def resolve(self, target: str) -> str:
        """A commit id from a ref name, a full commit id, or a unique id prefix (>= 8 hex digits),
        each optionally followed by git's ancestry suffixes (``main~1``, ``main^``, ``<id>~3``;
        SPEC.md §Refs), resolved through parent links. TargetNotFound if the history is shorter."""
        if not isinstance(target, str) or not target:
            raise TargetNotFound(f"empty target {target!r}")
        base, back = split_revision(target)
        if back == 0:
            return self._resolve_name(base)
        cid = self._resolve_name(base)
        for k in range(back):
            parent = self.commit(cid).parent
            if parent is None:
                raise TargetNotFound(
                    f"{target!r} names no commit: the history of {base!r} is {k + 1} commits long "
                    f"(commit {cid} has no parent)"
                )
            cid = parent
        if not self.has(cid):
            raise TargetNotFound(f"{target!r} names commit {cid}, which is not in {self.url}")
        return cid

    def _resolve_name(self, target: str) -> str:
        """A commit id from a ref name, a full commit id, or a unique id prefix (>= 8 hex digits)."""
        try:
            value = self.ref(target)
        except InvalidName:
            value = None  # not a ref name at all: maybe an id prefix
        if value is not None:  # a ref that exists but does not parse raised ManifestError above
            return value
        try:
            check_oid_prefix(target)
        except Exception:
            raise TargetNotFound(
                f"{target!r} is neither a ref in {self.url} nor a commit id or prefix (>= 8 hex digits)"
            ) from None
        if len(target) == 64:
            if not self.has(target):
                raise TargetNotFound(f"commit {target} is not in {self.url}")
            return target
        matches = [o for o in self._objects_with_prefix(target)]
        if not matches:
            raise TargetNotFound(f"no object id in {self.url} starts with {target!r}")
        if len(matches) > 1:
            raise TargetNotFound(f"id prefix {target!r} is ambiguous in {self.url}: {len(matches)} objects match")
        return matches[0]

    def _objects_with_prefix(self, prefix: str) -> Iterator[str]:
        for key in self.storage.list(f"objects/{prefix[:2]}"):
            name = key.rsplit("/", 1)[-1]
            if name.startswith(prefix):
                yield name

    # -- pins --------------------------------------------------------------------------

    def _pin_raw(self, name: str) -> bytes | None:
        return self._read_or_none(pin_key(name))

    @staticmethod
    def _parse_pin(name: str, raw: bytes) -> tuple[str, ...]:
        pin = decode_manifest(raw, PinManifest, what=f"pin {name!r}")
        if list(pin.objects) != sorted(set(pin.objects)):
            raise ManifestError(f"pin {name!r}: object ids must be sorted and distinct (SPEC.md §Pins)")
        return pin.objects

    def _pin_bytes(self, name: str, objects: Sequence[str]) -> bytes:
        ids = sorted({check_oid(o, what=f"object id in pin {name!r}") for o in objects})
        if len(ids) > MAX_ENTRIES:
            raise ManifestError(f"pin {name!r}: {len(ids)} objects exceed the limit of {MAX_ENTRIES} (SPEC.md §Pins)")
        new = encode(PinManifest(version=FORMAT_VERSION, objects=tuple(ids)))
        if len(new) > MAX_MANIFEST_BYTES:  # cannot happen below MAX_ENTRIES ids; kept next to the rule it guards
            raise ManifestError(f"pin {name!r}: {len(new)} bytes exceed the manifest limit (SPEC.md §Limits)")
        return new

    def pin(self, name: str, objects: Sequence[str], *, expected: Sequence[str] | None) -> None:
        """Set pin ``name`` to exactly ``objects`` (ids of objects gc must keep; SPEC.md §Pins)
        if it holds exactly ``expected`` now (None: there must be no such pin).

        A compare-and-swap, like ``set_ref``: a read-modify-write passes the value it read,
        so that a concurrent change of the same pin raises RefConflict and changes nothing
        instead of being overwritten (``add_to_pin`` does the whole loop)."""
        new, exp = self._pin_bytes(name, objects), None if expected is None else self._pin_bytes(name, expected)
        added = sorted(set(objects) - set(expected or ()))  # behind the gc fence (SPEC.md §19.2), like set_ref
        fenced_move(self, objects=added, move=lambda: self.storage.swap(pin_key(name), exp, new))

    def add_to_pin(self, name: str, objects: Sequence[str], *, attempts: int = 20) -> tuple[str, ...]:
        """Make pin ``name`` hold ``objects`` as well as what it holds now (created if absent);
        return its new value. Read, union, compare-and-swap, again on a conflict (another
        writer changed the pin in between, or holds its lock) up to ``attempts`` times."""
        want = {check_oid(o, what=f"object id in pin {name!r}") for o in objects}
        for attempt in range(attempts):
            current = self.pinned(name)
            if current is not None and want <= set(current):
                return current
            union = tuple(sorted(want | set(current or ())))
            try:
                self.pin(name, union, expected=current)
                return union
            except RefConflict:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.005 * (attempt + 1) * (0.5 + random.random()))
        raise AssertionError("unreachable")  # pragma: no cover

    def unpin(self, name: str, *, expected: Sequence[str] | None = None) -> None:
        """Remove pin ``name`` (its objects become collectable unless something else names them).

        A compare-and-delete of the value read (or of ``expected``, when given): if another
        writer adds to the pin in between (``add_to_pin``), the pin is kept and RefConflict
        raised, so the objects it just protected are not handed to gc."""
        raw = self._pin_raw(name)
        if raw is None:
            raise RefNotFound(f"no pin {name!r} in {self.url}")
        if expected is not None:
            raw = self._pin_bytes(name, expected)
        self.storage.delete_if(pin_key(name), raw)

    def pin_names(self) -> list[str]:
        return self._names_under("pins")

    def pinned(self, name: str) -> tuple[str, ...] | None:
        """The object ids pin ``name`` holds, or None if there is no such pin."""
        raw = self._pin_raw(name)
        return None if raw is None else self._parse_pin(name, raw)

    def pins(self) -> dict[str, tuple[str, ...]]:
        """Every pin and its object ids; ManifestError if a pin does not parse."""
        out: dict[str, tuple[str, ...]] = {}
        for name in self.pin_names():
            value = self.pinned(name)
            if value is not None:
                out[name] = value
        return out

    # -- journal -----------------------------------------------------------------------

    def write_journal(self, commit: str, record: dict[str, Any]) -> None:
        """Unhashed notes about a commit (times, hosts); advisory, never read for trust.

        Written after the ref moved, so no failure here (a full disk, a server error, a
        ``journal`` that is a symbolic link, an unencodable note) is raised: raising would
        report a commit that is in as a failed save (SPEC.md §19.2)."""
        try:
            self.storage.write_once(f"journal/{check_oid(commit)}.json", json.dumps(record, sort_keys=True).encode())
        except (ShardstoreError, OSError, ValueError, TypeError):
            pass


def manifest_bytes(manifest: ShardManifest | CommitManifest) -> bytes:
    """A shard or commit manifest's canonical bytes, refused (ManifestError) if no reader would accept them."""
    what = f"shard manifest of slot {manifest.slot}" if isinstance(manifest, ShardManifest) else "commit manifest"
    return check_writable(encode(manifest), what)  # never write what no reader accepts


def open_store(url: str, *, create: bool = True, **storage_options: object) -> Store:
    """Open (and by default create) the store at a path or fsspec URL."""
    return Store(open_storage(str(url), **storage_options), create=create)
