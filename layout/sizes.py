"""The one size rule: byte counts written by people (``--max-buffer``, ``--max-shard-size``).

Decimal units are powers of 1000 and binary units powers of 1024, as IEC 80000-13 and
``transformers``' ``max_shard_size`` spell them: ``KB MB GB TB`` = 10**3, 10**6, 10**9,
10**12; ``KiB MiB GiB TiB`` = 2**10, 2**20, 2**30, 2**40; ``B`` or no unit = bytes. Letter
case does not matter (``mb`` = ``MB``); a bare ``K``/``M``/``G``/``T`` is refused, since it
would be ambiguous. Pure: no torch, no I/O.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

#: Unit (upper case) -> bytes.
UNITS: dict[str, int] = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}

#: One line for ``--help`` texts.
SIZE_HELP = "KB/MB/GB/TB = powers of 1000, KiB/MiB/GiB/TiB = powers of 1024"

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")


def parse_nbytes(text: str | int) -> int:
    """A positive whole number of bytes from ``"5GB"`` (5 * 10**9), ``"2MiB"`` (2 * 2**20),
    ``"1.5KB"`` (1500), ``"4096"`` or an int.

    Raises:
        ValueError: not a size, an unknown or ambiguous unit, zero, or not a whole number
            of bytes; the message names the text and the accepted units.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 1:
            raise ValueError(f"size {text}: must be at least 1 byte")
        return text
    m = _SIZE.fullmatch(str(text))
    unit = m.group(2).upper() if m else ""
    if not m or unit not in UNITS:
        hint = (
            f"; {m.group(2)!r} is ambiguous: write {m.group(2)}B (decimal) or "
            f"{m.group(2)}iB (binary)"
            if m and unit in ("K", "M", "G", "T")
            else ""
        )
        raise ValueError(
            f"size {str(text)!r} is not a size{hint}; write a number with an optional "
            f"unit B, {SIZE_HELP}, e.g. 500MB or 2GiB"
        )
    try:
        value = Decimal(m.group(1)) * UNITS[unit]
    except InvalidOperation:  # pragma: no cover - the regex admits only decimal numbers
        raise ValueError(f"size {str(text)!r} is not a number") from None
    if value != value.to_integral_value() or value < 1:
        raise ValueError(
            f"size {str(text)!r} = {value} bytes: must be a whole number of bytes >= 1"
        )
    return int(value)


def format_nbytes(nbytes: float) -> str:
    """Human form in binary units, e.g. ``256.0 MiB``, ``1,000 B``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:,.0f} {unit}" if unit == "B" else f"{nbytes:,.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def short_nbytes(nbytes: int) -> str:
    """Shortest exact spelling that :func:`parse_nbytes` reads back: ``268435456`` ->
    ``256MiB``, ``5000000000`` -> ``5GB``, ``1000`` -> ``1KB``, ``1023`` -> ``1023``."""
    for unit in ("TiB", "TB", "GiB", "GB", "MiB", "MB", "KiB", "KB"):
        if nbytes % UNITS[unit.upper()] == 0 and nbytes:
            return f"{nbytes // UNITS[unit.upper()]}{unit}"
    return str(nbytes)
