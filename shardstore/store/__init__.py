"""The store: objects named by their BLAKE3 hash, manifests, refs and the journal (SPEC.md §Store layout).

A ``Store`` wraps one ``Storage`` backend and owns the key layout::

    config                      the store config (a StoreConfig manifest)
    objects/<id[:2]>/<id>       immutable objects; b3sum of the file equals its name
    refs/<name>                 "<commit id>\\n", moved only by compare-and-swap
    pins/<name>                 a PinManifest: objects gc keeps though no commit names them
    journal/<commit id>.json    unhashed notes (times, hosts, durations); never trusted

Everything read back is re-hashed before it is used. Names and ids are validated before
they become keys.
"""
from .keys import object_key, pin_key, ref_key
from .store import Store, open_store

__all__ = ["Store", "open_store", "object_key", "ref_key", "pin_key"]
