"""Channel: checked, bounded point-to-point tensor messages between pipeline slots.

Every message is two transfers on the same (src, dst, tag): a fixed-size int64 header,
then the payload. The header says what the payload is (activation or gradient, step,
microbatch index, dtype, shape). The receiver knows what it expects next, checks the
header against it field by field, and only then allocates the payload buffer, whose size
is bounded by `max_elements`; any disagreement is a `MessageError` naming the field.

Every wait has a deadline: a peer that died breaks the connection (Gloo reports it at
once), and a peer that hangs makes the wait time out. Either way the caller gets a
`PeerFailureError` naming the peer, the message and the cause, instead of a hang.

Header layout (12 int64, little-endian in memory):
    0 magic  1 version  2 kind  3 step  4 microbatch  5 dtype code  6 ndim
    7..10 dims (unused dims are 0)  11 numel (= product of dims)
"""

from __future__ import annotations

import dataclasses
import math
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from shardtrain.errors import MessageError, PeerFailureError

__all__ = ["ACTIVATION", "GRADIENT", "REFERENCE", "MessageHeader", "check_header", "Channel", "PostedRecv"]

MAGIC = 0x53485452414E  # "SHTRAN"
VERSION = 1
HEADER_LEN = 12
MAX_NDIM = 4
ACTIVATION = 1
GRADIENT = 2
REFERENCE = 3  # activations of the frozen reference's forward-only pass (shardtrain.run.distill)
_KIND_NAMES = {ACTIVATION: "activation", GRADIENT: "gradient", REFERENCE: "reference activation"}
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


@dataclasses.dataclass(frozen=True)
class MessageHeader:
    """What a payload is: kind, step, microbatch index, dtype and shape."""

    kind: int
    step: int
    microbatch: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{_KIND_NAMES.get(self.kind, f'kind {self.kind}')} of step {self.step} microbatch {self.microbatch}"

    def encode(self) -> torch.Tensor:
        """The header as a (HEADER_LEN,) int64 tensor."""
        if self.dtype not in _DTYPE_CODES:
            raise MessageError(f"cannot send dtype {self.dtype}")
        if not 1 <= len(self.shape) <= MAX_NDIM:
            raise MessageError(f"cannot send a tensor of {len(self.shape)} dimensions (at most {MAX_NDIM})")
        dims = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        fields = [
            MAGIC,
            VERSION,
            self.kind,
            self.step,
            self.microbatch,
            _DTYPE_CODES[self.dtype],
            len(self.shape),
            *dims,
            math.prod(self.shape),
        ]
        return torch.tensor(fields, dtype=torch.int64)

    @classmethod
    def decode(cls, raw: torch.Tensor, *, max_elements: int) -> MessageHeader:
        """Parse and bound-check a received header; raise `MessageError` if malformed."""
        f = [int(x) for x in raw.cpu().tolist()]
        if len(f) != HEADER_LEN or f[0] != MAGIC:
            raise MessageError("received a message without the shardtrain header magic")
        if f[1] != VERSION:
            raise MessageError(f"message header version {f[1]} is not supported (expected {VERSION})")
        if f[2] not in _KIND_NAMES:
            raise MessageError(f"message header has unknown kind {f[2]}")
        if f[5] not in _CODE_DTYPES:
            raise MessageError(f"message header has unknown dtype code {f[5]}")
        ndim = f[6]
        if not 1 <= ndim <= MAX_NDIM:
            raise MessageError(f"message header has {ndim} dimensions (1..{MAX_NDIM} allowed)")
        shape = tuple(f[7 : 7 + ndim])
        if any(d < 0 for d in shape) or any(f[7 + ndim : 11]):
            raise MessageError(f"message header has an invalid shape {tuple(f[7:11])}")
        numel = math.prod(shape)
        if numel != f[11]:
            raise MessageError(f"message header numel {f[11]} does not match its shape {shape}")
        if numel > max_elements:
            raise MessageError(f"message of {numel} elements exceeds the bound of {max_elements}")
        return cls(f[2], f[3], f[4], _CODE_DTYPES[f[5]], shape)


def check_header(got: MessageHeader, expected: MessageHeader, *, src: int) -> None:
    """Raise `MessageError` naming the first field in which `got` differs from `expected`."""
    for field in ("kind", "step", "microbatch", "dtype", "shape"):
        g, e = getattr(got, field), getattr(expected, field)
        if g != e:
            raise MessageError(
                f"message from slot {src}: expected {expected.describe()} with {field} {e!r}, "
                f"got {field} {g!r} ({got.describe()})"
            )


@dataclasses.dataclass
class PostedRecv:
    """A receive posted ahead of need (`Channel.post`): header and payload buffers and their waits."""

    src: int
    expected: MessageHeader
    raw: torch.Tensor  # (HEADER_LEN,) int64
    payload: torch.Tensor  # the expected shape and dtype
    works: tuple[dist.Work, dist.Work]


