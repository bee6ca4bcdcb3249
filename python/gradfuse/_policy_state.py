"""Checks shared by the clipping policies' ``load_state_dict`` (``clipping.py``, ``agc.py``): a
module below both, so that neither imports the other for them."""

from __future__ import annotations


def _check_keys(policy, state: dict, keys: set[str]) -> None:
    if not isinstance(state, dict):
        raise TypeError(f"{type(policy).__name__}.load_state_dict: expected a dict, got {type(state).__name__}")
    if set(state) != keys:
        missing, extra = sorted(keys - set(state)), sorted(set(state) - keys)
        raise ValueError(f"{type(policy).__name__}.load_state_dict: missing keys {missing}, unexpected keys {extra}")


def _check_config(policy, state: dict) -> None:
    """A state saved under another configuration would resume a different rule: refuse it."""
    saved, mine = state["config"], policy._config()
    for key, value in mine.items():
        if saved.get(key) != value:
            raise ValueError(
                f"{type(policy).__name__}.load_state_dict: {key} is {value!r} here but {saved.get(key)!r} "
                "in the saved state"
            )
