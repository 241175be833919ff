"""Saving and restoring training state as commits: the library's main entry points (SPEC.md §15, §16).

`info` (`CommitInfo`, and the checks a writer runs before its first write), `slots` (`save`,
`save_slots`, `write_shard`, `write_commit`), `restore` (`restore`: plan, read, install, over
`state.plan`'s one plan type), `distributed` (the commit protocol
over a ``torch.distributed`` group: `save_distributed`, `agree_on_commit`) and `async_save`
(`AsyncSaver`: snapshot, return to training, commit in the background).

May import everything of shardstore below `ops`: `verification`, `sharded`, `state`, `store`,
`backends`, `format`, `errors` (checked by import-linter); never `ops` or shardtrain.
"""
