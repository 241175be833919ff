"""The S3 backend's transport: one request to the server, with bounded concurrency and retries (SPEC.md §19).

``S3Transport`` is the whole surface that ``S3Storage`` and the request layer (``requests``:
the multipart upload, the probe of request conditions) use to reach the server: a store
key's full object key under the prefix (``key``), one request by aiobotocore method name
(``call``; a ``get_object`` whose body is piped to a consumer as it streams in, ``pipe``), a coroutine run on s3fs's event loop from any thread (``run``), and the
StorageError that names a refused request (``fail``). The storage holds one.

Retries are ours and bounded: 500/502/503/504, SlowDown, 409 ConditionalRequestConflict and
connection errors or timeouts (``transient_errors``) are retried with jittered exponential
backoff, ``attempts`` tries in all; after the last the error is a StorageError naming the
key. Any other error answer is an ``S3Error`` (status, code, and whether the request had
been retried: a conditional write that got 412 on a retry may have landed on its first
try), for the caller to map to a typed error. At most ``concurrency`` requests are in
flight, from any number of threads: every request runs on s3fs's event loop.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import fsspec.asyn

from ...errors import StorageError, StorageOptionError
from ...format.names import check_key

__all__ = ["S3Error", "S3Transport", "transient_errors"]

T = TypeVar("T")

_RETRY_STATUS = frozenset({500, 502, 503, 504})
#: The most a piped body hands its consumer at once: what one socket read delivers (asyncio's
#: 256 KiB), so that a piece is normally handed on as it was received, never joined or cut.
PIPE_PIECE = 256 * 1024
_RETRY_CODES = frozenset(
    {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "ConditionalRequestConflict"}
)


class S3Error(Exception):
    """A non-retryable error answer from the server (internal; mapped to typed errors by callers)."""

    def __init__(self, status: int, code: str, message: str, retried: bool) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.retried = status, code, retried


def transient_errors() -> tuple[type[BaseException], ...]:
    """Connection-level failures worth retrying (the server never answered)."""
    import aiohttp
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError

    return (BotoConnectionError, HTTPClientError, aiohttp.ClientError, asyncio.TimeoutError)


class S3Transport:
    """Requests to one bucket under one prefix through s3fs's aiobotocore client (see module docstring).

    ``fs``: the ``s3fs.S3FileSystem`` whose client and event loop carry the requests; ``url``:
    the store's URL, for messages; ``part_size``: the size of an upload part and of a ranged GET.
    """

    def __init__(
        self,
        fs: Any,
        *,
        url: str,
        bucket: str,
        prefix: str,
        part_size: int,
        concurrency: int,
        attempts: int,
        backoff: float,
    ) -> None:
        from botocore.exceptions import BotoCoreError

        self.fs, self.url, self.bucket, self.prefix = fs, url, bucket, prefix
        self.part_size, self.concurrency, self.attempts, self.backoff = part_size, concurrency, attempts, backoff
        self._sem: asyncio.Semaphore | None = None
        self._transient = transient_errors()
        self._client_side: type[BaseException] = BotoCoreError

    def key(self, key: str) -> str:
        """The object key of store key ``key`` (checked), under the prefix."""
        key = check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run coroutine function ``fn(*args)`` on s3fs's event loop and return its result (from any thread)."""
        return fsspec.asyn.sync(self.fs.loop, fn, *args)

    def fail(self, op: str, key: str, e: S3Error) -> StorageError:
        """The StorageError of request ``op`` on ``key`` answered ``e``."""
        return StorageError(f"{op} {key!r} in store {self.url}: server answered {e}")

    async def call(
        self,
        method: str,
        key: str,
        *,
        pipe: Callable[[dict[str, Any]], Callable[[bytes], None]] | None = None,
        **kwargs: Any,
    ) -> Any:
        """One request (aiobotocore's ``method``, on this bucket; ``key`` names it in errors) with
        bounded retries of transient failures. ``get_object`` returns (response, body); with
        ``pipe``, (response, bytes received): ``pipe(response)`` is called when the answer's
        headers arrive (again for a retried attempt) and returns the consumer of the body, handed
        each piece in order as it arrives, on the event loop, and never holding the body whole."""
        if self._sem is None:  # created on the loop thread, the only thread that touches it
            self._sem = asyncio.Semaphore(self.concurrency)
        client = await self._client()
        last: BaseException | None = None
        for attempt in range(self.attempts):
            if attempt:
                await asyncio.sleep(self.backoff * (2 ** (attempt - 1)) * (0.5 + random.random()))
            try:
                async with self._sem:
                    resp = await getattr(client, method)(Bucket=self.bucket, **kwargs)
                    if method == "get_object":
                        try:
                            if pipe is None:
                                return resp, await resp["Body"].read()
                            return resp, await _pipe(resp, pipe(resp))
                        finally:
                            resp["Body"].close()
                    return resp
            except self._transient as e:
                last = e
            except Exception as e:
                answer = getattr(e, "response", None)
                if not isinstance(answer, dict):
                    if isinstance(e, self._client_side):  # no credentials, an invalid bucket name...
                        text = " ".join(str(e).split())  # one line: botocore's messages span several
                        raise StorageError(
                            f"{method} {key!r} in store {self.url}: {type(e).__name__}: {text}"
                        ) from None
                    raise
                err = answer.get("Error", {})
                status = int(answer.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
                code = str(err.get("Code", status))
                if status in _RETRY_STATUS or code in _RETRY_CODES:
                    last = e
                    continue
                raise S3Error(status, code, str(err.get("Message", "")), attempt > 0) from None
        raise StorageError(f"{method} {key!r} in store {self.url} failed after {self.attempts} attempts: {last}")

    async def _client(self) -> Any:
        """s3fs's botocore client, made on first use; a client that cannot be made from the
        options (a profile that does not exist, a ``config_kwargs`` botocore refuses) is a
        StorageOptionError, not a traceback from inside aiobotocore."""
        try:
            return await self.fs.set_session()
        except (self._client_side, ValueError, TypeError) as e:
            text = " ".join(str(e).split())
            raise StorageOptionError(
                f"cannot open store {self.url!r}: no S3 client can be made from its storage options: "
                f"{type(e).__name__}: {text}"
            ) from None


async def _pipe(resp: dict[str, Any], consume: Callable[[bytes], None]) -> int:
    """Hand ``resp``'s body to ``consume`` piece by piece as it arrives; the bytes received (the
    body checks them against the Content-Length it was sent with as it ends)."""
    body, n = resp["Body"], 0
    while piece := await body.read(PIPE_PIECE):
        consume(piece)
        n += len(piece)
    return n
