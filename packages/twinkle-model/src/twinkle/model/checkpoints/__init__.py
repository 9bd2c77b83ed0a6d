"""Checkpoints: writing and reading a model's (or adapter's) state (:mod:`.save_load`) and the files (:mod:`.files`)."""
