"""Weighted blends of datasets (``--data 0.7 a 0.3 b``), in a DP-independent order.

Megatron-Core's ``BlendedDataset`` assigns global sample ``i`` to a dataset with the greedy
"largest error" rule of ``build_blending_indices`` (``megatron/core/datasets/helpers.cpp``):
sample ``i`` goes to the dataset ``d`` that maximizes ``w_d * max(i, 1) - n_d``, where ``n_d``
is how many samples ``d`` got so far (ties: the lowest ``d``). Megatron builds that table for
the run's whole length; here the sample index is unbounded, so the table is built for one
block of :data:`BLOCK_SIZE` samples and repeated. Block ``b`` gives dataset ``d`` its samples
``b * c_d ... (b+1) * c_d - 1``, where ``c_d`` is ``d``'s count in the table. So the blend is a
pure function of the weights and the global sample index, and of nothing else: every DP
degree sees the same global batches. Each dataset orders its own samples by its own seeded
permutation per epoch (:class:`~shardsmith.trainer.data.dataset.TokenDataset`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from shardsmith.errors import ConfigError
from shardsmith.trainer.data.dataset import TokenDataset

BLOCK_SIZE = 16384  # samples per repeated blending table; each weight is honoured to 1/BLOCK_SIZE
_SEED_STRIDE = 1_000_003  # dataset d's permutation seed is seed + d * stride (mod 2**63)


def component_seed(seed: int, index: int) -> int:
    """The permutation seed of the blend's dataset ``index``: ``(seed + index * 1_000_003) mod 2**63``."""
    return (seed + index * _SEED_STRIDE) % 2**63


def blending_table(
    weights: Sequence[float], size: int = BLOCK_SIZE
) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blending table for one block (see the module doc).

    Args:
        weights: one weight > 0 per dataset (normalized here).
        size: samples in the block.

    Returns:
        ``(dataset_index, dataset_sample_index)``: int64 ``(size,)`` each; sample ``r`` of the
        block is sample ``dataset_sample_index[r]`` (counted within the block) of dataset
        ``dataset_index[r]``.

    Raises:
        ConfigError: a weight so small that its dataset gets no sample in a block.
    """
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    counts = np.zeros(len(w), dtype=np.int64)
    dataset_index = np.empty(size, dtype=np.int64)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for i in range(size):
        d = int(np.argmax(w * max(i, 1) - counts))  # argmax: first of equal errors, as Megatron
        dataset_index[i], dataset_sample_index[i] = d, counts[d]
        counts[d] += 1
    if (counts == 0).any():
        d = int(np.argmin(counts))
        raise ConfigError(
            f"blend weight {weights[d]} (dataset {d}) is below 1/{size} of the total; its "
            "dataset would get no sample: raise it or drop that dataset"
        )
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """Samples drawn from several :class:`TokenDataset` in fixed proportions.

    Global sample ``i`` is sample ``(i // B) * c_d + s[i % B]`` of dataset ``d = t[i % B]``,
    with ``(t, s)`` = :func:`blending_table` and ``c_d`` = the count of ``d`` in ``t``.

    Args:
        datasets: the blend's datasets, all with the same ``seq_length``.
        weights: one weight > 0 per dataset.

    Raises:
        ConfigError: fewer than one dataset, a weight per dataset missing, or mixed
            ``seq_length``.
    """

    def __init__(self, datasets: Sequence[TokenDataset], weights: Sequence[float]) -> None:
        if not datasets or len(datasets) != len(weights):
            raise ConfigError(
                f"a blend needs one weight per dataset: {len(datasets)} datasets, "
                f"{len(weights)} weights"
            )
        lengths = {ds.seq_length for ds in datasets}
        if len(lengths) != 1:
            raise ConfigError(f"blend datasets have different seq_length {sorted(lengths)}")
        self.datasets = list(datasets)
        self.weights = tuple(float(w) for w in weights)
        self.seq_length = lengths.pop()
        self.table, self.table_sample = blending_table(self.weights)
        self.counts = np.bincount(self.table, minlength=len(self.datasets))  # c_d per block

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Which dataset, and which of its samples, each global sample index is.

        Args:
            indices: shape ``(n,)`` global sample indices >= 0.

        Returns:
            ``(dataset, sample)``: int64 ``(n,)`` each.
        """
        block, r = np.divmod(np.asarray(indices, dtype=np.int64), len(self.table))
        dataset = self.table[r]
        return dataset, block * self.counts[dataset] + self.table_sample[r]

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global samples ``start .. start+count-1``: ``(inputs, targets)``, int64 ``(count, T)``.

        Raises:
            ValueError: ``start`` or ``count`` is negative.
        """
        if start < 0 or count < 0:
            raise ValueError(f"batch(start={start}, count={count}): both must be >= 0")
        dataset, sample = self.locate(np.arange(start, start + count))
        out = np.empty((count, self.seq_length + 1), dtype=np.int64)  # (count, T+1)
        for d, ds in enumerate(self.datasets):
            mask = dataset == d
            if mask.any():
                out[mask] = ds.windows(sample[mask])
        window_tokens = torch.from_numpy(out)
        return window_tokens[:, :-1], window_tokens[:, 1:]
