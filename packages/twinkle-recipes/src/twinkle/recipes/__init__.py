"""Ready-made training recipes behind the ``twinkle`` command (``twinkle sft``)."""
