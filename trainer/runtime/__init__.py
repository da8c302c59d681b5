"""The job's processes: launch, workers, supervisor, preflight, in-process restart."""
