"""What bytes mean, independent of where they live: names, canonical values, manifests, the grid, roots.

From the bottom up (an import-linter contract of its own): `names` (validated names, ids and
targets) and `bounded` (reads bounded before they allocate); `tensors` (dtypes, tensor bytes,
BLAKE3) and `canonical` (the one canonical-value rule); `manifest/` (the msgspec Structs, the
version rule and the canonical encoding); `grid` (the canonical block grid and chunked
payloads); `slices`, `roots` (the learned-state root) and `rng`; `closure` (what a commit
names) on top. `lazy` imports torch on first use.

The lowest package: imports only `shardstore.errors` (checked by import-linter). Nothing here
reads or writes a store (SPEC.md §3-§13, §15.4-§15.5, §20, §22).
"""
