"""Box math: n-dimensional index boxes in global element coordinates.

A *box* is ``(offsets, lengths)``: the global element offsets of a shard in each
tensor dim and its extent. All functions are pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod


@dataclass(frozen=True)
class Box:
    """A shard's place in its logical tensor: global ``offsets`` and ``lengths`` in elements."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        assert len(self.offsets) == len(self.lengths), (self.offsets, self.lengths)

    @property
    def numel(self) -> int:
        """Number of elements (1 for a 0-d box)."""
        return prod(self.lengths)

    @property
    def is_empty(self) -> bool:
        """True when some length is 0."""
        return any(n == 0 for n in self.lengths)

    def intersect(self, other: "Box") -> "Box | None":
        """The common part of two boxes of the same rank, or ``None`` when disjoint/empty."""
        offsets, lengths = [], []
        for a0, an, b0, bn in zip(self.offsets, self.lengths, other.offsets, other.lengths):
            lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
            if hi <= lo:
                return None
            offsets.append(lo)
            lengths.append(hi - lo)
        return Box(tuple(offsets), tuple(lengths))

    def relative_to(self, outer: "Box") -> tuple[slice, ...]:
        """Slices selecting this box inside a tensor holding ``outer``."""
        return tuple(
            slice(o - oo, o - oo + n) for o, n, oo in zip(self.offsets, self.lengths, outer.offsets)
        )

    def within(self, shape: tuple[int, ...]) -> bool:
        """True when the box lies inside a tensor of global ``shape``."""
        return len(shape) == len(self.offsets) and all(
            o >= 0 and n >= 0 and o + n <= s for o, n, s in zip(self.offsets, self.lengths, shape)
        )

    def to_json(self) -> dict[str, list[int]]:
        """``{"offsets": [...], "lengths": [...]}``."""
        return {"offsets": list(self.offsets), "lengths": list(self.lengths)}


def bounding_box(boxes: list[Box]) -> Box:
    """The smallest box holding every non-empty box of ``boxes`` (all of one rank); the first
    box when all are empty."""
    full = [b for b in boxes if not b.is_empty] or boxes[:1]
    lo = tuple(min(o) for o in zip(*(b.offsets for b in full)))
    hi = tuple(max(h) for h in zip(*((o + n for o, n in zip(b.offsets, b.lengths)) for b in full)))
    return Box(lo, tuple(h - o for h, o in zip(hi, lo)))


def chunk_range(length: int, num_chunks: int, index: int) -> tuple[int, int]:
    """Start and length of chunk ``index`` when ``length`` is split like ``torch.chunk``.

    ``torch.chunk`` (and therefore DTensor ``Shard`` and FSDP2) gives every chunk
    ``ceil(length / num_chunks)`` elements except the tail, so trailing chunks may be
    short or empty: 6 over 4 gives 2, 2, 2, 0.
    """
    size = -(-length // num_chunks)
    start = min(index * size, length)
    return start, max(0, min(size, length - start))


def row_major_strides(lengths: tuple[int, ...]) -> list[int]:
    """Element strides of a contiguous row-major (C-order) array of shape ``lengths``."""
    strides = [1] * len(lengths)
    for d in range(len(lengths) - 2, -1, -1):
        strides[d] = strides[d + 1] * lengths[d + 1]
    return strides


def row_major_span(outer: Box, inner: Box) -> tuple[int, int]:
    """Element span ``[first, last + 1)`` of ``inner`` inside the row-major storage of ``outer``.

    Used to turn a box intersection into one contiguous ranged read: the span is
    exact when ``inner`` covers whole trailing dims, and otherwise includes the gaps
    between its rows.
    """
    if inner.numel == 0:
        return 0, 0
    strides = row_major_strides(outer.lengths)
    first = sum((o - oo) * s for o, oo, s in zip(inner.offsets, outer.offsets, strides))
    last = sum(
        (o + n - 1 - oo) * s
        for o, n, oo, s in zip(inner.offsets, inner.lengths, outer.offsets, strides)
    )
    return first, last + 1
