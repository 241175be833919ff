"""SPEC.md's encoding rules, implemented here in plain Python (no msgspec) and compared with the
project's own encoders, so the text and the code cannot drift apart (issue 26, Build 6):

- §7: how a string is written (which characters are escaped, and how) and the order of
  object keys (by UTF-8 bytes, which is code-point order), on every code point;
- docs/SHARDTRAIN-FORMATS.md §1: how a gate report writes a real (msgspec's float text).
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from shardstore.format.manifest import HyperGroup, encode, encode_config

#: SPEC.md §7: the only escapes; every other character (DEL, U+2028, U+2029, "/", non-ASCII) is its own UTF-8 bytes.
_SHORT = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _escape_char(ch: str) -> str:
    if ch in _SHORT:
        return _SHORT[ch]
    if ord(ch) < 0x20:
        return f"\\u{ord(ch):04x}"  # lowercase hex digits
    return ch


def spec_string(s: str) -> bytes:
    """A string's canonical bytes by SPEC.md §7's rule."""
    return ('"' + "".join(_escape_char(c) for c in s) + '"').encode("utf-8")


def spec_object(d: dict[str, str]) -> bytes:
    """A flat object of strings by SPEC.md §7: keys in order of their UTF-8 bytes, no whitespace."""
    keys = sorted(d, key=lambda k: k.encode("utf-8"))
    return b"{" + b",".join(spec_string(k) + b":" + spec_string(d[k]) for k in keys) + b"}"


def test_every_code_point_is_written_as_spec_says():
    """All 1,112,064 Unicode scalar values (surrogates cannot be encoded: a lone one is refused
    before writing, §7), one string each, through the canonical encoder of manifests."""
    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    got = encode(HyperGroup(name="g", hyper={"s": tuple(chars)}))
    want = ('{"hyper":{"s":["' + '","'.join(map(_escape_char, chars)) + '"]},"name":"g"}').encode("utf-8")
    if got != want:  # name the first code point written otherwise
        bad = next(
            c
            for c in chars
            if encode(HyperGroup(name="g", hyper={"s": c})) != b'{"hyper":{"s":' + spec_string(c) + b'},"name":"g"}'
        )
        raise AssertionError(f"U+{ord(bad):04X} is not written as SPEC.md §7 says")
    # the cases SPEC.md names, spelled out
    for ch, text in (("\x00", b'"\\u0000"'), ("\x1f", b'"\\u001f"'), ("\x0b", b'"\\u000b"'), ("\x7f", b'"\x7f"'), ("/", b'"/"'),
                     ("\u2028", '"\u2028"'.encode()), ("\u00e9", b'"\xc3\xa9"'), ("\U0010ffff", b'"\xf4\x8f\xbf\xbf"')):  # fmt: skip
        assert spec_string(ch) == text


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(max_size=8), st.text(max_size=12), max_size=6))
def test_model_config_strings_and_key_order_follow_spec(d):
    """Random text (any code point but surrogates) as keys and values of a model config."""
    assert encode_config(d) == spec_object(d)


def test_key_order_is_code_point_order_not_utf16():
    """U+FFFF sorts before U+10000 (UTF-8 bytes and code points agree; UTF-16 units would not)."""
    d = {"\U00010000": "a", "\uffff": "b", "b": "c", "B": "d", "\u00e9": "e"}
    assert encode_config(d) == spec_object(d) == '{"B":"d","b":"c","é":"e","\uffff":"b","\U00010000":"a"}'.encode()


def spec_real(x: float) -> str:
    """A gate report's real by docs/SHARDTRAIN-FORMATS.md §1: Python's shortest round-trip digits, written in
    plain notation when the decimal exponent e of the first digit is -5 <= e < 16 (with at
    least one digit after the point), else as d[.ddd]e<e> (no "+", no leading zeros)."""
    if x == 0:
        return "-0.0" if math.copysign(1, x) < 0 else "0.0"
    sign, r = ("-", repr(-x)) if x < 0 else ("", repr(x))
    m = re.fullmatch(r"(\d)(?:\.(\d+))?e([+-]\d+)", r)
    if m:
        digits, e = m.group(1) + (m.group(2) or ""), int(m.group(3))
    else:
        whole, frac = r.split(".")
        e = len(whole) - 1 if whole != "0" else -(len(frac) - len(frac.lstrip("0")) + 1)
        digits = (whole + frac).lstrip("0")
    digits = digits.rstrip("0") or "0"
    if -5 <= e < 16:
        if e < 0:
            return sign + "0." + "0" * (-e - 1) + digits
        whole, frac = digits[: e + 1].ljust(e + 1, "0"), digits[e + 1 :] or "0"
        return sign + whole + "." + frac
    return sign + digits[0] + ("." + digits[1:] if len(digits) > 1 else "") + f"e{e}"


@functools.lru_cache(maxsize=1)
def _gate_store():
    import shardstore as ss

    return ss.open_store(f"memory://gates-{uuid.uuid4().hex}")


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                 st.integers(-(10**17), 10**17).flatmap(lambda n: st.integers(0, 22).map(lambda k: n / 10**k))))  # fmt: skip
def test_gate_report_reals_follow_spec(x):
    """A gate report holding ``x`` as a row's value, as stored: its text is SPEC.md's rule."""
    from shardtrain.run.gates import GateReport, GateRow, write_gate_report

    store = _gate_store()
    report = GateReport(
        1,
        "a" * 64,
        "development",
        "b" * 64,
        "c" * 64,
        2000,
        0,
        (GateRow("gain", "dev_task", x, -1.5, -0.001, True),),
        True,
    )
    raw = bytes(store.get(write_gate_report(store, report)))
    row = f'{{"bound":-1.5,"gate":"gain","passed":true,"set":"dev_task","threshold":-0.001,"value":{spec_real(x)}}}'
    assert raw.decode() == ('{"baseline":"' + "b" * 64 + '","candidate":"' + "c" * 64 + '","job":"' + "a" * 64 + '","passed":true,'
                            '"resamples":2000,"role":"development","rows":[' + row + '],"seed":0,"type":"shardtrain-gate-report","version":1}')  # fmt: skip
    assert struct.pack(">d", json.loads(raw)["rows"][0]["value"]) == struct.pack(
        ">d", x
    )  # the text reads back to the same bits


def test_new_slot_rng_seed_is_spelled_as_spec_says():
    """SPEC.md §15.1's seed of a new slot's RNG, byte-exact: the ASCII message with the commit id
    as hex text and k in decimal, BLAKE2b with an 8-byte digest, little-endian, mod 2^32."""
    import hashlib

    from shardtrain.reshape.regroup import rng_seed

    cid = "7aefa805a1d63548eef4513d9fa55a9d83cc1ffc93634f6c7c0eba2cd6da378c"
    message = b"shardtrain-rng-v1:" + cid.encode("ascii") + b":2"
    assert len(message) == 84 and hashlib.blake2b(message, digest_size=8).hexdigest() == "23625dbe01f6b7df"
    assert rng_seed(cid, 2) == int.from_bytes(bytes.fromhex("23625dbe01f6b7df"), "little") % 2**32 == 3193791011
    assert (
        rng_seed(cid, 10)
        == int.from_bytes(hashlib.blake2b(f"shardtrain-rng-v1:{cid}:10".encode(), digest_size=8).digest(), "little")
        % 2**32
    )


# -- the points SPEC.md left open, each settled by one sentence (issue 35, item 6) ------------------


def _nested(levels: int, leaf: object) -> dict:
    """``{"a": {"a": ... leaf}}``: ``leaf`` enclosed by ``levels`` objects (at depth ``levels``, SPEC.md §7)."""
    value = leaf
    for _ in range(levels):
        value = {"a": value}
    return value


def test_nesting_levels_count_the_containers_enclosing_a_value():
    """SPEC.md §7's nesting: a value's depth is the number of arrays and objects enclosing it, so
    ``{"a": 1}`` is one level and an empty container adds none of its own. The model config holds
    32 levels and state documents 64, on writing and on reading alike (the bytes of one level
    more, built by hand, are refused by the reader)."""
    import pytest

    from shardstore.errors import ManifestError, UnsupportedState
    from shardstore.format.manifest import decode_config
    from shardstore.state.documents import encode_state, read_state

    for limit, write, read, refused in (
        (32, lambda v: encode_config(v), lambda raw: decode_config(raw), ManifestError),
        (64, lambda v: encode_state(v, "x")[0], lambda raw: read_state(raw, [], "x"), UnsupportedState),
    ):
        deepest = _nested(limit, 1)  # the leaf at depth `limit`
        assert read(write(deepest)) == deepest
        empty = _nested(limit, {})  # an empty object at depth `limit`: one bracket more, no level more
        assert read(write(empty)) == empty
        with pytest.raises(refused, match="deeper than"):
            write(_nested(limit + 1, 1))
        with pytest.raises(ManifestError, match="deeper than|nested"):
            read(('{"a":' * (limit + 1) + "1" + "}" * (limit + 1)).encode())


def test_a_trees_levels_are_the_state_dicts_containers_not_its_tags():
    """SPEC.md §9.6: a state dict's tree holds 64 levels of the state dict's own containers; a
    typed value's array (``["type:dict", [K, V]]``: two JSON arrays) is not a level."""
    import pytest

    from shardstore.errors import ManifestError, UnsupportedState
    from shardstore.state.documents import encode_tree, read_tree

    def nested(levels: int):  # {0: {0: ... 1}}: integer keys, so every level is a typed dict
        value = 1
        for _ in range(levels):
            value = {0: value}
        return value

    raw, _ = encode_tree(nested(64), "x")
    assert read_tree(raw, "x") == nested(64)
    with pytest.raises(UnsupportedState, match="deeper than 64"):
        encode_tree(nested(65), "x")
    text = "1"
    for _ in range(65):
        text = f'["type:dict",[0,{text}]]'
    with pytest.raises(ManifestError, match="deeper than 64"):
        read_tree(('{"tree":' + text + "}").encode(), "x")


