"""Checksums: CRC-32C (Castagnoli; RFC 3720 §B.4), hardware accelerated.

The bytes are checksummed by ``crc32c-rs`` where it is installed (AVX-512 / PCLMULQDQ
folding kernels chosen at run time, faster than the ``crc32c`` package's SSE4.2 code;
``python bench/copy_primitives.py`` times the CRC pass), else by ``crc32c``. Both compute
the same function (tests/storage/test_checksum_passes.py compares them on random lengths,
alignments and seeds).

Shard bytes are checksummed in fixed-size chunks so a ranged read can verify
exactly the chunks it touched without reading the whole shard.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol, Sequence

import crc32c as _crc32c_sse42

try:  # optional, faster; same function (RFC 3720 CRC-32C)
    from crc32c_rs import crc32c as _crc32c_impl

    CRC32C_BACKEND = "crc32c-rs"
except ImportError:  # pragma: no cover - platforms without its wheels
    _crc32c_impl = _crc32c_sse42.crc32c
    CRC32C_BACKEND = "crc32c"

from shardsmith.errors import IntegrityError


class ChecksummedShard(Protocol):
    """What chunk verification needs of a shard record
    (:class:`~shardsmith.storage.manifest.records.ShardRecord` satisfies it): its key, its size
    and offset in its file (bytes) and its per-chunk CRC32C values. A protocol, so this module,
    which the manifest records import, imports nothing of theirs."""

    @property
    def key(self) -> str: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def crc32c(self) -> Sequence[int]: ...

    @property
    def byte_offset(self) -> int: ...


#: Default chunk size for shard checksums, in bytes. A ranged read is widened to whole
#: chunks so every byte it reads is verified: smaller chunks read less beyond what a
#: reshard load needs (``bench/checkpoint_vs_dcp.py``: 1 GiB tp2 x dp2 -> dp4 reads 1.28x
#: the bytes needed with 4 MiB chunks, 1.15x with 1 MiB, 1.02x with 256 KiB) at the cost of
#: a longer manifest (about 11 bytes of JSON per chunk: 42 bytes per MiB of data). The size
#: is recorded in every manifest, so changing this default stays format-compatible.
DEFAULT_CHUNK_NBYTES = 256 * 1024


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """CRC-32C of ``data`` as an unsigned 32-bit int."""
    return int(_crc32c_impl(data))


def chunk_crc32c(
    data: bytes | bytearray | memoryview, chunk_nbytes: int = DEFAULT_CHUNK_NBYTES
) -> list[int]:
    """CRC-32C of each consecutive ``chunk_nbytes`` piece of ``data`` (the last may be short).

    An empty ``data`` gives ``[]``.
    """
    view = memoryview(data)
    return [crc32c(view[i : i + chunk_nbytes]) for i in range(0, len(view), chunk_nbytes)]


def crc32c_update(data: Any, value: int) -> int:
    """CRC-32C of ``data`` (any buffer) continuing from the CRC ``value`` of the bytes before it."""
    return int(_crc32c_impl(data, value))


def grid_crcs(
    data: Any, start: int, chunk_nbytes: int, known: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """``(CRC-32C, length)`` of ``data`` (any buffer) cut on a ``chunk_nbytes`` grid, for bytes
    that start at stream position ``start``: the first piece ends at the next multiple of
    ``chunk_nbytes``, then whole chunks, the last may be short. Feed them to
    :meth:`ChunkedCrc.add` in stream order, from any thread that wrote them.

    Args:
        known: the chunk CRCs of ``data`` cut in ``chunk_nbytes`` pieces from its first byte,
            already computed; used (no pass over the bytes) when ``start`` is on the grid.
    """
    view = memoryview(data).cast("B")
    size = len(view)
    if known is not None and start % chunk_nbytes == 0 and len(known) == -(-size // chunk_nbytes):
        return [(int(c), min(chunk_nbytes, size - k * chunk_nbytes)) for k, c in enumerate(known)]
    out, pos = [], 0
    while pos < size:
        n = min(size - pos, chunk_nbytes - (start + pos) % chunk_nbytes)
        out.append((crc32c(view[pos : pos + n]), n))
        pos += n
    return out


class ChunkedCrc:
    """CRC-32C of each consecutive ``chunk_nbytes`` piece of a byte stream fed in any
    pieces (equals :func:`chunk_crc32c` of the whole)."""

    def __init__(self, chunk_nbytes: int) -> None:
        self.chunk_nbytes = chunk_nbytes
        self.done: list[int] = []
        self.nbytes = 0
        self._crc = 0
        self._fill = 0

    def update(self, data: Any, known: Sequence[int] | None = None) -> None:
        """Feed the next bytes of the stream (any buffer).

        Args:
            known: the chunk CRC-32Cs of ``data`` cut in ``chunk_nbytes`` pieces from its first
                byte (the last may be short), already computed (e.g. verified source chunks);
                used, with no pass over the bytes, when ``data`` starts a chunk of the stream.
        """
        self.add(grid_crcs(data, self._fill, self.chunk_nbytes, known))

    def add(self, pieces: Sequence[tuple[int, int]]) -> None:
        """Feed the next bytes of the stream by their CRCs: ``(CRC-32C, length)`` of consecutive
        pieces cut on this stream's chunk grid (:func:`grid_crcs` from the stream position
        ``nbytes``). A piece that fills a chunk alone is taken as it is; pieces of one chunk
        are combined (:func:`crc32c_combine`), no pass over any bytes.

        Raises:
            ValueError: a piece crosses a chunk boundary (not cut on this grid).
        """
        for crc, n in pieces:
            if self._fill + n > self.chunk_nbytes:
                raise ValueError(
                    f"a {n}-byte piece at stream byte {self.nbytes} crosses a "
                    f"{self.chunk_nbytes}-byte chunk boundary"
                )
            self._crc = crc32c_combine(self._crc, crc, n) if self._fill else crc
            self._fill += n
            self.nbytes += n
            if self._fill == self.chunk_nbytes:
                self.done.append(self._crc)
                self._crc, self._fill = 0, 0

    def finish(self) -> list[int]:
        """The chunk CRCs of everything fed (the last chunk may be short)."""
        return self.done + ([self._crc] if self._fill else [])

    def extend_crc(self, crc: int) -> int:
        """CRC-32C of (the bytes ``crc`` covers) followed by everything fed, combined from the
        chunk CRCs (:func:`crc32c_combine`) without another pass over the bytes."""
        return crc32c_extend(crc, self.finish(), self.nbytes, self.chunk_nbytes)


# ---- verifying what a ranged read returned: one home for the check and its messages ----


def require_full_read(got: int, expected: int, offset: int, url: str) -> None:
    """Raise when a ranged read of ``expected`` bytes at byte ``offset`` of ``url`` returned ``got``.

    Raises:
        IntegrityError: ``got != expected`` (the object ends early: it is truncated).
    """
    if got != expected:
        raise IntegrityError(
            f"{url}: truncated — expected {expected} bytes at offset {offset}, got {got}; "
            "the file is damaged: restore it, or load or reshard another step"
        )


def verify_chunks(
    shard: ChecksummedShard, first_chunk: int, views: Sequence[Any], chunk_nbytes: int, url: str
) -> None:
    """Check bytes read from a shard against the manifest's per-chunk CRC-32Cs.

    Args:
        shard: the saved shard's record (``crc32c``: one value per ``chunk_nbytes`` of its data).
        first_chunk: index of the first checksum chunk the bytes start at.
        views: the bytes, in order, possibly scattered over several buffers; together they
            cover whole chunks ``first_chunk, first_chunk + 1, ...`` (the shard's last chunk
            may be short).
        chunk_nbytes: checksum chunk size of the checkpoint (bytes).
        url: the file's URL, for the message.

    Raises:
        IntegrityError: a chunk's CRC differs (names the file, the key and the chunk's byte
            range in the file, as ``verify`` does).
    """
    c, value, filled = first_chunk, 0, 0
    need = min(chunk_nbytes, shard.nbytes - c * chunk_nbytes)
    for v in views:  # one CRC call per view while it fits in the chunk (row segments)
        view = (
            v
            if isinstance(v, memoryview) and v.format == "B" and v.ndim == 1
            else memoryview(v).cast("B")
        )
        size, pos = len(view), 0
        while pos < size:
            if need <= 0:
                _check_chunk(shard, c, value, need, chunk_nbytes, url)  # bytes past the shard
            take = min(size - pos, need - filled)
            value = _crc32c_impl(view if take == size else view[pos : pos + take], value)
            filled += take
            pos += take
            if filled == need:
                _check_chunk(shard, c, int(value), need, chunk_nbytes, url)
                c, value, filled = c + 1, 0, 0
                need = min(chunk_nbytes, shard.nbytes - c * chunk_nbytes)
    if filled:  # the bytes end inside a chunk: only its CRC over all of it can match
        _check_chunk(shard, c, int(value), filled, chunk_nbytes, url)


def _check_chunk(
    shard: ChecksummedShard, c: int, value: int, need: int, chunk_nbytes: int, url: str
) -> None:
    if c >= len(shard.crc32c) or value != shard.crc32c[c] or need <= 0:
        start = shard.byte_offset + c * chunk_nbytes  # file offsets, as `shardsmith verify` gives
        raise IntegrityError(
            f"{url}: checksum mismatch in {shard.key!r} at bytes [{start}, "
            f"{start + max(need, 0)}) of the file — the file is corrupt; restore it, or load "
            "or reshard another step"
        )


def verify_chunks_split(
    shard: ChecksummedShard,
    first_chunk: int,
    data: Any,
    chunk_nbytes: int,
    sub_nbytes: int,
    url: str,
) -> list[int]:
    """:func:`verify_chunks` of one contiguous buffer that also returns the CRC-32Cs of its
    ``sub_nbytes`` pieces (from its first byte; the last may be short), in the same pass:
    each saved chunk's CRC is combined from its pieces' (:func:`crc32c_combine`).

    Lets a writer checksum bytes it copies with a smaller chunk size than the source's without
    reading them again. ``sub_nbytes`` must divide ``chunk_nbytes``.

    Raises:
        IntegrityError: a chunk's CRC differs (as :func:`verify_chunks`).
    """
    assert chunk_nbytes % sub_nbytes == 0, (chunk_nbytes, sub_nbytes)
    view = memoryview(data).cast("B")
    subs: list[int] = []
    pos, c = 0, first_chunk
    while pos < len(view):
        need = min(chunk_nbytes, shard.nbytes - c * chunk_nbytes, len(view) - pos)
        value = 0
        for start in range(pos, pos + max(need, 0), sub_nbytes):
            piece = view[start : min(start + sub_nbytes, pos + need)]
            subs.append(crc32c(piece))
            value = crc32c_combine(value, subs[-1], len(piece))
        _check_chunk(shard, c, value, need, chunk_nbytes, url)
        pos += need
        c += 1
    return subs


# ---- combining: CRC(A || B) from CRC(A), CRC(B) and len(B), without touching the data ----
# The algorithm of zlib's crc32_combine (Mark Adler), for the Castagnoli polynomial: appending
# n zero bytes to a message is a linear map of its CRC over GF(2), a 32x32 bit matrix built by
# repeated squaring of the one-zero-bit operator. Matrices are lists of 32 column ints.

_CASTAGNOLI_REFLECTED = 0x82F63B78


def _gf2_times(matrix: Sequence[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, column) for column in matrix]


@functools.lru_cache(maxsize=256)
def _zeros_operator(nbytes: int) -> tuple[int, ...]:
    """The matrix that maps CRC(A) to CRC(A || nbytes zero bytes), conditioning aside."""
    power = [_CASTAGNOLI_REFLECTED] + [1 << i for i in range(31)]  # one zero bit
    result: list[int] | None = None
    bits = nbytes * 8
    while bits:
        if bits & 1:
            result = power if result is None else [_gf2_times(power, c) for c in result]
        bits >>= 1
        if bits:
            power = _gf2_square(power)
    return tuple(result or [1 << i for i in range(32)])


@functools.lru_cache(maxsize=256)
def _zeros_tables(nbytes: int) -> tuple[tuple[int, ...], ...]:
    """:func:`_zeros_operator` as four 256-entry tables, one per byte of the CRC (the map is
    linear: the image of a CRC is the XOR of its bytes' images), so applying it costs four
    lookups instead of up to 32 column XORs."""
    matrix = _zeros_operator(nbytes)
    tables = []
    for k in range(4):
        cols = matrix[8 * k : 8 * k + 8]
        table = [0] * 256
        for b in range(1, 256):
            low = b & -b
            table[b] = table[b ^ low] ^ cols[low.bit_length() - 1]
        tables.append(tuple(table))
    return tuple(tables)


def crc32c_combine(crc_a: int, crc_b: int, nbytes_b: int) -> int:
    """CRC-32C of ``A || B`` given ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``.

    About a microsecond per call once the length's tables are cached (the first call for a
    length builds them, about a millisecond), so a file's CRC is assembled from its chunk
    CRCs instead of a second pass over the bytes.
    """
    if nbytes_b == 0:
        return crc_a
    t0, t1, t2, t3 = _zeros_tables(nbytes_b)
    return (
        t0[crc_a & 0xFF]
        ^ t1[(crc_a >> 8) & 0xFF]
        ^ t2[(crc_a >> 16) & 0xFF]
        ^ t3[crc_a >> 24]
        ^ crc_b
    )


def crc32c_extend(crc: int, chunk_crcs: Sequence[int], nbytes: int, chunk_nbytes: int) -> int:
    """CRC-32C of (the bytes ``crc`` covers) followed by ``nbytes`` bytes whose consecutive
    ``chunk_nbytes`` pieces (the last may be short) have the CRCs ``chunk_crcs``."""
    for value in chunk_crcs[:-1]:
        crc = crc32c_combine(crc, value, chunk_nbytes)
    if chunk_crcs:
        crc = crc32c_combine(crc, chunk_crcs[-1], nbytes - (len(chunk_crcs) - 1) * chunk_nbytes)
    return crc
