"""The native API's request and reply bodies (pydantic models, documented in ``/openapi.json``)."""