def test_the_model_configs_integers_are_in_the_canonical_range():
    """SPEC.md §7 and §20: a model config's integers are in -2^63 <= n < 2^64, refused outside on
    writing and on reading (ManifestError), like every value that may be of several types."""
    import pytest

    from shardstore.errors import ManifestError
    from shardstore.format.manifest import decode_config

    for n in (2**64 - 1, -(2**63)):
        assert decode_config(encode_config({"n": n})) == {"n": n}
    for n in (2**64, -(2**63) - 1):
        with pytest.raises(ManifestError, match="outside the 64-bit range"):
            encode_config({"n": n})
        with pytest.raises(ManifestError):
            decode_config(b'{"n":' + str(n).encode() + b"}")


def test_a_numpy_gauss_beside_has_gauss_0_may_be_any_value_but_is_always_float_hex_text():
    """SPEC.md §10: beside ``has_gauss`` 0 a reader accepts any cached Gaussian (NumPy never reads
    it), but only spelled as ``float.hex()`` spells it, there as everywhere."""
    import numpy as np
    import pytest

    from shardstore.errors import ManifestError
    from shardstore.format.rng import check_rng

    _, key, pos, _, _ = np.random.RandomState(0).get_state(legacy=True)

    def numpy_state(has_gauss: int, gauss: str) -> bytes:
        doc = {"bit_generator": "MT19937", "gauss": gauss, "has_gauss": has_gauss, "key": key.tolist(), "pos": int(pos)}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    check_rng({"numpy": numpy_state(0, (1.5).hex())})  # a value NumPy left there: accepted
    check_rng({"numpy": numpy_state(1, (1.5).hex())})
    for has_gauss in (0, 1):
        with pytest.raises(ManifestError, match="not float.hex"):
            check_rng({"numpy": numpy_state(has_gauss, "0x1.8p+0")})  # 1.5, another spelling


