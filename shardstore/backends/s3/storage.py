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
412 the second, third and fourth time (a ref or pin is deleted with ``If-Match``); opening a
store and reading it writes nothing, so a read-only credential can verify. A server that
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
lands the ranges straight in the caller's buffer (a tensor on restore) and
``hash_object`` (deep verify) holds at most ``concurrency`` + 1 ranges of an object at once.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from ...errors import ObjectNotFound, ObjectTooLarge, RefConflict, StorageError
from ...format.names import check_key
from ..base import Buffer
from .requests import multipart_upload, probe_conditions
from .transport import S3Error, S3Transport

__all__ = ["S3Storage", "DEFAULT_PART_SIZE", "DEFAULT_CONCURRENCY", "DEFAULT_ATTEMPTS"]

DEFAULT_PART_SIZE = 8 * 1024 * 1024
DEFAULT_CONCURRENCY = 16
DEFAULT_ATTEMPTS = 5
#: Ranges at least this large are consumed (hashed) in a worker thread, off the event loop.
_OFFLOAD_BYTES = 1 << 20
_BUCKET = re.compile(r"[a-zA-Z0-9.\-_]{1,255}")
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
        """``conditional``, probed when a write first needs it (reads never probe: read-only credentials work)."""
        if self._conditional is None:
            ok, reason = await probe_conditions(self.transport)
            if self._conditional is None:  # two writers may probe at once: the first answer stands
                self._conditional, self.conditional_reason = ok, reason
        return bool(self._conditional)

    async def _head(self, key: str) -> dict[str, Any] | None:
        try:
            return await self.transport.call("head_object", key, Key=self.transport.key(key))
        except S3Error as e:
            if e.status == 404:
                return None
            raise self.transport.fail("stat", key, e) from None

    async def _get_or_none(self, key: str) -> tuple[dict[str, Any], bytes] | None:
        try:
            return await self.transport.call("get_object", key, Key=self.transport.key(key))
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
        data = self.transport.run(self._read, key, h.update, limit)
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

    async def _read(self, key: str, consume: Callable[[memoryview], None] | None, limit: int | None = None) -> Buffer:
        buf: bytearray | None = None

        def sized(total: int) -> memoryview:
            nonlocal buf
            if limit is not None and total > limit:
                raise ObjectTooLarge(
                    f"{key} in store {self.url} is {total} bytes, over this reader's limit of {limit} (SPEC.md §Limits)"
                )
            buf = bytearray(total)
            return memoryview(buf)

        await self._stream(key, sized, consume)
        assert buf is not None
        return buf

    async def _stream(
        self,
        key: str,
        out: memoryview | Callable[[int], memoryview] | None,
        consume: Callable[[memoryview], None] | None,
    ) -> int:
        """GET ``key`` as ``part_size`` ranges, at most ``concurrency`` in flight, handled in order.

        ``out``: where the bytes go: a buffer (left untouched unless the object has exactly
        its size), a function of the object's size returning one, or None (ranges are only
        passed to ``consume``). Each range is copied into ``out`` as soon as it arrives;
        ``consume`` runs on each range in order, ranges of ``_OFFLOAD_BYTES`` and more in a
        worker thread so that hashing never stalls the event loop. With no ``out``, at most
        ``concurrency`` ranges wait while one is consumed. Ranges after the first carry
        ``If-Match`` on the first one's ETag (when the server sent one): a concurrent
        overwrite of the key (only a ref can be overwritten) fails the read instead of
        mixing versions. Returns the object's size.
        """
        full = self.transport.key(key)
        try:
            resp, first = await self.transport.call("get_object", key, Key=full, Range=f"bytes=0-{self.part_size - 1}")
        except S3Error as e:
            if e.status == 404:
                raise ObjectNotFound(f"{key} is missing from store {self.url}") from None
            if e.status == 416:  # a range of an empty object
                resp, first = {}, b""
            else:
                raise self.transport.fail("read", key, e) from None
        rng = str(resp.get("ContentRange") or "")
        status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if "/" in rng:
            total = int(rng.rsplit("/", 1)[1])
        elif status == 206:  # partial content that does not say of what: never guess the size
            raise StorageError(f"read {key!r} in store {self.url}: a ranged GET answered 206 without a Content-Range")
        else:
            total = len(first)  # the server sent the whole object (it ignored the range)
        if callable(out):
            out = out(total)
        elif out is not None and len(out) != total:
            return total
        dest = out
        conditions = {"IfMatch": resp["ETag"]} if resp.get("ETag") else {}
        del resp

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

        async def land(view: memoryview) -> None:
            if consume is not None and len(view) >= _OFFLOAD_BYTES:
                await asyncio.to_thread(consume, view)
            elif consume is not None and len(view):
                consume(view)  # a manifest or a small tensor: a thread hop would cost more

        starts = iter(range(len(first), total, self.part_size))
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
            await land(head)
            del head
            while ahead:
                view = await ahead.popleft()
                nxt = next(starts, None)
                if nxt is not None:
                    ahead.append(asyncio.ensure_future(part(nxt)))
                await land(view)
                del view
        finally:
            for fut in ahead:
                fut.cancel()
            if ahead:
                await asyncio.gather(*ahead, return_exceptions=True)
        return total

    def size(self, key: str) -> int | None:
        head = self.transport.run(self._head, key)
        return None if head is None else int(head["ContentLength"])

    def exists(self, key: str) -> bool:
        return self.transport.run(self._head, key) is not None

    def mtime(self, key: str) -> float | None:
        head = self.transport.run(self._head, key)
        return None if head is None else float(head["LastModified"].timestamp())

    def touch(self, key: str) -> int | None:
        return self.transport.run(self._touch, key)

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
                await self.transport.call("put_object", key, Key=full, Body=bytes(view), **cond)
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
