"""The store: a ``Store`` over one storage backend (``store``), its key layout (``keys``), tensor
objects written in one batch and read straight into tensors (``tensors``), and the fence that
keeps gc from deleting what a ref is moving to (``gc_fence``; SPEC.md §Store layout, §19.2).

Above `backends`: imports only `shardstore.backends`, `shardstore.format` and
`shardstore.errors` (checked by import-linter); it knows nothing of torch modules or optimizers.
"""

from .keys import object_key, pin_key, ref_key
from .store import Store, manifest_bytes, open_store

__all__ = ["Store", "open_store", "manifest_bytes", "object_key", "ref_key", "pin_key"]
