"""Reshaping: changing where and how big the model is without changing what it learned.

`regroup` (the same learned state on another number of slots; a `repartition` commit),
`grow` (appending identity blocks), `planner` (per-worker peak-memory estimates and the
contiguous assignment minimising the highest utilisation) and `admission` (each worker's
check of its estimate against its real free memory). Uses the job and the engine.
"""
