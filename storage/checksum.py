"""Checksums: CRC-32C (Castagnoli; RFC 3720 §B.4) via the ``crc32c`` package (hardware accelerated).

Shard bytes are checksummed in fixed-size chunks so a ranged read can verify
exactly the chunks it touched without reading the whole shard.
"""

from __future__ import annotations

import crc32c as _crc32c

#: Default chunk size for shard checksums, in bytes.
DEFAULT_CHUNK_NBYTES = 4 * 1024 * 1024


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """CRC-32C of ``data`` as an unsigned 32-bit int."""
    return int(_crc32c.crc32c(data))


def chunk_crc32c(data: bytes | bytearray | memoryview, chunk_nbytes: int = DEFAULT_CHUNK_NBYTES) -> list[int]:
    """CRC-32C of each consecutive ``chunk_nbytes`` piece of ``data`` (the last may be short).

    An empty ``data`` gives ``[]``.
    """
    view = memoryview(data)
    return [crc32c(view[i:i + chunk_nbytes]) for i in range(0, len(view), chunk_nbytes)]
