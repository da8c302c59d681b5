"""The step's peak above the sharded state: FSDP buffers, root gradients and the last stage's loss.

Pure (no torch). :func:`transient_nbytes` says which of these coexist at the peak (they are
phases of the step, not a sum); :mod:`shardsmith.sizing.estimate` adds them to the weights,
gradients, AdamW state and kept activations. ``bench/fake_scale.py`` measures each against
the real code on fake tensors.
"""

from __future__ import annotations

from shardsmith.layout import ModelConfig, ParallelDims, padded_vocab_size
from shardsmith.sizing import activations as act


def loss_nbytes(
    model: ModelConfig, dims: ParallelDims, micro_batch_size: int, bytes_per_value: int
) -> int:
    """The last stage's logits and loss of one microbatch (:func:`activations.loss_nbytes_per_token`)."""
    vocab = padded_vocab_size(model.vocab_size, dims.tp) // dims.tp
    return int(
        model.seq_length
        // dims.cp
        * micro_batch_size
        * act.loss_nbytes_per_token(vocab, bytes_per_value)
    )


def fsdp_buffer_nbytes(
    block_numel: int, root_numel: int, dims: ParallelDims, bf16: bool, prefetch: bool = True
) -> int:
    """FSDP2's unsharded buffers at the backward peak (``parallel.apply_fsdp``): the root's
    parameters stay gathered from forward to backward (FSDP2 does not reshard the root after
    forward), the current and (``prefetch``: the stage or chunk has another block, which
    FSDP2's backward prefetch gathers early; a one-layer chunk has none, measured by
    ``bench/fake_scale.py`` on the 405B plan's v7 chunks) the prefetched block's parameters in
    the compute dtype, and the
    current block's unsharded gradient in the compute dtype plus its fp32 reduce-scatter
    input under bf16 (``reduce_dtype=float32``). 0 without FSDP: ``parallel.parallelize``
    applies it when ``dp_replicate * dp_shard * cp > 1`` (it shards over ``dp_shard * cp``)."""
    if dims.dp_replicate * dims.fsdp == 1:
        return 0
    c = 2 if bf16 else 4
    return root_numel * c + block_numel * ((3 if prefetch else 2) * c + (4 if bf16 else 0))


def transient_nbytes(
    root_param_nbytes: int,
    block_buffer_nbytes: int,
    root_grad_nbytes: int,
    early_root_grad_nbytes: int,
    loss_nbytes: int,
) -> int:
    """Bytes above the sharded state and the kept activations at the step's peak.

    The root's gathered parameters (``root_param_nbytes``; FSDP2 keeps the root unsharded from
    forward to backward) are there throughout; on top of them the largest of three phases,
    which never overlap: a block's backward (``block_buffer_nbytes``: current and prefetched
    block, its unsharded gradient and reduce-scatter input; plus ``early_root_grad_nbytes``,
    the output layer's and final norm's gradients, which the last stage makes before any
    block's), the end of backward (``root_grad_nbytes``: every root gradient, the embedding's
    last, before the root's reduce-scatter) and the loss (``loss_nbytes``). Measured against
    the real code by ``bench/fake_scale.py``; the sum of the three overstated 70B's first and
    last stages by 13-19 %."""
    return root_param_nbytes + max(
        block_buffer_nbytes + early_root_grad_nbytes, root_grad_nbytes, loss_nbytes
    )


def stage_transient(
    model: ModelConfig,
    dims: ParallelDims,
    stage: int,
    block: int,
    root: int,
    root_grad: int,
    c: int,
    micro_batch_size: int,
    unsharded: int = 0,
    prefetch: bool = True,
) -> dict[str, int]:
    """The FSDP, root-gradient and loss fields of one stage's roles (:func:`transient_nbytes`).

    ``unsharded``: the stage's gathered parameter elements when FSDP keeps them gathered for
    the step (``--fsdp-reshard-after-forward never``, the default under pipelining:
    :func:`shardsmith.sizing.traffic.fsdp_numel`). They are held all step with their unsharded
    gradients accumulating in fp32 (``c + 4`` bytes each), the vocab-parallel embedding's
    gradient accumulating whole (``Replicate`` over tp, :func:`root_grad_numels`); above them
    only a block's gradient as autograd produces it before it is added (or the embedding's)
    and the loss."""
    if unsharded and dims.dp_replicate * dims.fsdp > 1:
        held = unsharded * (c + 4) + 4 * max(0, root_grad - root)  # + the embedding's, whole
        loss = loss_nbytes(model, dims, micro_batch_size, c) if stage == dims.pp - 1 else 0
        top = max(c * block, c * max(0, root_grad - root), loss)
        return {
            "fsdp_buffer_nbytes": held,
            "root_grad_nbytes": c * root_grad,
            "loss_nbytes": loss,
            "transient_nbytes": held + top,
        }
    buffers = fsdp_buffer_nbytes(block, root, dims, c == 2, prefetch)
    root_param = c * root if buffers else 0
    embedding = (
        padded_vocab_size(model.vocab_size, dims.tp) * model.hidden_size if stage == 0 else 0
    )
    last = stage == dims.chunk_rank(dims.num_chunks - 1)  # the V pipeline style: rank 0
    loss = loss_nbytes(model, dims, micro_batch_size, c) if last else 0
    early = c * max(0, root_grad - embedding) if last else 0
    return {
        "fsdp_buffer_nbytes": buffers,
        "root_grad_nbytes": c * root_grad,
        "loss_nbytes": loss,
        "transient_nbytes": transient_nbytes(
            root_param, buffers - root_param, c * root_grad, early, loss
        ),
    }
