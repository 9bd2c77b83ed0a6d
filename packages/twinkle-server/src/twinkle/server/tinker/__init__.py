"""The Tinker-compatible API (``/api/v1``): the unmodified ``tinker`` SDK trains against this server."""
