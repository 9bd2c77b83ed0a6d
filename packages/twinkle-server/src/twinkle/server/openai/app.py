"""The OpenAI-compatible API as a server plugin: entry point ``openai`` in the group ``twinkle.server.apis``."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from twinkle.server.app.state import ServerState
from twinkle.server.errors import error_response
from twinkle.server.openai.routes import PREFIX, router
from twinkle.server.openai.state import OpenAIState

# OpenAI's error ``type`` by status (the SDK picks its exception class by the status alone).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
}
ERROR_CODES = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded"}


class OpenAIApi:
    """``/v1``: any OpenAI client (the ``openai`` SDK, evaluation harnesses, agent frameworks) chats with the
    served model, a user's training runs and their checkpoints."""

    name = "openai"

    def include_routers(self, app: FastAPI) -> None:
        app.include_router(router)

    def start(self, state: ServerState) -> OpenAIState:
        openai = OpenAIState(state)
        state.checkpoints.removed_hooks.append(openai.checkpoint_removed)
        return openai

    def owns(self, path: str) -> bool:
        return path == PREFIX or path.startswith(PREFIX + "/")

    def error_reply(self, exc: Exception) -> Response:
        """``{"error": {"message", "type", "param", "code"}}``; a body that is not valid JSON is a 400 too."""
        status, body = error_response(exc)
        status = 400 if status == 422 else status
        detail = body["error"]
        error = {
            "message": detail["message"],
            "type": ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": detail.get("field"),
            "code": ERROR_CODES.get(status) if status != 404 or "model" in detail["message"] else None,
        }
        return JSONResponse({"error": error}, status_code=status)


API = OpenAIApi()
