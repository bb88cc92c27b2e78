"""Typed flag values: argparse converters that refuse a bad value naming the flag.

argparse reports a converter's ``ArgumentTypeError`` as ``argument --flag: message``, which the
CLI's parser turns into one line and exit code 2 — so every bad flag value fails the same way,
before any model is built, in the flag's own words (not an API field's).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["at_least", "non_negative_float", "probability"]


def at_least(minimum: int) -> Callable[[str], int]:
    """A converter for integers ``>= minimum``."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    convert.__name__ = f"integer >= {minimum}"
    return convert


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number ``>= 0``."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def probability(text: str) -> float:
    """A number in ``(0, 1]``."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value
