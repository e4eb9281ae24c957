"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}` with a status.

Every problem a client can cause is an `ApiError` raised by the request handling and turned
into one JSON body by the app's exception handler; no traceback ever reaches a client.
"""

from __future__ import annotations

from starlette.responses import JSONResponse


class ApiError(Exception):
    """A request the server answers with an error `status` and a one-line `message`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The JSON body OpenAI's API (and so its client library) uses for errors."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)
