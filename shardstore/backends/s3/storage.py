"""The S3 backend: ``s3://bucket/prefix`` through s3fs's aiobotocore client (SPEC.md §Storage).

``S3Storage`` implements the narrow ``Storage`` protocol on any S3-compatible server. It
uses s3fs only for what s3fs is good at (credentials, endpoint and session handling, its
event loop) and talks to the underlying aiobotocore client directly, because the two
guarantees the store rests on are request conditions s3fs does not expose:

- objects are written create-only: ``PutObject`` (or ``CompleteMultipartUpload`` for large
  objects) with ``If-None-Match: *``; a 412 means "already there", and since an object's
  name is the hash of its bytes, that is success without writing;
- refs move by compare-and-swap: read the ref and its ETag, then ``PutObject`` with
  ``If-Match: <etag>`` (or ``If-None-Match: *`` for a new ref); a 412 is a RefConflict;
  refs and pins are deleted the same way (``DeleteObject`` with ``If-Match: <etag>``).

Before the first write, a probe writes a scratch key under ``tmp/`` twice with ``If-None-Match: *`` and
once with a stale ``If-Match``, and deletes it once with a stale ``If-Match``, and expects
412 the second, third and fourth time (a ref or pin is deleted with ``If-Match``); a probe that
finds them honoured answers for every store opened in the same bucket through the same s3fs
filesystem (the same server, the same credentials), which do not probe again (a refusal is
not shared: it may be a prefix-scoped policy's or a transient error's). Opening a store and reading it
writes nothing, so a read-only credential can verify. A server that
ignores the conditions (older MinIO, some gateways) still stores objects (head, then put:
content addressing makes a lost race harmless) but every ref update is refused with a
StorageError: a compare-and-swap that is not one would silently lose commits.

Every request goes through the storage's ``S3Transport`` (``transport``), and so do the
request layer's (``requests``: the multipart upload, the probe). Retries are ours and
bounded: botocore's own retries are off (``total_max_attempts=1``) unless the caller
configures them, so that a retried conditional write is visible here. 500/502/503/504,
SlowDown, 409 ConditionalRequestConflict and connection errors or timeouts are retried
with jittered exponential backoff; after the last attempt the error is a StorageError
naming the key. A ref write whose response was lost and whose retry then got 412 is
re-read: if the ref holds the new value, the first attempt won.

Concurrency is bounded by one semaphore per backend (the transport's: ``concurrency``
requests in flight, from any number of threads: every call runs on s3fs's event loop).
Objects larger than ``multipart_threshold`` (default 4 parts) upload as concurrent
``part_size`` parts, and objects larger than ``part_size`` download as concurrent ranged
GETs (``concurrency`` ranges ahead of the one being handled). Downloads are hashed as they stream: ranges are hashed
in order as they arrive, so verifying a download costs no second pass; ``read_into``
lands the ranges straight in the caller's buffer (a tensor on restore),
``hash_object`` (deep verify) holds at most ``concurrency`` + 1 ranges of an object at once,
and ``read_piped`` (a copy to a local store) hands the first range to its consumer piece by
piece as the response streams in, never joining it into one buffer.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from ...errors import ObjectNotFound, ObjectTooLarge, RefConflict, StorageError
from ...format.names import check_key
from ..base import Buffer
from .requests import listed_sizes, multipart_upload, probe_conditions
from .transport import S3Error, S3Transport

__all__ = ["S3Storage", "DEFAULT_PART_SIZE", "DEFAULT_CONCURRENCY", "DEFAULT_ATTEMPTS"]

DEFAULT_PART_SIZE = 8 * 1024 * 1024
DEFAULT_CONCURRENCY = 16
DEFAULT_ATTEMPTS = 5
#: Ranges at least this large are consumed (hashed) in a worker thread, off the event loop.
_OFFLOAD_BYTES = 1 << 20
_BUCKET = re.compile(r"[a-zA-Z0-9.\-_]{1,255}")
#: Probes that found the conditions honoured, by s3fs filesystem (``id``: one client, one endpoint,
#: one set of credentials) and bucket: the server's support does not depend on the prefix, so the
#: stores opened under one bucket through one filesystem probe once between them. A refusal is
#: kept by its own store only (it may be a prefix-scoped policy's or a transient error's).
_PROBED: dict[tuple[int, str], tuple[bool, str]] = {}
#: CopyObject's limit; larger objects cannot be refreshed by copying them onto themselves.
_MAX_COPY_BYTES = 5 * 1024**3


def _show(value: bytes | None) -> str:
    return "no ref" if value is None else repr(value.decode("ascii", "replace").strip())


class S3Storage:
    """A store under ``s3://bucket/prefix`` with create-only objects and CAS refs (see module docstring).

    ``storage_options`` go to ``s3fs.S3FileSystem`` (``endpoint_url``, ``key``/``secret``,
    ``client_kwargs``, ``config_kwargs``...; credentials default to botocore's lookup: the
    environment, profiles, instance roles). ``conditional``: None probes the server, True
    trusts it without probing, False refuses ref updates.
    """

    def __init__(
        self,
        url: str,
        *,
        conditional: bool | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        multipart_threshold: int | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        attempts: int = DEFAULT_ATTEMPTS,
        backoff: float = 0.1,
        **storage_options: Any,
    ) -> None:
        import s3fs

        scheme, _, rest = url.partition("://")
        if scheme not in ("s3", "s3a") or not rest.split("/", 1)[0]:
            raise StorageError(f"not an S3 store URL: {url!r} (expected s3://bucket/prefix)")
        if part_size < 5 * 1024 * 1024:
            raise StorageError(f"part_size {part_size} is below S3's 5 MiB minimum multipart part size")
        self.url = url.rstrip("/")
        self.bucket, _, prefix = rest.partition("/")
        if _BUCKET.fullmatch(self.bucket) is None:  # botocore's own rule, checked before any request
            raise StorageError(f"not an S3 store URL: {url!r}: {self.bucket!r} is not a valid bucket name")
        self.prefix = "/".join(check_key(prefix.strip("/")).split("/")) if prefix.strip("/") else ""
        self.multipart_threshold = 4 * part_size if multipart_threshold is None else max(part_size, multipart_threshold)
        self.part_size, self.concurrency = part_size, max(1, concurrency)
        options = dict(storage_options)
        config = dict(options.pop("config_kwargs", None) or {})
        config.setdefault("retries", {"mode": "standard", "total_max_attempts": 1})
        # An object's bytes are hashed against its id as they arrive (BLAKE3, every byte): the
        # server's CRC of the response is checked only where asked (``_checksum``: refs, pins...).
        config.setdefault("response_checksum_validation", "when_required")
        options["config_kwargs"] = config
        self.fs = s3fs.S3FileSystem(**options)
        # every request to the server goes through it, the request layer's too
        self.transport = S3Transport(
            self.fs,
            url=self.url,
            bucket=self.bucket,
            prefix=self.prefix,
            part_size=self.part_size,
            concurrency=self.concurrency,
            attempts=max(1, attempts),
            backoff=backoff,
        )
        self.conditional_reason = ""
        self._conditional = conditional  # None: not probed yet (the first write probes)

    def __repr__(self) -> str:
        return f"S3Storage({self.url!r}, conditional={self._conditional})"

    @property
    def conditional(self) -> bool:
        """Whether the server honours the request conditions (probed on first use; see module docstring)."""
        if self._conditional is None:
            self.transport.run(self._conditions)
        return bool(self._conditional)

    @conditional.setter
    def conditional(self, value: bool) -> None:
        self._conditional = value

    async def _conditions(self) -> bool:
        """``conditional``, probed when a write first needs it (reads never probe: read-only credentials
        work), once per s3fs filesystem and bucket where honoured (``_PROBED``)."""
        if self._conditional is None:
            where = (id(self.fs), self.bucket)
            found = _PROBED.get(where)
            if found is None:
                found = await probe_conditions(self.transport)
                # only "honoured" is the server's answer; a refusal may be this prefix's (a policy
                # scoped to it) or a passing error's, and is not shared: the next store probes again
                if found[0] and _PROBED.setdefault(where, found) is found:
                    weakref.finalize(self.fs, _PROBED.pop, where, None)  # an id is only unique while its object lives
            if self._conditional is None:  # two writers may probe at once: the first answer stands
                self._conditional, self.conditional_reason = found
        return bool(self._conditional)

    async def _head(self, key: str) -> dict[str, Any] | None:
        try:
            return await self.transport.call("head_object", key, Key=self.transport.key(key))
        except S3Error as e:
            if e.status == 404:
                return None
            raise self.transport.fail("stat", key, e) from None

    @staticmethod
    def _checksum(key: str) -> dict[str, str]:
        """A GET's checksum mode: an object is hashed against its id by its reader, every byte, so
        the server's checksum of it is not checked a second time; anything else (a ref, a pin, the
        config, a gc marker) has no id to be checked against, and the server's checksum is."""
        return {} if key.startswith("objects/") else {"ChecksumMode": "ENABLED"}

    async def _get_or_none(self, key: str) -> tuple[dict[str, Any], bytes] | None:
        try:
            return await self.transport.call("get_object", key, Key=self.transport.key(key), **self._checksum(key))
        except S3Error as e:
            if e.status == 404:
                return None
            raise self.transport.fail("read", key, e) from None

    # -- Storage protocol --------------------------------------------------------------

    def read(self, key: str, limit: int | None = None) -> Buffer:
        return self.transport.run(self._read, key, None, limit)

    def read_hashed(self, key: str, hasher: Callable[[], Any], limit: int | None = None) -> tuple[Buffer, str]:
        """The bytes at ``key`` and their digest, hashed range by range as the ranges arrive
        (in order, off the event loop) rather than in a second pass over the whole object.
        ``limit``: ObjectTooLarge if the server reports more bytes, before allocating them."""
        h = hasher()
        data, whole = self.transport.run(self._read_parts, key, h.update, limit)
        if whole:  # it came in one range, not yet hashed: hashed here, in the caller's thread
            h.update(data)
        return data, h.hexdigest()

    def hash_object(self, key: str, hasher: Callable[[], Any], *, threads: int = 1) -> tuple[str, int]:
        """(hex digest, size) of the object at ``key``, streamed: at most ``concurrency`` + 1
        ranges are held at once, never the whole object."""
        h = hasher()
        total = self.transport.run(self._stream, key, None, h.update)
        return h.hexdigest(), total

    def read_into(self, key: str, out: memoryview, consume: Callable[[memoryview], None] | None = None) -> int:
        """Download the object at ``key`` straight into ``out`` when its size is exactly
        ``len(out)``, calling ``consume`` on each range in order as it lands. Returns the
        object's size; when that differs from ``len(out)`` only the first range is fetched."""
        return self.transport.run(self._stream, key, out, consume)

    def read_piped(self, key: str, start: Callable[[int], Callable[[Buffer], None]]) -> int:
        """Hand the bytes at ``key`` to the consumer ``start(size)`` returns, in order; return their
        size (``PipedReads``). The first range goes to the consumer piece by piece as its body
        streams in, on the event loop (``start`` too: again if that GET is retried); the ranges
        after it (an object over ``part_size``) as each lands, in order (``_rest``)."""
        return self.transport.run(self._piped, key, start)

    async def _piped(self, key: str, start: Callable[[int], Callable[[Buffer], None]]) -> int:
        began: list[Any] = []  # (object size, consumer) of the latest attempt

        def begin(resp: dict[str, Any]) -> Callable[[bytes], None]:
            total = self._size_of(key, resp, None)
            consume = start(total)
            began[:] = [total, consume]
            return consume

        try:
            resp, n = await self.transport.call(
                "get_object",
                key,
                pipe=begin,
                Key=self.transport.key(key),
                Range=f"bytes=0-{self.part_size - 1}",
                **self._checksum(key),
            )
        except S3Error as e:
            if e.status == 404:
                raise ObjectNotFound(f"{key} is missing from store {self.url}") from None
            if e.status == 416:  # a range of an empty object
                start(0)
                return 0
            raise self.transport.fail("read", key, e) from None
        total, consume = began
        if n > total:
            raise StorageError(f"read {key!r} in store {self.url}: {n} bytes arrived of a {total}-byte object")
        if n < total:
            await self._rest(key, resp, b"", total, None, consume, offset=n)
        return total

    def _size_of(self, key: str, resp: dict[str, Any], received: int | None) -> int:
        """The object's size, from a (ranged) GET's answer: its Content-Range; for a server that
        ignored the range, the whole body (``received`` bytes, or its Content-Length)."""
        rng = str(resp.get("ContentRange") or "")
        status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if "/" in rng:
            return int(rng.rsplit("/", 1)[1])
        if status == 206:  # partial content that does not say of what: never guess the size
            raise StorageError(f"read {key!r} in store {self.url}: a ranged GET answered 206 without a Content-Range")
        return received if received is not None else int(resp.get("ContentLength") or 0)

    async def _read(self, key: str, consume: Callable[[memoryview], None] | None, limit: int | None = None) -> Buffer:
        data, whole = await self._read_parts(key, consume, limit)
        if whole:
            await self._land(memoryview(data), consume)
        return data

    async def _read_parts(
        self, key: str, consume: Callable[[memoryview], None] | None, limit: int | None = None
    ) -> tuple[Buffer, bool]:
        """(the bytes at ``key``, whether they came in one range): an object of one range is handed
        back as it arrived (no copy) and NOT passed to ``consume``, for the caller to consume in its
        own thread (no hop to a worker thread and back); the ranges of a larger one are consumed in
        order as they land (``_rest``). ``limit``: ObjectTooLarge past it, before allocating."""
        resp, first, total = await self._first_range(key)
        if limit is not None and total > limit:
            raise ObjectTooLarge(
                f"{key} in store {self.url} is {total} bytes, over this reader's limit of {limit} (SPEC.md §Limits)"
            )
        if total == len(first):
            return first, True
        buf = bytearray(total)
        await self._rest(key, resp, first, total, memoryview(buf), consume)
        return buf, False

    async def _stream(self, key: str, out: memoryview | None, consume: Callable[[memoryview], None] | None) -> int:
        """GET ``key`` as ``part_size`` ranges into ``out`` (left untouched unless the object
        has exactly its size), or with no ``out`` only through ``consume``; returns the object's
        size (``_rest`` says how the ranges arrive)."""
        resp, first, total = await self._first_range(key)
        if out is not None and len(out) != total:
            return total
        await self._rest(key, resp, first, total, out, consume)
        return total

    async def _first_range(self, key: str) -> tuple[dict[str, Any], bytes, int]:
        """(response, bytes, object size) of the first ``part_size`` range of ``key``."""
        full = self.transport.key(key)
        try:
            resp, first = await self.transport.call(
                "get_object", key, Key=full, Range=f"bytes=0-{self.part_size - 1}", **self._checksum(key)
            )
        except S3Error as e:
            if e.status == 404:
                raise ObjectNotFound(f"{key} is missing from store {self.url}") from None
            if e.status == 416:  # a range of an empty object
                resp, first = {}, b""
            else:
                raise self.transport.fail("read", key, e) from None
        total = self._size_of(key, resp, len(first))  # a server that ignored the range sent the whole object
        if len(first) > total:
            raise StorageError(f"read {key!r} in store {self.url}: {len(first)} bytes arrived of a {total}-byte object")
        return resp, first, total

    @staticmethod
    async def _land(view: memoryview, consume: Callable[[memoryview], None] | None) -> None:
        """``consume`` a range that landed: in a worker thread from ``_OFFLOAD_BYTES`` up, so that
        hashing never stalls the event loop; inline below (a manifest, a small tensor: a thread hop
        would cost more)."""
        if consume is not None and len(view) >= _OFFLOAD_BYTES:
            await asyncio.to_thread(consume, view)
        elif consume is not None and len(view):
            consume(view)

    async def _rest(
        self,
        key: str,
        resp: dict[str, Any],
        first: bytes,
        total: int,
        dest: memoryview | None,
        consume: Callable[[memoryview], None] | None,
        offset: int | None = None,
    ) -> None:
        """The object's ranges after ``first`` (or from ``offset``, bytes already handled by the
        caller), at most ``concurrency`` in flight, handled in order.

        ``dest`` (``total`` bytes): where the bytes go, each range copied in as soon as it
        arrives; None: ranges are only passed to ``consume``, and at most ``concurrency`` wait
        while one is consumed. ``consume`` runs on each range in order (``_land``). Ranges after
        the first carry ``If-Match`` on the first one's ETag (when the server sent one): a
        concurrent overwrite of the key (only a ref can be overwritten) fails the read instead
        of mixing versions.
        """
        full = self.transport.key(key)
        conditions = {"IfMatch": resp["ETag"]} if resp.get("ETag") else {}
        conditions.update(self._checksum(key))

        async def part(start: int) -> memoryview:
            end = min(start + self.part_size, total)
            try:
                _, data = await self.transport.call(
                    "get_object", key, Key=full, Range=f"bytes={start}-{end - 1}", **conditions
                )
            except S3Error as e:
                raise self.transport.fail("read", key, e) from None
            if len(data) != end - start:
                raise StorageError(
                    f"read {key!r} in store {self.url}: range {start}-{end - 1} returned {len(data)} bytes"
                )
            if dest is None:
                return memoryview(data)
            dest[start:end] = data  # landed now; only the in-order hashing waits
            return dest[start:end]

        starts = iter(range(len(first) if offset is None else offset, total, self.part_size))
        ahead: deque[asyncio.Future[memoryview]] = deque()
        try:
            for start in itertools.islice(starts, self.concurrency):
                ahead.append(asyncio.ensure_future(part(start)))
            if dest is not None:
                dest[: len(first)] = first
                head = dest[: len(first)]
            else:
                head = memoryview(first)
            del first
            await self._land(head, consume)
            del head
            while ahead:
                view = await ahead.popleft()
                nxt = next(starts, None)
                if nxt is not None:
                    ahead.append(asyncio.ensure_future(part(nxt)))
                await self._land(view, consume)
                del view
        finally:
            for fut in ahead:
                fut.cancel()
            if ahead:
                await asyncio.gather(*ahead, return_exceptions=True)

    def size(self, key: str) -> int | None:
        head = self.transport.run(self._head, key)
        return None if head is None else int(head["ContentLength"])

    def exists(self, key: str) -> bool:
        return self.transport.run(self._head, key) is not None

    def sizes(self, keys: list[str]) -> dict[str, int]:
        """The sizes of those of ``keys`` that are present, from listing pages (``requests.listed_sizes``:
        never more requests than keys, one per lane where the keys are dense)."""
        return self.transport.run(listed_sizes, self.transport, list(keys))

    def mtime(self, key: str) -> float | None:
        head = self.transport.run(self._head, key)
        return None if head is None else float(head["LastModified"].timestamp())

    def touch(self, key: str) -> int | None:
        return self.transport.run(self._touch, key)

    def refresh(self, key: str, size: int) -> bool:
        """``touch`` of a key a listing found with ``size`` bytes: the copy onto itself alone, no HEAD."""
        return self.transport.run(self._refresh, key, size)

    async def _touch(self, key: str) -> int | None:
        head = await self._head(key)
        if head is None:
            return None
        size = int(head["ContentLength"])
        return size if await self._refresh(key, size) else None

    async def _refresh(self, key: str, size: int) -> bool:
        """Make ``LastModified`` now by copying the object onto itself (server side, no bytes
        move here); False if it vanished meanwhile. CopyObject stops at 5 GiB: a larger object
        keeps its time (SPEC.md §19.1 states the residual race)."""
        if size > _MAX_COPY_BYTES:
            return True
        source = {"Bucket": self.bucket, "Key": self.transport.key(key)}
        try:
            await self.transport.call(
                "copy_object", key, Key=self.transport.key(key), CopySource=source, MetadataDirective="REPLACE"
            )
        except S3Error as e:
            if e.status == 404:
                return False
            raise self.transport.fail("refresh", key, e) from None
        return True

    def write_once(self, key: str, data: Buffer) -> bool:
        return self.transport.run(self._write_once, key, data)

    async def _write_once(self, key: str, data: Buffer) -> bool:
        full = self.transport.key(key)
        view = memoryview(data).cast("B")
        multipart = len(view) > self.multipart_threshold
        conditional = await self._conditions()
        # A multipart upload can only fail its condition after every part is sent: look first.
        if (multipart or not conditional) and await self._touch(key) is not None:
            return False
        cond = {"IfNoneMatch": "*"} if conditional else {}
        try:
            if multipart:
                await multipart_upload(self.transport, key, view, conditional=conditional)
            else:
                # bytes of their own (a copy's download, a manifest) go as they are; a view (a tensor's memory) is copied
                body = data if isinstance(data, (bytes, bytearray)) else bytes(view)
                await self.transport.call("put_object", key, Key=full, Body=body, **cond)
        except S3Error as e:  # multipart_upload raises only a 412 as one
            if e.status == 412:
                return await self._confirm_present(key, e)
            raise self.transport.fail("write", key, e) from None
        return True

    async def _confirm_present(self, key: str, e: S3Error) -> bool:
        """A create-only write answered 412 ("already there"): believe it only after a HEAD
        finds the object, since a commit naming an object the server never stored would be
        acknowledged with a hole in it; then refresh it, as every writer relying on a present
        object does (SPEC.md §19.1)."""
        try:
            head = await self.transport.call("head_object", key, Key=self.transport.key(key))
        except S3Error as h:
            if h.status != 404:
                raise self.transport.fail("stat", key, h) from None
            raise StorageError(
                f"write {key!r} in store {self.url}: the server answered {e} but holds no such object"
            ) from None
        await self._refresh(key, int(head["ContentLength"]))
        return False  # already there; same name, same bytes

    def swap(self, key: str, expected: bytes | None, new: bytes) -> None:
        self.transport.run(self._swap, key, expected, new)

    async def _swap(self, key: str, expected: bytes | None, new: bytes) -> None:
        if not await self._conditions():
            raise StorageError(
                f"refusing to update {key} in store {self.url}: the server does not honour conditional writes "
                f"({self.conditional_reason or 'disabled by the caller'}), so a compare-and-swap cannot be guaranteed"
            )
        if expected is None:
            cond = {"IfNoneMatch": "*"}
        else:
            got = await self._get_or_none(key)
            current = None if got is None else got[1]
            if got is None or current != expected:
                raise RefConflict(f"{key}: expected {_show(expected)}, found {_show(current)}")
            cond = {"IfMatch": got[0]["ETag"]}
        try:
            await self.transport.call("put_object", key, Key=self.transport.key(key), Body=bytes(new), **cond)
        except S3Error as e:
            if e.status not in (404, 412):
                raise self.transport.fail("update", key, e) from None
            got = await self._get_or_none(key)
            now = None if got is None else got[1]
            if e.retried and now == new:
                return  # our earlier attempt landed; its answer was lost
            raise RefConflict(
                f"{key}: compare-and-swap lost in {self.url}: expected {_show(expected)}, found {_show(now)}"
            ) from None

    def delete(self, key: str) -> None:
        self.transport.run(self._delete, key)

    def delete_if(self, key: str, expected: bytes) -> None:
        self.transport.run(self._delete_if, key, expected)

    async def _delete_if(self, key: str, expected: bytes) -> None:
        """Read the value and its ETag, then ``DeleteObject`` with ``If-Match: <etag>``."""
        if not await self._conditions():
            raise StorageError(
                f"refusing to delete {key} in store {self.url}: the server does not honour conditional "
                f"requests ({self.conditional_reason or 'disabled by the caller'})"
            )
        got = await self._get_or_none(key)
        current = None if got is None else got[1]
        if got is None or current != expected:
            raise RefConflict(f"{key}: expected {_show(expected)}, found {_show(current)}")
        try:
            await self.transport.call("delete_object", key, Key=self.transport.key(key), IfMatch=got[0]["ETag"])
        except S3Error as e:
            if e.status not in (404, 412):
                raise self.transport.fail("delete", key, e) from None
            if e.retried and e.status == 404:
                return  # our earlier attempt landed; its answer was lost
            raise RefConflict(f"{key}: conditional delete lost in {self.url}: it changed since it was read") from None

    async def _delete(self, key: str) -> None:
        try:
            await self.transport.call("delete_object", key, Key=self.transport.key(key))
        except S3Error as e:
            if e.status != 404:
                raise self.transport.fail("delete", key, e) from None

    def list(self, prefix: str) -> Iterator[str]:
        return iter(self.transport.run(self._list, prefix))

    async def _list(self, prefix: str) -> list[str]:
        base = self.transport.key(prefix) + "/"
        skip = len(self.prefix) + 1 if self.prefix else 0
        keys: list[str] = []
        token: dict[str, str] = {}
        while True:
            try:
                page = await self.transport.call("list_objects_v2", prefix, Prefix=base, **token)
            except S3Error as e:
                raise self.transport.fail("list", prefix, e) from None
            keys.extend(o["Key"][skip:] for o in page.get("Contents", []))
            if not page.get("IsTruncated"):
                return sorted(keys)
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def sync(self) -> None:
        return None  # a PutObject answered 200 is durable
