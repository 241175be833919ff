"""S3 requests, counted two ways: what shardstore's S3 backend sends for each storage call, and
what an S3-compatible server (moto on loopback) actually answered. ``bench_s3_requests.py``
measures with both and checks that they agree; ``bench_scale_sim.py`` uses the first to turn
the storage calls of its simulated commits into requests.

- ``requests_for``: the requests ``shardstore.backends.s3.S3Storage`` makes for one storage call
  (``Storage`` protocol, backends/base.py), given its outcome: a create-only write is one
  ``PutObject`` with ``If-None-Match: *`` (a 412 "already there" adds a HEAD and a CopyObject
  onto itself, which refreshes it for gc), above ``MULTIPART_THRESHOLD`` a HEAD, a multipart
  upload of ``PART`` parts; a read is ranged GETs of ``PART`` bytes; a ref's compare-and-swap a
  GET and a conditional PUT; a listing one ``ListObjectsV2`` per 1,000 keys; the probe of the
  server's request conditions (once per backend, before its first write) three PUTs and two
  DELETEs. Kept beside S3Storage's code by ``bench_s3_requests.py``, which fails when the
  server counts something else.
- ``Tally``: requests by phase, method and key class, and per key and rate class (hot keys).
- ``RecordingStorage``: a real backend whose every storage call is tallied with ``requests_for``;
  a presence check of many keys (``sizes``: listing pages, ``requests.listed_sizes``) is tallied
  as the pages it asked for, and ``listing_requests`` says how many pages that walk takes over a
  known set of keys (``bench_scale_sim``'s in-memory store).
- ``CountingServer``: moto's S3 server behind a WSGI layer that tallies every request it
  answers, server side, under the phase a worker last named (``POST /__phase__/<name>``).
- ``s3fs_write``, ``dcp_writes``: the requests s3fs makes to write one file, and the writes DCP's
  ``FsspecWriter`` makes to a rank's file.

Methods, as S3's request-rate classes group them: PUT, POST, COPY, DELETE (3,500 a second per
partitioned prefix) and GET, HEAD, LIST (5,500; a LIST is a GET on the bucket).

Not a benchmark itself (the leading underscore): imported by the scripts in this directory.
"""

from __future__ import annotations

import logging
import math
import threading
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from shardstore.backends.s3.storage import DEFAULT_PART_SIZE
from shardstore.errors import ObjectNotFound

__all__ = [
    "PART",
    "MULTIPART_THRESHOLD",
    "WRITE",
    "READ",
    "PUT_RATE",
    "GET_RATE",
    "requests_for",
    "listing_requests",
    "key_class",
    "Tally",
    "RecordingStorage",
    "CountingServer",
    "mark",
    "retried",
    "watch_lost",
    "s3fs_write",
    "s3fs_file",
    "dcp_writes",
    "SAVE_OVERHEAD",
    "floor_seconds",
]

PART = DEFAULT_PART_SIZE
#: S3Storage's default: objects above 4 parts go multipart.
MULTIPART_THRESHOLD = 4 * PART
#: CopyObject's limit: S3Storage does not refresh a larger object by copying it onto itself.
MAX_COPY = 5 * 1024**3
WRITE = ("PUT", "POST", "COPY", "DELETE")
READ = ("GET", "HEAD", "LIST")
#: S3's published request rates per partitioned prefix, per second.
PUT_RATE, GET_RATE = 3500, 5500


def _reads(size: int) -> int:
    """GETs of one whole object of ``size`` bytes: a first range of PART bytes, then the rest."""
    return 1 + max(0, math.ceil((size - PART) / PART))


