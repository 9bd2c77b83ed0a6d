"""The pass engine: every forward, loss and backward of a training call (see :mod:`.engine`)."""
