"""Per-rank execution: a rank's model and steps (`rank`, `worker`, `sampler`), the
executors that run the engine's calls on every rank (`executor`), and starting the
ranks of a job (`launch`)."""
