"""Checks of the numeric flags of ``cyclebox model`` and ``cyclebox train``, made on the
host before anything is created or any container starts.

A value the trainer container cannot use (a seed numpy and torch refuse, a NaN learning
rate, a negative epoch count) used to reach it and end as an engine error (exit 6) after
minutes, with ``--out`` left behind. Each check here is a ConfigError (exit 3) naming
the flag, the value and the allowed range.
"""

from __future__ import annotations

import math

from runner.errors import ConfigError

SEED_MAX = 2**32 - 1
"""Largest seed: numpy's generators take 0..2**32-1 (torch takes more)."""
LR_MAX = 1.0
"""Largest learning rate: a LoRA adapter trained with more diverges."""
EPOCHS_MAX = 1000
"""Most epochs an operator may ask for (the derived schedule stays at or below 40)."""


def check_seed(seed: object, flag: str = "--seed") -> int:
    """``seed`` as an int in 0..:data:`SEED_MAX`; ConfigError naming ``flag`` otherwise."""
    if type(seed) is not int or not 0 <= seed <= SEED_MAX:
        raise ConfigError(f"{_show(seed)} is not a seed in 0..{SEED_MAX}", field=flag,
                          fix=f"give a whole number from 0 to {SEED_MAX} (2**32-1), "
                              "e.g. --seed 0")
    return seed


def check_lr(lr: object, flag: str = "--lr") -> float:
    """``lr`` as a finite float in (0, :data:`LR_MAX`]; ConfigError naming ``flag``."""
    if (isinstance(lr, bool) or not isinstance(lr, int | float)
            or not math.isfinite(lr) or not 0 < lr <= LR_MAX):
        raise ConfigError(f"{_show(lr)} is not a learning rate greater than 0 and at most "
                          f"{LR_MAX:g}", field=flag,
                          fix="give a finite number such as 5e-3 (no nan or inf)")
    return float(lr)


def check_epochs(epochs: object, flag: str = "--epochs") -> int | None:
    """``epochs`` as None (derived from the row count) or an int in 1..:data:`EPOCHS_MAX`."""
    if epochs is None:
        return None
    if type(epochs) is not int or not 1 <= epochs <= EPOCHS_MAX:
        raise ConfigError(f"{_show(epochs)} is not an epoch count in 1..{EPOCHS_MAX}",
                          field=flag, fix=f"give a whole number from 1 to {EPOCHS_MAX}, or "
                          "leave --epochs out to derive it from the row count")
    return epochs


def check_train_flags(*, seed: object = 0, lr: object = None, epochs: object = None) -> None:
    """Every numeric training flag at once (``lr`` None: the command takes none)."""
    check_seed(seed)
    if lr is not None:
        check_lr(lr)
    check_epochs(epochs)


def _show(value: object) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return "a number too long to show"
    return text if len(text) <= 40 else text[:37] + "..."