class Channel:
    """One slot's message endpoint; slots are ranks of the default process group."""

    def __init__(self, rank: int, *, timeout: timedelta, max_elements: int, device: torch.device | str = "cpu") -> None:
        self.rank = rank
        self.timeout = timeout
        self.max_elements = max_elements
        self.device = torch.device(device)
        # Gloo moves host tensors only (no point-to-point for CUDA tensors): a CUDA slot whose
        # group is Gloo (two workers sharing one device, which NCCL refuses) stages each
        # message through host memory. NCCL, and every CPU slot, send tensors where they are.
        gloo = dist.is_initialized() and dist.get_backend() == "gloo"
        self.wire = torch.device("cpu") if gloo and self.device.type != "cpu" else self.device
        self.bytes_sent = 0
        self.bytes_received = 0
        self.wait_seconds = 0.0  # time spent blocked in receives (how well a schedule overlaps)
        # Sends are asynchronous so the ring cannot deadlock; their buffers must stay alive
        # until `flush` waits for them.
        self._pending: list[tuple[dist.Work, MessageHeader, int, torch.Tensor, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, dst: int, header: MessageHeader) -> None:
        """Start sending `tensor` with `header` to slot `dst`; `flush` completes it."""
        assert tuple(tensor.shape) == header.shape and tensor.dtype == header.dtype, (tensor.shape, header)
        if tensor.numel() > self.max_elements:
            raise MessageError(
                f"slot {self.rank}: {header.describe()} of {tensor.numel()} elements exceeds "
                f"the bound of {self.max_elements}"
            )
        raw = header.encode().to(self.wire)
        payload = tensor.detach().to(self.wire).contiguous()
        try:
            for t in (raw, payload):
                self._pending.append((dist.isend(t, dst, tag=header.kind), header, dst, raw, payload))
        except RuntimeError as exc:
            raise self._peer_error("sending", "to", dst, header, exc) from exc
        self.bytes_sent += raw.numel() * raw.element_size() + payload.numel() * payload.element_size()

    def recv(self, src: int, expected: MessageHeader) -> torch.Tensor:
        """Receive the next message from slot `src`, which must match `expected`."""
        if math.prod(expected.shape) > self.max_elements:
            raise MessageError(
                f"slot {self.rank}: expected {expected.describe()} of shape {expected.shape} "
                f"exceeds the bound of {self.max_elements} elements"
            )
        raw = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.wire)
        self._wait_recv(raw, src, expected)
        got = MessageHeader.decode(raw, max_elements=self.max_elements)
        check_header(got, expected, src=src)
        payload = torch.empty(expected.shape, dtype=expected.dtype, device=self.wire)
        self._wait_recv(payload, src, expected)
        self.bytes_received += raw.numel() * raw.element_size() + payload.numel() * payload.element_size()
        return payload.to(self.device)

    def post(self, src: int, expected: MessageHeader) -> PostedRecv:
        """Post the receive of the next message from `src` now, so that it can land while this
        slot computes (Gloo moves a message only once both sides have posted it); `wait`
        checks its header and returns its payload. Posted receives from one `src` with one
        kind match that peer's sends in the order they were posted."""
        if math.prod(expected.shape) > self.max_elements:
            raise MessageError(
                f"slot {self.rank}: expected {expected.describe()} of shape {expected.shape} "
                f"exceeds the bound of {self.max_elements} elements"
            )
        raw = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.wire)
        payload = torch.empty(expected.shape, dtype=expected.dtype, device=self.wire)
        try:
            works = (dist.irecv(raw, src, tag=expected.kind), dist.irecv(payload, src, tag=expected.kind))
        except RuntimeError as exc:
            raise self._peer_error("receiving", "from", src, expected, exc) from exc
        return PostedRecv(src, expected, raw, payload, works)

    def wait(self, posted: PostedRecv) -> torch.Tensor:
        """The payload of a posted receive, once its header has arrived and matched."""
        src, expected = posted.src, posted.expected
        for i, work in enumerate(posted.works):
            t0 = time.perf_counter()
            try:
                work.wait(self.timeout)
            except RuntimeError as exc:
                raise self._peer_error("receiving", "from", src, expected, exc) from exc
            finally:
                self.wait_seconds += time.perf_counter() - t0
            if i == 0:  # the header is checked before the payload is waited for or used
                check_header(MessageHeader.decode(posted.raw, max_elements=self.max_elements), expected, src=src)
        self.bytes_received += (
            posted.raw.numel() * posted.raw.element_size() + posted.payload.numel() * posted.payload.element_size()
        )
        return posted.payload.to(self.device)

    def settle(self, dst: int, kind: int, microbatch: int) -> None:
        """Complete and release the sends of (`dst`, `kind`, `microbatch`), which the caller
        knows were received (a reply that depends on them has arrived)."""
        keep = []
        for entry in self._pending:
            work, header, to = entry[0], entry[1], entry[2]
            if to == dst and header.kind == kind and header.microbatch == microbatch:
                try:
                    work.wait(self.timeout)
                except RuntimeError as exc:
                    raise self._peer_error("sending", "to", dst, header, exc) from exc
            else:
                keep.append(entry)
        self._pending = keep

    def flush(self) -> None:
        """Wait until every started send has completed."""
        pending, self._pending = self._pending, []
        for work, header, dst, _raw, _payload in pending:
            try:
                work.wait(self.timeout)
            except RuntimeError as exc:
                raise self._peer_error("sending", "to", dst, header, exc) from exc

    def _wait_recv(self, buf: torch.Tensor, src: int, expected: MessageHeader) -> None:
        t0 = time.perf_counter()
        try:
            dist.irecv(buf, src, tag=expected.kind).wait(self.timeout)
        except RuntimeError as exc:
            raise self._peer_error("receiving", "from", src, expected, exc) from exc
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def _peer_error(
        self, verb: str, prep: str, peer: int, header: MessageHeader, exc: BaseException
    ) -> PeerFailureError:
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return PeerFailureError(
            f"slot {self.rank}: {verb} {header.describe()} {prep} slot {peer} failed "
            f"(timeout {self.timeout.total_seconds():g} s); the peer died, hung or "
            f"disconnected: {cause}"
        )
