"""Every layout and batch error a worker raises is raised before any worker starts.

The condition checks that run inside workers (:class:`~shardsmith.errors.ConfigError` or
:class:`~shardsmith.errors.LayoutError` raised by a function of ``trainer/`` or ``layout/``)
are found by reading the source, and each is either proven to fire in ``train --dry-run``
(and so in the launcher, which runs the same :meth:`TrainConfig.check_layout` first) or
named as a check that runs before a worker for another reason (as the config is built, in
the launcher's resume preflight) or on the data's bytes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from click.testing import CliRunner

import shardsmith
from shardsmith.cli.main import cli

ROOT = Path(shardsmith.__file__).parent
MODEL = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4"]
MODEL += ["--num-kv-heads", "2", "--ffn-hidden-size", "128", "--steps", "1"]

#: module:function raising in a worker -> [(train flags that trip it, words of the error)].
CAUGHT_BEFORE_LAUNCH: dict[str, list[tuple[list[str], str]]] = {
    "trainer/config.py:_apply_pipeline_style": [
        (["--pp", "2", "--dp-shard", "1", "--pipeline-schedule", "zbv"], "--virtual-stages 2"),
        (
            [*("--pp", "2", "--dp-shard", "1", "--virtual-stages", "2"), "--pipeline-schedule"]
            + ["dualpipev", "--global-batch-size", "2", "--micro-batch-size", "1"],
            "needs at least 2 x pp = 4 microbatches",
        ),
    ],
    "layout/model_config.py:validate_layout": [
        (["--tp", "3", "--dp-shard", "1"], "tp=3 does not divide"),
        (["--tp", "8", "--dp-shard", "1", "--num-kv-heads", "4"], "does not divide"),
    ],
    "layout/model_config.py:chunk_layers": [
        (["--pp", "16", "--dp-shard", "1", "--global-batch-size", "32"], "exceeds num_layers"),
    ],
    "layout/model_config.py:check_sequence_split": [
        (
            [
                "--cp",
                "2",
                "--dp-shard",
                "1",
                "--seq-length",
                "10",
                "--global-batch-size",
                "8",
                "--micro-batch-size",
                "1",
            ],
            "2*cp=4 equal chunks",
        ),
        (
            [
                "--cp",
                "2",
                "--tp",
                "4",
                "--dp-shard",
                "1",
                "--sequence-parallel",
                "--seq-length",
                "36",
                "--micro-batch-size",
                "1",
                "--global-batch-size",
                "8",
            ],
            "18 tokens are not divisible",
        ),
        (
            ["--tp", "4", "--dp-shard", "1", "--sequence-parallel", "--seq-length", "30"],
            "30 tokens are not divisible by tp=4",
        ),
    ],
    "trainer/context_parallel/sequence.py:check_seq_length": [
        (["--cp", "4", "--dp-shard", "1", "--seq-length", "20"], "2*cp=8 equal chunks"),
    ],
    "trainer/config.py:num_microbatches": [
        (
            ["--dp-shard", "2", "--global-batch-size", "7", "--micro-batch-size", "2"],
            "is not a multiple of micro_batch_size",
        ),
    ],
    "trainer/config.py:check_pipeline_microbatches": [
        (
            [
                "--pp",
                "8",
                "--dp-shard",
                "1",
                "--seq-length",
                "32",
                "--micro-batch-size",
                "2",
                "--global-batch-size",
                "8",
            ],
            "needs at least 8 microbatches",
        ),
        (
            [
                "--pp",
                "4",
                "--virtual-stages",
                "2",
                "--dp-shard",
                "1",
                "--micro-batch-size",
                "1",
                "--global-batch-size",
                "9",
            ],
            "in 2 rounds",
        ),
        (
            [
                "--pp",
                "4",
                "--virtual-stages",
                "2",
                "--pipeline-schedule",
                "interleaved-zb",
                "--dp-shard",
                "1",
                "--micro-batch-size",
                "1",
                "--global-batch-size",
                "9",
            ],
            "in 2 rounds",
        ),
    ],
    "trainer/pipeline.py:check_schedule": [
        (
            [
                "--pp",
                "2",
                "--virtual-stages",
                "2",
                "--pipeline-schedule",
                "1f1b",
                "--dp-shard",
                "1",
            ],
            "runs one stage per rank",
        ),
    ],
    "trainer/config.py:check_layout": [
        (
            ["--nproc-per-node", "4", "--dp-shard", "4", "--simulate-nodes", "3"],
            "--simulate-nodes 3 does not divide the world size 4",
        ),
    ],
    "trainer/checkpoint/local_tier.py:ranks_per_node": [
        (
            ["--nproc-per-node", "4", "--dp-shard", "4", "--simulate-nodes", "3"],
            "--simulate-nodes 3 does not divide the world size 4",
        ),
    ],
    "layout/dims.py:check_world_size": [
        (["--nproc-per-node", "3", "--tp", "2", "--dp-shard", "1"], "needs 2 processes"),
    ],
}

#: Raised before a worker for another reason (the reason is the value).
BEFORE_WORKERS = {
    "layout/dims.py:for_world_size": "resolves --dp-shard -1 in the CLI (train_config)",
    "layout/dims.py:parse": "parses layout names the user types (CLI)",
    "layout/shrink.py:shrink_layout": "a shrink after a lost node: the supervisor refuses it with "
    "the reason when no smaller layout fits; no layout given at launch reaches it",
    "layout/model_config.py:from_json": "reads saved configs (the launcher's resume preflight)",
    "trainer/checkpoint/config.py:_check_local_tier": "runs as the config is built (__post_init__)",
    "trainer/checkpoint/resume.py:check_data_change": "the launcher's resume preflight (prepare)",
}


def _raising_functions() -> set[str]:
    """``module:function`` of every function in trainer/ (but data/) and layout/ that raises
    ConfigError or LayoutError, ``__post_init__`` aside (it runs as the config is built,
    in the CLI, before anything starts)."""
    out = set()
    files = [*ROOT.glob("layout/*.py"), *ROOT.glob("trainer/**/*.py")]
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("trainer/data/"):
            continue  # conditions on the data's bytes: read where the data is read
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or node.name == "__post_init__":
                continue
            for sub in ast.walk(node):
                exc = sub.exc if isinstance(sub, ast.Raise) else None
                func = exc.func if isinstance(exc, ast.Call) else exc
                if getattr(func, "id", "") in ("ConfigError", "LayoutError"):
                    out.add(f"{rel}:{node.name}")
    return out


def test_every_worker_config_error_is_classified() -> None:
    found = _raising_functions()
    known = set(CAUGHT_BEFORE_LAUNCH) | set(BEFORE_WORKERS)
    delegating = {
        "trainer/context_parallel/sequence.py:check_seq_length"
    }  # calls check_sequence_split
    assert found | delegating == known, (
        f"new worker-side checks, add them to TrainConfig.check_layout and this table: "
        f"{sorted(found - known)}; gone: {sorted(known - found - delegating)}"
    )


@pytest.mark.parametrize(
    "where,flags,words",
    [
        (where, flags, words)
        for where, cases in CAUGHT_BEFORE_LAUNCH.items()
        for flags, words in cases
    ],
)
def test_dry_run_refuses_what_a_worker_would(where: str, flags: list[str], words: str) -> None:
    result = CliRunner().invoke(cli, ["train", "--dry-run", *MODEL, *flags])
    assert result.exit_code != 0, f"{where}: the dry run accepts {flags}:\n{result.output}"
    assert words in result.output, (where, result.output)


def test_launcher_refuses_before_a_worker_starts(monkeypatch, tmp_path: Path) -> None:
    import dataclasses

    from shardsmith.errors import ConfigError
    from shardsmith.layout import ParallelDims
    from shardsmith.trainer.config import TrainConfig
    from shardsmith.trainer.runtime import launch as launch_module
    from shardsmith.trainer.runtime import supervisor

    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(launch_module, "run_agent", no_worker)
    monkeypatch.setattr(supervisor.subprocess, "Popen", no_worker)
    cfg = TrainConfig(
        parallel=ParallelDims(pp=4, dp_shard=1),
        global_batch_size=4,
        micro_batch_size=2,
        run_dir=str(tmp_path),
    )
    for start in (launch_module.launch, supervisor.launch_in_process):
        with pytest.raises(ConfigError, match="needs at least 4 microbatches"):
            start(cfg, 4)
    sp = dataclasses.replace(
        cfg,
        parallel=ParallelDims(tp=4, cp=2, dp_shard=1),
        sequence_parallel=True,
        global_batch_size=2,
        micro_batch_size=1,
    )
    with pytest.raises(ConfigError, match="18 tokens are not divisible by tp=4"):
        dataclasses.replace(sp, model=dataclasses.replace(sp.model, seq_length=36))
