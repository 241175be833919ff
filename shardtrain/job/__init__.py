"""The job: everything a run is bound to before it trains, fixed by one job id.

`job` (the prepared `job.json`'s format and reader: model config, optimizer groups, schedule,
records and the per-step batches, bound by hash), `default_job` (the embedded default job's
generator), `user_job` (a job over a user's own model and records), `recipe` (cohorts,
distillation references and gate thresholds), `tasks` (the embedded generated task and
conversation records), `tokenizer` (the bound tokenizer assets) and `roles` (development
and final held-out sets, selection).
Built on the engine's types (`LlamaConfig`, `GroupConfig`, `Batch`).
"""
