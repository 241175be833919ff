"""Tools over whole commits: diff, copy, garbage collection, export and import (SPEC.md §18, §19.1).

`diff` and `state_diff` (what changed between two commits), `transfer` (copying a commit's
closure between stores), `gc` (deleting what no ref or pin reaches), `interchange` and
`safetensors_files` (Hugging Face style safetensors directories out and in) and `assets`
(tokenizer files carried with a commit).

The top of shardstore: may import every other package of it (checked by import-linter);
nothing inside shardstore imports `ops`.
"""
