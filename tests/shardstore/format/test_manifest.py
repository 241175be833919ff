"""Canonical encoding and strict decoding of manifests (properties and rejections)."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import commit_manifests, shard_manifests

from shardstore.errors import ManifestError
from shardstore.format.manifest import (
    MAX_MANIFEST_BYTES,
    CommitManifest,
    ShardManifest,
    StoreConfig,
    decode,
    decode_config,
    encode,
    encode_config,
    f64_decode,
    f64_encode,
)


@given(shard_manifests())
def test_shard_round_trip_and_canonical(m):
    b = encode(m)
    assert decode(b) == m
    assert encode(decode(b)) == b


@given(commit_manifests())
def test_commit_round_trip_and_canonical(m):
    b = encode(m)
    assert decode(b) == m


@given(commit_manifests(), st.randoms(use_true_random=False))
def test_field_order_never_changes_the_bytes(m, rnd):
    """Any key order decodes to the same manifest, but only the sorted spelling is accepted."""
    doc = json.loads(encode(m))

    def shuffle(x):
        if isinstance(x, dict):
            items = list(x.items())
            rnd.shuffle(items)
            return {k: shuffle(v) for k, v in items}
        if isinstance(x, list):
            return [shuffle(v) for v in x]
        return x

    shuffled = json.dumps(shuffle(doc), separators=(",", ":")).encode()
    relaxed = msgspec.json.decode(shuffled, type=CommitManifest)
    assert encode(relaxed) == encode(m)
    if shuffled != encode(m):
        with pytest.raises(ManifestError, match="canonical"):
            decode(shuffled)


@given(st.floats(allow_nan=False))
def test_f64_is_exact(x):
    assert f64_decode(f64_encode(x)) == x
    assert len(f64_encode(x)) == 16


@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**60), 2**60)
        | st.floats(allow_nan=False)
        | st.text(max_size=5).filter(lambda s: not s.startswith("f64:")),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
        max_leaves=10,
    )
)
def test_config_round_trip(value):
    cfg = {"v": value}
    b = encode_config(cfg)
    assert decode_config(b) == cfg
    assert encode_config(decode_config(b)) == b


def test_config_rejects_plain_reals_and_reserved_prefix():
    with pytest.raises(ManifestError, match="f64"):
        decode_config(b'{"eps":1e-05}')
    with pytest.raises(ManifestError, match="reserved"):
        encode_config({"x": "f64:0000000000000000"})


def _shard_bytes() -> bytes:
    from strategies import shard_manifests as _  # noqa: F401

    return encode(
        ShardManifest(
            version=1,
            job="j",
            step=0,
            parent=None,
            config=None,
            slot=0,
            slots=1,
            algorithm="none",
            groups=(),
            entries=(),
            rng=(),
        )
    )


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b.replace(b'"version":1', b'"version":5'), "version 5 is not supported"),
        # Formats 2 and 3 exist for chunked payloads only: a shard without one must say version 1.
        (lambda b: b.replace(b'"version":1', b'"version":2'), "must be version 1"),
        (lambda b: b.replace(b'"version":1', b'"version":3'), "must be version 1"),
        (lambda b: b.replace(b'"type":"shard"', b'"type":"tree"'), "unknown manifest type 'tree'"),
        (lambda b: b.replace(b'"slot":0', b'"slot":0,"extra":1'), "unknown field `extra`"),
        (lambda b: b.replace(b'"step":0', b'"step":-1'), "step"),
        (lambda b: b.replace(b'"job":"j"', b'"job":"../x"'), "job"),
        (lambda b: b.replace(b'"slots":1', b'"slots":1.0'), "slots"),
        (lambda b: b.replace(b'"step":0', b'"step":0 '), "canonical"),
        (lambda b: b[:-1], "not a manifest"),
        (lambda b: b.replace(b'"rng":[]', b'"rng":{}'), "rng"),
        (lambda b: b"\x80\x04pickle", "not a manifest"),
    ],
)
def test_strict_decoding(mutate, message):
    with pytest.raises(ManifestError, match=message):
        decode(mutate(_shard_bytes()))


def test_size_is_bounded_before_parsing():
    with pytest.raises(ManifestError, match="limit"):
        decode(b" " * (MAX_MANIFEST_BYTES + 1))


def test_store_config_unknown_version_refused():
    b = encode(StoreConfig(version=1)).replace(b'"version":1', b'"version":9')
    with pytest.raises(ManifestError, match="version 9"):
        decode(b)


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_raise_untyped(data):
    try:
        decode(data)
    except ManifestError:
        pass
