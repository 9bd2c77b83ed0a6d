"""Triton implementations; imported only when triton is installed (see twinkle.kernel.backends)."""
