"""Adapters from live torch objects to stored state, and back (SPEC.md §9-§9.3, §16.1).

`module` (parameters and persistent buffers), `optim` (Adam's canonical form), `torch_optim`
(any torch optimizer whose state is tensors and numbers), `extras` and `stateful` (anything
with ``state_dict()``, generators, data loaders), `plan` (the restore plan each of them
returns: reads, then installs), `restore_match` (which tensors a restore fills) and `slot` (`SlotState` and `capture`: one slot as a commit takes it).

May import `store`, `backends`, `format` and `errors` (checked by import-linter); nothing above.
"""
