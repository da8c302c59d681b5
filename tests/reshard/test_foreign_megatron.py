"""import-megatron / export-megatron against megatron-core itself (skipped where it is absent).

megatron-core lives in its own venv (shared/notes/megatron-core-on-cpu.md): set
``SHARDSMITH_MCORE_PYTHON`` to its interpreter, default ``<repo>/.venv-mcore/bin/python``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import REPO_ROOT, assert_tensors_bitwise_equal, helper_script, read_full_tensors
from safetensors.torch import load_file

from shardsmith.cli.main import cli
from shardsmith.errors import ConfigError
from shardsmith.layout import ModelConfig
from shardsmith.reshard.foreign.dcp_reader import DCPCheckpoint
from shardsmith.reshard.foreign.hf import permute_from_hf
from shardsmith.reshard.foreign.megatron import fuse_qkv, split_qkv
from shardsmith.reshard.foreign.megatron_optim import optimizer_layout
from shardsmith.trainer.model import Transformer

MCORE_PYTHON = os.environ.get(
    "SHARDSMITH_MCORE_PYTHON", str(REPO_ROOT / ".venv-mcore" / "bin" / "python")
)
TOKENS = torch.arange(32).reshape(2, 16) * 7 % 256  # as megatron_scenarios.TOKENS
HINT_FLAGS = ["--num-attention-heads", "4", "--seq-length", "16"]


def test_qkv_groups_follow_megatron_interleaving():
    """Rows of the fused QKV are, per kv group: its q heads, then its k head, then its v head."""
    model = ModelConfig(
        num_layers=1,
        hidden_size=48,
        num_attention_heads=6,
        num_kv_heads=2,
        ffn_hidden_size=8,
        vocab_size=8,
    )
    hd, d = model.head_dim, model.hidden_size  # Dh = 8
    qkv = torch.arange((6 + 2 * 2) * hd, dtype=torch.float32)[:, None].expand(-1, d).contiguous()
    parts = split_qkv(qkv, model)
    rows = lambda head: list(range(head * hd, (head + 1) * hd))  # noqa: E731  (fused row numbers)
    q_rows = rows(0) + rows(1) + rows(2) + rows(5) + rows(6) + rows(7)  # group 0: 0-2, group 1: 5-7
    assert torch.equal(parts["q"], permute_from_hf(qkv[q_rows], 6))
    assert torch.equal(parts["k"], permute_from_hf(qkv[rows(3) + rows(8)], 2))
    assert torch.equal(parts["v"], qkv[rows(4) + rows(9)])
    assert torch.equal(fuse_qkv(parts["q"], parts["k"], parts["v"], model), qkv)


def _megatron(
    mode: str, ckpt: Path, out: Path, nproc: int = 2, tied: bool = False, optim: str = ""
) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "MEGATRON_TIED": str(int(tied)),
        "MEGATRON_OPTIM": optim,
    }
    proc = subprocess.run(
        [
            MCORE_PYTHON,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(helper_script("megatron_scenarios")),
            mode,
            str(ckpt),
            str(out),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]


def _assert_same_logits(
    weights: dict[str, torch.Tensor], want: torch.Tensor, *, tied: bool
) -> None:
    """shardsmith's model with ``weights`` gives Megatron's logits for :data:`TOKENS`."""
    model = Transformer(
        ModelConfig(
            num_layers=4,
            hidden_size=32,
            num_attention_heads=4,
            num_kv_heads=2,
            ffn_hidden_size=64,
            vocab_size=256,
            seq_length=16,
            tie_embeddings=tied,
        )
    )
    model.load_state_dict(weights)
    with torch.no_grad():
        logits = model(TOKENS)
    # 1e-5 relative to the logits' scale (Megatron's and our kernels differ in summation order)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def _assert_bitwise(want_path: Path, got_path: Path) -> None:
    want, got = load_file(str(want_path)), load_file(str(got_path))
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{got_path.name}: {bad}"


needs_mcore = pytest.mark.skipif(
    not os.path.exists(MCORE_PYTHON), reason="megatron-core venv not installed"
)


@pytest.mark.distributed
@pytest.mark.slow
@needs_mcore
def test_megatron_tied_embeddings_roundtrip(tmp_path):
    """Tied: no output_layer.weight on either side; same logits; export -> load bitwise."""
    _megatron("save", tmp_path / "meg", tmp_path / "saved", nproc=1, tied=True)
    runner = CliRunner()
    result = runner.invoke(
        cli,
        ["import-megatron", str(tmp_path / "meg"), str(tmp_path / "ck"), "--pp", "2", *HINT_FLAGS],
    )
    assert result.exit_code == 0, result.output
    weights = read_full_tensors(str(tmp_path / "ck"))
    assert "output.weight" not in weights
    _assert_same_logits(
        weights, load_file(str(tmp_path / "saved-rank0.safetensors"))["logits"], tied=True
    )
    result = runner.invoke(cli, ["export-megatron", str(tmp_path / "ck"), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "output_layer.weight" not in DCPCheckpoint(str(tmp_path / "out")).chunks
    _megatron("load", tmp_path / "out", tmp_path / "loaded", nproc=1, tied=True)
    _assert_bitwise(tmp_path / "saved-rank0.safetensors", tmp_path / "loaded-rank0.safetensors")


@pytest.mark.distributed
@pytest.mark.slow
@needs_mcore
def test_megatron_torch_dist_roundtrip(tmp_path):
    """Megatron tp2 save -> import-megatron (tp2·pp2) -> same logits in shardsmith's model ->
    export-megatron -> Megatron tp2 load: every weight bitwise equal, same logits."""
    _megatron("save", tmp_path / "meg", tmp_path / "saved")
    runner = CliRunner()
    result = runner.invoke(
        cli,
        [
            "import-megatron",
            str(tmp_path / "meg"),
            str(tmp_path / "ck"),
            "--tp",
            "2",
            "--pp",
            "2",
            *HINT_FLAGS,
        ],
    )
    assert result.exit_code == 0, result.output
    saved = load_file(str(tmp_path / "saved-rank0.safetensors"))
    weights = read_full_tensors(str(tmp_path / "ck"))
    _assert_same_logits(weights, saved["logits"], tied=False)

    result = runner.invoke(
        cli, ["export-megatron", str(tmp_path / "ck"), str(tmp_path / "out"), "--tp", "2"]
    )
    assert result.exit_code == 0, result.output
    _megatron("load", tmp_path / "out", tmp_path / "loaded")
    for rank in (0, 1):
        _assert_bitwise(
            tmp_path / f"saved-rank{rank}.safetensors", tmp_path / f"loaded-rank{rank}.safetensors"
        )

    result = runner.invoke(
        cli,
        [
            "import-megatron",
            str(tmp_path / "meg"),
            str(tmp_path / "ck250"),
            "--vocab-size",
            "250",
            *HINT_FLAGS,
        ],
    )
    assert result.exit_code == 0, result.output
    small = read_full_tensors(str(tmp_path / "ck250"))
    assert torch.equal(small["tok_embeddings.weight"], weights["tok_embeddings.weight"][:250])
    result = runner.invoke(
        cli,
        [
            "export-megatron",
            str(tmp_path / "ck250"),
            str(tmp_path / "out250"),
            "--tp",
            "4",
            "--make-vocab-size-divisible-by",
            "32",
        ],
    )
    assert result.exit_code == 0 and "vocab padded to 256" in result.output, result.output
    ck = DCPCheckpoint(str(tmp_path / "out250"))
    emb = ck.read(
        "embedding.word_embeddings.weight", ck.chunks["embedding.word_embeddings.weight"][0].box
    )
    assert torch.equal(emb[:250], small["tok_embeddings.weight"]) and not emb[250:].any()


def test_import_megatron_refuses_a_torchtitan_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save(
        {"tok_embeddings.weight": torch.zeros(8, 4)},
        checkpoint_id=str(tmp_path / "dcp"),
        no_dist=True,
    )
    result = CliRunner().invoke(
        cli, ["import-megatron", str(tmp_path / "dcp"), str(tmp_path / "ck"), *HINT_FLAGS]
    )
    assert result.exit_code == 1 and "no embedding.word_embeddings.weight" in result.output


# ---- Adam state ----------------------------------------------------------------------------------

MODEL_KEYS = ["embedding.word_embeddings.weight", "decoder.layers.self_attention.linear_qkv.weight"]


def test_optimizer_layout_takes_model_space_moments_and_the_group_step():
    keys = set(MODEL_KEYS) | {
        f"optimizer.state.{k}.{m}" for k in ("exp_avg", "exp_avg_sq") for m in MODEL_KEYS
    }
    common = [
        {
            "optimizer": {
                "optimizer": {"param_groups": [{"step": 7.0, "wd_mult": 1.0}, {"step": 7.0}]}
            }
        }
    ]
    optim, notes = optimizer_layout(keys, MODEL_KEYS, common, "src")
    assert optim is not None and optim.step == 7 and not optim.main_params and notes == []
    optim, notes = optimizer_layout(
        keys, MODEL_KEYS, [{"optimizer": {"param_groups": [{"step": 7.0}, {"step": 6.0}]}}], "src"
    )
    assert optim is None and "different steps [6.0, 7.0]" in notes[0] and "--init-from" in notes[0]
    optim, notes = optimizer_layout(keys, MODEL_KEYS, None, "src")
    assert optim is None and "unreadable" in notes[0]
    with pytest.raises(ConfigError, match="Adam state is partial .1 of 4"):
        optimizer_layout(
            keys - {"optimizer.state.exp_avg_sq." + MODEL_KEYS[0]}, MODEL_KEYS, common, "src"
        )


def test_optimizer_layout_reports_the_bucket_layout():
    keys = set(MODEL_KEYS) | {
        "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, "
        "torch.float32).bucket_idx_0.exp_avg"
    }
    optim, notes = optimizer_layout(keys, MODEL_KEYS, None, "src")
    assert (
        optim is None
        and "dp_reshardable" in notes[0]
        and "--dist-ckpt-optim-fully-reshardable" in notes[0]
    )


def test_export_then_import_carries_adam_state_bitwise(tmp_path):
    """shardsmith (with AdamW) -> export-megatron -> import-megatron: every tensor bitwise,
    moments through the QKV fusion, RoPE row order and vocab padding and back."""
    import torch.distributed.checkpoint as dcp
    from torchtitan_state import torchtitan_state

    state, _ = torchtitan_state()
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    runner = CliRunner()
    result = runner.invoke(
        cli, ["import-dcp", str(tmp_path / "dcp"), str(tmp_path / "a"), *HINT_FLAGS]
    )
    assert result.exit_code == 0 and "AdamW state" in result.output, result.output
    result = runner.invoke(
        cli,
        [
            "export-megatron",
            str(tmp_path / "a"),
            str(tmp_path / "meg"),
            "--tp",
            "2",
            "--make-vocab-size-divisible-by",
            "100",
        ],
    )
    assert (
        result.exit_code == 0 and "weights and Adam state, vocab padded to 400" in result.output
    ), result.output
    ck = DCPCheckpoint(str(tmp_path / "meg"))
    assert ck.shape("optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight") == (
        4,
        64,
        32,
    )
    groups = ck.read_value("common_state/shard_0_1")[0]["optimizer"]["optimizer"]["param_groups"]
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0] and {g["step"] for g in groups} == {1.0}
    ck.close()
    result = runner.invoke(
        cli,
        [
            "import-megatron",
            str(tmp_path / "meg"),
            str(tmp_path / "b"),
            "--tp",
            "2",
            "--pp",
            "2",
            "--vocab-size",
            "256",
            *HINT_FLAGS,
        ],
    )
    assert (
        result.exit_code == 0
        and "as step 5" in result.output
        and "AdamW state and step" in result.output
    ), result.output
    want = read_full_tensors(str(tmp_path / "a"))
    got = read_full_tensors(str(tmp_path / "b"))
    assert_tensors_bitwise_equal(got, want, "export-megatron -> import-megatron")
    _as_megatron_lm(tmp_path / "meg", tmp_path / "lm")
    result = runner.invoke(
        cli,
        [
            "import-megatron",
            str(tmp_path / "lm"),
            str(tmp_path / "c"),
            "--vocab-size",
            "256",
            *HINT_FLAGS,
        ],
    )
    assert (
        result.exit_code == 0
        and "as step 9" in result.output
        and "AdamW state and step" in result.output
    )
    assert "dropped: common_state: args, opt_param_scheduler" in result.output
    assert_tensors_bitwise_equal(
        read_full_tensors(str(tmp_path / "c")), want, "fp32 main params of a bf16 model"
    )
    result = runner.invoke(
        cli, ["export-megatron", str(tmp_path / "a"), str(tmp_path / "weights"), "--no-optimizer"]
    )
    assert result.exit_code == 0 and "(model weights," in result.output
    assert not [
        k for k in DCPCheckpoint(str(tmp_path / "weights")).chunks if k.startswith("optimizer.")
    ]


def _as_megatron_lm(src: Path, out: Path) -> None:
    """``src`` rewritten as Megatron-LM saves a bf16 run: bf16 model weights (the fp32 main
    params stay in ``optimizer.state.param.*``) and a common state with its args (a Namespace
    holding a dtype) and scheduler next to the iteration and the optimizer's param groups."""
    import argparse

    import torch.distributed.checkpoint as dcp

    from shardsmith.layout.box import Box

    ck = DCPCheckpoint(str(src))
    sd: dict = {k: ck.read(k, Box((0,) * len(ck.shape(k)), ck.shape(k))) for k in ck.chunks}
    sd.update(
        {k: v.to(torch.bfloat16) for k, v in sd.items() if not k.startswith("optimizer.")}
    )  # bf16 model
    sd.update({k: ck.read_value(k) for k in ck.values if k != "common_state/shard_0_1"})
    common = ck.read_value("common_state/shard_0_1")[0]
    sd["common_state/shard_0_1"] = [
        {
            **common,
            "iteration": 9,
            "opt_param_scheduler": {"num_steps": 72},
            "args": argparse.Namespace(params_dtype=torch.bfloat16, lr=3e-3),
        }
    ]
    ck.close()
    dcp.save(
        sd,
        storage_writer=dcp.FileSystemWriter(str(out)),
        no_dist=True,
        planner=dcp.DefaultSavePlanner(flatten_state_dict=False),
    )


