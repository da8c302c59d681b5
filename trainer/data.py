"""Token data: where the corpus comes from, and which samples each DP rank sees at each step.

Read top to bottom: :class:`DataConfig` says where tokens come from; :func:`load_tokens`
turns it into one flat 1-D array of token ids; :class:`TokenDataset` cuts that array into
non-overlapping windows and orders them by a seeded permutation per epoch;
:class:`GlobalBatchSampler` hands each DP rank its contiguous slice of each global batch.

The sample order is a pure function of ``(seed, global sample index)``. It does not depend
on the DP degree, so a run saved at DP=4 and resumed at DP=2 sees exactly the same global
batches. The only loader state in a checkpoint is ``{"sample_index": int}``.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from shardsmith.errors import ConfigError

TOKEN_DTYPES = ("auto", "uint16", "uint32")
BYTE_VOCAB_SIZE = 256
_SEPARATOR = b"\n\n"  # between concatenated text files, as in the default corpus
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_MAX_SEED = 2**63  # torch.Generator.manual_seed takes < 2**64; leaves room for seed + epoch


@dataclass(kw_only=True)
class DataConfig:
    """Where training tokens come from.

    Attributes:
        sources: ``--data`` sources: local paths, globs (expanded in sorted order) or fsspec
            URLs (``memory://``, ``s3://`` ...). Empty means the embedded default corpus
            (the ``.py`` files of the running Python's standard library, as bytes). Files
            ending in ``.bin`` are pre-tokenized nanoGPT-style flat arrays; every other file is
            text, tokenized as bytes. Text and ``.bin`` sources cannot be mixed.
        token_dtype: element type of ``.bin`` files: ``"uint16"``, ``"uint32"`` or ``"auto"``
            (= ``"uint16"``, nanoGPT's GPT-2 format). Ignored for text.
        seed: seeds the per-epoch sample permutation; in ``[0, 2**63)``.

    Raises:
        ConfigError: on a value out of range (names the field, the value and what is allowed).
    """

    sources: tuple[str, ...] = ()
    token_dtype: str = "auto"
    seed: int = 1234

    def __post_init__(self) -> None:
        if isinstance(self.sources, str) or not isinstance(self.sources, (tuple, list)):
            raise ConfigError(f"DataConfig.sources={self.sources!r}: expected a tuple of strings")
        self.sources = tuple(self.sources)
        bad = [s for s in self.sources if not isinstance(s, str) or not s.strip()]
        if bad:
            raise ConfigError(f"DataConfig.sources has {bad[0]!r}: need a path, glob or URL")
        if self.token_dtype not in TOKEN_DTYPES:
            raise ConfigError(
                f"DataConfig.token_dtype={self.token_dtype!r}: allowed values are {TOKEN_DTYPES}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"DataConfig.seed={self.seed!r}: expected an int in [0, 2**63)")
        if not 0 <= self.seed < _MAX_SEED:
            raise ConfigError(f"DataConfig.seed={self.seed}: allowed range is [0, 2**63)")


def stdlib_corpus() -> bytes:
    """The embedded default corpus: every ``.py`` file of the running Python's stdlib.

    Found at run time under ``sysconfig.get_paths()["stdlib"]``, sorted by POSIX relative
    path, concatenated with ``b"\\n\\n"`` between files. Skips ``site-packages``,
    ``dist-packages`` and unreadable files. Nothing is cached on disk. Deterministic for a
    given Python installation (typically tens of MB).

    Returns:
        The corpus bytes.

    Raises:
        ConfigError: if no readable ``.py`` file was found.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    rel_paths: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        rel_paths.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    chunks = []
    for rel in sorted(rel_paths):
        try:
            chunks.append((root / rel).read_bytes())
        except OSError:
            continue  # unreadable (permissions, broken link): skip, as documented
    if not chunks:
        raise ConfigError(f"no readable .py files under the stdlib {root}; pass --data explicitly")
    return _SEPARATOR.join(chunks)


def _expand_source(source: str) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """Resolves one source to its filesystem and its files (globs expanded, sorted)."""
    try:
        fs, path = fsspec.core.url_to_fs(os.path.expanduser(source))
    except (ValueError, ImportError) as e:
        raise ConfigError(f"--data source {source!r}: cannot open its filesystem ({e})") from e
    if any(c in path for c in "*?["):
        paths = sorted(p for p in fs.glob(path) if fs.isfile(p))
    elif fs.isdir(path):
        raise ConfigError(
            f"--data source {source!r} is a directory; pass a glob such as '{source}/*.txt'"
        )
    else:
        paths = [path] if fs.isfile(path) else []
    if not paths:
        raise ConfigError(f"--data source {source!r} matched no file; check the path or glob")
    return fs, paths


def _read_bin(fs: fsspec.AbstractFileSystem, path: str, dtype: np.dtype) -> np.ndarray:
    """Reads one flat little-endian token array; local files are memory-mapped (read-only)."""
    nbytes = fs.size(path)
    if nbytes % dtype.itemsize:
        raise ConfigError(
            f".bin file {path!r} has {nbytes} bytes, not a multiple of {dtype.itemsize} "
            f"({dtype.name}); check DataConfig.token_dtype"
        )
    if isinstance(fs, LocalFileSystem) and nbytes > 0:  # np.memmap cannot map 0 bytes
        return np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r")
    return np.frombuffer(fs.cat_file(path), dtype=dtype.newbyteorder("<")).astype(dtype)


def load_tokens(cfg: DataConfig) -> np.ndarray:
    """Loads the whole corpus as one flat array of token ids.

    Text sources are concatenated with ``b"\\n\\n"`` between files (like the default corpus);
    ``.bin`` sources are concatenated as they are. One local ``.bin`` file is memory-mapped.

    Args:
        cfg: the data config.

    Returns:
        Shape ``(N,)`` token ids, N in tokens: ``uint8`` for bytes (text and the default
        corpus), ``uint16``/``uint32`` for ``.bin`` per ``cfg.token_dtype``.

    Raises:
        ConfigError: a source matches no file, text and ``.bin`` sources are mixed, or a
            ``.bin`` file's size is not a whole number of tokens.
    """
    if not cfg.sources:
        return np.frombuffer(stdlib_corpus(), dtype=np.uint8)
    files = [(fs, p) for src in cfg.sources for fs, paths in [_expand_source(src)] for p in paths]
    bins = [p for _, p in files if p.endswith(".bin")]
    texts = [p for _, p in files if not p.endswith(".bin")]
    if bins and texts:
        raise ConfigError(
            f"--data mixes pre-tokenized .bin files (e.g. {bins[0]!r}) with text files "
            f"(e.g. {texts[0]!r}); use only one kind"
        )
    if texts:
        return np.frombuffer(_SEPARATOR.join(fs.cat_file(p) for fs, p in files), dtype=np.uint8)
    dtype = np.dtype("uint16" if cfg.token_dtype == "auto" else cfg.token_dtype)
    arrays = [_read_bin(fs, p, dtype) for fs, p in files]
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def vocab_size_needed(tokens: np.ndarray) -> int:
    """The smallest vocabulary that covers ``tokens``.

    Args:
        tokens: shape ``(N,)`` token ids as returned by :func:`load_tokens`.

    Returns:
        256 for ``uint8`` (byte) tokens; ``max(tokens) + 1`` for any other integer dtype.

    Raises:
        ConfigError: non-byte tokens are empty (there is no maximum).
    """
    if tokens.dtype == np.uint8:
        return BYTE_VOCAB_SIZE
    if tokens.size == 0:
        raise ConfigError("the token array is empty; cannot size the vocabulary")
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
        windows = np.empty(count, dtype=np.int64)
        i = start
        while i < start + count:  # one pass per epoch the range touches
            epoch, offset = divmod(i, self.num_samples)
            n = min(self.num_samples - offset, start + count - i)
            windows[i - start : i - start + n] = self._permutation(epoch)[offset : offset + n]
            i += n
        T = self.seq_length
        index = windows[:, None] * T + np.arange(T + 1)  # (count, T+1)
        window_tokens = torch.from_numpy(self.tokens[index].astype(np.int64))  # (count, T+1)
        return window_tokens[:, :-1], window_tokens[:, 1:]

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
        dataset: the token dataset.
        global_batch_size: GB, samples per optimizer step over all DP ranks; >= 1.
        dp_degree: dp, number of DP ranks; >= 1 and dividing GB.
        dp_rank: this rank's index in ``[0, dp)``.

    Raises:
        ConfigError: a value out of range, or GB not divisible by dp (says what would work).
    """

    def __init__(
        self, dataset: TokenDataset, *, global_batch_size: int, dp_degree: int, dp_rank: int
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
