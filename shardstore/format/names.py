"""Validation of every name and id that can reach a path or a manifest (SPEC.md §Names).

Names are checked when they are parsed, before they are joined to anything: object ids,
ref names, tensor names, group names, job ids and storage keys. The rules are deliberately
ASCII-only so that look-alike Unicode, percent-encoding, NUL, backslashes and dot segments
cannot express a path outside the store.
"""

from __future__ import annotations

import re

from ..errors import InvalidName, TargetNotFound

__all__ = [
    "OID_PATTERN",
    "TENSOR_NAME_PATTERN",
    "GROUP_NAME_PATTERN",
    "JOB_ID_PATTERN",
    "REF_SEGMENT_PATTERN",
    "check_oid",
    "check_oid_prefix",
    "check_ref_name",
    "check_tensor_name",
    "check_group_name",
    "check_key",
    "split_revision",
]

OID_PATTERN = r"^[0-9a-f]{64}$"
TENSOR_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.:/-]{0,511}$"
GROUP_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$"
JOB_ID_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,127}$"
REF_SEGMENT_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$"

_OID = re.compile(OID_PATTERN)
_PREFIX = re.compile(r"^[0-9a-f]{8,64}$")
_TENSOR = re.compile(TENSOR_NAME_PATTERN)
_GROUP = re.compile(GROUP_NAME_PATTERN)
_REF_SEGMENT = re.compile(REF_SEGMENT_PATTERN)
_KEY_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
MAX_REF_DEPTH = 4
#: A target and git's ancestry suffixes (SPEC.md §Refs): ``main~2``, ``main^``, ``<commit>^^``, ``main~1^``.
_REVISION = re.compile(r"(?P<base>[^~^]+)(?P<suffixes>(?:[~^][0-9]*)+)")
_SUFFIX = re.compile(r"([~^])([0-9]*)")


def check_oid(oid: object, what: str = "object id") -> str:
    """Return ``oid`` if it is 64 lowercase hex digits, else raise InvalidName."""
    if not isinstance(oid, str) or _OID.fullmatch(oid) is None:
        raise InvalidName(f"invalid {what} {oid!r}: expected 64 lowercase hex digits (SPEC.md §Names)")
    return oid


def check_oid_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is 8..64 lowercase hex digits, else raise InvalidName."""
    if not isinstance(prefix, str) or _PREFIX.fullmatch(prefix) is None:
        raise InvalidName(f"invalid id prefix {prefix!r}: expected 8 to 64 lowercase hex digits")
    return prefix


def check_ref_name(name: object) -> str:
    """Return ``name`` if it is a valid ref name (1..4 '/'-separated segments), else raise."""
    if not isinstance(name, str) or not name:
        raise InvalidName(f"invalid ref name {name!r}: must be a non-empty string (SPEC.md §Names)")
    segments = name.split("/")
    if len(segments) > MAX_REF_DEPTH:
        raise InvalidName(f"invalid ref name {name!r}: more than {MAX_REF_DEPTH} segments")
    for seg in segments:
        if _REF_SEGMENT.fullmatch(seg) is None or seg.endswith(".lock"):
            raise InvalidName(
                f"invalid ref name {name!r}: segment {seg!r} must match {REF_SEGMENT_PATTERN} "
                "and must not end in '.lock' (SPEC.md §Names)"
            )
    return name


def check_tensor_name(name: object) -> str:
    """Return ``name`` if it is a valid tensor name, else raise InvalidName."""
    if not isinstance(name, str) or _TENSOR.fullmatch(name) is None:
        raise InvalidName(f"invalid tensor name {name!r}: must match {TENSOR_NAME_PATTERN} (SPEC.md §Names)")
    return name


def check_group_name(name: object) -> str:
    """Return ``name`` if it is a valid optimizer group name, else raise InvalidName."""
    if not isinstance(name, str) or _GROUP.fullmatch(name) is None:
        raise InvalidName(f"invalid group name {name!r}: must match {GROUP_NAME_PATTERN} (SPEC.md §Names)")
    return name


def check_key(key: str) -> str:
    """Return a storage key if every '/'-separated segment is a plain name, else raise.

    Keys are built by the store from validated parts; this is the last line of defence
    before a key becomes a path or URL.
    """
    if not isinstance(key, str) or not key:
        raise InvalidName(f"invalid storage key {key!r}")
    for seg in key.split("/"):
        if _KEY_SEGMENT.fullmatch(seg) is None:
            raise InvalidName(f"invalid storage key {key!r}: bad segment {seg!r}")
    return key


def split_revision(target: str) -> tuple[str, int]:
    """``(base, n)``: the target without its ancestry suffixes, and how many parents back they go.

    As in git: ``~N`` is N parents back (``~`` alone, one), ``^`` or ``^1`` the parent, ``^0`` the
    commit itself; suffixes add up (``main~2^`` is ``main~3``). A commit has at most one parent, so
    ``^N`` for N >= 2 names no commit: TargetNotFound. A target without suffixes is ``(target, 0)``;
    ref names cannot hold ``~`` or ``^`` (§Names), so the split is never ambiguous.
    """
    m = _REVISION.fullmatch(target)
    if m is None:
        return target, 0
    n = 0
    for op, digits in _SUFFIX.findall(m["suffixes"]):
        k = int(digits) if digits else 1
        if op == "^" and k > 1:
            raise TargetNotFound(
                f"{target!r}: a commit has at most one parent, so ^{k} names no commit (SPEC.md §Refs)"
            )
        n += k
    return m["base"], n
