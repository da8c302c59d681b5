"""The zarr v3 tensor format: one zarr array per logical tensor, chunked on shard boundaries.

Layout of a step directory (``tensor_format: "zarr"`` in the manifest)::

    <step>/zarr/zarr.json                     the group (zarr v3 metadata)
    <step>/zarr/<fqn>/zarr.json               one array per logical tensor, global shape
    <step>/zarr/<fqn>/c/<i>/<j>               its chunks ("default" key encoding, "/")
    <step>/manifest.json                      written last: the commit, as for safetensors

``zarr.open_group("<step>/zarr")`` opens it with no shardsmith code; every tensor shows
its global shape.

Chunk grid (:func:`regular_chunks`): zarr v3 grids are regular, while the saving layout's
boxes follow ``torch.chunk`` and, with nested splits (``tp`` then ``dp_shard``), need not
form a regular grid. Along each dim the chunk length is the gcd of the box boundaries
strictly inside the tensor (the whole dim when it is not split): the largest regular grid
whose boundaries include every box boundary. So every box is a union of whole chunks,
no chunk is shared by two writers, and the rank that writes a box writes all its chunks.
The last chunk along a dim may be short; zarr stores it padded with the fill value (0).

Manifest records: one shard record per chunk file: its box (the chunk's region clipped to
the tensor's shape), ``file`` = the chunk's path, ``key`` = the fqn, ``byte_offset`` 0,
``nbytes`` and ``crc32c`` of the bytes *as stored* (encoded, possibly compressed). Every
chunk file and every ``zarr.json`` is listed in ``files`` with its size and CRC-32C, so
``verify``, ``gc`` and ``ls`` work unchanged.

Dtypes: zarr-python 3 has no bfloat16 data type, so BF16 tensors are stored as ``uint16``
arrays holding the bfloat16 bit patterns, with the attribute ``shardsmith.dtype = "BF16"``
(``torch.from_numpy(a.view("int16")).view(torch.bfloat16)`` recovers them). Every array
carries ``shardsmith.dtype``. 0-d tensors are 0-d arrays with one chunk (key ``c``).

Codecs: ``bytes`` (little endian), optionally followed by ``zstd`` or ``gzip`` (see
:func:`parse_codec`). Reading never hands stored metadata to zarr: it checks the fields
against the manifest and a whitelist of codecs and rebuilds the metadata itself, so an
untrusted checkpoint cannot select arbitrary codecs (e.g. ``numcodecs.pickle``).
Encoding and decoding of compressed chunks are zarr's own (in-memory arrays); bytes move
through :class:`~shardsmith.storage.store.fs.Store` (retries, any fsspec URL) and are checksummed.
Reading is in :mod:`shardsmith.storage.formats.zarr_read`: uncompressed chunks by byte range (only
what a box needs, as for safetensors), compressed chunks whole.

Costs (``bench/format_bench.py``): one object per chunk plus one ``zarr.json`` per tensor,
so many more objects than safetensors' one file per rank; with nested uneven splits the
gcd grid can cut boxes into several chunks each.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import reduce
from itertools import product
from math import gcd
from typing import Any, Iterable, Sequence

import numpy as np
import torch
import zarr
from zarr.codecs import GzipCodec, ZstdCodec
from zarr.storage import MemoryStore

from shardsmith.errors import ConfigError, IntegrityError
from shardsmith.layout import ZARR_DTYPES, Box
from shardsmith.storage.checksum import chunk_crc32c, crc32c
from shardsmith.storage.manifest.records import FileRecord, ShardRecord, TensorRecord
from shardsmith.storage.store.fs import Store

ZARR_DIR = "zarr"
#: Compression codecs a checkpoint may use, with their default levels.
CODEC_LEVELS: dict[str, int] = {"zstd": 3, "gzip": 5}
#: Chunk files read or written at once (threads; object-store requests release the GIL).
IO_WORKERS = 8
#: Encoded bytes buffered before they are written / chunk bytes held before decoding.
MAX_PENDING_NBYTES = 256 * 2**20


def parse_codec(spec: str) -> tuple[str, int]:
    """``""`` (none), ``"zstd"``, ``"zstd:5"``, ``"gzip"``, ``"gzip:9"`` -> (name, level).

    Raises:
        ConfigError: an unknown codec or a level that is not an integer.
    """
    if not spec:
        return "", 0
    name, _, level = spec.partition(":")
    if name not in CODEC_LEVELS:
        raise ConfigError(
            f"zarr codec {spec!r}: choose one of {sorted(CODEC_LEVELS)} (optionally "
            "with a level, e.g. zstd:5), or '' for none"
        )
    try:
        return name, int(level) if level else CODEC_LEVELS[name]
    except ValueError:
        raise ConfigError(f"zarr codec {spec!r}: the level after ':' must be an integer") from None


def regular_chunks(shape: Sequence[int], boxes: Iterable[Box]) -> tuple[int, ...]:
    """The largest regular chunk grid whose boundaries include every box boundary.

    Along dim ``d`` the chunk length is the gcd of the box edges strictly inside
    ``(0, shape[d])``, or ``shape[d]`` when no box edge is inside (at least 1).

    Args:
        shape: the tensor's global shape (elements).
        boxes: the boxes the saving layout stores (any order, replicas allowed).

    Returns:
        Chunk shape, one length per dim (``()`` for a 0-d tensor).
    """
    boxes = list(boxes)
    out = []
    for d, n in enumerate(shape):
        edges = {e for b in boxes for e in (b.offsets[d], b.offsets[d] + b.lengths[d]) if 0 < e < n}
        out.append(reduce(gcd, edges, 0) or max(n, 1))
    return tuple(out)


@dataclass(frozen=True)
class ZarrArray:
    """One logical tensor as a zarr array.

    Attributes:
        fqn: the tensor's global name (the array's name in the group).
        shape: global shape (elements).
        dtype: manifest dtype name (``F32``, ``BF16`` ...).
        chunks: chunk shape (see :func:`regular_chunks`).
        codec: compression after the ``bytes`` codec: ``""``, ``"zstd:3"`` ... (normalized).
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]
    codec: str = ""

    @property
    def path(self) -> str:
        """The array's directory, relative to the step directory."""
        return f"{ZARR_DIR}/{self.fqn}"

    def create_kwargs(self) -> dict[str, Any]:
        """Arguments of ``zarr.create_array`` / ``Group.create_array`` for this array."""
        name, level = parse_codec(self.codec)
        compressors: ZstdCodec | GzipCodec | None = None
        if name == "zstd":
            compressors = ZstdCodec(level=level)
        elif name == "gzip":
            compressors = GzipCodec(level=level)
        attrs: dict[str, Any] = {"dtype": self.dtype}
        if self.dtype == "BF16":
            attrs["note"] = "uint16 bit patterns of bfloat16 values; view the data as bfloat16"
        return {
            "shape": self.shape,
            "chunks": self.chunks,
            "dtype": ZARR_DTYPES[self.dtype],
            "fill_value": False if self.dtype == "BOOL" else 0,
            "compressors": compressors,
            "attributes": {"shardsmith": attrs},
        }

    def chunk_key(self, chunk: Box) -> str:
        """Step-relative path of the chunk whose (clipped) region is ``chunk``."""
        index = [o // c for o, c in zip(chunk.offsets, self.chunks)]
        return f"{self.path}/c" + "".join(f"/{i}" for i in index)

    def chunk_region(self, index: Sequence[int]) -> Box:
        """The region of chunk ``index``, clipped to the shape."""
        offsets = tuple(i * c for i, c in zip(index, self.chunks))
        return Box(
            offsets, tuple(min(c, n - o) for o, c, n in zip(offsets, self.chunks, self.shape))
        )

    def chunks_of(self, box: Box) -> list[Box]:
        """Regions of the chunks tiling ``box`` (a union of whole chunks), row-major order.

        Raises:
            ValueError: ``box`` does not lie on chunk boundaries (an internal error: the
                grid is built from the boxes).
        """
        for o, n, c, s in zip(box.offsets, box.lengths, self.chunks, self.shape):
            if o % c or ((o + n) % c and o + n != s):
                raise ValueError(
                    f"{self.fqn}: box {box} does not lie on the chunk grid {self.chunks}"
                )
        ranges = [
            range(o // c, -(-(o + n) // c))
            for o, n, c in zip(box.offsets, box.lengths, self.chunks)
        ]
        return [self.chunk_region(index) for index in product(*ranges)]

    def in_memory(self, chunks: dict[str, Any] | None = None) -> zarr.Array:
        """A zarr array over a dict (key relative to the array -> zarr Buffer): zarr's own
        encoder and decoder, no I/O. Empty chunks are written too (no sparse chunks)."""
        return zarr.create_array(
            store=MemoryStore({} if chunks is None else chunks),
            config={"write_empty_chunks": True},
            **self.create_kwargs(),
        )


# ---- torch <-> numpy (zero copy) ------------------------------------------------------------


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's elements as numpy (BF16 as uint16 bit patterns), no copy when contiguous."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def numpy_to_torch(a: np.ndarray, dtype: str) -> torch.Tensor:
    """Inverse of :func:`torch_to_numpy` for manifest dtype ``dtype``."""
    a = np.ascontiguousarray(a)
    if dtype == "BF16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


# ---- writing --------------------------------------------------------------------------------


def encode_box(array: ZarrArray, tensor: torch.Tensor, box: Box) -> list[tuple[Box, str, bytes]]:
    """Encode the chunks of ``box`` (a union of whole chunks) holding ``tensor``.

    Args:
        array: the array's description.
        tensor: the box's data, shape ``box.lengths`` (any device; copied to CPU).
        box: global box (elements) on the chunk grid.

    Returns:
        (chunk region, step-relative chunk path, encoded bytes) per chunk.
    """
    store: dict[str, Any] = {}
    arr = array.in_memory(store)
    data = torch_to_numpy(tensor)
    arr[box.relative_to(Box((0,) * len(box.lengths), array.shape)) if box.lengths else ()] = data
    out = []
    for region in array.chunks_of(box):
        key = array.chunk_key(region)
        out.append((region, key, store[key[len(array.path) + 1 :]].to_bytes()))
    return out


def _write_all(store: Store, items: list[tuple[str, bytes]], workers: int = IO_WORKERS) -> None:
    if len(items) <= 1:
        for key, data in items:
            store.write(key, data)
        return
    with ThreadPoolExecutor(min(workers, len(items))) as pool:
        list(pool.map(lambda kv: store.write(*kv), items))


def write_chunks(
    step_store: Store,
    arrays: dict[str, ZarrArray],
    entries: Iterable[tuple[str, torch.Tensor, Box]],
    chunk_nbytes: int,
) -> tuple[dict[str, FileRecord], dict[str, list[ShardRecord]]]:
    """Encode and write the chunks of this writer's boxes; return their manifest records.

    Every writer calls it for the boxes it is assigned (``layout.sharding.write_assignment``),
    any number of writers at once: chunks are never shared. ``entries`` may be a generator
    (e.g. boxes read one at a time); at most :data:`MAX_PENDING_NBYTES` of encoded bytes
    are held before they are written, concurrently.

    Args:
        step_store: the step directory.
        arrays: fqn -> array description (the same on every writer).
        entries: (fqn, data of shape ``box.lengths``, global box); empty boxes are skipped.
        chunk_nbytes: checksum chunk size (bytes) of the manifest.

    Returns:
        (files: chunk path -> size and CRC-32C, shards: fqn -> one record per chunk).

    Raises:
        StorageError / OSError: a write failed (after the store's retries).
    """
    files: dict[str, FileRecord] = {}
    shards: dict[str, list[ShardRecord]] = {}
    pending: list[tuple[str, bytes]] = []
    pending_nbytes = 0
    for fqn, tensor, box in entries:
        if box.is_empty:
            continue
        array = arrays[fqn]
        for region, key, data in encode_box(array, tensor, box):
            files[key] = FileRecord(nbytes=len(data), crc32c=crc32c(data))
            shards.setdefault(fqn, []).append(
                ShardRecord(
                    offsets=list(region.offsets),
                    lengths=list(region.lengths),
                    file=key,
                    key=fqn,
                    byte_offset=0,
                    nbytes=len(data),
                    crc32c=chunk_crc32c(data, chunk_nbytes),
                )
            )
            pending.append((key, data))
            pending_nbytes += len(data)
        if pending_nbytes > MAX_PENDING_NBYTES:
            _write_all(step_store, pending)
            pending, pending_nbytes = [], 0
    _write_all(step_store, pending)
    return files, shards


def metadata_files(arrays: Iterable[ZarrArray]) -> dict[str, bytes]:
    """Step-relative path -> bytes of the group's and every array's ``zarr.json`` (zarr's own)."""
    store: dict[str, Any] = {}
    group = zarr.open_group(
        store=MemoryStore(store),
        mode="w",
        zarr_format=3,
        attributes={
            "shardsmith": {
                "note": "a shardsmith checkpoint; ../manifest.json holds boxes, checksums "
                "and training state; BF16 arrays hold uint16 bit patterns"
            }
        },
    )
    for array in arrays:
        group.create_array(array.fqn, **array.create_kwargs())
    return {f"{ZARR_DIR}/{key}": buf.to_bytes() for key, buf in sorted(store.items())}


def write_metadata(step_store: Store, arrays: Iterable[ZarrArray]) -> dict[str, FileRecord]:
    """Write the group and array metadata once (the coordinator, before the manifest).

    Returns:
        path -> size and CRC-32C of each ``zarr.json`` (for the manifest's ``files``).
    """
    files = metadata_files(arrays)
    _write_all(step_store, list(files.items()))
    return {key: FileRecord(nbytes=len(data), crc32c=crc32c(data)) for key, data in files.items()}


# ---- metadata checks (used by zarr_read) -------------------------------------------------


def damaged(url: str, what: str) -> IntegrityError:
    """An IntegrityError naming ``url``, saying what is wrong and what to do."""
    return IntegrityError(
        f"{url}: {what} — the checkpoint is damaged or was not written by "
        "shardsmith; resume from another step or restore the file"
    )


def _codec_of(codecs: Any, url: str) -> str:
    """The codec spec of a stored ``codecs`` list: ``bytes`` then at most one whitelisted codec."""
    if (
        not isinstance(codecs, list)
        or not codecs
        or not isinstance(codecs[0], dict)
        or codecs[0].get("name") != "bytes"
        or (codecs[0].get("configuration") or {}).get("endian", "little") != "little"
        or len(codecs) > 2
    ):
        raise damaged(
            url,
            f"unsupported codecs {json.dumps(codecs)[:200]} (expected bytes/little, "
            f"optionally followed by one of {sorted(CODEC_LEVELS)})",
        )
    if len(codecs) == 1:
        return ""
    extra = codecs[1]
    name = extra.get("name") if isinstance(extra, dict) else None
    level = (extra.get("configuration") or {}).get("level") if isinstance(extra, dict) else None
    if name not in CODEC_LEVELS or type(level) is not int:
        raise damaged(
            url, f"unsupported codec {json.dumps(extra)[:200]} (allowed: {sorted(CODEC_LEVELS)})"
        )
    return f"{name}:{level}"


def parse_array_metadata(raw: bytes, fqn: str, rec: TensorRecord, url: str) -> ZarrArray:
    """Check an array's stored ``zarr.json`` against the manifest record; describe the array.

    Raises:
        IntegrityError: naming ``url``, when it is not JSON, not a zarr v3 array, or its
            shape, data type, chunk grid, key encoding or codecs are not what shardsmith
            writes for this tensor.
    """
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise damaged(url, f"not valid JSON ({str(exc)[:100]})") from exc
    if (
        not isinstance(meta, dict)
        or meta.get("zarr_format") != 3
        or meta.get("node_type") != "array"
    ):
        raise damaged(url, "not zarr v3 array metadata")
    if meta.get("shape") != rec.shape or meta.get("data_type") != ZARR_DTYPES[rec.dtype]:
        raise damaged(
            url,
            f"array is {meta.get('data_type')!r:.20} {meta.get('shape')!r:.80}, the manifest "
            f"says {fqn} is {rec.dtype} {rec.shape}",
        )
    grid = meta.get("chunk_grid")
    chunks = (
        (grid.get("configuration") or {}).get("chunk_shape") if isinstance(grid, dict) else None
    )
    if (
        not isinstance(grid, dict)
        or grid.get("name") != "regular"
        or not isinstance(chunks, list)
        or len(chunks) != len(rec.shape)
        or any(type(c) is not int or c < 1 for c in chunks)
    ):
        raise damaged(url, f"unsupported chunk grid {json.dumps(grid)[:200]}")
    if meta.get("chunk_key_encoding") != {"name": "default", "configuration": {"separator": "/"}}:
        raise damaged(
            url,
            f"unsupported chunk key encoding {json.dumps(meta.get('chunk_key_encoding'))[:120]}",
        )
    if meta.get("storage_transformers") not in (None, []):
        raise damaged(url, "storage transformers are not supported")
    return ZarrArray(
        fqn, tuple(rec.shape), rec.dtype, tuple(chunks), _codec_of(meta.get("codecs"), url)
    )
