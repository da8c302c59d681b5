"""The box -> byte-range rules every reader shares (pure: no torch, no I/O).

Used by load planning (:mod:`shardsmith.storage.reading.ranges`), the zarr reader and the
offline reshard planner, so the three agree on which saved shards a box touches and on
how a byte range is widened to the checksum chunks that verify it.
"""

from __future__ import annotations

from typing import Iterator

from shardsmith.layout import Box
from shardsmith.storage.manifest.records import ShardRecord, TensorRecord


def intersections(rec: TensorRecord, box: Box) -> Iterator[tuple[ShardRecord, Box, Box]]:
    """(shard, saved box, intersection with ``box``) for every saved shard of ``rec`` that
    holds elements of ``box`` (global element coordinates; a 0-d ``box`` takes its shard whole)."""
    for shard in rec.shards:
        saved = shard.box
        common = saved.intersect(box) if box.lengths else saved
        if common is not None and common.numel > 0:
            yield shard, saved, common


def chunk_span(first: int, last: int, chunk_nbytes: int, shard_nbytes: int) -> tuple[int, int]:
    """The byte range ``[first, last)`` of a shard's data widened to whole checksum chunks
    (the last chunk of the shard may be short); offsets relative to the shard's data."""
    return first // chunk_nbytes * chunk_nbytes, min(
        -(-last // chunk_nbytes) * chunk_nbytes, shard_nbytes
    )
