"""The main job's guarantees, on real gloo process groups (CPU).

Launches (each one covers many cases; start-up dominates their cost):

* ``trajectory`` (dp_shard=2, 2 processes): ``2K`` uninterrupted steps, and a separate
  run of ``K`` steps that saves the *reference checkpoint* (non-trivial optimizer state).
* one launch per world size of :data:`LAYOUTS` (1, 2, 4, 8 processes), running for each
  layout of that size: fresh-init forward logits; load every one of the offline-resharded
  copies of the reference (one per layout, plus a dp_replicate=2 one) and save it again; in
  dp_shard=2 resume the reference and train to ``2K`` (same layout), in tp2·pp2 likewise
  (new layout).
* the CLI smoke test: ``shardsmith train`` on 2 processes with dp_replicate=2, resuming the
  reference, then ``shardsmith reshard`` and ``shardsmith inspect``.

"Save in A, load in B" for every pair: the checkpoint in layout A is written by the offline
resharder, which :func:`test_offline_reshard_equals_job_save` proves identical, file for
file, to what a job in layout A saves; the job in B loads it and saves again, and the test
reads every logical tensor back whole and compares its bits with the reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
from click.testing import CliRunner
from conftest import (
    LAYOUTS,
    TINY_MODEL,
    TINY_TRAIN_FLAGS,
    assert_tensors_bitwise_equal,
    open_checkpoint,
    read_full_tensors,
    run_torchrun,
    tiny_train_config,
)
from safetensors.torch import load_file

from shardsmith.layout import ParallelDims
from shardsmith.layout.sharding import OPTIM_PREFIXES
from shardsmith.reshard.api import reshard
from shardsmith.storage.commit import step_dir
from shardsmith.storage.store.fs import Store
from shardsmith.trainer.model import Transformer
from shardsmith.trainer.weight_init import init_weights

K = 3  # steps before the save; runs go to 2K
SOURCE_LAYOUTS: dict[str, ParallelDims] = {
    **LAYOUTS,
    "1.2.2.1": ParallelDims(dp_replicate=2, dp_shard=2),
}
SAME_LAYOUT_RESUME = "1.1.2.1"  # the trajectory's own layout
NEW_LAYOUT_RESUME = "2.1.1.2"


def _tokens() -> list[list[int]]:
    """A fixed (B=2, T=16) batch of token ids for the logits comparison."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(
        0, TINY_MODEL.vocab_size, (2, TINY_MODEL.seq_length), generator=gen
    ).tolist()


@dataclass
class Trajectory:
    """Launch 0: uninterrupted losses and the reference checkpoint (step K, dp_shard=2)."""

    full: list[dict]
    part: list[dict]
    ref_url: str


@dataclass
class LayoutRun:
    """What one layout's launch produced."""

    logits_dir: Path
    resaved: dict[str, str] = field(default_factory=dict)  # source layout -> step URL
    resumed: list[dict] | None = None


@pytest.fixture(scope="session")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="session")
def trajectory(work: Path, data_path: str) -> Trajectory:
    cfg = tiny_train_config(LAYOUTS[SAME_LAYOUT_RESUME], data_path)
    spec = {
        "config": cfg.to_json(),
        "tasks": [
            {"kind": "train", "steps": 2 * K, "out": str(work / "full.json")},
            {
                "kind": "train",
                "steps": K,
                "ckpt": str(work / "ref"),
                "out": str(work / "part.json"),
            },
        ],
    }
    run_torchrun(spec, cfg.parallel.world_size, work, "trajectory").check()
    return Trajectory(
        full=json.loads((work / "full.json").read_text()),
        part=json.loads((work / "part.json").read_text()),
        ref_url=str(work / "ref" / step_dir(K)),
    )


@pytest.fixture(scope="session")
def reference(trajectory: Trajectory) -> dict[str, torch.Tensor]:
    """Every logical tensor of the reference checkpoint, whole."""
    return read_full_tensors(trajectory.ref_url)


@pytest.fixture(scope="session")
def offline(trajectory: Trajectory, work: Path) -> dict[str, str]:
    """The reference resharded offline (no processes) into every source layout: name -> step URL."""
    out = {}
    for name, dims in SOURCE_LAYOUTS.items():
        url = str(work / "offline" / name / step_dir(K))
        reshard(Store(trajectory.ref_url), url, dims)
        out[name] = url
    return out


