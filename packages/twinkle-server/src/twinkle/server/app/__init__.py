"""The native Twinkle API: its routes, HTTP helpers and the server's state.

Both APIs are assembled into one application in ``twinkle.server.application``.
"""
