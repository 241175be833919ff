"""Reading and checking commits: `load_commit` and `verify` (SPEC.md §16, §17).

`commits` (reading a commit and its shard manifests, and every check that needs no tensor
byte), `rules` (the manifest rules beyond each field's own constraint), `objects` (each object
a commit references: present, of its size, hashing to its id, decoding as its load path would)
and `checker` (`verify`: every rule over every commit reachable from the refs, each problem
reported with its object, tensor and commit).

Beside `sharded`, above `state`: may import `state`, `store`, `backends`, `format` and `errors`
(checked by import-linter), never `sharded`, `checkpoint` or `ops`.
"""
