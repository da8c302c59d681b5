"""Which tokens of each sequence a context-parallel rank holds (pure index math).

Causal attention costs a query in proportion to its position, so giving rank ``r`` the
``r``-th contiguous slice would leave the last rank ``2 cp - 1`` times the work of the
first. As Megatron-LM (``get_batch_on_this_cp_rank``) and torchtitan (``_load_balancer``)
do, the sequence (T tokens) is cut into ``2 cp`` equal chunks and rank ``r`` takes chunks
``r`` and ``2 cp - 1 - r``: every rank then holds the same causal work.
"""

from __future__ import annotations

import torch

from shardsmith.layout import ParallelDims, check_sequence_split


def check_seq_length(seq_length: int, cp: int) -> None:
    """Raise :class:`~shardsmith.errors.ConfigError` unless ``2 * cp`` divides ``seq_length``
    (the rule of :func:`shardsmith.layout.check_sequence_split`, which the launcher applies)."""
    check_sequence_split(seq_length, ParallelDims(cp=cp, dp_shard=1), sequence_parallel=False)


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of ``2 cp``) context-parallel rank ``rank`` holds, in its local order."""
    return rank, 2 * cp - 1 - rank


def local_positions(
    seq_length: int, cp: int, rank: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Global token positions (int64, shape ``(T / cp,)``) held by ``rank``, in local order.

    Raises:
        ConfigError: ``2 * cp`` does not divide ``seq_length``.
    """
    check_seq_length(seq_length, cp)
    c = seq_length // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(cp, rank)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of ``x`` along ``dim`` (e.g. tokens (B, T) -> (B, T / cp)).

    Raises:
        ConfigError: ``2 * cp`` does not divide ``x.shape[dim]``.
    """
    if cp == 1:
        return x
    return x.index_select(dim, local_positions(x.shape[dim], cp, rank, x.device))


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_sequence` over all ranks: ``parts[r]`` is rank ``r``'s shard;
    returns the whole sequence in natural order (tests, and the K/V all-gather)."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        a, b = chunk_ids(cp, rank)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]
