"""Shared test helpers: a tiny model, a small text corpus, torchrun launches, checkpoint reads.

The tests are laid out by package (``tests/<package>/``) plus ``tests/e2e/`` for whole jobs.
Helpers shared between test modules live in ``tests/helpers/`` (the checkpoint factory, the
loopback S3 server, the scripts launches run, ...) and in this file; both directories are put
on ``sys.path`` here, so a test module anywhere below ``tests/`` imports them by name
(``from ckpt_factory import save_offline``). A test module never imports another one."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.layout.box import Box
from shardsmith.storage.commit import read_manifest, resolve_checkpoint
from shardsmith.storage.formats.registry import read_box
from shardsmith.storage.manifest.records import Manifest
from shardsmith.trainer.config import DataConfig, OptimConfig, TrainConfig

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
HELPERS_DIR = TESTS_DIR / "helpers"
#: Data files the tests read (a version-1 checkpoint, a Megatron indexed dataset, hashes).
FIXTURES = TESTS_DIR / "fixtures"
for _path in (TESTS_DIR, HELPERS_DIR):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


def helper_script(name: str) -> Path:
    """The file of helper module ``name`` (a script a launch runs, e.g. ``dist_scenarios``)."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin, f"no helper module {name!r} on {sys.path[:3]}"
    return Path(spec.origin)


SCENARIOS = helper_script("dist_scenarios")

#: Small enough that start-up, not compute, dominates a launch; big enough that every
#: layout below shards something (4 heads, 2 kv heads, 4 layers).
TINY_MODEL = ModelConfig(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=64,
    vocab_size=256,
    seq_length=16,
)

#: Layouts of the save/load matrix, named ``pp·dp_replicate·dp_shard·tp``.
LAYOUTS: dict[str, ParallelDims] = {
    "1.1.1.1": ParallelDims(),
    "1.1.1.2": ParallelDims(tp=2),
    "2.1.1.1": ParallelDims(pp=2),
    "1.1.2.1": ParallelDims(dp_shard=2),
    "2.1.1.2": ParallelDims(pp=2, tp=2),
    "1.1.2.2": ParallelDims(dp_shard=2, tp=2),
    "2.1.2.2": ParallelDims(pp=2, dp_shard=2, tp=2),
}


def tiny_train_config(dims: ParallelDims, data_path: str) -> TrainConfig:
    """The config every distributed test trains with: warmup then cosine decay over a fixed
    6 steps (``decay_steps``), so runs of different lengths share one LR schedule. The
    values equal the ``shardsmith train`` flags of :data:`TINY_TRAIN_FLAGS`."""
    return TrainConfig(
        model=TINY_MODEL,
        parallel=dims,
        optim=OptimConfig(lr=3e-3, warmup_steps=2, decay_steps=6),
        data=DataConfig(sources=(data_path,), seed=1234),
        global_batch_size=8,
        micro_batch_size=2,
        seed=1234,
        log_interval=1,
    )


#: ``shardsmith train`` flags giving :func:`tiny_train_config` (add --data and the layout).
TINY_TRAIN_FLAGS: list[str] = [
    "--num-layers",
    "4",
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
    "--lr",
    "3e-3",
    "--warmup-steps",
    "2",
    "--lr-decay-steps",
    "6",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "2",
    "--seed",
    "1234",
    "--log-interval",
    "1",
]


@dataclass
class LaunchResult:
    """A finished torchrun launch: its return code and its combined output."""

    returncode: int
    output: str

    def check(self) -> "LaunchResult":
        assert self.returncode == 0, (
            f"launch failed (exit {self.returncode}):\n{self.output[-6000:]}"
        )
        return self


def run_torchrun(
    spec: dict[str, Any], nproc: int, workdir: Path, name: str, timeout: float = 600
) -> LaunchResult:
    """Run ``dist_scenarios.py`` on ``nproc`` gloo processes with ``spec`` (see its docstring)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(SCENARIOS),
            str(spec_path),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    (workdir / f"{name}.log").write_text(proc.stdout)
    return LaunchResult(proc.returncode, proc.stdout)


@pytest.fixture(scope="session")
def data_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """~100 KB of real text (a few standard-library modules' source), tokenized as bytes."""
    import argparse
    import json as json_module
    import textwrap

    body = b"\n\n".join(Path(m.__file__).read_bytes() for m in (json_module, argparse, textwrap))
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(body)
    return str(path)


def open_checkpoint(url: str) -> tuple[Any, Manifest]:
    """(step store, manifest) of a checkpoint step or root URL."""
    _, step_store, _ = resolve_checkpoint(url)
    return step_store, read_manifest(step_store)


def read_full_tensors(url: str) -> dict[str, torch.Tensor]:
    """Every logical tensor of a checkpoint, assembled whole from its shards (checksummed reads)."""
    store, manifest = open_checkpoint(url)
    return {
        fqn: read_box(store, manifest, fqn, Box((0,) * len(rec.shape), tuple(rec.shape)))
        for fqn, rec in manifest.tensors.items()
    }


def assert_tensors_bitwise_equal(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str
) -> None:
    """Same FQNs, dtypes, shapes and bits."""
    assert sorted(got) == sorted(want), f"{where}: FQNs differ: {sorted(set(got) ^ set(want))[:8]}"
    bad = [
        fqn
        for fqn in want
        if got[fqn].dtype != want[fqn].dtype or not torch.equal(got[fqn], want[fqn])
    ]
    assert not bad, f"{where}: {len(bad)} tensors differ, e.g. {bad[:5]}"


@pytest.fixture
def gloo_group():
    """A 1-rank gloo process group in this process (for in-process save/load tests)."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def tp2_reference(tmp_path_factory: pytest.TempPathFactory, data_path: str):
    """The uninterrupted tiny-model run (4 processes, tp2·dp_shard2, 8 steps, a checkpoint
    every 2) the fault-tolerance, local-tier and multi-node tests compare against; see
    :mod:`train_runs`. One launch for all of them."""
    from train_runs import reference_run

    return reference_run(tmp_path_factory.mktemp("tp2-reference") / "reference", data_path)
