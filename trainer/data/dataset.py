"""Samples: fixed-length windows of a token array in a seeded order, and each DP rank's slice.

:class:`TokenDataset` cuts one flat array of token ids into non-overlapping windows and orders
them by a seeded permutation per epoch; :class:`GlobalBatchSampler` hands each DP rank its
contiguous slice of each global batch (of a :class:`TokenDataset` or a
:class:`~shardsmith.trainer.data.blend.BlendedDataset`).

The sample order is a pure function of ``(seed, global sample index)``. It does not depend
on the DP degree, so a run saved at DP=4 and resumed at DP=2 sees exactly the same global
batches. The only loader state in a checkpoint is ``{"sample_index": int}``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from shardsmith.errors import ConfigError

BYTE_VOCAB_SIZE = 256


class SampleSource(Protocol):
    """What :class:`GlobalBatchSampler` reads: global samples by index."""

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global samples ``start .. start+count-1``: ``(inputs, targets)``, ``(count, T)``."""
        ...


def vocab_size_needed(tokens: np.ndarray) -> int:
    """The smallest vocabulary that covers ``tokens``.

    Args:
        tokens: shape ``(N,)`` token ids as returned by :func:`load_tokens`.

    Returns:
        256 for ``uint8`` (byte) tokens; ``max(tokens) + 1`` for any other integer dtype.

    Raises:
        ConfigError: non-byte tokens are empty (there is no maximum), or a signed array holds
            a negative id.
    """
    if tokens.dtype == np.uint8:
        return BYTE_VOCAB_SIZE
    if tokens.size == 0:
        raise ConfigError("the token array is empty; cannot size the vocabulary")
    if np.issubdtype(tokens.dtype, np.signedinteger) and int(tokens.min()) < 0:
        raise ConfigError(f"the token array holds a negative id ({int(tokens.min())})")
    return int(tokens.max()) + 1


