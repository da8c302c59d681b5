"""Layout-independent weight initialization: any box of any parameter, without the rest.

Every initial value is a function of (seed, FQN, global element index) only, so every
layout starts from bitwise the same weights and no rank ever materializes more than its
own shards plus one generation block.

Counter-based scheme: dim 0 of a tensor of global (canonical, unpadded) shape ``S`` is
cut into fixed blocks of :func:`block_rows` rows, a function of ``S`` alone. Block ``b``
is ``torch.randn((rows, *S[1:]))`` from ``torch.Generator().manual_seed(block_seed(seed,
fqn, b))``, scaled by the tensor's std. A box is produced by drawing the blocks its dim-0
range touches and slicing: time O(box rows x row length), memory O(one block + box).

Distribution (unchanged from the earlier full-model init): matrices N(0, 0.02); the
residual-branch outputs ``wo`` and ``w2`` N(0, 0.02 / sqrt(2 * num_layers)) (GPT-2,
Radford et al. 2019, sec. 2.3); norm weights 1; vocab padding rows 0.
"""

from __future__ import annotations

import hashlib
from math import prod

import torch
from torch.distributed.tensor import DTensor

from shardsmith.layout import Box, ModelConfig, ParallelDims, TensorSpec, param_specs

#: Elements drawn per generation block (4 MiB in fp32). Part of the init's definition:
#: changing it changes every initial weight.
BLOCK_NUMEL = 1 << 20


def block_rows(shape: tuple[int, ...]) -> int:
    """Rows of dim 0 per generation block for a tensor of global ``shape`` (>= 1)."""
    return max(1, BLOCK_NUMEL // max(1, prod(shape[1:])))


def block_seed(seed: int, fqn: str, block: int) -> int:
    """The generator seed of one block: 63 bits of BLAKE2b over (seed, fqn, block)."""
    digest = hashlib.blake2b(f"{seed}\0{fqn}\0{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def init_std(fqn: str, cfg: ModelConfig) -> float | None:
    """Standard deviation of ``fqn``'s normal init; ``None`` for norm weights (ones)."""
    if fqn.endswith("norm.weight"):
        return None
    if fqn.endswith(("wo.weight", "w2.weight", "experts.w2")):
        return 0.02 / (2 * cfg.num_layers) ** 0.5  # GPT-2 scaled residual init
    return 0.02


def init_box(
    fqn: str, shape: tuple[int, ...], box: Box, seed: int, cfg: ModelConfig
) -> torch.Tensor:
    """The initial values of ``box`` of the global tensor ``fqn`` of ``shape`` (elements).

    Returns:
        float32 CPU tensor of shape ``box.lengths``, equal to the same slice of the whole
        tensor's init whatever box is asked (bitwise).
    """
    std = init_std(fqn, cfg)
    if std is None:
        return torch.ones(box.lengths)
    out = torch.empty(box.lengths)
    if out.numel() == 0:
        return out
    start, stop = box.offsets[0], box.offsets[0] + box.lengths[0]
    rows = block_rows(shape)
    inner = tuple(slice(o, o + n) for o, n in zip(box.offsets[1:], box.lengths[1:]))
    for b in range(start // rows, -(-stop // rows)):
        lo, hi = b * rows, min((b + 1) * rows, shape[0])
        gen = torch.Generator().manual_seed(block_seed(seed, fqn, b))
        block = torch.randn((hi - lo, *shape[1:]), generator=gen).mul_(std)
        take_lo, take_hi = max(lo, start), min(hi, stop)
        out[take_lo - start : take_hi - start] = block[(slice(take_lo - lo, take_hi - lo), *inner)]
    return out


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a parameter (the DTensor's local shard, or ``p`` itself)."""
    return p.to_local() if isinstance(p, DTensor) else p


@torch.no_grad()
def materialize_local_shards(
    model: torch.nn.Module,
    cfg: ModelConfig,
    dims: ParallelDims,
    coords: dict[str, int],
    seed: int,
    specs: dict[str, TensorSpec] | None = None,
) -> None:
    """Write the initial values into every parameter shard this rank holds, in place.

    ``model`` is one stage, already parallelized and moved off ``meta`` (``to_empty``);
    each parameter's local tensor must hold exactly the plan's box for ``coords`` (padding
    rows after it are zeroed). Called by every rank on its own stage; no communication.

    Raises:
        AssertionError: a local shard's shape differs from the plan's (internal invariant).
    """
    specs = specs if specs is not None else param_specs(cfg, dims)
    for fqn, p in model.named_parameters():
        spec = specs[fqn]
        local = local_tensor(p)
        want = spec.local_lengths(dims, coords)
        assert tuple(local.shape) == want, (
            f"{fqn}: local shard {tuple(local.shape)}, plan says {want}"
        )
        box = spec.box(dims, coords)
        values = init_box(fqn, spec.shape, box, seed, cfg)
        if tuple(box.lengths) != tuple(local.shape):
            local.zero_()  # vocab padding rows
        local[tuple(slice(0, n) for n in box.lengths)].copy_(values)


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Initialize a whole single-process :class:`~shardsmith.trainer.model.Transformer`
    (no TP/PP/FSDP, unpadded vocab) with the values every layout starts from."""
    materialize_local_shards(model, model.cfg, ParallelDims(), ParallelDims().coords(0), seed)
