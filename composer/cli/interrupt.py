"""Ctrl-C during generation: the first cancels the request (it stops within one transformer block), a second
one stops at once."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from composer.cancel import CancelToken


@contextmanager
def cancel_on_sigint(token: CancelToken) -> Iterator[CancelToken]:
    """While the block runs, SIGINT cancels `token`; a second SIGINT raises KeyboardInterrupt where the program
    is (for a stage that never reaches a cancel point, such as a long VAE decode or a blocked stdin read)."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield token
        return

    def on_sigint(signum, frame) -> None:
        if token.cancelled:
            raise KeyboardInterrupt
        token.cancel("Ctrl-C")

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield token
    finally:
        signal.signal(signal.SIGINT, previous)
