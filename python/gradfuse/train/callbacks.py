"""The user's own code called at points of training: ``Trainer(..., callbacks=[...])``.

A callback is any object with some of ``on_step_end(row)`` (after every optimizer step, with
its metrics row), ``on_eval(row)`` (after an evaluation, the row holding ``eval_loss``) and
``on_save(path)`` (after a checkpoint file is written, on the process that wrote it). An
object with none of them is refused when the Trainer is made, so that a misspelt method is an
error rather than a callback that never runs.
"""

from __future__ import annotations

from collections.abc import Iterable

HOOKS = ("on_step_end", "on_eval", "on_save")


class Callbacks:
    def __init__(self, callbacks: Iterable | None):
        callbacks = () if callbacks is None else callbacks
        if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Iterable):
            raise TypeError(f"Trainer(callbacks=...) must be a list of callback objects, got {callbacks!r}")
        self.callbacks = list(callbacks)
        for i, callback in enumerate(self.callbacks):
            if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
                raise TypeError(
                    f"Trainer(callbacks=...)[{i}] ({type(callback).__name__}) has none of the methods "
                    f"{', '.join(HOOKS)}: it would never be called"
                )

    def _call(self, hook: str, value) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if callable(method):
                method(value)

    def step_end(self, row: dict) -> None:
        self._call("on_step_end", dict(row))

    def eval(self, row: dict) -> None:
        self._call("on_eval", dict(row))

    def save(self, path) -> None:
        self._call("on_save", path)
