"""The pieces of the training entry point: CLI, run directory, metrics sinks, resumable state."""
