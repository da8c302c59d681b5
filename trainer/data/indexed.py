"""Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``, the ``MMIDIDX`` format), read
with numpy alone: no Megatron import.

Layout of ``PREFIX.idx``, all little-endian, as written by Megatron-Core's
``megatron/core/datasets/indexed_dataset.py`` (``_IndexWriter``; the format of
``tools/preprocess_data.py``)::

    offset 0   9 bytes   b"MMIDIDX\\x00\\x00"
           9   uint64    version, 1
          17   uint8     dtype code of the tokens (1 uint8, 2 int8, 3 int16, 4 int32,
                         5 int64, 6 float64, 7 float32, 8 uint16)
          18   uint64    S, sequence count
          26   uint64    D, document-index count (documents + 1: it starts with 0)
          34   int32[S]  sequence lengths, in tokens
               int64[S]  sequence pointers: byte offset of each sequence in PREFIX.bin
               int64[D]  document indices: sequence index where each document ends
               (int8[S]  sequence modes, multimodal datasets only; ignored here)

``PREFIX.bin`` is the sequences' tokens back to back, in order. Documents already end with
the end-of-document token when ``preprocess_data.py --append-eod`` made them, so the dataset
is read as one flat token array (the whole ``.bin``), as the other sources are.
"""

from __future__ import annotations

import struct

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from shardsmith.errors import ConfigError

INDEX_HEADER = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D: 34 bytes
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_TOKEN_CODES = (1, 3, 4, 5, 8)  # integer dtypes; int8 and floats cannot be token ids


def index_paths(prefix: str) -> tuple[str, str]:
    """``(PREFIX.bin, PREFIX.idx)`` for a prefix, or for a path ending in ``.bin``/``.idx``."""
    for ext in (".bin", ".idx"):
        if prefix.endswith(ext):
            prefix = prefix[: -len(ext)]
    return prefix + ".bin", prefix + ".idx"


def is_indexed(fs: fsspec.AbstractFileSystem, source: str) -> bool:
    """Whether ``source`` names an indexed dataset: both ``.bin`` and ``.idx`` exist."""
    bin_path, idx_path = index_paths(source)
    return fs.isfile(idx_path) and fs.isfile(bin_path)


def read_index(raw: bytes, where: str) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """Parses an ``.idx`` file's bytes.

    Args:
        raw: the whole ``.idx`` file.
        where: its path, for messages.

    Returns:
        ``(dtype, lengths, pointers, document_indices)``: the token dtype, int32 ``(S,)``
        sequence lengths in tokens, int64 ``(S,)`` byte offsets into ``.bin``, int64 ``(D,)``.

    Raises:
        ConfigError: not an MMIDIDX file, an unknown version or dtype, or a truncated file.
    """
    if len(raw) < _HEADER.size or raw[:9] != INDEX_HEADER:
        raise ConfigError(f"{where!r} is not a Megatron indexed dataset index (no MMIDIDX header)")
    _, version, code, num_seq, num_doc = _HEADER.unpack_from(raw)
    if version != 1:
        raise ConfigError(f"{where!r}: MMIDIDX version {version}; only version 1 is known")
    if code not in _TOKEN_CODES:
        raise ConfigError(
            f"{where!r}: dtype code {code} is not an integer token type "
            f"(known codes {sorted(DTYPE_CODES)})"
        )
    need = _HEADER.size + 12 * num_seq + 8 * num_doc
    if len(raw) < need:
        raise ConfigError(f"{where!r} is truncated: {len(raw)} bytes, the header promises {need}")
    off = _HEADER.size
    lengths = np.frombuffer(raw, dtype="<i4", count=num_seq, offset=off)
    pointers = np.frombuffer(raw, dtype="<i8", count=num_seq, offset=off + 4 * num_seq)
    docs = np.frombuffer(raw, dtype="<i8", count=num_doc, offset=off + 12 * num_seq)
    return np.dtype(DTYPE_CODES[code]), lengths, pointers, docs


def _check_contiguous(
    lengths: np.ndarray, pointers: np.ndarray, itemsize: int, bin_nbytes: int, where: str
) -> None:
    """The sequences must tile ``.bin`` back to back from byte 0 (what the builder writes)."""
    ends = np.cumsum(lengths.astype(np.int64)) * itemsize
    starts = np.concatenate([[0], ends[:-1]]) if len(ends) else ends
    total = int(ends[-1]) if len(ends) else 0
    if (lengths < 0).any() or not np.array_equal(starts, pointers) or total != bin_nbytes:
        raise ConfigError(
            f"indexed dataset {where!r}: the .idx sequences ({len(lengths)} of them, {total} bytes) "
            f"do not tile the .bin ({bin_nbytes} bytes) back to back; rebuild it with Megatron's "
            "preprocess_data.py"
        )


def load_indexed(fs: fsspec.AbstractFileSystem, source: str) -> np.ndarray:
    """An indexed dataset's tokens as one flat array (memory-mapped when local).

    Args:
        fs: the filesystem of ``source``.
        source: ``PREFIX`` (or ``PREFIX.bin`` / ``PREFIX.idx``).

    Returns:
        Shape ``(N,)`` token ids, N = the sum of the sequence lengths, in the ``.idx`` dtype
        (read-only ``np.memmap`` for local files).

    Raises:
        ConfigError: as :func:`read_index`, or the ``.idx`` does not describe the ``.bin``.
    """
    bin_path, idx_path = index_paths(source)
    dtype, lengths, pointers, _ = read_index(fs.cat_file(idx_path), idx_path)
    nbytes = fs.size(bin_path)
    _check_contiguous(lengths, pointers, dtype.itemsize, nbytes, source)
    little = dtype.newbyteorder("<")
    if nbytes == 0:
        return np.zeros(0, dtype=dtype)
    if isinstance(fs, LocalFileSystem):
        return np.memmap(bin_path, dtype=little, mode="r")
    return np.frombuffer(fs.cat_file(bin_path), dtype=little).astype(dtype)