def requests_for(op: str, *, size: int = 0, found: bool = True, keys: int = 0, whole: bool = True) -> Counter[str]:
    """The requests S3Storage sends for one storage call ``op`` (a method of the ``Storage``
    protocol, or ``probe``). ``size``: the object's bytes (written, or found); ``found``: a write
    found the object already there, a read or stat found it at all; ``keys``: a listing's keys;
    ``whole``: a ``read_into`` whose buffer had the object's size (else one range is read)."""
    c: Counter[str] = Counter()
    if op == "probe":
        c.update(PUT=3, DELETE=2)
    elif op == "write_once":
        copy = 1 if size <= MAX_COPY else 0
        if size > MULTIPART_THRESHOLD:
            c["HEAD"] += 1  # a multipart upload learns "already there" only at its end: look first
            if found:
                c["COPY"] += copy
            else:
                c.update(POST=2, PUT=math.ceil(size / PART))
        else:
            c["PUT"] += 1
            if found:  # 412, then confirmed by a HEAD and refreshed
                c.update(HEAD=1, COPY=copy)
    elif op in ("read", "read_hashed", "hash_object", "read_into"):
        c["GET"] += _reads(size) if found and (whole or op != "read_into") else 1
    elif op in ("size", "exists", "mtime"):
        c["HEAD"] += 1
    elif op == "refresh":  # a key a listing found: the copy onto itself alone
        if found and size <= MAX_COPY:
            c["COPY"] += 1
    elif op == "touch":
        c["HEAD"] += 1
        if found and size <= MAX_COPY:
            c["COPY"] += 1
    elif op == "swap_new":
        c["PUT"] += 1
    elif op == "swap":
        c.update(GET=1, PUT=1)
    elif op == "delete":
        c["DELETE"] += 1
    elif op == "delete_if":
        c.update(GET=1, DELETE=1)
    elif op == "list":
        c["LIST"] += max(1, math.ceil(keys / 1000))
    else:
        raise ValueError(f"unknown storage call {op!r}")
    return c


