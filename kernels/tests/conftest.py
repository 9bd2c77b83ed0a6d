"""Triton kernels run in Triton's CPU interpreter here: it must be on before any kernel is decorated."""

import os

os.environ["TRITON_INTERPRET"] = "1"