def test_cuda_rng_kinds_have_no_leading_zeros():
    """SPEC.md §8.2: an RNG kind ``cuda:N`` names device N in decimal without leading zeros, as
    every writer writes it; a reader refuses ``cuda:01`` (a second spelling of device 1's kind,
    which a restore would set twice). Before issue 35 the pattern admitted it."""
    import pytest

    from shardstore.errors import ManifestError
    from shardstore.format.manifest import RngEntry, ShardManifest, decode

    def shard(kind: str) -> bytes:
        rng = (RngEntry(kind=kind, object="0" * 64),)
        return encode(ShardManifest(version=1, job="j", step=0, parent=None, config=None, slot=0, slots=1,
                                    algorithm="none", groups=(), entries=(), rng=rng))  # fmt: skip

    for kind in ("cuda:0", "cuda:7", "cuda:10", "cuda:9999"):
        assert decode(shard(kind)).rng[0].kind == kind
    for kind in ("cuda:01", "cuda:00", "cuda:0010", "cuda:10000"):
        with pytest.raises(ManifestError):
            decode(shard(kind))


def test_the_block_count_limit_of_version_1_counts_row_bands():
    """SPEC.md §5.1: version 1 has no grid, and its block-count limit counts the row-band grid's
    blocks. float32 [1048577, 524289] is 1,048,577 row bands (over 2^20) but 1,047,040 tiles: as
    one object in a version-1 manifest it is refused; on the tile grid its count is within the limit."""
    from shardstore.errors import GridError
    from shardstore.format.grid import block_count
    from shardstore.format.manifest import MAX_BLOCKS, ShardManifest, TensorEntry
    from shardstore.verification.commits import shard_problems

    shape = (1048577, 524289)
    assert (
        block_count("float32", shape, bands=True)
        == 1_048_577
        > MAX_BLOCKS
        >= block_count("float32", shape)
        == 1_047_040
    )
    entry = TensorEntry(name="w", dtype="float32", shape=shape, param="0" * 64, optim=None)
    shard = ShardManifest(version=1, job="j", step=0, parent=None, config=None, slot=0, slots=1, algorithm="none",
                          groups=(), entries=(entry,), rng=())  # fmt: skip
    problems = [p.error for p in shard_problems(shard, "1" * 64)]
    assert any(isinstance(e, GridError) and "1048577 blocks, more than the limit" in str(e) for e in problems), problems
