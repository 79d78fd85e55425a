"""OpenAI-shaped errors: every error body is `{"error": {"message", "type", "param", "code"}}`
with `code` the HTTP status (an int) and `type` from one vocabulary, vLLM's: the name of the
`openai` client's exception for that status where it has one (`BadRequestError`,
`AuthenticationError`, `NotFoundError`, `RateLimitError`, `InternalServerError`), else the
status's phrase in the same form (`MethodNotAllowedError`, `ServiceUnavailableError`, ...)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from vllm_rlt.engine.async_engine import (
    EngineDeadError,
    EngineStoppedError,
    QueueFullError,
    RequestFailedError,
)
from vllm_rlt.sampling_params import SamplingParams

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "PayloadTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_PARAMS = set(SamplingParams.__dataclass_fields__) | {"prompt"}


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return HTTPStatus(status).phrase.title().replace(" ", "").replace("-", "") + "Error"


class APIError(Exception):
    """An error answered with HTTP `status` and the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": error_type(self.status),
                "param": self.param,
                "code": self.status,
            }
        }


def bad_request(message: str) -> APIError:
    """400 whose `param` is the field the message starts with (`top_p must be ...`)."""
    first = message.split(" ", 1)[0].rstrip(":")
    return APIError(400, message, param=first if first in _PARAMS else None)


def shutting_down() -> APIError:
    """503 for requests the stopping server will not serve (the client may retry elsewhere)."""
    return APIError(503, "the server is shutting down", headers={"Connection": "close"})


def engine_error(err: Exception) -> APIError:
    """Map an engine exception to the HTTP error the client sees (no internals in the text)."""
    if isinstance(err, ValueError):
        return bad_request(str(err))
    if isinstance(err, QueueFullError):
        return APIError(429, str(err), headers={"Retry-After": "1"})
    if isinstance(err, EngineStoppedError):
        return shutting_down()
    if isinstance(err, (EngineDeadError, RequestFailedError)):
        return APIError(500, str(err))
    return APIError(500, "internal error while generating")
