"""The run: training, committing, distilling, evaluating and gating a job on a store.

`lifecycle` (the step loop of a group: resume from one agreed commit, train, commit,
recover), `committer` (commits written in the background from a staged copy), `distill`
(the frozen reference's targets), `evaluate` (held-out losses and greedy generation
through the shards), `gates` (paired-bootstrap gates) and `demo` (the main job). The top
layer: it uses every other package.
"""
