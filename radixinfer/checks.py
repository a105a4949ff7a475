"""Checks of user-given values, each raising a ``ValueError`` that names the user's field.

Shared by `SamplingParams`, the `LLM` constructor and the command line, so a value is refused with the
same words wherever it is given. Bools are refused where numbers are expected (Python counts them as
integers); numpy integers and floats are accepted and returned as Python ones.
"""

from __future__ import annotations

import math
import numbers
import reprlib

import torch


def wrong_type(name: str, expected: str, value: object) -> ValueError:
    """The error for a value of the wrong type: a ``ValueError`` (bad input), not a ``TypeError``."""
    return ValueError(
        f"{name} must be {expected}, got {type(value).__name__} {reprlib.repr(value)}"
    )


def integer(name: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` as a Python int in ``[low, high)`` (no upper bound when ``high`` is None).

    Performance: a plain int (the usual case; ``type(True)`` is bool, not int) skips the abstract
    base class check, which costs most of the time of building a request's `SamplingParams`."""
    if type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise wrong_type(name, "an integer", value)
        value = int(value)
    if value < low or (high is not None and value >= high):
        upper = f"2**{high.bit_length() - 1}" if high and high & (high - 1) == 0 else high
        bounds = f">= {low}" if high is None else f"in [{low}, {upper})"
        raise ValueError(f"{name} must be an integer {bounds}, got {value}")
    return value


def optional_integer(name: str, value: object, low: int) -> int | None:
    """None, or ``value`` as a Python int ``>= low``."""
    return None if value is None else integer(name, value, low)


def real(name: str, value: object) -> float:
    """``value`` as a finite Python float (a plain float or int skips the abstract base class
    check, as in `integer`)."""
    kind = type(value)
    if kind is not float and kind is not int:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise wrong_type(name, "a number", value)
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def flag(name: str, value: object) -> bool:
    """``value``, which must be a bool (not merely truthy)."""
    if not isinstance(value, bool):
        raise wrong_type(name, "a bool", value)
    return value


def device(value: str | torch.device) -> torch.device:
    """``value`` as a torch device the engine runs on: the CPU, or a CUDA device this machine has."""
    try:
        parsed = torch.device(value)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:<index>', got {value!r}")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {value!r}: CUDA is not available on this machine (use 'cpu')")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {value!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return parsed
