"""SIGTERM unwinds like Ctrl-C.

``kill PID``, a batch scheduler's cancel or time limit, or a container's stop sends SIGTERM to the driver alone. By
default Python dies of it on the spot: no ``finally`` runs, and no ``atexit`` hook, so Prefect's temporary server
(a uvicorn process of its own, about 200 MB) runs on after the run it served. Raised as :class:`Terminated`, a
KeyboardInterrupt, it takes the path a Ctrl-C takes: the run lock is let go, one line says what stopped, and the
interpreter exits normally, stopping the server on the way out.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM was received."""


def _raise_terminated(signum, frame):
    raise Terminated


_depth = 0  # blocks open in this process


@contextlib.contextmanager
def sigterm_as_interrupt(nested: bool = False):
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread (elsewhere signals cannot be handled:
    nothing changes); the previous handler is back after it.

    ``nested``: only inside another such block. Prefect's flow engine installs its own handler for the flow's
    duration, which marks the flow crashed and lets its tasks run on; the flow body started by the CLI takes it back.
    A flow that a Prefect worker runs keeps the engine's handler, through which a cancel from the UI arrives."""
    global _depth
    if threading.current_thread() is not threading.main_thread() or (nested and not _depth):
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        signal.signal(signal.SIGTERM, previous)
