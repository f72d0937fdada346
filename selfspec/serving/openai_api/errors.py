"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Every way a request can fail is one `ApiError`; the app turns it into a JSON response (or, once a
stream has started, into an `error` event), so a client sees the same shape OpenAI sends.
"""

from __future__ import annotations


class ApiError(Exception):
    """One failed request: HTTP status, message, OpenAI error type, the offending field, a code."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """400: a request the server understood and refuses (bad type, range, unsupported value)."""
    return ApiError(400, message, param=param, code=code)


def model_not_found(name: str, served: str) -> ApiError:
    return ApiError(404, f"the model {name!r} does not exist; this server serves {served!r} (GET /v1/models)",
                    param="model", code="model_not_found")


def unauthorized() -> ApiError:
    return ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key")


def queue_full(limit: int) -> ApiError:
    return ApiError(429, f"the server is at capacity ({limit} requests running or waiting); retry later",
                    type="rate_limit_error", code="queue_full")


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down and accepts no new requests", type="server_error",
                    code="server_shutting_down")


def cut_by_shutdown() -> ApiError:
    return ApiError(503, "the server shut down before this generation finished", type="server_error",
                    code="server_shutting_down")


def internal(message: str = "internal error") -> ApiError:
    return ApiError(500, message, type="server_error", code="internal_error")
