"""Activation bytes of shardsmith's Llama block, counted from what its autograd graph keeps.

Pure (no torch). Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", eq. 2) count a GPT block with dropout and materialized attention scores
(``sbh(34 + 5as/h)``). shardsmith's block (:mod:`shardsmith.trainer.model`) has neither: no
dropout, and ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels on GPU, the
fused CPU kernel here) keeps only its output and a log-sum-exp per row, never the s x s
scores. Counted per token of one microbatch, at ``c`` bytes per compute value (2 under bf16
autocast with FSDP's bf16 parameters, 4 in fp32), hidden ``h``, FFN width ``f``, query width
``q = heads * head_dim``, tensor parallel degree ``t``:

* each RMSNorm keeps its fp32 input (``x.float()``; in fp32 that is the block input itself)
  ``4h``, its normalized value before the weight ``c*h`` and, as the input the next linears
  save, its output ``c*h``: ``4h + 2ch``; under sequence parallelism the norm runs on
  ``s/t`` tokens and the linears save the all-gathered output: ``(4h + ch)/t + ch``;
* attention keeps q and the GQA-expanded k and v after RoPE, the fused kernel's output and
  its (B, T, q) copy that ``wo`` saves: ``5*c*q/t``;
* the SwiGLU FFN keeps ``w1 x``, ``silu(w1 x)``, ``w3 x`` and their product: ``4*c*f/t``;
* with activation checkpointing (``torch.utils.checkpoint``, non-reentrant) a layer keeps
  only its input, ``c*h`` (``/t`` under sequence parallelism), and the layer being
  recomputed in backward holds its full set once;
* with per-op selective checkpointing (``--activation-checkpointing selective``, option
  ``op``: :func:`shardsmith.trainer.model.op_sac_contexts`) a layer keeps its input
  ``c*h`` (``/t`` under sequence parallelism) and the outputs of the matmuls and the
  attention kernel the policy saves: ``wq`` ``c*q/t``, ``wv`` ``c*k`` (``k`` its TP-local
  width, at least one head), the attention output ``c*q/t`` and its fp32 log-sum-exp
  ``4*heads/t``, ``w1`` ``c*f/t``, ``w2``'s partial sums ``c*h`` and, under sequence
  parallelism, the two reduce-scatter outputs ``2*c*h/t``; ``wk``, ``wo``, ``w3`` and every
  elementwise op are recomputed (a MoE layer is counted as a dense one of width
  ``topk * expert_ffn``); the layer being recomputed in backward holds its full set once;
* the last stage's loss: logits ``(b, s, V/t)`` in ``c`` bytes, their fp32 copy
  (``loss_fn``'s ``.float()``; none in fp32), the log-softmax of the vocab-parallel cross
  entropy and its gradient, 4 bytes each.

``bench/fake_scale.py`` checks these counts against PyTorch's memory tracker on the real code.
"""

from __future__ import annotations

from shardsmith.layout import ModelConfig, ParallelDims


def compute_nbytes(mixed_precision: str) -> int:
    """Bytes per activation value: 2 under ``bf16``, 4 under ``fp32``."""
    return 2 if mixed_precision == "bf16" else 4


