"""How native operations are documented: errors in the native shape, replies in JSON or the wire codec."""

from __future__ import annotations

from twinkle.server.app.schemas.common import ErrorReply
from twinkle.server.contract import ContractRoute


class NativeRoute(ContractRoute):
    error_model = ErrorReply
    wire_replies = True
