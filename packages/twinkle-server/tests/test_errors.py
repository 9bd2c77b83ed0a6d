import pytest
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from twinkle.errors import (
    AuthenticationError,
    ComponentNotFoundError,
    ConfigurationError,
    InvalidInputError,
    MissingDependencyError,
    PermissionDeniedError,
    QuotaExceededError,
    RateLimitError,
    ResourceNotFoundError,
    ServerError,
)
from twinkle.server.errors import error_response


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (InvalidInputError("bad shape"), 400),
        (ComponentNotFoundError("no loss 'Nope'"), 400),
        (AuthenticationError("invalid API key"), 401),
        (PermissionDeniedError("not yours"), 403),
        (ResourceNotFoundError("no run 'run-x'"), 404),
        (ConfigurationError("optimizer not set"), 409),
        (MissingDependencyError("vllm", "twinkle-sampler[vllm]", "vLLM sampling"), 500),
        (ServerError("worker died"), 500),
    ],
)
def test_status_and_body_per_error_class(exc, status):
    assert error_response(exc) == (status, {"error": {"type": type(exc).__name__, "message": str(exc)}})


def test_quota_errors_carry_their_limit():
    assert error_response(QuotaExceededError("too many adapters", "max_adapters")) == (
        403,
        {"error": {"type": "QuotaExceededError", "message": "too many adapters", "limit": "max_adapters"}},
    )
    assert error_response(RateLimitError("slow down")) == (
        429,
        {"error": {"type": "RateLimitError", "message": "slow down", "limit": "requests_per_second"}},
    )


def test_subclasses_outside_core_travel_as_their_core_base():
    class BadBatchError(InvalidInputError):
        pass

    assert error_response(BadBatchError("empty batch")) == (
        400,
        {"error": {"type": "InvalidInputError", "message": "empty batch"}},
    )


def test_malformed_request_is_422_naming_the_fields():
    exc = RequestValidationError(
        [{"loc": ("query", "wait"), "msg": "Input should be a valid number", "type": "float_parsing"}, {"msg": "bad"}]
    )
    assert error_response(exc) == (
        422,
        {
            "error": {
                "type": "InvalidInputError",
                "message": "malformed request: query.wait: Input should be a valid number; bad",
                "field": "query.wait",
            }
        },
    )


def test_a_body_field_at_fault_is_named_apart_from_the_message():
    error = InvalidInputError("invalid CreateRun: session_id: Field required")
    error.field = "session_id"
    assert error_response(error) == (
        400,
        {"error": {"type": "InvalidInputError", "message": str(error), "field": "session_id"}},
    )


def test_framework_http_errors_come_in_the_same_shape():
    assert error_response(HTTPException(405, "Method Not Allowed")) == (
        405,
        {"error": {"type": "InvalidInputError", "message": "Method Not Allowed"}},
    )
    assert error_response(HTTPException(404, "Not Found"))[1]["error"]["type"] == "ResourceNotFoundError"


def test_unexpected_errors_are_server_errors_naming_the_class():
    assert error_response(KeyError("lora_A")) == (
        500,
        {"error": {"type": "ServerError", "message": "KeyError: 'lora_A'"}},
    )