class TokenDataset:
    """Non-overlapping windows of a flat token array, in a seeded order per epoch.

    Window ``w`` is ``tokens[w*T : w*T + T + 1]`` (T+1 tokens; consecutive windows share one
    boundary token); input = its first T tokens, target = its last T. There are
    ``num_samples = (N - 1) // T`` windows. Global sample ``i`` (0, 1, 2, ..., unbounded) is
    window ``perm_e[i % num_samples]`` with ``e = i // num_samples`` and
    ``perm_e = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + e))``.
    The order is thus a function of ``seed`` and ``i`` only: independent of the DP degree.

    Args:
        tokens: shape ``(N,)`` token ids (any integer dtype; not copied).
        seq_length: T, tokens per input sequence; >= 1.
        seed: base seed of the per-epoch permutation; in ``[0, 2**63)``.

    Raises:
        ConfigError: ``seq_length`` < 1, or the corpus is shorter than one sample (T+1 tokens).
    """

    def __init__(self, tokens: np.ndarray, seq_length: int, seed: int) -> None:
        if tokens.ndim != 1:
            raise ConfigError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_length < 1:
            raise ConfigError(f"seq_length={seq_length}: must be >= 1")
        self.tokens = tokens
        self.seq_length = seq_length
        self.seed = seed
        self.num_samples = (len(tokens) - 1) // seq_length
        if self.num_samples < 1:
            raise ConfigError(
                f"the corpus has {len(tokens)} tokens but one sample needs seq_length+1="
                f"{seq_length + 1}; lower seq_length or add data"
            )
        self._perm_epoch = -1
        self._perm = np.zeros(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        """The window order of ``epoch``: shape ``(num_samples,)`` int64; caches one epoch."""
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.num_samples, generator=gen).numpy()
            self._perm_epoch = epoch
        return self._perm

    def windows(self, indices: np.ndarray) -> np.ndarray:
        """The token windows of global samples ``indices``.

        Args:
            indices: shape ``(n,)`` global sample indices, each >= 0, any order.

        Returns:
            int64 of shape ``(n, T+1)``: row k is the window of sample ``indices[k]``.
        """
        indices = np.asarray(indices, dtype=np.int64)
        epochs, offsets = np.divmod(indices, self.num_samples)
        windows = np.empty(len(indices), dtype=np.int64)
        for epoch in np.unique(epochs):  # one permutation per epoch the indices touch
            mask = epochs == epoch
            windows[mask] = self._permutation(int(epoch))[offsets[mask]]
        T = self.seq_length
        index = windows[:, None] * T + np.arange(T + 1)  # (n, T+1)
        return self.tokens[index].astype(np.int64)

    def batch(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global samples ``start .. start+count-1``, stacked.

        Args:
            start: first global sample index, >= 0.
            count: number of samples, >= 0.

        Returns:
            ``(inputs, targets)``, each int64 of shape ``(count, T)``.

        Raises:
            ValueError: ``start`` or ``count`` is negative.
        """
        if start < 0 or count < 0:
            raise ValueError(f"batch(start={start}, count={count}): both must be >= 0")
        window_tokens = torch.from_numpy(self.windows(np.arange(start, start + count)))
        return window_tokens[:, :-1], window_tokens[:, 1:]  # (count, T) each

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global sample ``i`` (>= 0): ``(input, target)``, each int64 of shape ``(T,)``."""
        inputs, targets = self.batch(i, 1)
        return inputs[0], targets[0]


class GlobalBatchSampler:
    """Each DP rank's contiguous slice of each global batch.

    Global step ``s`` covers global samples ``[s*GB, (s+1)*GB)`` (counted from wherever the
    sample index started); DP rank ``d`` takes ``[s*GB + d*GB/dp, s*GB + (d+1)*GB/dp)``.
    Concatenating the slices of ranks ``0..dp-1`` gives the DP=1 batch exactly.

    Every rank builds its own sampler from the same dataset and state; ranks that share a
    ``dp_rank`` (TP and PP peers) get the same batches. All ranks must call
    :meth:`next_local_batch` once per step, so their ``sample_index`` stays equal.

    Args:
        dataset: the samples: a :class:`TokenDataset` or a ``BlendedDataset``.
        global_batch_size: GB, samples per optimizer step over all DP ranks; >= 1.
        dp_degree: dp, number of DP ranks; >= 1 and dividing GB.
        dp_rank: this rank's index in ``[0, dp)``.

    Raises:
        ConfigError: a value out of range, or GB not divisible by dp (says what would work).
    """

    def __init__(
        self, dataset: SampleSource, *, global_batch_size: int, dp_degree: int, dp_rank: int
    ) -> None:
        if global_batch_size < 1 or dp_degree < 1:
            raise ConfigError(
                f"global_batch_size={global_batch_size}, dp_degree={dp_degree}: both must be >= 1"
            )
        if not 0 <= dp_rank < dp_degree:
            raise ConfigError(f"dp_rank={dp_rank}: must be in [0, dp_degree={dp_degree})")
        if global_batch_size % dp_degree:
            divisors = [d for d in range(1, global_batch_size + 1) if global_batch_size % d == 0]
            lower = global_batch_size - global_batch_size % dp_degree
            raise ConfigError(
                f"global_batch_size={global_batch_size} is not divisible by dp_degree="
                f"{dp_degree}; use a global_batch_size that is a multiple of {dp_degree} "
                f"(e.g. {lower or dp_degree} or {lower + dp_degree}) or a dp_degree in {divisors}"
            )
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.dp_degree = dp_degree
        self.dp_rank = dp_rank
        self.local_batch_size = global_batch_size // dp_degree
        self.sample_index = 0  # next global sample index, always at a step boundary

    def next_local_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the next global batch; advances by one global batch.

        Returns:
            ``(inputs, targets)``, each int64 of shape ``(GB/dp, T)``.
        """
        start = self.sample_index + self.dp_rank * self.local_batch_size
        batch = self.dataset.batch(start, self.local_batch_size)
        self.sample_index += self.global_batch_size
        return batch

    def skip_steps(self, num_steps: int) -> None:
        """Skips ``num_steps`` (>= 0) global batches without loading them."""
        if num_steps < 0:
            raise ValueError(f"skip_steps({num_steps}): num_steps must be >= 0")
        self.sample_index += num_steps * self.global_batch_size

    def state_dict(self) -> dict[str, int]:
        """The checkpointed state: ``{"sample_index": int}`` (JSON-safe, DP-independent)."""
        return {"sample_index": self.sample_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restores :meth:`state_dict`'s output; may come from a run with another DP degree.

        Raises:
            ValueError: ``state`` is not exactly ``{"sample_index": int >= 0}``.
        """
        ok_keys = isinstance(state, dict) and set(state) == {"sample_index"}
        value = state["sample_index"] if ok_keys else None
        if not ok_keys or isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"data loader state {state!r}: expected {{'sample_index': int}}")
        if value < 0:
            raise ValueError(f"data loader state sample_index={value}: must be >= 0")
        self.sample_index = value