@pytest.fixture(scope="session")
def layout_run(
    work: Path, data_path: str, offline: dict[str, str], trajectory: Trajectory
) -> Callable[[str], LayoutRun]:
    """``layout_run(name)``: that layout's tasks, run once on first use, in one launch with
    every other layout of the same world size (start-up dominates a launch's cost)."""
    cache: dict[str, LayoutRun | str] = {}  # a failed launch is not retried: its error is kept

    def get(name: str) -> LayoutRun:
        if name not in cache:
            group = [
                n for n, dims in LAYOUTS.items() if dims.world_size == LAYOUTS[name].world_size
            ]
            try:
                cache.update(_launch(group))
            except AssertionError as exc:
                cache.update(dict.fromkeys(group, str(exc)))
        result = cache[name]
        if isinstance(result, str):
            pytest.fail(result, pytrace=False)
        return result

    def _tasks(name: str, base: Path, run: LayoutRun) -> list[dict]:
        tasks: list[dict] = [{"kind": "logits", "tokens": _tokens(), "out": str(run.logits_dir)}]
        for src_name, src_url in offline.items():
            tasks.append({"kind": "reload", "src": src_url, "dst": str(base / f"from-{src_name}")})
            run.resaved[src_name] = str(base / f"from-{src_name}" / step_dir(K))
        if name in (SAME_LAYOUT_RESUME, NEW_LAYOUT_RESUME):
            tasks.append(
                {
                    "kind": "train",
                    "steps": 2 * K,
                    "resume": trajectory.ref_url,
                    "out": str(base / "resumed.json"),
                }
            )
        return [{**task, "set": {"parallel": LAYOUTS[name].to_json()}} for task in tasks]

    def _launch(names: list[str]) -> dict[str, LayoutRun]:
        cfg = tiny_train_config(LAYOUTS[names[0]], data_path)
        runs = {name: LayoutRun(logits_dir=work / "runs" / name / "logits") for name in names}
        tasks = [task for name in names for task in _tasks(name, work / "runs" / name, runs[name])]
        run_torchrun(
            {"config": cfg.to_json(), "tasks": tasks},
            cfg.parallel.world_size,
            work / "runs",
            f"launch-{'-'.join(names)}",
        ).check()
        for name in set(names) & {SAME_LAYOUT_RESUME, NEW_LAYOUT_RESUME}:
            runs[name].resumed = json.loads((work / "runs" / name / "resumed.json").read_text())
        return runs

    return get


# ---- forward ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def single_process_logits() -> torch.Tensor:
    model = Transformer(TINY_MODEL)
    init_weights(model, 1234)
    with torch.no_grad():
        return model(torch.tensor(_tokens()))  # (B, T, V)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_forward_logits_match_single_process(name: str, layout_run, single_process_logits) -> None:
    run = layout_run(name)
    dims = LAYOUTS[name]
    last_stage = [r for r in range(dims.world_size) if dims.coords(r)["pp"] == dims.pp - 1]
    files = sorted(p.name for p in run.logits_dir.iterdir())
    assert files == [f"logits-rank-{r:05d}.safetensors" for r in last_stage]
    for f in files:
        logits = load_file(str(run.logits_dir / f))["logits"]
        assert logits.shape == single_process_logits.shape
        torch.testing.assert_close(
            logits, single_process_logits, rtol=0, atol=1e-5, msg=f"{name}/{f}"
        )


# ---- the save/load matrix --------------------------------------------------------------------


@pytest.mark.distributed
def test_reference_has_nontrivial_optimizer_state(reference: dict[str, torch.Tensor]) -> None:
    fqn = "layers.1.attention.wq.weight"
    assert float(reference[f"optim.step.{fqn}"]) == K
    assert reference[f"optim.exp_avg.{fqn}"].abs().max() > 0
    assert reference[f"optim.exp_avg_sq.{fqn}"].min() > 0
    assert len([k for k in reference if k.startswith(OPTIM_PREFIXES)]) == 3 * len(
        [k for k in reference if not k.startswith(OPTIM_PREFIXES)]
    )


@pytest.mark.distributed
def test_offline_reshard_is_bitwise(
    offline: dict[str, str], reference: dict[str, torch.Tensor]
) -> None:
    for name, url in offline.items():
        _, manifest = open_checkpoint(url)
        assert manifest.layout["world_size"] == SOURCE_LAYOUTS[name].world_size
        assert_tensors_bitwise_equal(read_full_tensors(url), reference, f"offline {name}")


def _core_state(state: dict) -> dict:
    """The non-tensor training state every checkpoint carries (step, data position, LR schedule)."""
    return {k: state[k] for k in ("step", "tokens_seen", "data", "lr_scheduler")}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_loads_every_layout_bitwise(
    name: str, layout_run, reference, trajectory
) -> None:
    run = layout_run(name)
    _, ref_manifest = open_checkpoint(trajectory.ref_url)
    for src_name, url in run.resaved.items():
        where = f"saved in {src_name}, loaded and re-saved in {name}"
        _, manifest = open_checkpoint(url)
        assert manifest.layout == {
            **LAYOUTS[name].to_json(),
            "world_size": LAYOUTS[name].world_size,
        }
        assert _core_state(manifest.state) == _core_state(ref_manifest.state), where
        assert_tensors_bitwise_equal(read_full_tensors(url), reference, where)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_offline_reshard_equals_job_save(name: str, layout_run, offline: dict[str, str]) -> None:
    """Offline reshard to B == a job in B that resumed (from any layout) and saved: same
    files, bytes, keys and boxes."""
    offline_store, offline_manifest = open_checkpoint(offline[name])
    for src_name, url in layout_run(name).resaved.items():
        where = f"job in {name} (resumed from {src_name}) vs offline reshard to {name}"
        store, manifest = open_checkpoint(url)
        assert manifest.files == offline_manifest.files, where
        assert manifest.tensors == offline_manifest.tensors, where
        assert sorted(store.list_dir("shards")) == sorted(offline_store.list_dir("shards")), where
        for file_name in manifest.files:
            assert store.read(file_name) == offline_store.read(file_name), f"{where}: {file_name}"


