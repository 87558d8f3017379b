"""Bookkeeping that a KeyboardInterrupt must not cut in half.

Python raises KeyboardInterrupt in the main thread between any two bytecodes.
The managers' calls wait on the server, where an interrupt is expected and
settled (the call's outcome is unknown); the bookkeeping between their calls
(laying out a step, committing it, forgetting sequences) must instead run to
its end. Inside `with held_interrupt() as h:` a SIGINT is held (h.got says
whether one came) instead of raised, and the code after the block decides
where it is raised. Elsewhere than in the main thread, or while the program
has its own SIGINT handler, it changes nothing (h.got stays False).
"""

from __future__ import annotations

import signal
import threading


class held_interrupt:  # noqa: N801 - used as a context manager, like a function
    __slots__ = ("_on", "got")

    def __init__(self) -> None:
        self._on = False
        self.got = False

    def __enter__(self) -> "held_interrupt":
        if threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                    signal.signal(signal.SIGINT, self._hold)
                    self._on = True
            except (ValueError, OSError):  # no signals here (an embedded interpreter)
                self._on = False
        return self

    def _hold(self, signum, frame) -> None:
        self.got = True

    def __exit__(self, *exc) -> bool:
        if self._on:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._on = False
        return False