_OURS = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attention.linear_proj.weight": "attention.wo.weight",
    "pre_mlp_layernorm.weight": "ffn_norm.weight",
    "mlp.linear_fc2.weight": "feed_forward.w2.weight",
}
_GLOBAL = {
    "embedding.word_embeddings.weight": "tok_embeddings.weight",
    "output_layer.weight": "output.weight",
    "decoder.final_layernorm.weight": "norm.weight",
}


def _full_state(
    ranks: list[dict[str, torch.Tensor]], kind: str, model: ModelConfig
) -> dict[str, torch.Tensor]:
    """Our FQN -> whole ``kind`` tensor, assembled from every DP rank's flat optimizer shards
    (Megatron's ``range.<name>``), mapped onto our names by hand (q/k/v, gate/up)."""
    shapes = {
        k: v.shape
        for k, v in ranks[0].items()
        if not k.startswith(("range.", "exp_avg", "param.", "step"))
    }
    flat = {
        name: torch.full((shapes[name].numel(),), float("nan"))
        for name in shapes
        if name != "logits"
    }
    for shards in ranks:
        for key, r in (
            (k[len("range.") :], v) for k, v in shards.items() if k.startswith("range.")
        ):
            flat[key][r[0] : r[1]] = shards[f"{kind}.{key}"]
    out = {}
    for name, t in flat.items():
        t = t.reshape(shapes[name])
        if name in _GLOBAL:
            out[_GLOBAL[name]] = t
            continue
        i, rest = name.split(".", 3)[2:]
        if rest == "self_attention.linear_qkv.weight":
            parts = split_qkv(t, model)
            out.update({f"layers.{i}.attention.w{p}.weight": parts[p] for p in "qkv"})
        elif rest == "mlp.linear_fc1.weight":
            out[f"layers.{i}.feed_forward.w1.weight"], out[f"layers.{i}.feed_forward.w3.weight"] = (
                t.chunk(2)
            )
        else:
            out[f"layers.{i}.{_OURS[rest]}"] = t
    assert not any(v.isnan().any() for v in out.values()), "a parameter's shards do not cover it"
    return out


