"""The answers every route of `composer serve` shares: an OpenAI-style error body (`error`), a refused request
(`refused`: a `RequestProblem`, as OpenAI answers it), a full queue's 429 (`queue_full`), and the app's handlers
that turn HTTP errors, bad bodies and unexpected exceptions into such bodies (`add_error_handlers`). Below the
routes (app.py, text.py, auth.py, ...), which all answer through it."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from composer.logging import get_logger
from composer.serve.problems import RequestProblem

logger = get_logger(__name__)


def error(status: int, message: str, field: str | None = None, headers: dict | None = None) -> JSONResponse:
    """An OpenAI-style error body: {"error": {"message", "type", "param"}}."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": field, "code": status}}, status,
                        headers=headers)


def refused(exc: RequestProblem) -> JSONResponse:
    """A refused request as OpenAI answers it (another model's name: 404 `model_not_found`)."""
    if exc.status == 404:
        return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error", "param": exc.field,
                                       "code": "model_not_found"}}, 404)
    return error(exc.status, str(exc), exc.field)


def queue_full(max_queue: int, what: str = "jobs") -> JSONResponse:
    """The 429 of a full queue (Retry-After: 10): nothing of the request was kept."""
    return error(429, f"the queue is full ({max_queue} {what} waiting); retry later", None,
                 headers={"Retry-After": "10"})


def add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style body: HTTP errors with their status, bad bodies 422, anything unexpected 500
    (logged; the server goes on)."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return error(422, str(exc.errors()))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error serving %s", request.url.path)
        return error(500, f"internal error: {type(exc).__name__}: {exc}")

