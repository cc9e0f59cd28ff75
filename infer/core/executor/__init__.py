"""Per-rank execution: building a rank's model and running its steps (`rank`), and
starting the ranks of a job (`launch`)."""
