"""Tokenizing the default corpus (the stdlib's .py files) with a BPE tokenizer: first start
(tokenize + write the cache) vs later starts (cache hit), against the byte-level baseline.

    OMP_NUM_THREADS=1 python bench/tokenize_cache.py [--vocab-size 4000] [--rounds 1]

The tokenizers are trained here (``tokenizers`` BpeTrainer; tiktoken's educational trainer),
so nothing is downloaded. Each round runs the byte-level baseline and each tokenizer's first
start (into a fresh cache directory) then its cached start, the rivals in an order rotated each
round (bench/robust.py). Ratios are medians of per-round ratios: ``<tok>_first_start_vs_bytes``,
``<tok>_cached_vs_bytes`` and ``<tok>_cached_speedup`` (first start / cached start), printed
with their IQR and min-max; there is no goal, so ``<tok>_cached_vs_bytes`` is judged against
parity (<= 1.0: a cached start no slower than bytes; ``within_noise`` when this run cannot
tell). The last line is one JSON object with those keys, ``spread``, ``within_noise`` and
``load_average``. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / d) for d in ("helpers", ".")]

import robust  # noqa: E402
from tokenizer_factory import sample_text, train_hf_bpe, train_tiktoken  # noqa: E402

from shardsmith.trainer.data import DataConfig, load_tokens  # noqa: E402


def _time(cfg: DataConfig) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = load_tokens(cfg)
    return time.perf_counter() - start, int(tokens.size)


def ratios(
    runs: dict[str, list[dict[str, float]]],
) -> dict[str, tuple[dict[str, Any], str | None, float | None]]:
    """Paired ratios of the rounds (``runs``: ``bytes`` -> [{"s"}], each tokenizer ->
    [{"cold", "warm"}], round order) with their judging: ``(stat, op, reference)``."""
    base = [r["s"] for r in runs["bytes"]]
    out: dict[str, tuple[dict[str, Any], str | None, float | None]] = {}
    for name, rs in runs.items():
        if name == "bytes":
            continue
        cold, warm = [r["cold"] for r in rs], [r["warm"] for r in rs]
        out[f"{name}_first_start_vs_bytes"] = (robust.paired(cold, base), None, None)
        out[f"{name}_cached_vs_bytes"] = (robust.paired(warm, base), "<=", 1.0)
        out[f"{name}_cached_speedup"] = (robust.paired(cold, warm), None, None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab-size", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=1, help="rounds, every rival in each")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        toks = {
            "hf-bpe": train_hf_bpe(root / "tokenizer.json", sample_text(), args.vocab_size),
            "tiktoken": train_tiktoken(root / "t.tiktoken", sample_text()[:8000], 300),
        }

        def baseline(r: int) -> dict[str, float]:
            s, n = _time(DataConfig())
            print(f"round {r + 1} bytes (baseline)      {s:7.2f} s  {n:>11,} tokens")
            return {"s": s}

        def tokenizer(name: str) -> Any:
            def run(r: int) -> dict[str, float]:
                cache = root / f"cache-{name}-{r}"
                cold, n = _time(DataConfig(tokenizer=str(toks[name]), cache_dir=str(cache)))
                warm, _ = _time(DataConfig(tokenizer=str(toks[name]), cache_dir=str(cache)))
                print(
                    f"round {r + 1} {name:9s} first start {cold:7.2f} s  {n:>11,} tokens; cached {warm:7.2f} s"
                )
                return {"cold": cold, "warm": warm}

            return run

        runs = robust.alternate(
            {"bytes": baseline, **{name: tokenizer(name) for name in toks}}, args.rounds
        )
    goals = ratios(runs)
    extra = robust.report(
        "\npaired rounds (median of per-round ratios; cached vs bytes judged against parity, "
        "not a goal):",
        goals,
    )
    print(
        json.dumps(
            {
                **robust.medians({k: v[0] for k, v in goals.items()}, 3),
                "rounds": args.rounds,
                **extra,
            }
        )
    )


if __name__ == "__main__":
    main()