def listing_requests(present: list[str], asked: list[str], *, page: int = 1000, lane: int = 64, lanes: int = 16) -> int:
    """The ``ListObjectsV2`` requests ``requests.listed_sizes`` sends to find which of ``asked``
    are among ``present`` (both store keys; ``present`` sorted, every key the store holds under
    the asked keys' common prefix), walking the same lanes and pages over the sorted keys: a
    lane of the sorted asked keys asks for the page of ``page`` keys after its first unresolved
    key less its last character, resolves every asked key up to the page's last key, and goes
    on from the first after it; a page shorter than ``page`` ends the lane's walk.
    ``lane``/``lanes``: ``requests.LANE_KEYS`` and the backend's concurrency."""
    import bisect
    import os

    order = sorted(set(asked))
    if not order:
        return 0
    prefix = os.path.commonprefix(order)
    lo, hi = bisect.bisect_left(present, prefix), bisect.bisect_left(present, prefix + "\U0010ffff")
    count = max(1, min(lanes, len(order) // lane))
    step = -(-len(order) // count)
    sent = 0
    for at in range(0, len(order), step):
        keys, i = order[at : at + step], 0
        start = None  # None: from StartAfter of keys[i]; else the index a continuation resumes at
        while i < len(keys):
            begin = bisect.bisect_right(present, keys[i][:-1], lo, hi) if start is None else start
            end = min(begin + page, hi)
            sent += 1
            if end - begin < page or end == hi:
                break  # not truncated: every key after the start was seen
            last = present[end - 1]
            if last < keys[i]:
                start = end  # a page wholly before the key asked about: paged on
                continue
            start = None
            while i < len(keys) and keys[i] <= last:
                i += 1
    return sent


def key_class(key: str) -> str:
    """What a store key holds, by its first component (store/keys.py, gc_fence.py), else ``other``."""
    head = key.split("/", 1)[0]
    return head if head in ("objects", "refs", "pins", "intents", "gc", "tmp", "journal", "config") else "other"


class Tally:
    """Requests by (phase, method, key class) and by (phase, key, rate class: "W" for PUT, POST,
    COPY and DELETE, "R" for GET, HEAD and LIST). Thread-safe."""

    def __init__(self) -> None:
        self.by = Counter[tuple[str, str, str]]()
        self.keys = Counter[tuple[str, str, str]]()
        self.phase = "setup"
        self._lock = threading.Lock()

    def add(self, key: str, requests: Counter[str], phase: str | None = None) -> None:
        phase = self.phase if phase is None else phase
        with self._lock:
            for method, n in requests.items():
                if n:
                    self.by[(phase, method, key_class(key))] += n
                    self.keys[(phase, key, "W" if method in WRITE else "R")] += n

    def methods(self, phase: str) -> Counter[str]:
        out: Counter[str] = Counter()
        for (p, method, _cls), n in self.by.items():
            if p == phase:
                out[method] += n
        return out

    def classes(self, phase: str) -> Counter[tuple[str, str]]:
        """(method, key class) -> requests in ``phase``."""
        return Counter({(m, c): n for (p, m, c), n in self.by.items() if p == phase})

    def per_key(self, phase: str) -> dict[str, tuple[int, int]]:
        """key -> (write-class, read-class) requests in ``phase``."""
        out: dict[str, tuple[int, int]] = {}
        for (p, key, rate), n in self.keys.items():
            if p == phase:
                w, r = out.get(key, (0, 0))
                out[key] = (w + n, r) if rate == "W" else (w, r + n)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"by": [[*k, n] for k, n in self.by.items()], "keys": [[*k, n] for k, n in self.keys.items()]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Tally:
        t = cls()
        t.by.update({tuple(row[:3]): row[3] for row in doc["by"]})
        t.keys.update({tuple(row[:3]): row[3] for row in doc["keys"]})
        return t

    def merge(self, other: Tally) -> None:
        self.by.update(other.by)
        self.keys.update(other.keys)


class RecordingStorage:
    """A real backend (S3Storage) with every storage call tallied as the requests ``requests_for``
    says it makes, under ``tally.phase``. The probe is tallied when ``conditional`` is first read
    (call it before the first write: S3Storage probes on first use)."""

    def __init__(self, inner: Any, tally: Tally) -> None:
        self.inner, self.tally = inner, tally
        self.url = inner.url
        self._probed = False

    @property
    def conditional(self) -> bool:
        if not self._probed:
            self._probed = True
            self.tally.add("tmp/probe", requests_for("probe"))
        return bool(self.inner.conditional)

    def _add(self, key: str, op: str, **kw: Any) -> None:
        assert self._probed or op not in ("write_once", "swap", "swap_new", "delete_if"), "read .conditional first"
        self.tally.add(key, requests_for(op, **kw))

    def _read(self, op: str, key: str, call: Callable[[], Any], size: Callable[[Any], int]) -> Any:
        try:
            got = call()
        except ObjectNotFound:
            self._add(key, op, found=False)
            raise
        self._add(key, op, size=size(got))
        return got

    def read(self, key: str, limit: int | None = None) -> Any:
        return self._read("read", key, lambda: self.inner.read(key, limit), len)

    def read_hashed(self, key: str, hasher: Any, limit: int | None = None) -> Any:
        return self._read("read_hashed", key, lambda: self.inner.read_hashed(key, hasher, limit), lambda g: len(g[0]))

    def hash_object(self, key: str, hasher: Any, *, threads: int = 1) -> Any:
        return self._read(
            "hash_object", key, lambda: self.inner.hash_object(key, hasher, threads=threads), lambda g: g[1]
        )

    def read_into(self, key: str, out: memoryview, consume: Any = None) -> int:
        try:
            n = self.inner.read_into(key, out, consume)
        except ObjectNotFound:
            self._add(key, "read_into", found=False)
            raise
        self._add(key, "read_into", size=n, whole=n == len(out))
        return n

    def size(self, key: str) -> int | None:
        self._add(key, "size")
        return self.inner.size(key)

    def exists(self, key: str) -> bool:
        self._add(key, "exists")
        return self.inner.exists(key)

    def mtime(self, key: str) -> float | None:
        self._add(key, "mtime")
        return self.inner.mtime(key)

    def touch(self, key: str) -> int | None:
        n = self.inner.touch(key)
        self._add(key, "touch", size=n or 0, found=n is not None)
        return n

    def write_once(self, key: str, data: Any) -> bool:
        created = self.inner.write_once(key, data)
        self._add(key, "write_once", size=len(memoryview(data).cast("B")), found=not created)
        return created

    def swap(self, key: str, expected: bytes | None, new: bytes) -> None:
        self._add(key, "swap_new" if expected is None else "swap")
        self.inner.swap(key, expected, new)

    def delete(self, key: str) -> None:
        self._add(key, "delete")
        self.inner.delete(key)

    def delete_if(self, key: str, expected: bytes) -> None:
        self._add(key, "delete_if")
        self.inner.delete_if(key, expected)

    def list(self, prefix: str) -> Iterator[str]:
        keys = list(self.inner.list(prefix))
        self._add(prefix.rstrip("/") + "/", "list", keys=len(keys))
        return iter(keys)

    def sizes(self, keys: list[str]) -> dict[str, int]:
        """S3Storage's ``sizes`` (``ListedSizes``: what the store uses on S3 for presence checks of
        many objects), tallied as the listing pages it asked for: its walk runs here on a transport
        that counts them (the pages depend on what the store holds, which only the server knows)."""
        from shardstore.backends.s3.requests import listed_sizes

        counted = _PageCounter(self.inner.transport)
        found = self.inner.transport.run(listed_sizes, counted, list(keys))
        if keys:
            self.tally.add(sorted(keys)[0], Counter(LIST=counted.pages))
        return found

    def refresh(self, key: str, size: int) -> bool:
        ok = self.inner.refresh(key, size)
        self._add(key, "refresh", size=size, found=ok)
        return ok

    def sync(self) -> None:
        self.inner.sync()


class _PageCounter:
    """An ``S3Transport`` that counts the listing pages sent through it (``RecordingStorage.sizes``)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.pages = inner, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def call(self, method: str, key: str, **kwargs: Any) -> Any:
        if method == "list_objects_v2":
            self.pages += 1  # one request answered (a retry of it is counted apart, as the server's error)
        return await self.inner.call(method, key, **kwargs)


def _method(environ: dict[str, Any]) -> str:
    method = environ["REQUEST_METHOD"]
    query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    if method == "PUT" and environ.get("HTTP_X_AMZ_COPY_SOURCE"):
        return "COPY"  # CopyObject (and UploadPartCopy)
    if method == "GET" and "list-type" in query or method == "GET" and "prefix" in query:
        return "LIST"
    return method


class CountingServer:
    """moto's S3 server on 127.0.0.1 behind a WSGI layer that tallies each request it answers
    (method as S3's rate classes count it, key under the bucket, phase), and each answer's
    status (``status``: (phase, method, status) -> answers). A worker names the phase with
    ``mark(endpoint, name)`` (a POST to ``/__phase__/<name>``, answered here)."""

    def __init__(self, bucket: str) -> None:
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        # a line per request otherwise, and a traceback for each 500 (counted in ``status``)
        logging.getLogger("werkzeug").setLevel(logging.CRITICAL)
        self.bucket, self.tally, self.status = bucket, Tally(), Counter[tuple[str, str, int]]()
        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server("127.0.0.1", 0, self._wrap(app), threaded=True)
        host, port = self._server.server_address[:2]
        self.endpoint = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _wrap(self, app: Any) -> Callable[..., Any]:
        def counted(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            path = environ.get("PATH_INFO", "")
            if path.startswith("/__phase__/"):
                self.tally.phase = urllib.parse.unquote(path[len("/__phase__/") :])
                start_response("204 No Content", [])
                return [b""]
            method = _method(environ)
            parts = path.lstrip("/").split("/", 1)
            key = parts[1] if len(parts) == 2 and parts[0] == self.bucket else ""

            phase = self.tally.phase

            def start(status: str, headers: list, *rest: Any) -> Any:
                self.status[(phase, method, int(status.split()[0]))] += 1
                return start_response(status, headers, *rest)

            self.tally.add(key, Counter({method: 1}), phase)
            try:
                return app(environ, start)
            except Exception:  # werkzeug answers 500 itself (moto's in-memory backend is not safe
                self.status[(phase, method, 500)] += 1  # under concurrent writes to one key)
                raise

        return counted

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join()


def retried(status: Counter[tuple[str, str, int]], phase: str) -> Counter[str]:
    """Answers in ``phase`` that S3Storage retries (a server error, or 409 ConditionalRequestConflict;
    the save or restore went on, so each was retried), by method."""
    return Counter({m: n for (p, m, code), n in status.items() if p == phase and (code >= 500 or code == 409)})


#: botocore's operation names as S3's rate classes count them.
_OPERATIONS = {"PutObject": "PUT", "UploadPart": "PUT", "CopyObject": "COPY", "UploadPartCopy": "COPY",
               "CreateMultipartUpload": "POST", "CompleteMultipartUpload": "POST", "DeleteObjects": "POST",
               "DeleteObject": "DELETE", "AbortMultipartUpload": "DELETE", "GetObject": "GET", "HeadObject": "HEAD",
               "ListObjectsV2": "LIST"}  # fmt: skip


def watch_lost(client: Any, tally: Tally) -> None:
    """Tally under ``tally.phase`` each request of ``client`` (botocore's) that ended without an
    answer (a connection error, a timeout: botocore's ``after-call-error`` event). S3Storage
    retries them; the server may have answered the lost one, so it can count it twice."""

    def lost(event_name: str = "", **_kw: Any) -> None:
        op = event_name.rsplit(".", 1)[-1]
        tally.add("", Counter({_OPERATIONS.get(op, op): 1}))

    client.meta.events.register("after-call-error.s3", lost)


def mark(endpoint: str, phase: str) -> None:
    """Name the phase the server tallies requests under from now on."""
    urllib.request.urlopen(
        urllib.request.Request(f"{endpoint}/__phase__/{urllib.parse.quote(phase)}", method="POST"), timeout=30
    ).read()


def s3fs_write(writes: list[int], block: int) -> Counter[str]:
    """The requests s3fs sends to write a file by ``writes`` (the byte counts of successive
    writes) in ``block``-byte blocks: its buffer is flushed as one part whenever a write leaves
    it at ``block`` bytes or more, and at close; a file that never reached ``block`` is one PUT,
    any other a multipart upload (create, its parts, complete)."""
    parts = buffered = 0
    for n in writes:
        buffered += n
        if buffered >= block:
            parts, buffered = parts + 1, 0
    if parts == 0:
        return Counter(PUT=1)
    return Counter(POST=2, PUT=parts + (1 if buffered else 0))


def s3fs_file(size: int, block: int) -> Counter[str]:
    """``s3fs_write`` of a file written in writes much smaller than ``block`` (DCP's items at scale)."""
    if size < block:
        return Counter(PUT=1)
    return Counter(POST=2, PUT=math.ceil(size / block))


def dcp_writes(chunks: list[int]) -> list[int]:
    """The writes DCP's ``FileSystemWriter`` makes to a rank's file for tensor chunks of these
    byte counts: largest first (``_split_by_size_and_type``), each through ``torch.save``."""
    return [n + SAVE_OVERHEAD for n in sorted(chunks, reverse=True)]


def _torch_save_bytes(numel: int) -> int:
    import io

    import torch

    buf = io.BytesIO()
    torch.save(torch.zeros(numel), buf)
    return len(buf.getvalue())


#: What ``torch.save`` adds around a float32 tensor's bytes (FileSystemWriter saves each item so).
SAVE_OVERHEAD = _torch_save_bytes(1024) - 4096


def floor_seconds(write: float, read: float, partitions: int = 1, hot: tuple[float, float] = (0.0, 0.0)) -> float:
    """The fewest seconds S3's published per-prefix rates allow for ``write`` write-class and
    ``read`` read-class requests spread evenly over ``partitions`` partitioned prefixes, when one
    key (which S3 cannot split) takes ``hot`` = (write-class, read-class) of them."""
    return max(write / partitions / PUT_RATE, read / partitions / GET_RATE, hot[0] / PUT_RATE, hot[1] / GET_RATE)
