"""`RequestProblem`: a request the server refuses, raised by every check of a request (requests.py, uploads.py,
text_requests.py, stream.py, sessions.py) and answered by the routes as an OpenAI-style error
(responses.py's `refused`). It imports nothing, so the body readers (uploads.py) and the request checks
(requests.py) share it without importing each other, and without the web stack."""

from __future__ import annotations


class RequestProblem(Exception):
    """A request the server refuses: `status` (400, 413, 422...), the message, and the field at fault."""

    def __init__(self, message: str, field: str | None = None, status: int = 422):
        super().__init__(message)
        self.field = field
        self.status = status
