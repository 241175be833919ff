"""The store's key layout (SPEC.md §Store layout): where each kind of thing lives under the
store's root, built only from validated names and ids.

    config                      the store config (a StoreConfig manifest)
    objects/<id[:2]>/<id>       immutable objects; b3sum of the file equals its name
    refs/<name>                 "<commit id>\\n", moved only by compare-and-swap
    pins/<name>                 a PinManifest: objects gc keeps though no commit names them
    journal/<commit id>.json    unhashed notes (times, hosts, durations); never trusted
"""

from __future__ import annotations

from ..format.names import check_oid, check_ref_name

__all__ = ["object_key", "ref_key", "pin_key"]


def object_key(oid: str) -> str:
    check_oid(oid)
    return f"objects/{oid[:2]}/{oid}"


def ref_key(name: str) -> str:
    return f"refs/{check_ref_name(name)}"


def pin_key(name: str) -> str:
    """Pins are named like refs (SPEC.md §Names)."""
    return f"pins/{check_ref_name(name)}"
