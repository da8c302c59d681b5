"""Messages that say what a checkpoint is and which field is wrong (issue 29, item 8): an
imported step refused for a resume says it was imported, and a model record that lies about
``num_kv_heads`` is named as such by ``verify``, ``reshard`` and a ``train`` preflight."""

from __future__ import annotations

import dataclasses

import pytest
from ckpt_factory import MODEL, full_tensors, save_offline
from click.testing import CliRunner

from shardsmith.cli.main import cli
from shardsmith.errors import CheckpointMismatch
from shardsmith.layout import ParallelDims
from shardsmith.layout.compat import check_has_optimizer_state
from shardsmith.storage.commit import read_manifest, step_dir
from shardsmith.storage.manifest.v2 import dumps_manifest
from shardsmith.storage.store.fs import Store
from shardsmith.storage.verify import verify_checkpoint
from shardsmith.trainer.config import CheckpointConfig, TrainConfig
from shardsmith.trainer.runtime.preflight import preflight

DIMS = ParallelDims(dp_shard=2)


def test_resume_of_an_imported_step_says_it_was_imported() -> None:
    weights = ["tok_embeddings.weight", "output.weight"]
    with pytest.raises(CheckpointMismatch) as exc:
        check_has_optimizer_state(
            weights,
            source="ck/step-000000000",
            imported={"format": "huggingface", "path": "/models/llama"},
        )
    msg = str(exc.value)
    assert "import-hf" in msg and "/models/llama" in msg and "model-only" not in msg, msg
    assert "--init-from ck/step-000000000" in msg and "--reset-optimizer" in msg, msg
    with pytest.raises(CheckpointMismatch, match="reshard --model-only"):
        check_has_optimizer_state(weights, source="x")


def test_a_lying_num_kv_heads_is_named_by_verify_reshard_and_train(tmp_path) -> None:
    root = Store(str(tmp_path / "r"))
    save_offline(root, 4, DIMS, full_tensors(MODEL, 4, with_optimizer=True), MODEL)
    step = root.child(step_dir(4))
    saved = read_manifest(step)
    saved.model["num_kv_heads"] = 4  # the K/V projections hold 2 heads
    step.write("manifest.json", dumps_manifest(saved))
    named = f"num_kv_heads=4 where the tensor implies {MODEL.num_kv_heads}"
    problems = [p.what for p in verify_checkpoint(step).problems]
    assert problems and all(named in p and "hidden_size" not in p for p in problems), problems
    result = CliRunner().invoke(cli, ["reshard", step.url, str(tmp_path / "out"), "--tp", "1"])
    assert result.exit_code != 0 and named in result.output, result.output
    believer = dataclasses.replace(MODEL, num_kv_heads=4)  # a job that trusts the record
    cfg = TrainConfig(
        model=believer,
        parallel=DIMS,
        global_batch_size=2,
        micro_batch_size=1,
        checkpoint=CheckpointConfig(url=str(tmp_path / "new"), resume=step.url),
    )
    with pytest.raises(CheckpointMismatch, match=named):
        preflight(cfg)


def test_each_warning_is_printed_once(tmp_path, caplog) -> None:
    """The `latest ... using newest committed step` line once per process however often the
    newest step is asked for, and a warning event is not echoed a second time by the console
    (the code that raised it logged it)."""
    import logging

    from shardsmith.storage.commit import LATEST_NAME, find_latest_committed
    from shardsmith.trainer.observe.console import event_line

    root = Store(str(tmp_path / "r"))
    save_offline(root, 4, DIMS, full_tensors(MODEL, 4), MODEL)
    root.delete(LATEST_NAME)
    with caplog.at_level(logging.WARNING, logger="shardsmith"):
        assert [find_latest_committed(root) for _ in range(4)] == [4] * 4
    assert sum("using newest committed step" in r.getMessage() for r in caplog.records) == 1, (
        caplog.text
    )
    assert event_line({"event": "warning", "message": "local tier: skipping x"}) == ""


def test_layout_names_and_inspect_spell_expert_parallelism(tmp_path) -> None:
    moe = dataclasses.replace(MODEL, num_experts=4, moe_router_topk=2)
    dims = ParallelDims(dp_shard=4, expert_parallel=4)
    assert (
        dims.describe() == "pp1·dpr1·dps4·tp1·ep4" and ParallelDims.parse(dims.describe()) == dims
    )
    staged = ParallelDims(pp=2, dp_shard=2, virtual_stages=2, expert_parallel=2)
    assert ParallelDims.parse(staged.describe()) == staged and staged.describe().endswith("·v2·ep2")
    assert ParallelDims(tp=2).describe() == "pp1·dpr1·dps1·tp2"  # unchanged without them
    root = Store(str(tmp_path / "r"))
    save_offline(root, 2, dims, full_tensors(moe, 2), moe)
    result = CliRunner().invoke(cli, ["inspect", root.url])
    assert result.exit_code == 0 and "layout pp1·dpr1·dps4·tp1·ep4 (4 ranks)" in result.output, (
        result.output
    )


def test_error_lines_spell_paths_as_the_user_typed_them(tmp_path, monkeypatch) -> None:
    from shardsmith.cli.main import user_spelling

    monkeypatch.chdir(tmp_path)
    save_offline(Store(str(tmp_path / "r")), 4, DIMS, full_tensors(MODEL, 4), MODEL)
    flags = [
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
        "--dp-shard",
        "2",
        "--nproc-per-node",
        "2",
        "--global-batch-size",
        "2",
        "--micro-batch-size",
        "1",
        "--steps",
        "1",
    ]
    result = CliRunner().invoke(
        cli, ["train", *flags, "--ckpt", "n", "--resume", "r/step-000000004"]
    )
    assert result.exit_code == 1 and "error: r/step-000000004 holds" in result.output, result.output
    assert str(tmp_path) not in result.output, result.output
    here = str(tmp_path)
    assert (
        user_spelling(f"file://{here}/r/step-1 and {here}/rx; {here}/other", ["./r", "--ckpt=rx"])
        == f"r/step-1 and rx; {here}/other"
    )
