"""The estimator's peak: phases that never coexist are not summed, FSDP under context
parallelism, and the printed formulas say what is computed (hand-computed values)."""

from __future__ import annotations

from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.sizing import activations as act
from shardsmith.sizing.estimate import FORMULAS, estimate
from shardsmith.sizing.peak import fsdp_buffer_nbytes, transient_nbytes

TINY = ModelConfig(
    num_layers=8,
    hidden_size=64,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=128,
    vocab_size=256,
    seq_length=64,
)


def test_transient_is_root_plus_the_largest_phase() -> None:
    # root 100 + max(block 1000 + early output grad 50, all root grads 700, loss 900)
    assert transient_nbytes(100, 1000, 700, 50, 900) == 100 + 1050
    assert transient_nbytes(100, 1000, 2000, 50, 900) == 100 + 2000
    assert transient_nbytes(0, 10, 20, 0, 3000) == 3000


def test_last_stage_does_not_add_loss_to_block_buffers() -> None:
    # tp2 pp2 dp_shard2, bf16, mb 1: stage 1 (last) holds 4 blocks; root = norm 64 + output 256*64/2
    dims = ParallelDims(tp=2, pp=2, dp_shard=2)
    est = estimate(
        TINY,
        dims,
        micro_batch_size=1,
        global_batch_size=4,
        mixed_precision="bf16",
        fsdp_reshard_after_forward="always",
    )
    last = [r for r in est.roles if r.stage == 1][0]
    root = 64 + 256 * 64 // 2
    block = 18560  # one block's TP share (test_gpu_plan)
    loss = 64 * act.loss_nbytes_per_token(128, 2)  # s * V/t * 14
    assert last.loss_nbytes == loss == 64 * 128 * 14
    assert last.fsdp_buffer_nbytes == 2 * root + 10 * block
    # phases: block 10*18560 + output/norm grads 2*root = 202,176; root grads 2*root; loss 114,688
    assert last.transient_nbytes == 2 * root + max(10 * block + 2 * root, 2 * root, loss)
    assert (
        last.total_nbytes == 16 * last.num_params + last.activation_nbytes + last.transient_nbytes
    )
    assert last.total_nbytes < (
        16 * last.num_params
        + last.activation_nbytes
        + last.fsdp_buffer_nbytes
        + last.root_grad_nbytes
        + last.loss_nbytes
    )


def test_fsdp_buffers_under_context_parallel_without_dp() -> None:
    # parallelize() applies FSDP when dp_replicate * dp_shard * cp > 1: cp 2 alone shards
    assert fsdp_buffer_nbytes(1000, 500, ParallelDims(tp=2, cp=2), True) == 500 * 2 + 1000 * 10
    assert fsdp_buffer_nbytes(1000, 500, ParallelDims(tp=2), True) == 0


def test_printed_formulas_match_the_loss_term() -> None:
    text = " ".join(FORMULAS.values())
    assert "4*s*b*V/t" not in text
    # bf16: c + fp32 copy + log-softmax + gradient = 2 + 4 + 4 + 4 (activations.loss_nbytes_per_token)
    assert (
        "s*b*V/t*(c + 4 + 4 + 4)" in FORMULAS["loss"]
        and act.loss_nbytes_per_token(1, 2) == 2 + 4 + 4 + 4
    )
    assert (
        "s*b*V/t*(4 + 4 + 4)" in FORMULAS["loss"] and act.loss_nbytes_per_token(1, 4) == 4 + 4 + 4
    )
    assert "largest" in FORMULAS["peak"]


def test_printed_activation_formula_is_the_one_computed() -> None:
    # activations.layer_nbytes_per_token: 2 * norm + 5*c*q/t + 4*c*f/t, norm = 4h + 2ch
    text = FORMULAS["activation"]
    assert "2*(4h + 2ch) + 5cq/t + 4cf/t" in text and "10 + 24/t" not in text
    h, q, f, c, t = 64, 64, 128, 2, 2
    assert (
        act.layer_nbytes_per_token(TINY, t, c)
        == 2 * (4 * h + 2 * c * h) + 5 * c * q / t + 4 * c * f / t
    )


def test_dry_run_prints_the_loss_and_peak_formulas() -> None:
    from click.testing import CliRunner

    from shardsmith.cli.main import cli

    out = CliRunner().invoke(cli, ["train", "--tp", "2", "--dp-shard", "2", "--dry-run"])
    assert out.exit_code == 0, out.output
    flat = " ".join(out.output.split())
    assert "loss: last stage" in flat and "peak: weights + gradients" in flat
    assert "4*s*b*V/t" not in flat


def test_parameters_kept_gathered_for_the_step_hold_the_stage_unsharded() -> None:
    # default under pp: each stage holds its gathered parameters (bf16) and fp32 gradients
    dims = ParallelDims(tp=2, pp=2, dp_shard=2)
    kw = {"micro_batch_size": 1, "global_batch_size": 4, "mixed_precision": "bf16"}
    never = [r for r in estimate(TINY, dims, **kw).roles if r.stage == 1][0]
    always = [
        r
        for r in estimate(TINY, dims, **kw, fsdp_reshard_after_forward="always").roles
        if r.stage == 1
    ][0]
    root, block = 64 + 256 * 64 // 2, 18560
    stage = 4 * block + root  # 4 blocks and the root, TP shares (no padding at dp_shard 2)
    assert never.fsdp_buffer_nbytes == stage * (2 + 4)
    assert never.transient_nbytes == stage * 6 + max(2 * block, 0, never.loss_nbytes)
    assert never.total_nbytes > always.total_nbytes
