"""Reading a PyTorch DCP checkpoint directory box by box, without ``torch.load``.

A DCP directory (``torch.distributed.checkpoint.FileSystemWriter``; Megatron-Core's
``torch_dist`` is the same) holds ``.metadata`` and ``__<rank>_<n>.distcp`` files. The
metadata lists, per key, either a tensor (global size, dtype, and the chunks saved: global
offsets and sizes) or a bytes value, and per chunk a ``_StorageInfo``: (relative path, byte
offset, byte length) in a ``.distcp`` file. With the default ``torch_save`` serialization
(torch 2.13 ``filesystem._write_item``), each item is a ``torch.save`` zip archive stored
uncompressed: ``<name>/data.pkl`` describes the tensor (storage key, offset, size, stride)
and ``<name>/data/<key>`` holds its raw little-endian bytes. :class:`DCPCheckpoint` reads
``data.pkl`` through :mod:`.unpickler` and then only the byte rows a box needs.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from shardsmith.errors import CheckpointNotFound, IntegrityError
from shardsmith.layout import Box
from shardsmith.reshard.foreign.unpickler import (
    PickledTensor,
    load_dcp_metadata,
    load_inert_value,
    load_plain_value,
    load_tensor_record,
)

METADATA_NAME = ".metadata"
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length


@dataclass(frozen=True)
class Chunk:
    """One saved piece of a tensor: its global box and where its archive lies."""

    box: Box
    file: str
    offset: int
    length: int


class _FileSlice(io.RawIOBase):
    """Read-only, seekable view of bytes ``[start, start + length)`` of an open file."""

    def __init__(self, f: Any, start: int, length: int) -> None:
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        data = os.pread(self.f.fileno(), n, self.start + self.pos) if n else b""
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


class DCPCheckpoint:
    """A local DCP checkpoint directory, read lazily.

    Args:
        path: the directory holding ``.metadata``.

    Raises:
        CheckpointNotFound: no ``.metadata`` in ``path``.
        IntegrityError: the metadata is not DCP's, names a global outside the allow-list,
            or points outside the directory.
    """

    def __init__(self, path: str) -> None:
        self.dir = os.path.abspath(path)
        meta_path = os.path.join(self.dir, METADATA_NAME)
        if not os.path.isfile(meta_path):
            raise CheckpointNotFound(
                f"{self.dir}: no {METADATA_NAME}; is this a "
                "torch.distributed.checkpoint (DCP) directory?"
            )
        self.metadata = load_dcp_metadata(meta_path)
        self.chunks: dict[str, list[Chunk]] = {}
        self.values: dict[str, Chunk] = {}
        self._index(meta_path)
        self._files: dict[str, Any] = {}

    def _index(self, source: str) -> None:
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            TensorStorageMetadata,
        )

        where: dict[tuple[str, tuple[int, ...] | None], Any] = {}
        for index, info in self.metadata.storage_data.items():
            path = info.relative_path
            if (
                not isinstance(path, str)
                or os.path.basename(path) != path
                or path in ("", ".", "..")
                or getattr(info, "transform_descriptors", None)
            ):
                raise IntegrityError(
                    f"{source}: {index.fqn} is stored in {path!r} with transforms "
                    f"{getattr(info, 'transform_descriptors', None)}; shardsmith reads "
                    "only plain files of this directory"
                )
            offsets = None if index.offset is None else tuple(index.offset)
            where[(index.fqn, offsets)] = info
        for key, md in self.metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                info = where.get((key, None))
                if info is not None:
                    self.values[key] = Chunk(
                        Box((), ()), info.relative_path, info.offset, info.length
                    )
                continue
            if not isinstance(md, TensorStorageMetadata):
                raise IntegrityError(f"{source}: {key} has metadata of type {type(md).__name__}")
            self.chunks[key] = []
            for c in md.chunks:
                info = where.get((key, tuple(c.offsets)))
                if info is None:
                    raise IntegrityError(
                        f"{source}: chunk {tuple(c.offsets)} of {key} has no storage entry"
                    )
                box = Box(tuple(c.offsets), tuple(c.sizes))
                self.chunks[key].append(Chunk(box, info.relative_path, info.offset, info.length))

    def shape(self, key: str) -> tuple[int, ...]:
        """Global shape of tensor ``key``."""
        return tuple(self.metadata.state_dict_metadata[key].size)

    def dtype(self, key: str) -> torch.dtype:
        """Stored dtype of tensor ``key``."""
        return self.metadata.state_dict_metadata[key].properties.dtype

    def _open(self, name: str) -> Any:
        if name not in self._files:
            path = os.path.join(self.dir, name)
            try:
                self._files[name] = open(path, "rb")
            except FileNotFoundError:
                raise CheckpointNotFound(
                    f"{path}: named by {METADATA_NAME} but missing; the DCP "
                    "checkpoint is incomplete"
                ) from None
        return self._files[name]

    def close(self) -> None:
        """Close every open ``.distcp`` file."""
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _archive(self, chunk: Chunk, what: str) -> tuple[zipfile.ZipFile, Any, str]:
        f = self._open(chunk.file)
        source = f"{self.dir}/{chunk.file}@{chunk.offset} ({what})"
        if os.pread(f.fileno(), 4, chunk.offset) != b"PK\x03\x04":
            raise IntegrityError(
                f"{source}: not a torch.save archive (DCP serialization other than "
                "torch_save is not supported)"
            )
        try:
            archive = zipfile.ZipFile(_FileSlice(f, chunk.offset, chunk.length))
        except zipfile.BadZipFile as exc:
            raise IntegrityError(f"{source}: damaged torch.save archive ({exc})") from None
        pkl = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkl) != 1:
            raise IntegrityError(f"{source}: no single data.pkl in the archive")
        return archive, f, pkl[0][: -len("data.pkl")]

    def read_value(self, key: str, *, inert: bool = False) -> Any:
        """A bytes item (``int``, ``float``, lists ...) through the plain allow-list; with
        ``inert``, other objects become :class:`~.unpickler.Opaque` placeholders instead of
        refusing the item (Megatron-LM's ``common_state``)."""
        chunk = self.values[key]
        archive, _, prefix = self._archive(chunk, key)
        load = load_inert_value if inert else load_plain_value
        return load(archive.read(prefix + "data.pkl"), f"{self.dir}/{chunk.file} ({key})")

    def _chunk_tensor(self, key: str, chunk: Chunk, rows: tuple[int, int]) -> torch.Tensor:
        """Rows ``[r0, r1)`` (chunk-local, dim 0) of a saved chunk; the whole chunk if 0-d."""
        archive, f, prefix = self._archive(chunk, key)
        source = f"{self.dir}/{chunk.file}@{chunk.offset} ({key})"
        rec = load_tensor_record(archive.read(prefix + "data.pkl"), source)
        _check_record(rec, chunk.box.lengths, self.dtype(key), source)
        info = archive.getinfo(prefix + "data/" + rec.storage.key)
        itemsize = torch.empty((), dtype=rec.storage.dtype).element_size()
        if (
            info.compress_type != zipfile.ZIP_STORED
            or info.file_size != rec.storage.numel * itemsize
        ):
            raise IntegrityError(
                f"{source}: storage entry is compressed or of {info.file_size} bytes, "
                f"not {rec.storage.numel * itemsize}"
            )
        header = os.pread(f.fileno(), _LOCAL_HEADER.size, chunk.offset + info.header_offset)
        sig, name_len, extra_len = _LOCAL_HEADER.unpack(header)
        data_start = chunk.offset + info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        size = rec.size
        if rec.stride == _contiguous(size) and size:
            row = prod(size[1:])
            first, count = (rec.storage_offset + rows[0] * row), (rows[1] - rows[0]) * row
            shape = (rows[1] - rows[0],) + size[1:]
        else:  # 0-d or strided: the whole storage, viewed as saved
            first, count, shape = 0, rec.storage.numel, None
        buf = bytearray(count * itemsize)
        got = os.preadv(f.fileno(), [buf], data_start + first * itemsize) if buf else 0
        if sig != b"PK\x03\x04" or got != len(buf):
            raise IntegrityError(f"{source}: storage bytes cut short ({got} of {len(buf)})")
        flat = (
            torch.frombuffer(buf, dtype=rec.storage.dtype)
            if buf
            else torch.empty(0, dtype=rec.storage.dtype)
        )
        if shape is not None:
            return flat.reshape(shape)
        whole = flat.as_strided(size, rec.stride, rec.storage_offset)
        return whole[rows[0] : rows[1]] if size else whole

    def read(self, key: str, box: Box, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Box ``box`` (global elements) of tensor ``key``, assembled from the chunks it overlaps.

        Args:
            dtype: convert to this dtype (default: the stored one).

        Raises:
            IntegrityError: the saved chunks do not cover ``box``, or an archive is damaged.
        """
        out = torch.empty(box.lengths, dtype=dtype or self.dtype(key))
        covered = 0
        for chunk in self.chunks[key]:
            common = box.intersect(chunk.box)
            if common is None:
                continue
            local = tuple(o - c for o, c in zip(common.offsets, chunk.box.offsets))
            rows = (local[0], local[0] + common.lengths[0]) if local else (0, 0)
            piece = self._chunk_tensor(key, chunk, rows)
            if local:
                piece = piece[
                    (slice(None),)
                    + tuple(slice(o, o + n) for o, n in zip(local[1:], common.lengths[1:]))
                ]
            out[common.relative_to(box)] = piece
            covered += common.numel
        if covered != box.numel:
            raise IntegrityError(
                f"{self.dir}: the saved chunks of {key} cover {covered} of the "
                f"{box.numel} elements of box {box}; the DCP checkpoint is incomplete"
            )
        return out


def _contiguous(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _check_record(
    rec: PickledTensor, lengths: tuple[int, ...], dtype: torch.dtype, source: str
) -> None:
    if rec.size != tuple(lengths) or rec.storage.dtype != dtype:
        raise IntegrityError(
            f"{source}: archive holds {rec.storage.dtype} {rec.size}, metadata says "
            f"{dtype} {tuple(lengths)}"
        )
    last = (
        rec.storage_offset + sum((n - 1) * s for n, s in zip(rec.size, rec.stride))
        if prod(rec.size)
        else 0
    )
    if (
        rec.storage_offset < 0
        or min(rec.stride, default=0) < 0
        or last >= max(rec.storage.numel, 1)
    ):
        raise IntegrityError(f"{source}: tensor view reaches outside its storage")