# ---- resume ----------------------------------------------------------------------------------


@pytest.mark.distributed
def test_same_layout_resume_is_bitwise(trajectory: Trajectory, layout_run) -> None:
    resumed = layout_run(SAME_LAYOUT_RESUME).resumed
    assert [m["step"] for m in trajectory.full] == list(range(1, 2 * K + 1))
    assert trajectory.part == trajectory.full[:K]
    assert [m["step"] for m in resumed] == list(range(K + 1, 2 * K + 1))
    assert resumed == trajectory.full[K:]  # loss, grad norm and lr, bit for bit
    assert len({m["loss"] for m in trajectory.full}) == 2 * K  # the losses do move


@pytest.mark.distributed
def test_new_layout_resume_matches(trajectory: Trajectory, layout_run) -> None:
    resumed = layout_run(NEW_LAYOUT_RESUME).resumed
    assert [m["step"] for m in resumed] == list(range(K + 1, 2 * K + 1))
    for got, want in zip(resumed, trajectory.full[K:]):
        assert got["lr"] == want["lr"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), (got, want)


# ---- command line ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, needles",
    [
        (
            ["--tp", "3", "--nproc-per-node", "3"],
            ["tp=3", "num_attention_heads=4", "tensor-parallel degrees"],
        ),
        (["--pp", "5", "--nproc-per-node", "5"], ["pp=5", "num_layers=4"]),
    ],
)
def test_cli_refuses_layout_before_any_process(
    flags, needles, tmp_path, monkeypatch, data_path
) -> None:
    from shardsmith.cli.main import cli
    from shardsmith.trainer.runtime import launch

    def no_launch(*args, **kwargs):
        raise AssertionError("a worker was launched for an invalid layout")

    monkeypatch.setattr(launch, "launch", no_launch)
    ckpt = tmp_path / "ckpt"
    result = CliRunner().invoke(
        cli,
        [
            "train",
            *flags,
            *TINY_TRAIN_FLAGS,
            "--data",
            data_path,
            "--ckpt",
            str(ckpt),
            "--steps",
            "1",
        ],
    )
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: ")
    for needle in needles:
        assert needle in result.output
    assert not ckpt.exists()


def _cli(*args: str) -> str:
    """Run ``shardsmith ARGS`` in this process (click's runner); returns its output."""
    from shardsmith.cli.main import cli

    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, f"shardsmith {' '.join(args)} failed:\n{result.output}"
    return result.output


@pytest.mark.distributed
def test_cli_train_reshard_inspect(trajectory: Trajectory, work: Path, data_path: str) -> None:
    """`shardsmith train` (dp_replicate=2, resuming the dp_shard=2 reference) -> reshard -> inspect."""
    root = work / "cli"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardsmith",
            "train",
            "--nproc-per-node",
            "2",
            "--dp-replicate",
            "2",
            "--dp-shard",
            "1",
            *TINY_TRAIN_FLAGS,
            "--data",
            data_path,
            "--steps",
            str(K + 1),
            "--ckpt",
            str(root / "a"),
            "--resume",
            trajectory.ref_url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, f"shardsmith train failed:\n{proc.stdout[-6000:]}"
    saved = str(root / "a" / step_dir(K + 1))
    _, manifest = open_checkpoint(saved)
    assert (manifest.layout["dp_replicate"], manifest.layout["world_size"]) == (2, 2)
    losses = [json.loads(line) for line in (root / "a" / "metrics.jsonl").read_text().splitlines()]
    step_loss = {r["step"]: r["loss"] for r in losses if "loss" in r}
    assert list(step_loss) == [K + 1]
    assert step_loss[K + 1] == pytest.approx(trajectory.full[K]["loss"], rel=1e-4)

    _cli("reshard", saved, str(root / "b"), "--tp", "2", "--pp", "2", "--dp-shard", "1")
    out = _cli("inspect", str(root / "b"))
    assert "pp2·dpr1·dps1·tp2" in out and f"step {K + 1}" in out
    assert_tensors_bitwise_equal(
        read_full_tensors(str(root / "b")), read_full_tensors(saved), "cli reshard"
    )
