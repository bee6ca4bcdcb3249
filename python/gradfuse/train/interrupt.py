"""Stopping cleanly on SIGINT (Ctrl-C) or SIGTERM (a batch system's notice).

While ``fit`` runs, ``StopSignals`` replaces the handlers of both signals with one that only
notes the signal: the step in flight finishes, the trainer writes a checkpoint and raises
``TrainingInterrupted`` with a message saying how to resume. A second signal is not caught
(the previous handlers are back after the first): pressing Ctrl-C twice stops at once. The
handlers can only be set from the main thread; elsewhere the signals keep their handlers.
"""

from __future__ import annotations

import signal
import threading

SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None)) if s is not None)


class TrainingInterrupted(KeyboardInterrupt):
    """``fit`` stopped on SIGINT or SIGTERM after finishing a step (and saving a checkpoint when
    ``checkpoint_dir`` is set). ``step``, ``checkpoint`` (a path or None) and ``signal`` say where."""

    def __init__(self, message: str, step: int, checkpoint, signal_name: str):
        super().__init__(message)
        self.step, self.checkpoint, self.signal = step, checkpoint, signal_name

    def __str__(self) -> str:
        return self.args[0]


class StopSignals:
    """Context manager: ``.received`` is the name of the first SIGINT/SIGTERM since entering."""

    def __init__(self):
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name
        self._restore()  # a second signal stops at once

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __exit__(self, *exc_info) -> None:
        self._restore()
