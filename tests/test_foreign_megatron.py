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
from safetensors.torch import load_file

from conftest import TESTS_DIR, read_full_tensors
from shardsmith.cli.main import cli
from shardsmith.layout import ModelConfig
from shardsmith.reshard.foreign.dcp_reader import DCPCheckpoint
from shardsmith.reshard.foreign.megatron import fuse_qkv, split_qkv
from shardsmith.reshard.hf import permute_from_hf
from shardsmith.trainer.model import Transformer

MCORE_PYTHON = os.environ.get("SHARDSMITH_MCORE_PYTHON", str(TESTS_DIR.parent / ".venv-mcore" / "bin" / "python"))
TOKENS = torch.arange(32).reshape(2, 16) * 7 % 256                 # as megatron_scenarios.TOKENS
HINT_FLAGS = ["--num-attention-heads", "4", "--seq-length", "16"]


def test_qkv_groups_follow_megatron_interleaving():
    """Rows of the fused QKV are, per kv group: its q heads, then its k head, then its v head."""
    model = ModelConfig(num_layers=1, hidden_size=48, num_attention_heads=6, num_kv_heads=2,
                        ffn_hidden_size=8, vocab_size=8)
    hd, d = model.head_dim, model.hidden_size                       # Dh = 8
    qkv = torch.arange((6 + 2 * 2) * hd, dtype=torch.float32)[:, None].expand(-1, d).contiguous()
    parts = split_qkv(qkv, model)
    rows = lambda head: list(range(head * hd, (head + 1) * hd))    # noqa: E731  (fused row numbers)
    q_rows = rows(0) + rows(1) + rows(2) + rows(5) + rows(6) + rows(7)       # group 0: 0-2, group 1: 5-7
    assert torch.equal(parts["q"], permute_from_hf(qkv[q_rows], 6))
    assert torch.equal(parts["k"], permute_from_hf(qkv[rows(3) + rows(8)], 2))
    assert torch.equal(parts["v"], qkv[rows(4) + rows(9)])
    assert torch.equal(fuse_qkv(parts["q"], parts["k"], parts["v"], model), qkv)


def _megatron(mode: str, ckpt: Path, out: Path, nproc: int = 2, tied: bool = False) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MEGATRON_TIED": str(int(tied))}
    proc = subprocess.run([MCORE_PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(TESTS_DIR / "megatron_scenarios.py"), mode, str(ckpt), str(out)],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]


def _assert_same_logits(weights: dict[str, torch.Tensor], want: torch.Tensor, *, tied: bool) -> None:
    """shardsmith's model with ``weights`` gives Megatron's logits for :data:`TOKENS`."""
    model = Transformer(ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                                    ffn_hidden_size=64, vocab_size=256, seq_length=16, tie_embeddings=tied))
    model.load_state_dict(weights)
    with torch.no_grad():
        logits = model(TOKENS)
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def _assert_bitwise(want_path: Path, got_path: Path) -> None:
    want, got = load_file(str(want_path)), load_file(str(got_path))
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{got_path.name}: {bad}"


needs_mcore = pytest.mark.skipif(not os.path.exists(MCORE_PYTHON), reason="megatron-core venv not installed")


@pytest.mark.distributed
@pytest.mark.slow
@needs_mcore
def test_megatron_tied_embeddings_roundtrip(tmp_path):
    """Tied: no output_layer.weight on either side; same logits; export -> load bitwise."""
    _megatron("save", tmp_path / "meg", tmp_path / "saved", nproc=1, tied=True)
    runner = CliRunner()
    result = runner.invoke(cli, ["import-megatron", str(tmp_path / "meg"), str(tmp_path / "ck"), "--pp", "2",
                                 *HINT_FLAGS])
    assert result.exit_code == 0, result.output
    weights = read_full_tensors(str(tmp_path / "ck"))
    assert "output.weight" not in weights
    _assert_same_logits(weights, load_file(str(tmp_path / "saved-rank0.safetensors"))["logits"], tied=True)
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
    result = runner.invoke(cli, ["import-megatron", str(tmp_path / "meg"), str(tmp_path / "ck"),
                                 "--tp", "2", "--pp", "2", *HINT_FLAGS])
    assert result.exit_code == 0, result.output
    saved = load_file(str(tmp_path / "saved-rank0.safetensors"))
    weights = read_full_tensors(str(tmp_path / "ck"))
    _assert_same_logits(weights, saved["logits"], tied=False)

    result = runner.invoke(cli, ["export-megatron", str(tmp_path / "ck"), str(tmp_path / "out"), "--tp", "2"])
    assert result.exit_code == 0, result.output
    _megatron("load", tmp_path / "out", tmp_path / "loaded")
    for rank in (0, 1):
        _assert_bitwise(tmp_path / f"saved-rank{rank}.safetensors", tmp_path / f"loaded-rank{rank}.safetensors")

    result = runner.invoke(cli, ["import-megatron", str(tmp_path / "meg"), str(tmp_path / "ck250"),
                                 "--vocab-size", "250", *HINT_FLAGS])
    assert result.exit_code == 0, result.output
    small = read_full_tensors(str(tmp_path / "ck250"))
    assert torch.equal(small["tok_embeddings.weight"], weights["tok_embeddings.weight"][:250])
    result = runner.invoke(cli, ["export-megatron", str(tmp_path / "ck250"), str(tmp_path / "out250"),
                                 "--tp", "4", "--make-vocab-size-divisible-by", "32"])
    assert result.exit_code == 0 and "vocab padded to 256" in result.output, result.output
    ck = DCPCheckpoint(str(tmp_path / "out250"))
    emb = ck.read("embedding.word_embeddings.weight", ck.chunks["embedding.word_embeddings.weight"][0].box)
    assert torch.equal(emb[:250], small["tok_embeddings.weight"]) and not emb[250:].any()


def test_import_megatron_refuses_a_torchtitan_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"tok_embeddings.weight": torch.zeros(8, 4)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    result = CliRunner().invoke(cli, ["import-megatron", str(tmp_path / "dcp"), str(tmp_path / "ck"), *HINT_FLAGS])
    assert result.exit_code == 1 and "no embedding.word_embeddings.weight" in result.output
