"""A DP change on resume keeps the exact global batches, on real tokenizers and datasets:
a ``tokenizers`` BPE over the default corpus, and a Megatron indexed dataset written by
megatron-core's own builder (``fixtures/megatron``). Two ranks (dp_shard 2) train 4 steps
saving at step 2; one rank resumes from step 2: steps 3 and 4 must give the same losses
(within 1e-5: only the DP reduction order differs). Other batches would not come close."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES
from tokenizer_factory import sample_text, train_hf_bpe

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MEGATRON = FIXTURES / "megatron" / "tiny_uint16_text_document"
MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--num-kv-heads",
    "2",
    "--ffn-hidden-size",
    "64",
    "--seq-length",
    "16",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "2",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "1",
    "--lr-decay-steps",
    "4",
    "--seed",
    "1234",
    "--log-interval",
    "1",
]


def _train(flags: list[str], nproc: int, root: Path, *extra: str) -> dict[int, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardsmith",
            "train",
            "--nproc-per-node",
            str(nproc),
            *MODEL,
            *flags,
            "--steps",
            "4",
            "--ckpt",
            str(root),
            *extra,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    records = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.parametrize("source", ["bpe-default-corpus", "megatron-indexed"])
def test_dp_change_resume_keeps_the_batches(source: str, tmp_path: Path, request) -> None:
    if source == "bpe-default-corpus":
        pytest.importorskip("tokenizers")
        tok = train_hf_bpe(tmp_path / "tokenizer.json", sample_text(), vocab_size=400)
        cache = request.config.cache.mkdir("shardsmith-tokens")  # the stdlib tokenized once
        flags = ["--tokenizer", str(tok), "--data-cache", str(cache)]
    else:
        flags = ["--data", str(MEGATRON), "--vocab-size", "1000"]
    full = _train(flags, 2, tmp_path / "dp2", "--save-interval", "2")
    assert sorted(full) == [1, 2, 3, 4]
    manifest = json.loads((tmp_path / "dp2" / "step-000000002" / "manifest.json").read_text())
    assert manifest["layout"]["dp_shard"] == 2
    resumed = _train(
        flags,
        1,
        tmp_path / "dp1",
        "--resume",
        str(tmp_path / "dp2" / "step-000000002"),
        "--save-interval",
        "100",
    )
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert abs(resumed[step] - full[step]) <= 1e-5, (source, step, resumed[step], full[step])
    assert abs(full[3] - full[4]) > 1e-4  # different batches give visibly different losses
