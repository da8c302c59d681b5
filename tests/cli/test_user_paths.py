"""What a new user sees on the paths they hit by accident: a mistyped step name, a step
that is not there, a command's summary line. Each case was found by following README.md
in a fresh clone; the test pins the message that replaced a misleading one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ckpt_factory import full_tensors, save_offline
from click.testing import CliRunner

from shardsmith.cli.main import cli
from shardsmith.layout import ParallelDims
from shardsmith.storage.commit import commit
from shardsmith.storage.store.fs import Store


def _root_with_steps(tmp_path: Path, *steps: int) -> Path:
    root = tmp_path / "runs" / "a"
    for step in steps:  # model-shaped (reshard checks the tensors against the model record)
        commit(
            Store(str(root)),
            save_offline(Store(str(root)), step, ParallelDims(dp_shard=2), full_tensors()),
        )
    return root


def test_a_mistyped_step_name_lists_the_steps_the_root_holds(tmp_path: Path) -> None:
    root = _root_with_steps(tmp_path, 10, 20)
    for command in ("verify", "inspect"):
        result = CliRunner().invoke(cli, [command, f"{root}/step-00000020"])  # one zero short
        assert result.exit_code == 1, result.output
        assert (
            f"no committed checkpoint under {root}/step-00000020 (it does not exist); {root} holds "
            f"committed steps 10, 20: name one as {root}/step-000000020, or give {root} for its newest"
        ) in result.output


def test_verify_of_a_step_that_is_not_there_says_so_instead_of_counting_problems(
    tmp_path: Path,
) -> None:
    root = _root_with_steps(tmp_path, 10)
    result = CliRunner().invoke(cli, ["verify", f"{root}/step-000000099"])
    assert result.exit_code == 1, result.output
    assert "step-000000099 (it does not exist); " in result.output
    assert "holds committed steps 10" in result.output
    assert "problems in" not in result.output and "BAD" not in result.output


def test_an_empty_or_missing_root_names_which(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    empty = CliRunner().invoke(cli, ["verify", str(tmp_path / "empty")])
    assert empty.exit_code == 1
    assert f"no committed checkpoint under {tmp_path / 'empty'}\n" in empty.output
    missing = CliRunner().invoke(cli, ["verify", str(tmp_path / "nope")])
    assert (
        f"no committed checkpoint under {tmp_path / 'nope'} (it does not exist)" in missing.output
    )


def test_one_file_is_not_one_files(tmp_path: Path) -> None:
    root = _root_with_steps(tmp_path, 10)
    dry = CliRunner().invoke(cli, ["reshard", str(root), str(tmp_path / "b"), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "-> pp1·dpr1·dps1·tp1 (1 file;" in dry.output and "1 files" not in dry.output
    assert "dps2·tp1 (2 files) ->" in dry.output  # data files on both sides, no sidecar
    done = CliRunner().invoke(cli, ["reshard", str(root), str(tmp_path / "b"), "-q"])
    assert done.exit_code == 0, done.output
    assert "to pp1·dpr1·dps1·tp1: 1 file, " in done.output


def test_gc_of_a_local_root_says_each_deletion_once_and_nothing_of_uploads(tmp_path: Path) -> None:
    root = _root_with_steps(tmp_path, 10, 20)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "shardsmith", "gc", str(root), "--keep-last", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "deleted      step-000000010  committed  committed, outside the retention",
        "kept         step-000000020  committed  newest committed step",
        "deleted 1 of 2 steps",
    ]
    assert "step-000000010" not in out.stderr  # the log line that repeated the decision
    uploads = CliRunner().invoke(cli, ["gc", "--uploads", str(root)])  # asked for: answered
    assert uploads.output == "aborted 0 unfinished uploads older than 3600s\n"


def test_a_dry_run_without_a_world_size_says_what_dp_shard_minus_one_became() -> None:
    flags = ["train", "--model", "llama3-70b", "--pp", "2", "--dry-run", "--gpu", "h100"]
    unsized = CliRunner().invoke(cli, flags)
    assert unsized.exit_code == 0, unsized.output
    lines = unsized.output.splitlines()
    layout = next(
        i for i, line in enumerate(lines) if line.startswith("  layout pp2·dpr1·dps1·tp1 = 2 ranks")
    )
    assert lines[layout + 1].startswith(
        "  note: --dp-shard -1 (the default) takes the rest of the world size, "
        "which a dry run does not know: dp_shard 1 here; pass --dp-shard N"
    )
    assert "(1 rank, e.g. rank 0)" in unsized.output and "1 ranks" not in unsized.output
    for sized in (["--dp-shard", "4"], ["--nproc-per-node", "8"], ["--json"]):
        result = CliRunner().invoke(cli, flags + sized)
        assert result.exit_code == 0 and "note: --dp-shard -1" not in result.output, (
            sized,
            result.output,
        )


def test_a_run_without_ckpt_says_it_saves_nothing(tmp_path: Path, monkeypatch) -> None:
    import shardsmith.trainer.runtime.launch as launch_module
    from shardsmith.trainer.checkpoint.resume import COMMAND_ENV

    for name in (COMMAND_ENV, "SHARDSMITH_LAUNCH_TIME"):  # the launcher sets them: restored after
        monkeypatch.delenv(name, raising=False)
    launched: list[tuple] = []
    monkeypatch.setattr(
        launch_module, "launch", lambda cfg, world, **kw: launched.append((cfg, world)) or 0
    )
    monkeypatch.chdir(tmp_path)
    bare = CliRunner().invoke(cli, ["train", "--steps", "1", "--nproc-per-node", "2"])
    assert bare.exit_code == 0 and len(launched) == 1, bare.output
    assert (
        "training pp1·dpr1·dps2·tp1 on 2 processes to step 1 (no --ckpt: no checkpoint will be saved)"
        in bare.output
    )
    saved = CliRunner().invoke(
        cli, ["train", "--steps", "1", "--nproc-per-node", "2", "--ckpt", "c"]
    )
    assert saved.exit_code == 0 and len(launched) == 2, saved.output
    assert "no --ckpt" not in saved.output


def test_a_mistyped_data_glob_is_refused_before_any_worker_starts(
    tmp_path: Path, monkeypatch
) -> None:
    import shardsmith.trainer.runtime.launch as launch_module
    from shardsmith.trainer.checkpoint.resume import COMMAND_ENV

    for name in (COMMAND_ENV, "SHARDSMITH_LAUNCH_TIME"):
        monkeypatch.delenv(name, raising=False)
    launched: list[int] = []
    monkeypatch.setattr(
        launch_module, "launch", lambda cfg, world, **kw: launched.append(world) or 0
    )
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("some text " * 100)
    base = ["train", "--steps", "1", "--nproc-per-node", "2", "--ckpt", str(tmp_path / "c")]
    typo = CliRunner().invoke(cli, base + ["--data", f"{tmp_path}/corpus/*.txtx"])
    assert typo.exit_code == 1 and launched == [], typo.output
    assert (
        f"error: --data source '{tmp_path}/corpus/*.txtx' matched no file; check the path or glob"
        in typo.output
    )
    assert not (tmp_path / "c").exists()  # the refused job created no root
    ok = CliRunner().invoke(cli, base + ["--data", f"{tmp_path}/corpus/*.txt"])
    assert ok.exit_code == 0 and launched == [2], ok.output


def test_ls_keeps_a_long_layout_apart_from_the_run_id(tmp_path: Path) -> None:
    root = Store(str(tmp_path / "lc"))
    commit(root, save_offline(root, 2, ParallelDims(dp_shard=2, cp=2, tp=2), full_tensors()))
    listing = CliRunner().invoke(cli, ["ls", root.url])
    assert listing.exit_code == 0, listing.output
    header, row = listing.output.splitlines()[:2]
    assert "pp1·dpr1·dps2·cp2·tp2  " in row  # was "...cp2·tp2 69e71fa6cab6": one space
    assert (
        header.index("run") == row.index("pp1·dpr1·dps2·cp2·tp2") + len("pp1·dpr1·dps2·cp2·tp2") + 2
    )
