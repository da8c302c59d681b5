"""The shard grid of a tensor (manifest version 3): read a rank's shard records, not a tensor's.

At 16,384 ranks a weight of a stage is saved as ``tp x dp_shard`` = 512 shards; a resuming
rank needs one or two of them, but a version-2 reader fetches the tensor's whole entry (all
512 records, ~170 bytes each), so its metadata read grew with the job. Version 3 adds, for
each tensor whose shards form a product grid (every dim cut at the same points in every
shard, records in row-major order, as :class:`~shardsmith.storage.manifest.records.ManifestBuilder`
sorts them) and that has at least :data:`GRID_MIN_SHARDS` shards, a *grid entry* in a section
``"grids"`` after ``"tensors"``::

    "fqn":{"shape":[..],"dtype":"..","split":[832, 16384],"at":[p0, p16, p32, .., end]}

``split`` gives each dim's cut points: an integer ``L`` for a regular split (cuts at
``0, L, 2L, ..`` and the dim's size, as ``torch.chunk`` and nested even chunks produce), or the
list of cut points (``0``, .., size). ``at`` gives, relative to the start of the tensor's
entry in ``"tensors"``, the byte where record ``0``, ``K``, ``2K``, .. begins
(``K`` = :data:`GRID_BLOCK`) and, last, the byte of the ``]`` that closes ``shards``. A
reader computes the cells its box intersects, fetches the blocks of records holding them
and checks each record's box is its cell. The records in ``"tensors"`` are unchanged, so any
JSON reader still finds every shard there; the grid entries of one stage are neighbours, so a
rank fetches its stage's grids in one read.

:func:`grid_bounds` finds a grid at save time; :func:`encode_entry` writes a gridded entry
and its grid entry; :func:`parse_grid`, :func:`cells_for`, :func:`parse_blocks` read them.
"""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import product
from math import prod
from typing import Any, Callable

from shardsmith.layout import DTYPE_NBYTES, Box
from shardsmith.storage.manifest.checks import (
    Problems,
    check_type,
    err,
    int_list,
    load_json,
    parse_tensor,
)
from shardsmith.storage.manifest.records import ShardRecord, TensorRecord

#: Tensors with fewer shards are read whole (their entry is small); a grid costs ~100 bytes.
GRID_MIN_SHARDS = 16
#: Records per block of ``at``: a reader fetches at most this many records per cell it needs
#: (~2.7 KB), and ``at`` costs one number per this many records.
GRID_BLOCK = 16
_SEPARATORS = (",", ":")


def grid_bounds(shape: list[int], shards: list[ShardRecord]) -> list[list[int]] | None:
    """Cut points of each dim when ``shards`` (sorted by offsets) are exactly the cells of a
    product grid in row-major order, with at least :data:`GRID_MIN_SHARDS` of them; else ``None``."""
    if len(shards) < GRID_MIN_SHARDS or not shape:
        return None
    bounds = [sorted({s.offsets[d] for s in shards} | {0, n}) for d, n in enumerate(shape)]
    if prod(len(b) - 1 for b in bounds) != len(shards):
        return None
    for s, cell in zip(shards, product(*(range(len(b) - 1) for b in bounds))):
        if any(
            s.offsets[d] != bounds[d][c] or s.lengths[d] != bounds[d][c + 1] - bounds[d][c]
            for d, c in enumerate(cell)
        ):
            return None
    return bounds


def _split_json(bounds: list[int]) -> int | list[int]:
    """``L`` when the cuts are ``0, L, 2L, .., size``, else the cuts."""
    step, size = bounds[1], bounds[-1]
    return step if bounds == list(range(0, size, step)) + [size] else bounds


def encode_entry(fqn: str, t: TensorRecord, bounds: list[list[int]]) -> tuple[bytes, bytes]:
    """The tensor's entry in ``"tensors"`` (the same JSON as version 2's) and its grid entry."""
    itemsize = DTYPE_NBYTES[t.dtype]
    fqn_json = json.dumps(fqn)
    head = (
        fqn_json
        + ":"
        + json.dumps({"shape": t.shape, "dtype": t.dtype}, separators=_SEPARATORS)[:-1]
        + ',"shards":['
    ).encode()
    records = [
        json.dumps(s.to_v2_json(itemsize), separators=_SEPARATORS).encode() for s in t.shards
    ]
    at, pos = [], len(head)
    for i, rec in enumerate(records):
        if i % GRID_BLOCK == 0:
            at.append(pos)
        pos += len(rec) + 1
    at.append(pos - 1)
    grid = {"shape": t.shape, "dtype": t.dtype, "split": [_split_json(b) for b in bounds], "at": at}
    return head + b",".join(records) + b"]}", (
        fqn_json + ":" + json.dumps(grid, separators=_SEPARATORS)
    ).encode()


