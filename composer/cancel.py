"""CancelToken: stop a running request between two transformer blocks.

    token = CancelToken()
    threading.Timer(5, token.cancel).start()      # or a SIGINT handler, or a server's cancel endpoint
    gen.generate_video("a cat", cancel=token)      # raises Cancelled within one block of the cancel

The pipeline checks the running request's token before every repeated transformer block (a forward pre-hook
registered at load, `composer/accel/cancel.py`), before every denoising step and before every stage, so a
cancel takes effect after at most one block's work however long a step is.
"""

from __future__ import annotations

import threading

from composer.errors import Cancelled


class CancelToken:
    """A one-way flag a request is cancelled with: `cancel()` from any thread (or a signal handler); the
    pipeline's `check()` then raises `Cancelled`. One token per request; it cannot be un-cancelled."""

    def __init__(self, on_behalf_of: CancelToken | None = None) -> None:
        self._event = threading.Event()
        self.reason = "cancel() was called"
        # the caller's token this one stands in for (a parallel layout's call: rank 0 cancels it at a sync point,
        # never directly), by which the caller's bookkeeping finds its request
        self.on_behalf_of = on_behalf_of

    def cancel(self, reason: str = "cancel() was called") -> None:
        """Ask the request to stop at its next check (safe from other threads and signal handlers)."""
        self.reason = reason
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        """Raise `Cancelled` if `cancel()` was called."""
        if self._event.is_set():
            raise Cancelled(f"request cancelled ({self.reason})")

    def __repr__(self) -> str:
        return f"CancelToken(cancelled={self.cancelled})"
