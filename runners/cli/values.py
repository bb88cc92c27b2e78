"""Typed flag values: argparse converters that refuse a bad value naming the flag.

argparse reports a converter's ``ArgumentTypeError`` as ``argument --flag: message``, which the
CLI's parser turns into one line and exit code 2 — so every bad flag value fails the same way,
before any model is built, in the flag's own words (not an API field's).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

__all__ = ["at_least", "byte_count", "non_negative_float", "positive_float", "probability"]


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


def positive_float(text: str) -> float:
    """A finite number ``> 0``."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def probability(text: str) -> float:
    """A number in ``(0, 1]``."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_BYTES = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)


def byte_count(text: str) -> int:
    """A positive number of bytes: ``1073741824``, ``512MiB``, ``1.5G`` (binary units)."""
    match = _BYTES.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected bytes such as 1073741824, 512MiB or 4GiB, got {text!r}"
        )
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte, got {text!r}")
    return value