@pytest.mark.distributed
@pytest.mark.slow
@needs_mcore
def test_megatron_distributed_optimizer_roundtrip(tmp_path):
    """Megatron DistributedOptimizer (dp 2, fully_reshardable) save -> import-megatron (tp2·pp2):
    moments, fp32 main params and step are Megatron's -> export-megatron -> Megatron loads model
    and optimizer: every rank's optimizer shard, step and logits bitwise equal."""
    _megatron("save", tmp_path / "meg", tmp_path / "saved", optim="fully_reshardable")
    runner = CliRunner()
    result = runner.invoke(
        cli,
        [
            "import-megatron",
            str(tmp_path / "meg"),
            str(tmp_path / "ck"),
            "--tp",
            "2",
            "--pp",
            "2",
            *HINT_FLAGS,
        ],
    )
    assert result.exit_code == 0 and "AdamW state and step" in result.output, result.output
    saved = [load_file(str(tmp_path / f"saved-rank{r}.safetensors")) for r in (0, 1)]
    assert saved[0]["step"] == 2
    got = read_full_tensors(str(tmp_path / "ck"))
    model = ModelConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=64,
        vocab_size=256,
        seq_length=16,
    )
    for kind, prefix in (
        ("exp_avg", "optim.exp_avg."),
        ("exp_avg_sq", "optim.exp_avg_sq."),
        ("param", ""),
    ):
        want = _full_state(saved, kind, model)
        bad = [f for f in want if not torch.equal(got[prefix + f], want[f])]
        assert not bad, f"{kind}: {bad[:4]}"
    assert {float(v) for k, v in got.items() if k.startswith("optim.step.")} == {2.0}
    _assert_same_logits(
        {k: v for k, v in got.items() if not k.startswith("optim.")}, saved[0]["logits"], tied=False
    )

    result = runner.invoke(cli, ["export-megatron", str(tmp_path / "ck"), str(tmp_path / "out")])
    assert result.exit_code == 0 and "weights and Adam state" in result.output, result.output
    _megatron("load", tmp_path / "out", tmp_path / "loaded", optim="fully_reshardable")
    for rank in (0, 1):
        _assert_bitwise(
            tmp_path / f"saved-rank{rank}.safetensors", tmp_path / f"loaded-rank{rank}.safetensors"
        )


@pytest.mark.distributed
@pytest.mark.slow
@needs_mcore
def test_megatron_bucket_layout_optimizer_is_reported_not_invented(tmp_path):
    """dp_reshardable (Megatron-LM's default): weights imported, optimizer said to be dropped,
    and a resume from the result is refused rather than run with a fresh AdamW."""
    from shardsmith.errors import CheckpointMismatch
    from shardsmith.layout.compat import check_has_optimizer_state

    _megatron("save", tmp_path / "meg", tmp_path / "saved", optim="dp_reshardable")
    result = CliRunner().invoke(
        cli, ["import-megatron", str(tmp_path / "meg"), str(tmp_path / "ck"), *HINT_FLAGS]
    )
    assert result.exit_code == 0, result.output
    assert "model weights only" in result.output and "dp_reshardable bucket layout" in result.output
    got = read_full_tensors(str(tmp_path / "ck"))
    assert not [k for k in got if k.startswith("optim.")]
    with pytest.raises(CheckpointMismatch, match="--init-from"):
        check_has_optimizer_state(got, source=str(tmp_path / "ck"))
    _assert_same_logits(
        got, load_file(str(tmp_path / "saved-rank0.safetensors"))["logits"], tied=False
    )
