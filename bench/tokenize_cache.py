"""Tokenizing the default corpus (the stdlib's .py files) with a BPE tokenizer: first start
(tokenize + write the cache) vs later starts (cache hit), against the byte-level baseline.

    OMP_NUM_THREADS=1 python bench/tokenize_cache.py [--vocab-size 4000]

The tokenizers are trained here (``tokenizers`` BpeTrainer; tiktoken's educational trainer),
so nothing is downloaded. Prints seconds and ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / d) for d in ("helpers", ".")]

from tokenizer_factory import sample_text, train_hf_bpe, train_tiktoken  # noqa: E402

from shardsmith.trainer.data import DataConfig, load_tokens  # noqa: E402


def _time(cfg: DataConfig) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = load_tokens(cfg)
    return time.perf_counter() - start, int(tokens.size)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab-size", type=int, default=4000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base_s, base_n = _time(DataConfig())
        print(f"bytes (baseline)      {base_s:7.2f} s  {base_n:>11,} tokens")
        toks = {"hf-bpe": train_hf_bpe(root / "tokenizer.json", sample_text(), args.vocab_size),
                "tiktoken": train_tiktoken(root / "t.tiktoken", sample_text()[:8000], 300)}
        for name, path in toks.items():
            cache = root / f"cache-{name}"
            cold_s, n = _time(DataConfig(tokenizer=str(path), cache_dir=str(cache)))
            warm_s, _ = _time(DataConfig(tokenizer=str(path), cache_dir=str(cache)))
            print(f"{name:9s} first start {cold_s:7.2f} s  {n:>11,} tokens "
                  f"({cold_s / base_s:.0f}x bytes)")
            print(f"{name:9s} cached      {warm_s:7.2f} s  ({warm_s / base_s:.1f}x bytes, "
                  f"{cold_s / warm_s:.0f}x faster than the first start)")


if __name__ == "__main__":
    main()
