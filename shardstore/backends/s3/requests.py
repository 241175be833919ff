"""Request-level pieces of the S3 backend (``shardstore.s3``): the server's error answers, which
failures are transient, the probe of the server's request conditions and the concurrent
multipart upload (SPEC.md §19).

Kept apart from ``S3Storage`` so that the backend module holds the storage protocol and
its read path; everything here works through the backend's request surface, named by the
``Requester`` protocol below (bounded concurrency and retries in ``_call``), and is internal.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any, Protocol

from ...errors import StorageError

__all__ = ["Requester", "S3Error", "transient_errors", "gather", "multipart_upload", "probe_conditions"]


class S3Error(Exception):
    """A non-retryable error answer from the server (internal; mapped to typed errors by callers)."""

    def __init__(self, status: int, code: str, message: str, retried: bool) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.retried = status, code, retried


class Requester(Protocol):
    """What the multipart upload and the probe use of the backend (``S3Storage`` is the one):
    its bucket, part sizes and bounds, and its request plumbing."""

    url: str
    bucket: str
    part_size: int
    concurrency: int
    conditional: bool

    def _full(self, key: str) -> str: ...

    def _fail(self, op: str, key: str, e: S3Error) -> StorageError: ...

    async def _call(self, method: str, key: str, **kwargs: Any) -> Any: ...

    async def _abort(self, key: str, uid: str) -> None: ...

    async def _confirm_present(self, key: str, e: S3Error) -> bool: ...


def transient_errors() -> tuple[type[BaseException], ...]:
    """Connection-level failures worth retrying (the server never answered)."""
    import aiohttp
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError

    return (BotoConnectionError, HTTPClientError, aiohttp.ClientError, asyncio.TimeoutError)


async def gather(coros: Any) -> list[Any]:
    """Run coroutines together; on the first failure cancel the rest and re-raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def multipart_upload(storage: Requester, key: str, view: memoryview) -> bool:
    """Upload ``view`` as concurrent ``part_size`` parts, completed with ``If-None-Match: *``
    when the server honours it; aborted on any failure. True if this call wrote the object."""
    full = storage._full(key)
    try:
        upload = await storage._call("create_multipart_upload", key, Key=full)
    except S3Error as e:
        raise storage._fail("start multipart upload of", key, e) from None
    uid = upload["UploadId"]
    parts_in_memory = asyncio.Semaphore(storage.concurrency)  # bounds the copies of part bytes

    async def part(number: int, start: int) -> dict[str, Any]:
        async with parts_in_memory:
            body = bytes(view[start : start + storage.part_size])
            r = await storage._call("upload_part", key, Key=full, UploadId=uid, PartNumber=number, Body=body)
        return {"PartNumber": number, "ETag": r["ETag"]}

    try:
        parts = await gather(part(i + 1, s) for i, s in enumerate(range(0, len(view), storage.part_size)))
        cond = {"IfNoneMatch": "*"} if await storage._conditions() else {}
        await storage._call(
            "complete_multipart_upload", key, Key=full, UploadId=uid, MultipartUpload={"Parts": parts}, **cond
        )
        return True
    except S3Error as e:
        await storage._abort(key, uid)
        if e.status == 412:
            return await storage._confirm_present(key, e)
        raise storage._fail("multipart upload of", key, e) from None
    except BaseException:
        await storage._abort(key, uid)
        raise


async def probe_conditions(storage: Requester) -> tuple[bool, str]:
    """Does the server honour If-None-Match / If-Match on PutObject and If-Match on
    DeleteObject? (ok, reason if not; S3Storage's module docstring says why each matters)."""
    key = f"tmp/probe-{secrets.token_hex(8)}"
    full = storage._full(key)
    try:
        try:
            await storage._call("put_object", key, Key=full, Body=b"probe", IfNoneMatch="*")
        except S3Error as e:
            if e.code == "NoSuchBucket":
                raise StorageError(
                    f"cannot open store {storage.url}: bucket {storage.bucket!r} does not exist"
                ) from None
            return False, f"a create-only write (If-None-Match: *) was refused: {e}"
        stale = '"00000000000000000000000000000000"'
        for what, method, cond in (
            ("a second create-only write (If-None-Match: *)", "put_object", {"Body": b"again", "IfNoneMatch": "*"}),
            ("a write with a stale If-Match", "put_object", {"Body": b"again", "IfMatch": stale}),
            ("a delete with a stale If-Match", "delete_object", {"IfMatch": stale}),
        ):
            try:
                await storage._call(method, key, Key=full, **cond)
            except S3Error as e:
                if e.status == 412:
                    continue
                return False, f"{what} of {key} was answered {e} instead of 412"
            return False, f"{what} of {key} succeeded instead of failing with 412"
        return True, ""
    finally:
        try:
            await storage._call("delete_object", key, Key=full)
        except Exception:
            pass  # a stale probe under tmp/ is harmless; gc removes it