@dataclass
class Grid:
    """A parsed grid entry: cut points per dim, block starts (``at``), number of records."""

    shape: list[int]
    dtype: str
    bounds: list[list[int]]
    at: list[int]

    @property
    def num_records(self) -> int:
        return prod(len(b) - 1 for b in self.bounds)

    def cell_box(self, i: int) -> tuple[list[int], list[int]]:
        """Offsets and lengths of record ``i`` (row-major)."""
        offsets, lengths = [], []
        for b in reversed(self.bounds):
            i, c = divmod(i, len(b) - 1)
            offsets.append(b[c])
            lengths.append(b[c + 1] - b[c])
        return offsets[::-1], lengths[::-1]


def _bounds(split: Any, size: int, where: str, source: str, max_cells: int) -> list[int]:
    if type(split) is int:
        if not 1 <= split or -(-size // split) > max_cells:
            raise err(
                where,
                f"a regular split of {size} into pieces of {split} is not a split of this grid",
                source,
            )
        return list(range(0, size, split)) + [size]
    cuts = int_list(split, where, source)
    if (
        len(cuts) < 2
        or len(cuts) > max_cells + 1
        or cuts[0] != 0
        or cuts[-1] != size
        or any(a >= b for a, b in zip(cuts, cuts[1:]))
    ):
        raise err(where, f"cut points must rise strictly from 0 to the dim's size {size}", source)
    return cuts


def parse_grid(raw: bytes, fqn: str, entry_nbytes: int, source: str) -> Grid:
    """The grid entry ``raw`` (``"fqn":{..}``) of a tensor entry of ``entry_nbytes`` bytes.

    Raises:
        ManifestError: not exactly this tensor's grid; a split that is not a split of the
            shape; ``at`` not rising inside the entry or not one start per block.
    """
    where = f"grids[{fqn!r:.120}]"
    data = load_json(b"{" + raw + b"}", source)
    if list(data) != [fqn]:
        raise err(
            where, f"points at the grid of {list(data)[:1]!r:.120}, not of this tensor", source
        )
    g = check_type(data[fqn], dict, where, source)
    if sorted(g) != ["at", "dtype", "shape", "split"]:
        raise err(where, f"expected fields shape, dtype, split, at; got {sorted(g)!r:.80}", source)
    t = parse_tensor(
        fqn, {"shape": g["shape"], "dtype": g["dtype"], "shards": []}, source, lambda d, w: d
    )
    at = int_list(g["at"], where + ".at", source)
    split = check_type(g["split"], list, where + ".split", source)
    if len(split) != len(t.shape) or not t.shape:
        raise err(where + ".split", f"{len(split)} dims for shape {t.shape}", source)
    cells = GRID_BLOCK * max(len(at) - 1, 1)
    bounds = [
        _bounds(s, n, f"{where}.split[{d}]", source, cells)
        for d, (s, n) in enumerate(zip(split, t.shape))
    ]
    grid = Grid(t.shape, t.dtype, bounds, at)
    if (
        len(at) != -(-grid.num_records // GRID_BLOCK) + 1
        or any(a >= b for a, b in zip(at, at[1:]))
        or at[-1] > entry_nbytes - 2
    ):
        raise err(
            where + ".at",
            f"expected one rising start per {GRID_BLOCK} of the {grid.num_records} records "
            f"and the end, inside the entry's {entry_nbytes} bytes",
            source,
        )
    return grid


def cells_for(grid: Grid, box: Box) -> list[int]:
    """Row-major indices of the records whose cells ``box`` intersects (none for an empty box)."""
    if box.is_empty or len(box.offsets) != len(grid.bounds):
        return []
    ranges = []
    for b, o, n in zip(grid.bounds, box.offsets, box.lengths):
        lo, hi = max(bisect_right(b, o) - 1, 0), min(bisect_left(b, o + n), len(b) - 1)
        ranges.append(range(lo, hi))
    out = []
    for cell in product(*ranges):
        i = 0
        for b, c in zip(grid.bounds, cell):
            i = i * (len(b) - 1) + c
        out.append(i)
    return out


def block_span(grid: Grid, block: int) -> tuple[int, int]:
    """Bytes ``[start, end)`` of block ``block``'s records in the tensor's entry (a trailing ``,`` included)."""
    return grid.at[block], grid.at[block + 1]


def parse_blocks(
    pieces: dict[int, bytes],
    grid: Grid,
    fqn: str,
    parse_shard: Callable[[Any, str], ShardRecord],
    source: str,
) -> dict[int, ShardRecord]:
    """Records of the blocks ``pieces`` (block -> its bytes, see :func:`block_span`), by record
    index; each record's box must be its cell.

    Raises:
        ManifestError: a block that is not exactly its records, or a record off its cell.
    """
    out: dict[int, ShardRecord] = {}
    for b, raw in sorted(pieces.items()):
        first = b * GRID_BLOCK
        count = min(GRID_BLOCK, grid.num_records - first)
        where = f"tensors[{fqn!r:.120}].shards[{first}:{first + count}]"
        body = raw[:-1] if b + 1 < len(grid.at) - 1 else raw
        if b + 1 < len(grid.at) - 1 and raw[-1:] != b",":
            raise err(where, "grid block does not end where the next begins (at)", source)
        items = load_json(b'{"r":[' + body + b"]}", source)["r"]
        if len(items) != count:
            raise err(where, f"grid block holds {len(items)} records, expected {count}", source)
        for k, item in enumerate(items):
            rec = parse_shard(item, f"tensors[{fqn!r:.120}].shards[{first + k}]")
            offsets, lengths = grid.cell_box(first + k)
            if list(rec.offsets) != offsets or list(rec.lengths) != lengths:
                raise err(
                    f"tensors[{fqn!r:.120}].shards[{first + k}]",
                    f"box offsets={rec.offsets} "
                    f"lengths={rec.lengths} is not its grid cell offsets={offsets} lengths={lengths}",
                    source,
                )
            out[first + k] = rec
    return out


def parse_gridded_entry(
    raw: bytes, fqn: str, grid: Grid, parse_shard: Callable[[Any, str], ShardRecord], source: str
) -> TensorRecord:
    """A whole gridded entry, read block by block as a partial reader would, so both see the
    same records: the prefix ``"fqn":{"shape":..,"dtype":..,"shards":[``, each block, ``]}``.

    Raises:
        ManifestError: the pieces do not make up the entry, or disagree with the grid.
    """
    where = f"tensors[{fqn!r:.120}]"
    prefix = load_json(b"{" + raw[: grid.at[0]] + b"]}}", source)
    t = prefix.get(fqn) if list(prefix) == [fqn] else None
    if (
        not isinstance(t, dict)
        or sorted(t) != ["dtype", "shape", "shards"]
        or t["shards"] != []
        or t["shape"] != grid.shape
        or t["dtype"] != grid.dtype
        or raw[grid.at[-1] :] != b"]}"
    ):
        raise err(
            where,
            "the entry is not the grid's tensor: expected shape, dtype as in its grid, then the "
            "shard records the grid's 'at' points at, then ']}'",
            source,
        )
    pieces = {b: raw[s:e] for b in range(len(grid.at) - 1) for s, e in [block_span(grid, b)]}
    records = parse_blocks(pieces, grid, fqn, parse_shard, source)
    return TensorRecord(
        shape=grid.shape, dtype=grid.dtype, shards=[records[i] for i in range(len(records))]
    )


def check_cell_nbytes(fqn: str, rec: TensorRecord, problems: Problems, *, raw_nbytes: bool) -> None:
    """Byte counts of the records of a partly read gridded tensor (``raw_nbytes``: safetensors,
    whose records hold exactly their box's elements)."""
    if not raw_nbytes:
        return
    for i, s in enumerate(rec.shards):
        want = prod(s.lengths) * DTYPE_NBYTES[rec.dtype]
        if s.nbytes != want:
            problems.add(
                f"tensors[{fqn!r}].shards[{i}].nbytes", f"{s.nbytes} but the box holds {want} bytes"
            )
