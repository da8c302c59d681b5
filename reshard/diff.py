"""Tensor-by-tensor comparison of two checkpoints, whatever their layouts.

Every logical tensor is read back through :func:`shardsmith.storage.formats.registry.read_box`
(ranged, checksum-verified reads of whichever saved boxes intersect), in slabs of
dim 0 so memory stays bounded by a few slabs, never the checkpoint or a whole tensor.
The default is bitwise equality (``atol=0``: same dtype, same bytes, NaN payloads
included); with ``atol > 0`` values are compared in float64 and dtypes may differ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from math import prod
from typing import Callable, Iterable

import torch

from shardsmith.layout import DTYPE_NBYTES, FLOAT_DTYPES, Box, optim_state_of
from shardsmith.storage.formats import TORCH_DTYPES, read_box
from shardsmith.storage.manifest import Manifest
from shardsmith.storage.store import Store

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class TensorDiff:
    """How one logical tensor differs.

    Attributes:
        fqn: the tensor.
        max_abs_diff: largest ``|a - b|`` over differing elements (float64; ``nan`` when a
            NaN is involved or the shapes differ).
        num_different: elements that differ (bitwise, or by more than ``atol``).
        numel: elements in the tensor.
        note: why it was not compared element-wise (shape or dtype mismatch), else "".
    """

    fqn: str
    max_abs_diff: float
    num_different: int
    numel: int
    note: str = ""


@dataclass
class DiffReport:
    """The result of :func:`diff_checkpoints`; ``equal`` iff no tensor differs or is missing.

    ``state_keys``: dotted paths where the non-tensor state differs (``state.run.parent``; not counted).
    """

    num_compared: int = 0
    differing: list[TensorDiff] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    state_keys: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not (self.differing or self.only_a or self.only_b)


def _slab_boxes(shape: tuple[int, ...], row_nbytes: int, slab_nbytes: int) -> list[Box]:
    """The whole tensor as dim-0 slabs of about ``slab_nbytes`` (one row at least)."""
    if not shape:
        return [Box((), ())]
    rows = max(1, slab_nbytes // max(1, row_nbytes))
    return [
        Box((r,) + (0,) * (len(shape) - 1), (min(rows, shape[0] - r),) + shape[1:])
        for r in range(0, shape[0], rows)
    ] or [Box((0,) * len(shape), shape)]


def _compare(ta: torch.Tensor, tb: torch.Tensor, atol: float) -> tuple[int, float]:
    """(elements differing, max abs difference among them) of two same-shape tensors."""
    if atol == 0:
        size = ta.element_size()
        mask = ta.view(_INT_VIEW[size]) != tb.view(_INT_VIEW[size])
        if not bool(mask.any()):
            return 0, 0.0
        delta = (ta.double() - tb.double()).abs()[mask]
    else:
        a, b = ta.double(), tb.double()
        delta = (a - b).abs()
        delta = torch.where(a.isnan() & b.isnan(), torch.zeros_like(delta), delta)
        delta = torch.where(a.isnan() ^ b.isnan(), torch.full_like(delta, math.inf), delta)
        delta = delta[(delta > atol) | delta.isnan()]
        if delta.numel() == 0:
            return 0, 0.0
    worst = float("nan") if bool(delta.isnan().any()) else float(delta.max())
    return int(delta.numel()), worst


def diff_tensor(
    a: Store,
    ma: Manifest,
    b: Store,
    mb: Manifest,
    fqn: str,
    *,
    atol: float = 0.0,
    cast_a: str | None = None,
    slab_nbytes: int = 64 << 20,
) -> TensorDiff | None:
    """Compare ``fqn`` in two checkpoints; ``None`` when equal.

    Args:
        a, ma, b, mb: step stores and manifests of the two checkpoints.
        atol: absolute tolerance; 0 means bitwise equality with equal dtypes.
        cast_a: convert A's floating values to this dtype first (to check a ``--dtype``
            conversion bitwise).
        slab_nbytes: bytes per slab read from each side.

    Raises:
        IntegrityError: a byte read does not match its checksum.
    """
    ra, rb = ma.tensors[fqn], mb.tensors[fqn]
    numel = prod(ra.shape)
    if ra.shape != rb.shape:
        return TensorDiff(fqn, math.nan, numel, numel, f"shape {ra.shape} vs {rb.shape}")
    dtype_a = (
        cast_a
        if cast_a and ra.dtype in FLOAT_DTYPES and not optim_state_of(fqn) == "step"
        else ra.dtype
    )
    if atol == 0 and dtype_a != rb.dtype:
        return TensorDiff(
            fqn, math.nan, numel, numel, f"dtype {dtype_a} vs {rb.dtype} (use --atol > 0)"
        )
    row = prod(ra.shape[1:]) * max(DTYPE_NBYTES[ra.dtype], DTYPE_NBYTES[rb.dtype])
    num_different, worst = 0, 0.0
    for box in _slab_boxes(tuple(ra.shape), row, slab_nbytes):
        ta = read_box(a, ma, fqn, box).to(TORCH_DTYPES[dtype_a])
        tb = read_box(b, mb, fqn, box)
        n, w = _compare(ta, tb, atol)
        num_different += n
        if n:
            worst = w if math.isnan(w) or math.isnan(worst) else max(worst, w)
    return TensorDiff(fqn, worst, num_different, numel) if num_different else None


def diff_checkpoints(
    a: Store,
    ma: Manifest,
    b: Store,
    mb: Manifest,
    *,
    atol: float = 0.0,
    cast_a: str | None = None,
    fqns: Iterable[str] | None = None,
    slab_nbytes: int = 64 << 20,
    on_tensor: Callable[[str, TensorDiff | None], None] | None = None,
) -> DiffReport:
    """Compare every logical tensor of two checkpoints (any layouts), streaming.

    Args:
        a, ma, b, mb: step stores and manifests of checkpoints A and B.
        atol, cast_a, slab_nbytes: see :func:`diff_tensor`.
        fqns: compare only these names (each must exist on both sides); default: all.
        on_tensor: called after each tensor with its difference (``None`` = equal).

    Returns:
        A :class:`DiffReport`.

    Raises:
        ValueError: ``atol`` is negative.
        IntegrityError: a byte read does not match its checksum.
    """
    if atol < 0 or math.isnan(atol):
        raise ValueError(f"--atol {atol}: must be >= 0")
    names = sorted(set(fqns)) if fqns is not None else sorted(set(ma.tensors) | set(mb.tensors))
    report = DiffReport()
    for fqn in names:
        if fqn not in mb.tensors:
            report.only_a.append(fqn)
            continue
        if fqn not in ma.tensors:
            report.only_b.append(fqn)
            continue
        found = diff_tensor(a, ma, b, mb, fqn, atol=atol, cast_a=cast_a, slab_nbytes=slab_nbytes)
        report.num_compared += 1
        if found is not None:
            report.differing.append(found)
        if on_tensor is not None:
            on_tensor(fqn, found)
    report.state_keys = differing_keys(ma.state, mb.state)
    return report


def differing_keys(a: object, b: object, path: str = "state") -> list[str]:
    """Dotted paths of the leaves where two JSON values differ (``state.run.parent``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            k
            for key in sorted(set(a) | set(b), key=str)
            for k in differing_keys(a.get(key), b.get(key), f"{path}.{key}")
        ]
    return [] if a == b else [path]
