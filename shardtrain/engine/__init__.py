"""The engine: one slot's share of the model and its training step, given a process group.

Below everything but `shardtrain.errors`; it knows nothing of jobs, stores or launching.
Modules, roughly from the bottom up: `model` (the compact Llama), `partition` (contiguous
layer ranges per slot; each worker builds only its stage), `batch` and `loss` (the weighted
objective), `messages` (checked point-to-point tensor messages), `schedule` (the order of a
step's forward and backward actions), `pipeline` (one step round the ring), `clipping`
(the partition-independent global norm), `optim` (shard-local AdamW with Adam ages),
`trainer` (a step: pipeline, clipping, optimizer) and `ring` (forward-only passes round the
ring, for evaluation and distillation).
"""
