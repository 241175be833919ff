"""Request-level pieces of the S3 backend that take several requests (SPEC.md §19): the
concurrent multipart upload and the probe of the server's request conditions.

Kept apart from ``S3Storage`` so that the backend module holds the storage protocol and its
read path; everything here reaches the server through the storage's ``S3Transport``
(``transport``: one request with bounded concurrency and retries), the only surface it uses.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from ...errors import StorageError
from .transport import S3Error, S3Transport

__all__ = ["gather", "multipart_upload", "probe_conditions"]


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


async def multipart_upload(transport: S3Transport, key: str, view: memoryview, *, conditional: bool) -> None:
    """Upload ``view`` as concurrent ``part_size`` parts, completed with ``If-None-Match: *``
    when ``conditional`` (the server honours it); aborted on any failure. An answer of 412 to
    the completion (the object is already there) is raised as the ``S3Error`` for the caller
    to confirm; any other refusal is a StorageError."""
    full = transport.key(key)
    try:
        upload = await transport.call("create_multipart_upload", key, Key=full)
    except S3Error as e:
        raise transport.fail("start multipart upload of", key, e) from None
    uid = upload["UploadId"]
    parts_in_memory = asyncio.Semaphore(transport.concurrency)  # bounds the copies of part bytes

    async def part(number: int, start: int) -> dict[str, Any]:
        async with parts_in_memory:
            body = bytes(view[start : start + transport.part_size])
            r = await transport.call("upload_part", key, Key=full, UploadId=uid, PartNumber=number, Body=body)
        return {"PartNumber": number, "ETag": r["ETag"]}

    try:
        parts = await gather(part(i + 1, s) for i, s in enumerate(range(0, len(view), transport.part_size)))
        cond = {"IfNoneMatch": "*"} if conditional else {}
        await transport.call(
            "complete_multipart_upload", key, Key=full, UploadId=uid, MultipartUpload={"Parts": parts}, **cond
        )
    except S3Error as e:
        await _abort(transport, key, uid)
        if e.status == 412:
            raise
        raise transport.fail("multipart upload of", key, e) from None
    except BaseException:
        await _abort(transport, key, uid)
        raise


async def _abort(transport: S3Transport, key: str, uid: str) -> None:
    try:
        await transport.call("abort_multipart_upload", key, Key=transport.key(key), UploadId=uid)
    except Exception:
        pass  # best effort; a bucket lifecycle rule reaps the rest


async def probe_conditions(transport: S3Transport) -> tuple[bool, str]:
    """Does the server honour If-None-Match / If-Match on PutObject and If-Match on
    DeleteObject? (ok, reason if not; S3Storage's module docstring says why each matters)."""
    key = f"tmp/probe-{secrets.token_hex(8)}"
    full = transport.key(key)
    try:
        try:
            await transport.call("put_object", key, Key=full, Body=b"probe", IfNoneMatch="*")
        except S3Error as e:
            if e.code == "NoSuchBucket":
                raise StorageError(
                    f"cannot open store {transport.url}: bucket {transport.bucket!r} does not exist"
                ) from None
            return False, f"a create-only write (If-None-Match: *) was refused: {e}"
        stale = '"00000000000000000000000000000000"'
        for what, method, cond in (
            ("a second create-only write (If-None-Match: *)", "put_object", {"Body": b"again", "IfNoneMatch": "*"}),
            ("a write with a stale If-Match", "put_object", {"Body": b"again", "IfMatch": stale}),
            ("a delete with a stale If-Match", "delete_object", {"IfMatch": stale}),
        ):
            try:
                await transport.call(method, key, Key=full, **cond)
            except S3Error as e:
                if e.status == 412:
                    continue
                return False, f"{what} of {key} was answered {e} instead of 412"
            return False, f"{what} of {key} succeeded instead of failing with 412"
        return True, ""
    finally:
        try:
            await transport.call("delete_object", key, Key=full)
        except Exception:
            pass  # a stale probe under tmp/ is harmless; gc removes it
