"""Sizes as tierkv.toml and the command line write them: "24GB" (10^9), "512MiB" (2^20) or a
plain count of bytes, parsed (`parse_size`) and printed (`format_size`)."""

from __future__ import annotations

import re
from fractions import Fraction

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": KIB,
    "mib": MIB,
    "gib": GIB,
    "tib": 1024 * GIB,
}
_SIZE_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


SIZE_FORMS = "a size like 24GB, 512MiB or 1073741824 (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
"""What parse_size accepts, as its errors say."""


def parse_size(value: int | str, forms: str = SIZE_FORMS) -> int:
    """Bytes from an int or a string like "24GB" (10^9) or "512MiB" (2^20); else ValueError,
    saying that it expected `forms`."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"expected {forms}, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return value
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"expected {forms}, got {value!r}")
    size = Fraction(match.group(1).replace("_", "")) * _SIZE_UNITS[unit]
    if size.denominator != 1:
        raise ValueError(f"a size is a whole number of bytes, got {value!r} ({float(size):g} B)")
    return int(size)


def format_size(size: int) -> str:
    """A human-readable binary size, e.g. 1.5 GiB."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            break
        value /= 1024
    return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