def layer_nbytes_per_token(
    model: ModelConfig, tp: int, c: int, *, sequence_parallel: bool = False
) -> float:
    """Bytes one transformer layer keeps for backward, per token of a microbatch (module doc)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    q = model.num_attention_heads * model.head_dim
    if model.num_experts:
        f = model.expert_ffn_size * model.moe_router_topk
    sp = sequence_parallel and tp > 1
    norm = (4 * h + c * h) / tp + c * h if sp else 4 * h + 2 * c * h
    return 2 * norm + 5 * c * q / tp + 4 * c * f / tp


def checkpointed_layer_nbytes_per_token(
    model: ModelConfig, tp: int, c: int, *, sequence_parallel: bool = False
) -> float:
    """Bytes a layer under activation checkpointing keeps, per token: its input (module doc)."""
    return c * model.hidden_size / (tp if sequence_parallel and tp > 1 else 1)


def selective_layer_nbytes_per_token(
    model: ModelConfig, tp: int, c: int, *, sequence_parallel: bool = False
) -> float:
    """Bytes a layer under per-op selective activation checkpointing keeps, per token
    (module doc)."""
    h, heads = model.hidden_size, model.num_attention_heads
    q = heads * model.head_dim
    f = (
        model.expert_ffn_size * model.moe_router_topk
        if model.num_experts
        else model.ffn_hidden_size
    )
    kv = max(model.num_kv_heads // tp, 1) * model.head_dim
    sp = sequence_parallel and tp > 1
    kept = c * h / (tp if sp else 1) + 2 * c * q / tp + c * kv + 4 * heads / tp + c * f / tp + c * h
    return kept + (2 * c * h / tp if sp else 0)


def loss_nbytes_per_token(vocab_per_rank: int, c: int) -> float:
    """Bytes of the last stage's logits and loss per token (module doc): logits, their fp32
    copy under bf16, the log-softmax and its gradient."""
    return vocab_per_rank * (c + (4 if c == 2 else 0) + 4 + 4)


def interleaved_1f1b_events(
    pp: int, virtual_stages: int, num_microbatches: int, rank: int
) -> list[tuple[int, int]]:
    """(local chunk ``k``, +1 forward / -1 backward) of each chunk microbatch, in the order
    torch 2.13's ``ScheduleInterleaved1F1B`` runs them on pipeline rank ``rank``
    (``torch/distributed/pipelining/schedules.py``: ``_calculate_single_rank_operations``,
    ``_get_warmup_ops``, ``_get_1f1b_rank_ops``). With ``R = M // max(1, M // P)``
    microbatches per round, the rank runs ``min((V - 1)*R + 2*(P - 1 - rank), M*V)`` warm-up
    forwards, then a forward and a backward at a time, then the remaining backwards; its
    ``i``-th forward is of chunk ``(i // R) % V``, its ``j``-th backward of chunk
    ``V - 1 - (j // R) % V``. Megatron's schedule (Narayanan et al. 2021 sec. 2.2.2) warms up
    the same ``(V - 1)*P + 2*(P - 1 - rank)`` when ``M = P``, but torch caps it at ``M*V``:
    every rank holds about ``(V - 1)/V`` of its chunks' microbatches, not only rank 0."""
    p, v, m = pp, virtual_stages, num_microbatches
    per_round = m // max(1, m // p)
    total = m * v
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), total)
    events = [((i // per_round) % v, 1) for i in range(warmup)]
    for j in range(total - warmup):
        events += [(((warmup + j) // per_round) % v, 1), (v - 1 - (j // per_round) % v, -1)]
    events += [(v - 1 - (j // per_round) % v, -1) for j in range(total - warmup, total)]
    return events


def peak_in_flight(
    events: list[tuple[int, int]], chunk_nbytes: list[float], backward_of: int | None = None
) -> tuple[int, ...]:
    """Microbatches of each chunk held at the point of ``events`` (:func:`interleaved_1f1b_events`)
    where the held activation bytes ``sum(held[k] * chunk_nbytes[k])`` are largest; a chunk's
    microbatch is held from its forward to its backward. The points looked at: just after each
    forward, or with ``backward_of=k`` just before each backward of chunk ``k`` (the microbatch
    being backpropagated still held)."""
    held, best, at = [0] * len(chunk_nbytes), -1.0, tuple([0] * len(chunk_nbytes))
    for k, step in events:
        if step < 0 and k == backward_of:
            total = sum(h * n for h, n in zip(held, chunk_nbytes))
            if total > best:
                best, at = total, tuple(held)
        held[k] += step
        total = sum(h * n for h, n in zip(held, chunk_nbytes))
        if step > 0 and backward_of is None and total > best:
            best, at = total, tuple(held)
    return at


def microbatches_in_flight(
    dims: ParallelDims, rank: int, num_microbatches: int, chunk_nbytes: list[float]
) -> tuple[int, ...]:
    """Microbatches in flight at the activation peak of pipeline rank ``rank``, one count per
    chunk it holds (``dims.chunk_ids(rank)``), each chunk keeping ``chunk_nbytes[k]`` bytes per
    microbatch: ``min(P - rank, M)`` under 1F1B (Narayanan et al. 2021 sec. 2.2.1); ``min(P, M)``
    of every chunk under the V-shaped schedules (Qi et al. 2024 sec. 6); under interleaved 1F1B
    (the default with virtual stages) torch's own order (:func:`interleaved_1f1b_events`)."""
    p, m = dims.pp, num_microbatches
    if dims.virtual_stages == 1:
        return (min(p - rank, m),)
    if dims.pipeline_style == "v":
        return (min(p, m),) * dims.virtual_stages
    events = interleaved_1f1b_events(p, dims.virtual_stages, m, rank)
    return peak_in_flight(events, chunk_nbytes)


def binding_phase(
    dims: ParallelDims,
    rank: int,
    num_microbatches: int,
    chunk_nbytes: list[float],
    chunk_extra: list[float],
) -> tuple[tuple[int, ...], int]:
    """(microbatches of each chunk in flight, local chunk ``k``) at the backward where the held
    activations plus ``chunk_extra[k]`` (what chunk ``k``'s backward adds above the others', e.g.
    its FSDP prefetch) are largest. Under interleaved 1F1B the held set is torch's just before
    a backward of ``k`` (:func:`peak_in_flight` with ``backward_of``), so a heavy backward of a
    chunk that runs late meets fewer microbatches; otherwise :func:`microbatches_in_flight`."""
    if dims.virtual_stages == 1 or dims.pipeline_style == "v":
        k = max(range(len(chunk_extra)), key=chunk_extra.__getitem__)
        return microbatches_in_flight(dims, rank, num_microbatches, chunk_nbytes), k
    events = interleaved_1f1b_events(dims.pp, dims.virtual_stages, num_microbatches, rank)
    held = [peak_in_flight(events, chunk_nbytes, k) for k in range(len(chunk_nbytes))]
    scores = [sum(h * n for h, n in zip(hk, chunk_nbytes)) + e for hk, e in zip(held, chunk_extra)]
    k = max(range(len(scores)), key=scores.__getitem__)
    return held[k], k
