"""import-dcp / export-dcp with torch.distributed.checkpoint itself, and the restricted unpickler."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import foreign_scenarios
import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from conftest import TINY_MODEL, TINY_TRAIN_FLAGS, helper_script, read_full_tensors
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torchtitan_state import torchtitan_state

from shardsmith.cli.main import cli
from shardsmith.errors import IntegrityError
from shardsmith.layout import ParallelDims
from shardsmith.layout.box import Box
from shardsmith.reshard.foreign.common import ModelHints
from shardsmith.reshard.foreign.dcp import export_dcp, import_dcp
from shardsmith.reshard.foreign.dcp_reader import DCPCheckpoint
from shardsmith.reshard.foreign.unpickler import (
    Opaque,
    load_inert_value,
    load_plain_value,
    load_tensor_record,
)
from shardsmith.storage.commit import read_manifest, resolve_checkpoint
from shardsmith.trainer.checkpoint.resume import schedule_change
from shardsmith.trainer.config import OptimConfig, TrainConfig
from shardsmith.trainer.model import Transformer
from shardsmith.trainer.weight_init import init_weights

HINTS = ModelHints(num_attention_heads=4, seq_length=16)
HINT_FLAGS = ["--num-attention-heads", "4", "--seq-length", "16"]


class Items(dict):
    """A dict subclass a pickle names by its global (as Megatron-LM's own containers)."""


class _Exploit:
    """Unpickling this would create ``marker`` (via os.system)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _ours(key: str) -> str:
    """Our FQN of a torchtitan DCP key."""
    if key.startswith("optimizer.state."):
        fqn, kind = key[len("optimizer.state.") :].rsplit(".", 1)
        return f"optim.{kind}.{fqn}"
    return key


def _load_exported(out: str, like: dict) -> dict:
    """``dcp.load`` of ``out`` into zeroed tensors/values shaped like ``like`` (one process)."""

    def zero(v):
        if isinstance(v, dict):
            return {k: zero(x) for k, x in v.items()}
        return torch.zeros_like(v) if isinstance(v, torch.Tensor) else None

    target = {k: zero(v) for k, v in like.items() if k != "dataloader"}
    dcp.load(target, checkpoint_id=out, no_dist=True)
    return target


def test_import_then_export_roundtrip_is_bitwise(tmp_path):
    state, full = torchtitan_state()
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    dims = ParallelDims(tp=2, pp=2)
    report = import_dcp(
        str(tmp_path / "dcp"),
        str(tmp_path / "ck"),
        dims,
        HINTS,
        make_config=lambda m: TrainConfig(model=m, parallel=dims).to_json(),
    )
    assert report.step == 5 and report.with_optimizer and report.model.num_kv_heads == 2
    assert any(d.startswith("optimizer.param_groups.*") for d in report.dropped)
    got = read_full_tensors(str(tmp_path / "ck"))
    assert len(got) == len(full)
    for key, want in full.items():
        assert torch.equal(got[_ours(key)], want), key
    export_dcp(str(tmp_path / "ck"), str(tmp_path / "out"))
    loaded = _load_exported(str(tmp_path / "out"), state)
    for key, want in full.items():
        parts = key.split(".", 1)
        value = loaded["optimizer"][parts[1]] if parts[0] == "optimizer" else loaded[key]
        assert torch.equal(value, want), key
    assert loaded["train_state"] == {"step": 5, "ntokens_seen": 640}
    assert loaded["lr_scheduler"] == {"last_epoch": 5}
    assert loaded["optimizer"]["param_groups.norm.weight.betas"] == (0.9, 0.95)  # train defaults
    assert loaded["optimizer"]["param_groups.norm.weight.lr"] == 3e-3


def test_tied_embeddings_carry_output_weight_both_ways(tmp_path):
    """A tied torchtitan state dict names the shared matrix twice (``output.weight`` too, one
    optimizer entry): import takes it as tied; export writes it back; an untied model whose
    output differs stays untied."""
    model = Transformer(dataclasses.replace(TINY_MODEL, tie_embeddings=True))
    init_weights(model, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(
        torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    ).square().mean().backward()
    opt.step()
    sd = model.state_dict()
    optim = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    assert "output.weight" not in sd and not [k for k in optim if ".output." in k]
    dcp.save(
        {**sd, "output.weight": sd["tok_embeddings.weight"], "optimizer": optim},
        checkpoint_id=str(tmp_path / "dcp"),
        no_dist=True,
    )
    report = import_dcp(str(tmp_path / "dcp"), str(tmp_path / "ck"), ParallelDims(tp=2), HINTS)
    assert report.model.tie_embeddings and report.with_optimizer
    assert any("imported as tied embeddings" in d for d in report.dropped)
    got = read_full_tensors(str(tmp_path / "ck"))
    assert "output.weight" not in got and torch.equal(
        got["tok_embeddings.weight"], sd["tok_embeddings.weight"]
    )
    export_dcp(str(tmp_path / "ck"), str(tmp_path / "out"))
    md = dcp.FileSystemReader(str(tmp_path / "out")).read_metadata().state_dict_metadata
    assert "output.weight" in md and not [k for k in md if k.startswith("optimizer.state.output.")]
    back = {"output.weight": torch.zeros(256, 32), "tok_embeddings.weight": torch.zeros(256, 32)}
    dcp.load(back, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    assert torch.equal(back["output.weight"], sd["tok_embeddings.weight"])
    assert torch.equal(back["tok_embeddings.weight"], sd["tok_embeddings.weight"])
    report = import_dcp(str(tmp_path / "out"), str(tmp_path / "ck2"), ParallelDims(), HINTS)
    assert report.model.tie_embeddings
    assert (
        CliRunner().invoke(cli, ["diff", str(tmp_path / "ck"), str(tmp_path / "ck2")]).exit_code
        == 0
    )
    untied = {**sd, "output.weight": sd["tok_embeddings.weight"] + 1}
    dcp.save(untied, checkpoint_id=str(tmp_path / "dcp3"), no_dist=True)
    assert not import_dcp(
        str(tmp_path / "dcp3"), str(tmp_path / "ck3"), ParallelDims(), HINTS
    ).model.tie_embeddings


def test_export_records_the_model_so_import_needs_no_flags(tmp_path):
    """export-dcp writes the model config as one JSON item; import-dcp takes it (flags still win);
    a torchtitan directory without it needs --num-attention-heads, and says so."""
    state, _ = torchtitan_state()
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    runner = CliRunner()
    result = runner.invoke(cli, ["import-dcp", str(tmp_path / "dcp"), str(tmp_path / "ck")])
    assert result.exit_code == 1 and "pass --num-attention-heads" in result.output
    model = dataclasses.replace(TINY_MODEL, seq_length=64, rope_theta=500000.0, norm_eps=1e-6)
    dims = ParallelDims()
    import_dcp(
        str(tmp_path / "dcp"),
        str(tmp_path / "ck"),
        dims,
        ModelHints(num_attention_heads=4, seq_length=64, rope_theta=500000.0, norm_eps=1e-6),
    )
    assert (
        runner.invoke(cli, ["export-dcp", str(tmp_path / "ck"), str(tmp_path / "out")]).exit_code
        == 0
    )
    result = runner.invoke(
        cli, ["import-dcp", str(tmp_path / "out"), str(tmp_path / "back"), "--tp", "2"]
    )
    assert result.exit_code == 0, result.output
    assert "shardsmith.model" not in result.output  # used, not reported as dropped
    got = TrainConfig.from_json(
        read_manifest(resolve_checkpoint(str(tmp_path / "back"))[1]).config
    ).model
    assert got == model
    assert runner.invoke(cli, ["diff", str(tmp_path / "ck"), str(tmp_path / "back")]).exit_code == 0
    result = runner.invoke(
        cli, ["import-dcp", str(tmp_path / "out"), str(tmp_path / "b2"), "--seq-length", "32"]
    )
    assert result.exit_code == 0
    assert (
        TrainConfig.from_json(
            read_manifest(resolve_checkpoint(str(tmp_path / "b2"))[1]).config
        ).model.seq_length
        == 32
    )


def test_model_only_bf16_import_cli(tmp_path):
    model = Transformer(TINY_MODEL)
    init_weights(model, 3)
    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    result = CliRunner().invoke(
        cli,
        [
            "import-dcp",
            str(tmp_path / "dcp"),
            str(tmp_path / "ck"),
            "--tp",
            "2",
            "--dp-shard",
            "2",
            *HINT_FLAGS,
        ],
    )
    assert result.exit_code == 0, result.output
    assert "model weights only" in result.output
    got = read_full_tensors(str(tmp_path / "ck"))
    assert sorted(got) == sorted(sd)
    for key, want in sd.items():
        assert got[key].dtype == torch.float32 and torch.equal(got[key], want.float()), key


def test_cli_errors_are_one_line(tmp_path):
    runner = CliRunner()
    result = runner.invoke(cli, ["import-dcp", str(tmp_path), str(tmp_path / "ck"), *HINT_FLAGS])
    assert result.exit_code == 1 and "no .metadata" in result.output
    state, _ = torchtitan_state()
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    result = runner.invoke(
        cli,
        ["import-dcp", str(tmp_path / "dcp"), str(tmp_path / "ck"), "--num-attention-heads", "3"],
    )
    assert result.exit_code == 1 and "--num-attention-heads 3" in result.output
    assert result.output.count("\n") == 1
    result = runner.invoke(cli, ["import-dcp", "--help"])
    assert result.exit_code == 0 and "torchtitan" in result.output


def test_hostile_metadata_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Exploit(marker)))
    with pytest.raises(IntegrityError, match=r"\.metadata: the pickle names (posix|os)\.system"):
        DCPCheckpoint(str(tmp_path / "dcp"))
    result = CliRunner().invoke(
        cli, ["import-dcp", str(tmp_path / "dcp"), str(tmp_path / "ck"), *HINT_FLAGS]
    )
    assert result.exit_code == 1 and "refused without running it" in result.output
    assert not marker.exists()


def test_hostile_value_and_tensor_pickles_are_refused(tmp_path):
    marker = tmp_path / "pwned"
    state, _ = torchtitan_state()
    state["train_state"]["step"] = _Exploit(marker)  # dcp.save pickles it as a bytes item
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert not marker.exists()
    with pytest.raises(IntegrityError, match="train_state.step"):
        import_dcp(str(tmp_path / "dcp"), str(tmp_path / "ck"), ParallelDims(), HINTS)
    with pytest.raises(IntegrityError, match="not one of the DCP tensor classes"):
        load_tensor_record(pickle.dumps(_Exploit(marker)), "x")
    with pytest.raises(IntegrityError, match="not one of the DCP plain classes"):
        load_plain_value(pickle.dumps({"a": _Exploit(marker)}), "x")
    assert not marker.exists()
    assert load_plain_value(pickle.dumps({"a": [1, 2.5, (3, "x")]}), "x") == {
        "a": [1, 2.5, (3, "x")]
    }


def test_inert_values_run_nothing_and_keep_the_plain_parts(tmp_path):
    """Megatron-LM's common_state holds its own objects (args: an argparse.Namespace with dtypes);
    the inert reader turns every named global into a placeholder of ours and keeps the rest."""
    import argparse

    marker = tmp_path / "pwned"
    value = [
        {
            "args": argparse.Namespace(params_dtype=torch.bfloat16, hook=_Exploit(marker)),
            "iteration": 7,
            "sched": collections.OrderedDict(a=1),
            "custom": Items(b=2),
            "rng": torch.arange(3),
            "optimizer": {"param_groups": [{"step": 7.0, "betas": (0.9, 0.95)}]},
        }
    ]
    got = load_inert_value(pickle.dumps(value), "x")
    assert not marker.exists()
    assert got[0]["iteration"] == 7 and got[0]["optimizer"] == value[0]["optimizer"]
    assert isinstance(got[0]["args"], Opaque) and got[0]["args"].global_name == "argparse.Namespace"
    assert isinstance(got[0]["args"].state["hook"], Opaque)  # os.system: named, never called
    assert isinstance(got[0]["rng"], Opaque)
    assert got[0]["sched"] == {"a": 1} and got[0]["custom"].items == {"b": 2}
    with pytest.raises(IntegrityError, match="argparse.Namespace"):
        load_plain_value(pickle.dumps(value[0]["args"]), "x")


def test_metadata_allow_list_covers_real_dcp_metadata(tmp_path):
    state, _ = torchtitan_state()
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    ck = DCPCheckpoint(str(tmp_path / "dcp"))
    assert ck.metadata == pickle.loads(
        (tmp_path / "dcp" / ".metadata").read_bytes()
    )  # trusted: test only


def test_an_imported_checkpoint_has_no_schedule_to_change(tmp_path):
    """import-dcp records no LR schedule of the source's trainer; resuming it under any
    schedule warns of no change (the check train runs on the resumed manifest)."""
    state, _ = torchtitan_state()
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    result = CliRunner().invoke(
        cli, ["import-dcp", str(tmp_path / "dcp"), str(tmp_path / "ck"), *HINT_FLAGS]
    )
    assert result.exit_code == 0, result.output
    manifest = read_manifest(resolve_checkpoint(str(tmp_path / "ck"))[1])
    cfg = TrainConfig(model=TINY_MODEL, steps=6, optim=OptimConfig(lr=1e-2, warmup_steps=1))
    assert schedule_change(manifest.config, cfg, manifest.step, manifest.state) == ""
    # the same check on a checkpoint of ours trained under another LR does warn
    ours = {**manifest.config, "optim": {**dataclasses.asdict(cfg.optim), "lr": 3e-4}, "steps": 6}
    assert "--lr 0.0003 -> 0.01" in schedule_change(ours, cfg, manifest.step, {})
    shown = CliRunner().invoke(cli, ["inspect", str(tmp_path / "ck")])
    assert shown.exit_code == 0, shown.output
    assert "trained with" not in shown.output
    assert f"imported from dcp {tmp_path / 'dcp'}: no LR schedule" in shown.output


@pytest.mark.distributed
def test_training_resumes_from_imported_dcp(tmp_path, data_path):
    """The imported step, AdamW state and LR position are what `train --resume` continues from."""
    state, _ = torchtitan_state()
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    result = CliRunner().invoke(
        cli, ["import-dcp", str(tmp_path / "dcp"), str(tmp_path / "run"), "--tp", "2", *HINT_FLAGS]
    )
    assert result.exit_code == 0, result.output
    flags = [
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
        "--global-batch-size",
        "4",
        "--micro-batch-size",
        "2",
        "--data",
        data_path,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardsmith",
            "train",
            *flags,
            "--steps",
            "6",
            "--ckpt",
            str(tmp_path / "run"),
            "--resume",
            "auto",
            "--save-interval",
            "100",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    resume = [r for r in records if r.get("event") == "resume"]
    assert len(resume) == 1 and resume[0]["step"] == 5 and resume[0]["saved_layout"]["tp"] == 2
    assert [r["step"] for r in records if "loss" in r] == [6]
    # The import had no LR schedule of ours to change: its first resume sets one, silently.
    assert not [r for r in records if r.get("event") == "schedule_change"], records
    assert "LR schedule" not in proc.stdout, proc.stdout[-4000:]


def _native_checkpoint(ref: dict[str, torch.Tensor], root: Path, dims: ParallelDims) -> None:
    """The reference tensors (DCP-keyed) as shardsmith's own checkpoint of step 1 in ``dims``,
    written by the storage API directly (no DCP reading involved)."""
    from shardsmith.reshard.foreign.write import write_checkpoint

    def dcp_key(fqn: str) -> str:
        if fqn.startswith("optim."):
            _, kind, rest = fqn.split(".", 2)
            return f"optimizer.state.{rest}.{kind}"
        return fqn

    model = foreign_scenarios.MODEL
    state = {
        "step": 1,
        "tokens_seen": 64,
        "data": {"sample_index": 0},
        "lr_scheduler": {"last_epoch": 1, "_step_count": 2, "lr_lambdas": [None]},
    }

    def read(fqn: str, box: Box) -> torch.Tensor:
        whole = ref[dcp_key(fqn)]
        return whole[box.relative_to(Box((0,) * whole.dim(), tuple(whole.shape)))]

    write_checkpoint(
        str(root),
        model,
        dims,
        read,
        state=state,
        config=TrainConfig(model=model, parallel=dims).to_json(),
        with_optimizer=True,
    )


def _resume_losses(root: Path, layout: list[str], nproc: int, data_path: str) -> dict[int, float]:
    """Steps 2 and 3 trained by `shardsmith train --resume auto` from the step-1 checkpoint in ``root``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardsmith",
            "train",
            "--nproc-per-node",
            str(nproc),
            *layout,
            *TINY_TRAIN_FLAGS,
            "--data",
            data_path,
            "--steps",
            "3",
            "--ckpt",
            str(root),
            "--resume",
            "auto",
            "--save-interval",
            "100",
            "--data-change",
            "continue",
        ],  # the native step was saved with the default data
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    records = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("event") == "resume"] == [1]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_tp_dcp_roundtrip(tmp_path, data_path):
    """4 gloo ranks save FSDP2+TP DTensors with dcp.save; import into tp2·pp2 and export back;
    resuming the import (tp2·pp2) trains like resuming the same state saved by shardsmith
    itself in the torchtitan run's layout (dp_shard 2 · tp 2): losses within 1e-5."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=4",
            str(helper_script("foreign_scenarios")),
            str(tmp_path),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    ref = load_file(str(tmp_path / "reference.safetensors"))
    ck = DCPCheckpoint(str(tmp_path / "dcp"))
    assert len(ck.chunks["layers.0.attention.wq.weight"]) == 4  # dp_shard x tp pieces
    runner = CliRunner()
    result = runner.invoke(
        cli,
        [
            "import-dcp",
            str(tmp_path / "dcp"),
            str(tmp_path / "ck"),
            "--tp",
            "2",
            "--pp",
            "2",
            *HINT_FLAGS,
        ],
    )
    assert result.exit_code == 0, result.output
    got = read_full_tensors(str(tmp_path / "ck"))
    assert len(got) == len(ref)
    for key, want in ref.items():
        assert torch.equal(got[_ours(key)], want), key
    result = runner.invoke(cli, ["export-dcp", str(tmp_path / "ck"), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    like = {k: v for k, v in ref.items() if not k.startswith("optimizer.")}
    like["optimizer"] = {
        k[len("optimizer.") :]: v for k, v in ref.items() if k.startswith("optimizer.")
    }
    loaded = _load_exported(str(tmp_path / "out"), like)
    for key, want in ref.items():
        value = (
            loaded["optimizer"][key[len("optimizer.") :]]
            if key.startswith("optimizer.")
            else loaded[key]
        )
        assert torch.equal(value, want), key
    result = runner.invoke(
        cli,
        [
            "import-dcp",
            str(tmp_path / "out"),
            str(tmp_path / "ck2"),
            "--dp-shard",
            "2",
            *HINT_FLAGS,
        ],
    )
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli, ["diff", str(tmp_path / "ck"), str(tmp_path / "ck2")])
    assert result.exit_code == 0, result.output
    _native_checkpoint(ref, tmp_path / "native", ParallelDims(dp_shard=2, tp=2))
    want = _resume_losses(tmp_path / "native", ["--dp-shard", "2", "--tp", "2"], 4, data_path)
    got = _resume_losses(
        tmp_path / "ck", ["--tp", "2", "--pp", "2", "--dp-shard", "1"], 4, data_path
    )
    assert sorted(got) == sorted(want) == [2, 3]
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-5, (step, got[step], want[step])
