"""A memory tier: one slot's latest committed objects in host-local memory (SPEC.md §19.3).

A cache of the durable store, never the record: a directory (by default on ``/dev/shm``,
named for the store and the user) that outlives the worker process, so that a worker
restarted on the same host restores without reading the store. One directory per slot
under the host's tier root::

    <root>/slot<k>/objects/<id[:2]>/<id>   objects, exactly as in a store (a LocalStorage)
    <root>/slot<k>/held.json               the commits held: each commit's id and its objects

``hold`` records a commit once it is durable (its slot-k closure, SPEC.md §19.1) and evicts
every object that none of the last ``keep`` commits held names, so the tier's size is
bounded by the closure of ``keep`` commits. Nothing here is trusted: a reader verifies
every object against its id before it is used (``backends.tiers``), and an index that does
not decode is an empty index. The root and each slot directory must be real directories
owned by this user and closed to others (``TierError`` otherwise): a tier on a shared
``/dev/shm`` must not be one another user prepared.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from collections.abc import Callable, Iterable

import msgspec

from ..errors import InvalidName, ManifestError, ObjectNotFound, ShardstoreError, TierError
from ..format.bounded import read_regular_file
from ..format.names import check_oid
from ..format.tensors import hash_bytes
from .base import Buffer
from .local import LocalStorage

__all__ = ["TIER_ROOT_ENV", "HeldCommit", "MemoryTier", "default_tier_root"]

#: Overrides where default tier roots are made (``/dev/shm`` when it exists, else the temp dir).
TIER_ROOT_ENV = "SHARDSTORE_TIER_ROOT"
_HELD = "held.json"
_HELD_VERSION = 1
#: The most bytes of a held index read back (a million ids is about 70 MB of JSON).
_MAX_HELD_BYTES = 1 << 28


class HeldCommit(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A commit the tier holds for its slot: the commit id and the ids of its slot closure."""

    commit: str
    objects: tuple[str, ...]


