"""Acting on SIGTERM while the main thread cannot.

Python runs a signal handler on the main thread, between bytecodes: a rank
blocked in a collective (gloo or NCCL waiting for a peer that stopped first)
runs it only once the collective returns, which may be never, and is then
SIGKILLed by its agent with nothing persisted. The C-level handler that
Python installs still writes the signal's number to the wakeup fd
(`signal.set_wakeup_fd`) at once, whatever the main thread does; a thread
reading that fd acts at once. A wakeup fd set before (asyncio's, say) keeps
getting every byte.

Lives in every training process whose Checkpointer persists.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
from collections.abc import Callable

_log = logging.getLogger(__name__)


class TermWatch:
    """Runs `action` on a thread of its own when SIGTERM arrives (once;
    made on the main thread, where a Python handler for SIGTERM is already
    installed: without one the signal never reaches the wakeup fd)."""

    def __init__(self, action: Callable[[], None]) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # the C handler must never block
        self._action = action
        self.signalled = threading.Event()  # SIGTERM came: the action runs, or ran
        self._previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._loop, name="dlfleet-ckpt-term", daemon=True)
        self._thread.start()

    def pending(self) -> bool:
        """Whether a signal came that the thread has not read yet."""
        return bool(select.select([self._read], [], [], 0)[0])

    def close(self) -> None:
        """Give the wakeup fd back (main thread only) and end the thread."""
        current = signal.set_wakeup_fd(self._previous)
        if current != self._write:
            signal.set_wakeup_fd(current)  # someone set their own since: theirs stays
        os.close(self._write)  # the thread reads EOF
        self._thread.join(timeout=5.0)
        os.close(self._read)

    def _loop(self) -> None:
        acted = False
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data:
                return
            if self._previous >= 0:
                with contextlib.suppress(OSError):  # full or closed: theirs to lose, as ever
                    os.write(self._previous, data)
            if not acted and int(signal.SIGTERM) in data:
                acted = True
                self.signalled.set()
                try:
                    self._action()
                except Exception:  # noqa: BLE001 - the main thread's handler still runs
                    _log.exception("persisting on SIGTERM failed")
