"""OpenAI-shaped errors: every 4xx/5xx this server sends is `{"error": {message, type, param, code}}`.

Why one exception type: handlers raise `APIError` wherever they find a problem (auth, parsing,
validation, queue full) and one FastAPI exception handler turns it into the body OpenAI clients
parse, so no route hand-builds error JSON and none can forget a field. Starlette's own 404/405 and
anything unexpected are mapped to the same shape.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("ternlm.server")

INVALID = "invalid_request_error"


class APIError(Exception):
    """An error response. status: HTTP status; type/code/param as in OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = INVALID, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, path: str = "") -> JSONResponse:
        """The error in the shape of the API `path` belongs to (OpenAI's unless another API's)."""
        return JSONResponse(body_for(path, self), status_code=self.status, headers=self.headers)


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_body(err: APIError) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(err.status, "api_error"), "message": err.message}}


def body_for(path: str, err: APIError) -> dict:
    """Each API's own error shape: Anthropic's under /v1/messages, Ollama's `{"error": msg}` under
    /api/, OpenAI's everywhere else."""
    if path.startswith("/v1/messages"):
        return anthropic_body(err)
    if path.startswith("/api/"):
        return {"error": err.message}
    return err.body()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, message: str | None = None) -> APIError:
    """A known OpenAI parameter this server does not implement: refused, never silently ignored."""
    return APIError(400, message or f"'{param}' is not supported by this server",
                    param=param, code="unsupported_parameter")


def unauthorized(message: str = "Missing or invalid API key: send 'Authorization: Bearer <key>'") -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, type="server_error", code=code, headers={"Retry-After": "1"})


def install_handlers(app: FastAPI) -> None:
    """Route every error path through the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return APIError(exc.status_code, message, code=code, headers=dict(exc.headers or {})).response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return bad_request(f"{loc}: {first.get('msg', 'invalid request')}", param=loc).response(request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}", type="server_error",
                        code="internal_error").response(request.url.path)