class _Index(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    commits: tuple[HeldCommit, ...]


def default_tier_root(store_url: str) -> str:
    """The host's default tier root for the store at ``store_url``: a directory named for the
    store (a hash of its URL) and the user, under ``$SHARDSTORE_TIER_ROOT``, else ``/dev/shm``
    (memory), else the temp directory."""
    base = os.environ.get(TIER_ROOT_ENV) or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    url = store_url.removeprefix("file://")
    url = url if "://" in url else os.path.abspath(url)  # one name for a local store, however it was spelled
    return os.path.join(base, f"shardstore-tier-{os.geteuid()}-{hash_bytes(url.encode())[:16]}")


def _private_dir(path: str) -> str:
    """Make ``path`` (mode 0700) if absent; TierError unless it is a directory of this user that
    no one else may write (never through a symbolic link)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise TierError(f"memory tier {path}: cannot be made ({e.strerror or e})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise TierError(f"memory tier {path} is not a directory (a symbolic link or a file); refusing to use it")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise TierError(
            f"memory tier {path} belongs to another user or others may write it; refusing to use it (SPEC.md §19.3)"
        )
    return path


class MemoryTier:
    """One slot's objects in a host-local directory, with the commits they belong to."""

    name = "memory"

    def __init__(self, root: str, slot: int, *, keep: int = 1) -> None:
        if keep < 1:
            raise TierError(f"a memory tier keeps at least one commit, not {keep}")
        self.root = _private_dir(os.path.abspath(root))
        self.dir = _private_dir(os.path.join(self.root, f"slot{int(slot)}"))
        self.slot, self.keep = int(slot), keep
        self.storage = LocalStorage(self.dir)

    def __repr__(self) -> str:
        return f"MemoryTier({self.dir!r})"

    # -- objects ------------------------------------------------------------------------

    @staticmethod
    def _key(oid: str) -> str:
        return f"objects/{oid[:2]}/{check_oid(oid)}"

    def where(self, oid: str) -> str:
        """Where this tier's copy of ``oid`` is, for messages."""
        return f"memory tier {self.dir}"

    def fetch(self, oid: str) -> Buffer | None:
        """This tier's bytes of ``oid`` (unverified), or None if it holds no readable copy."""
        try:
            return self.storage.read(self._key(oid))
        except (ObjectNotFound, InvalidName):
            return None
        except ShardstoreError:  # unreadable (an I/O error, a symbolic link): not a copy
            return None

    def fetch_into(self, oid: str, out: memoryview, consume: Callable[[memoryview], None] | None = None) -> int | None:
        """Read this tier's copy of ``oid`` into ``out`` (unverified) if it has exactly
        ``len(out)`` bytes, handing each chunk to ``consume`` as it lands; its size (another size:
        nothing read), or None if it holds no readable copy (``backends.tiers.StagedCopies``)."""
        try:
            return self.storage.read_into(self._key(oid), out, consume)
        except (ObjectNotFound, InvalidName):
            return None
        except ShardstoreError:  # unreadable (an I/O error, a symbolic link): not a copy
            return None

    def size(self, oid: str) -> int | None:
        return self.storage.size(self._key(oid))

    def has(self, oid: str) -> bool:
        return self.storage.exists(self._key(oid))

    def put(self, oid: str, data: Buffer) -> None:
        """Keep ``data`` as ``oid`` (the caller knows it hashes to ``oid``); a no-op if present."""
        self.storage.write_once(self._key(oid), data)

    def discard(self, oid: str) -> None:
        """Drop this tier's copy of ``oid`` (a reader found it corrupt: the next fill replaces it)."""
        try:
            self.storage.delete(self._key(oid))
        except ShardstoreError:
            pass

    def objects(self) -> list[str]:
        out = []
        for key in self.storage.list("objects"):
            name = key.rsplit("/", 1)[-1]
            if len(name) == 64:
                out.append(name)
        return out

    def nbytes(self) -> int:
        """Bytes of the objects this tier holds now."""
        return sum(self.size(o) or 0 for o in self.objects())

    def clear_partial(self) -> None:
        """Remove writes a killed process left half done (``tmp/``); call it only while no other
        process writes this slot's tier (a worker's start)."""
        tmp = os.path.join(self.dir, "tmp")
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            for name in os.listdir(tmp):
                try:
                    os.unlink(os.path.join(tmp, name))
                except OSError:
                    pass

    # -- the commits held ---------------------------------------------------------------

    def held(self) -> tuple[HeldCommit, ...]:
        """The commits held, oldest first; () when there is no index or it does not decode."""
        path = os.path.join(self.dir, _HELD)
        if not os.path.lexists(path):
            return ()
        try:
            raw = read_regular_file(path, _MAX_HELD_BYTES, f"memory tier index {path}")
            index = msgspec.json.decode(raw, type=_Index)
            if index.version != _HELD_VERSION:
                return ()
            for h in index.commits:
                check_oid(h.commit)
                for o in h.objects:
                    check_oid(o)
            return index.commits
        except (ManifestError, InvalidName, msgspec.DecodeError, msgspec.ValidationError):
            return ()  # a cache: an index that cannot be trusted is no index

    def holds(self, commit: str) -> tuple[str, ...] | None:
        """The object ids of ``commit``'s closure if this tier holds it with every object present
        (not yet verified: a reader verifies each), else None."""
        for h in self.held():
            if h.commit == commit:
                return h.objects if all(self.has(o) for o in h.objects) else None
        return None

    def hold(self, commit: str, objects: Iterable[str]) -> int:
        """Record ``commit`` (durable: its ref moved or it was restored) as held with ``objects``,
        keep the last ``keep`` commits, evict every object none of them names; return the bytes
        this tier holds afterwards."""
        entry = HeldCommit(check_oid(commit), tuple(sorted({check_oid(o) for o in objects})))
        commits = [h for h in self.held() if h.commit != commit][-(self.keep - 1) :] if self.keep > 1 else []
        commits.append(entry)
        self._write_index(commits)
        keepers = {o for h in commits for o in h.objects}
        total = 0
        for oid in self.objects():
            if oid in keepers:
                total += self.size(oid) or 0
            else:
                self.storage.delete(self._key(oid))
        return total

    def _write_index(self, commits: list[HeldCommit]) -> None:
        data = msgspec.json.encode(_Index(version=_HELD_VERSION, commits=tuple(commits)))
        path = os.path.join(self.dir, _HELD)
        tmp = os.path.join(self.dir, f".{_HELD}.{secrets.token_hex(8)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(tmp, path)  # atomic: a reader sees the old index or the new one
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise TierError(f"memory tier {self.dir}: the index could not be written ({e.strerror or e})") from None
