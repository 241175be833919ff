"""Message headers: encoding, checks against what the receiver expects, bounds, fuzzing."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardtrain_helpers import DETERMINISTIC_ENV, header_mismatch_worker, posted_header_mismatch_worker

from shardtrain import MessageError, MessageHeader, WorkerFailedError, check_header, launch_local
from shardtrain.engine.messages import ACTIVATION, GRADIENT, HEADER_LEN, MAGIC

EXPECTED = MessageHeader(ACTIVATION, 3, 1, torch.float32, (2, 5, 48))


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from([ACTIVATION, GRADIENT]),
    step=st.integers(0, 2**40),
    mb=st.integers(0, 1000),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    shape=st.lists(st.integers(0, 64), min_size=1, max_size=4),
)
def test_header_round_trips(kind: int, step: int, mb: int, dtype: torch.dtype, shape: list[int]) -> None:
    header = MessageHeader(kind, step, mb, dtype, tuple(shape))
    raw = header.encode()
    assert raw.shape == (HEADER_LEN,) and raw.dtype == torch.int64
    assert MessageHeader.decode(raw, max_elements=64**4) == header


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kind", GRADIENT),
        ("step", 4),
        ("microbatch", 0),
        ("dtype", torch.bfloat16),
        ("shape", (2, 6, 48)),
    ],
)
def test_each_mismatched_field_is_named(field: str, value: object) -> None:
    got = MessageHeader(**{**EXPECTED.__dict__, field: value})
    with pytest.raises(
        MessageError, match=f"message from slot 2: expected activation of step 3 microbatch 1 with {field} "
    ):
        check_header(got, EXPECTED, src=2)
    check_header(EXPECTED, EXPECTED, src=2)


def _raw(**changes: int) -> torch.Tensor:
    raw = EXPECTED.encode()
    names = ["magic", "version", "kind", "step", "microbatch", "dtype", "ndim", "d0", "d1", "d2", "d3", "numel"]
    for name, value in changes.items():
        raw[names.index(name)] = value
    return raw


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"magic": 0}, "without the shardtrain header magic"),
        ({"version": 2}, "version 2 is not supported"),
        ({"kind": 9}, "unknown kind 9"),
        ({"dtype": 77}, "unknown dtype code 77"),
        ({"ndim": 5}, "5 dimensions"),
        ({"ndim": 0}, "0 dimensions"),
        ({"d1": -5}, "invalid shape"),
        ({"d3": 4}, "invalid shape"),
        ({"numel": 481}, "numel 481 does not match"),
        ({"d2": 1 << 30, "numel": 10 * (1 << 30)}, "exceeds the bound"),
    ],
)
def test_malformed_headers_are_rejected(changes: dict[str, int], message: str) -> None:
    with pytest.raises(MessageError, match=message):
        MessageHeader.decode(_raw(**changes), max_elements=1 << 20)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=HEADER_LEN, max_size=HEADER_LEN), st.booleans())
def test_decoding_random_headers_never_crashes(fields: list[int], with_magic: bool) -> None:
    if with_magic:
        fields[0], fields[1] = MAGIC, 1
    try:
        header = MessageHeader.decode(torch.tensor(fields, dtype=torch.int64), max_elements=1 << 20)
    except MessageError:
        return
    assert 1 <= len(header.shape) <= 4 and all(d >= 0 for d in header.shape)


def test_receiver_refuses_a_mismatched_header_from_a_peer() -> None:
    with pytest.raises(WorkerFailedError) as info:
        launch_local(
            header_mismatch_worker,
            2,
            ("microbatch",),
            env=DETERMINISTIC_ENV,
            timeout=timedelta(seconds=30),
            join_timeout=90,
        )
    assert info.value.failures[0].startswith(
        "MessageError: message from slot 1: expected activation of step 7 microbatch 0 with microbatch 0, "
        "got microbatch 1"
    )


def test_a_receive_posted_ahead_checks_the_header_before_the_payload_is_used() -> None:
    with pytest.raises(WorkerFailedError) as info:
        launch_local(
            posted_header_mismatch_worker, 2, (), env=DETERMINISTIC_ENV, timeout=timedelta(seconds=30), join_timeout=90
        )
    assert info.value.failures[0].startswith(
        "MessageError: message from slot 1: expected activation of step 7 microbatch 0 with step 7, got step 8"
    )
