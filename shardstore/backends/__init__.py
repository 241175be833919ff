"""Where bytes live: the backends of the narrow storage protocol a store is built on (SPEC.md §19).

`base` (the `Storage` protocol: keys, bounded reads, exclusive and conditional writes, listing),
`local` (a directory; its file primitives in `posix`, its ref lock files in `ref_locks`), `s3/`
(``s3://bucket/prefix`` through s3fs), `fsspec` (any fsspec filesystem, ``memory://`` in the
tests), `holders` (a process named so that another can tell whether it still runs), `options`
(where storage options come from) and `location` (which backend a URL names), above the others.

Imports only `shardstore.format` and `shardstore.errors` (checked by import-linter): a backend
moves bytes under keys and knows nothing of objects, manifests or commits.
"""
