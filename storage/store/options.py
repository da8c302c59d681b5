"""``--storage-option KEY=VALUE`` flags -> fsspec storage options (used by every command
that opens a store)."""

from __future__ import annotations

from typing import Any


def parse_storage_options(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """Turn ``KEY=VALUE`` strings into fsspec storage options.

    Values ``true``/``false`` become bools, integers ints and decimals floats
    (``connect_timeout=2.5``: botocore compares it with numbers); a dotted key
    ``client_kwargs.endpoint_url=...`` nests. Raises ``ValueError`` on a pair without ``=``.
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--storage-option {pair!r}: expected KEY=VALUE")
        key, value = pair.split("=", 1)
        parsed: Any = value
        if value.lower() in ("true", "false"):
            parsed = value.lower() == "true"
        elif value.lstrip("-").isdigit():
            parsed = int(value)
        elif _is_decimal(value):
            parsed = float(value)
        target = out
        parts = key.split(".")
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = parsed
    return out


def _is_decimal(value: str) -> bool:
    """``2.5``, ``-0.5``, ``1e3`` (not ``nan``/``inf``, which stay text, nor names like ``e3``)."""
    try:
        number = float(value)
    except ValueError:
        return False
    return value.strip()[:1] in "-+.0123456789" and number == number and abs(number) != float("inf")
