"""DTensor state over a process group, written as canonical blocks and never gathered (SPEC.md §15.2, §15.4).

`placement` (a rank's local part as boxes of the global tensor), `exchange` (the block
exchange: each block staged and written once), `agreement` (whether the ranks agree on each
tensor, and errors naming who does not) and `dtensor` (capture and restore of DTensor state).

Beside `verification`, above `state`: may import `state`, `store`, `backends`, `format` and
`errors` (checked by import-linter), never `verification`, `checkpoint` or `ops`.
"""
