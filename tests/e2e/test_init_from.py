"""``train --init-from``: a run starts from another checkpoint's model weights (here, a model
made by ``transformers`` and brought in by ``import-hf`` in another layout), with a fresh
optimizer at step 0 — and ``--keep-last`` retention after each commit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from hf_models import save_hf_llama

from shardsmith.cli.main import cli
from shardsmith.storage.commit import list_steps
from shardsmith.storage.store.fs import Store
from shardsmith.trainer.data import TokenDataset

pytestmark = pytest.mark.distributed

FLAGS = [
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
    "--vocab-size",
    "256",
    "--seq-length",
    "16",
    "--rope-theta",
    "500000",
    "--norm-eps",
    "1e-5",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "1",
    "--seed",
    "5",
]


def test_init_from_imported_hf_model_and_keep_last(tmp_path: Path, data_path: str) -> None:
    hf = save_hf_llama(tmp_path / "hf", tied=False)
    imported = tmp_path / "imported"
    result = CliRunner().invoke(
        cli, ["import-hf", str(tmp_path / "hf"), str(imported), "--tp", "2"]
    )
    assert result.exit_code == 0, result.output

    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardsmith",
            "train",
            "--nproc-per-node",
            "2",
            "--dp-shard",
            "2",
            *FLAGS,
            "--data",
            data_path,
            "--steps",
            "3",
            "--save-interval",
            "1",
            "--keep-last",
            "1",
            "--init-from",
            str(imported),
            "--ckpt",
            str(run),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    init = [r for r in records if r.get("event") == "init_from"]
    assert len(init) == 1 and init[0]["saved_layout"]["tp"] == 2
    step1 = next(r for r in records if r.get("step") == 1 and "loss" in r)

    # The first step's loss is the transformers model's loss on the same global batch.
    tokens = np.frombuffer(Path(data_path).read_bytes(), dtype=np.uint8)
    inputs, targets = TokenDataset(tokens, 16, 5).batch(0, 4)
    with torch.no_grad():
        logits = hf(inputs).logits
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert abs(step1["loss"] - want) <= 1e-4 * want, (step1["loss"], want)

    # --keep-last 1: only the newest committed step remains, and each deletion is said once,
    # with the root as given (an absolute path outside the working directory here).
    assert [(s.step, s.committed) for s in list_steps(Store(str(run)))] == [(3, True)]
    said = [line for line in proc.stdout.splitlines() if "delet" in line]
    assert said == [
        f"deleted {run}/step-00000000{step} (committed, outside the retention)" for step in (1, 2)
    ], said
