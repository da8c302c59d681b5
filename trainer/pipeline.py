"""Pipeline parallelism: the stages of one rank and the schedule that runs them
(``torch.distributed.pipelining``).

Without virtual stages a rank holds one :class:`~shardsmith.trainer.model.Transformer`
stage. With ``virtual_stages = V`` it holds V model chunks, ``r, r + P, r + 2P, ...``
(Megatron's interleaved assignment, Narayanan et al. 2021 sec. 2.2.2), or ``r, 2P - 1 - r``
under the V-shaped schedules (``zbv``, ``dualpipev``: ``ParallelDims.pipeline_style``), in a
:class:`ChunkedStage` whose parameter names are the global FQNs, so checkpoints, the
optimizer and the gradient math see one model, whatever the chunking.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.pipelining._utils import _make_tensor_from_meta
from torch.distributed.pipelining.schedules import (
    _add_reduce_grad,
    _add_send_recv,
    _add_unshard_reshard,
    _defer_recv_ops,
    _PipelineScheduleRuntime,
)

from shardsmith.errors import ConfigError
from shardsmith.trainer.config import default_schedule
from shardsmith.trainer.moe import uncounted

#: ``--pipeline-schedule`` name -> (torch schedule class, runs several stages per rank).
SCHEDULES: dict[str, tuple[type, bool]] = {
    "1f1b": (Schedule1F1B, False),
    "gpipe": (ScheduleGPipe, False),
    "interleaved-1f1b": (ScheduleInterleaved1F1B, True),
    "looped-bfs": (ScheduleLoopedBFS, True),
    "interleaved-zb": (ScheduleInterleavedZeroBubble, True),
    "zbv": (ScheduleZBVZeroBubble, True),
    "dualpipev": (ScheduleDualPipeV, True),
}


def check_schedule(name: str, virtual_stages: int) -> None:
    """Raise :class:`ConfigError` unless schedule ``name`` can run ``virtual_stages`` chunks per rank."""
    if name not in SCHEDULES:
        raise ConfigError(f"pipeline schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    if virtual_stages > 1 and not SCHEDULES[name][1]:
        raise ConfigError(
            f"pipeline schedule {name!r} runs one stage per rank; with virtual_stages="
            f"{virtual_stages} use interleaved-1f1b, looped-bfs or interleaved-zb"
        )


class ChunkedStage(nn.Module):
    """The model chunks one pipeline rank holds, seen as one model.

    ``chunks[k]`` is pipeline chunk ``chunk_ids[k]``; :meth:`named_parameters` yields the
    chunks' own (global) FQNs, never ``chunks.<k>.``, so ``parameters()``, the optimizer and
    the checkpoint code use the same names as an unchunked stage.
    """

    def __init__(self, chunks: list[nn.Module], chunk_ids: tuple[int, ...]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.chunk_ids = chunk_ids

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        for chunk in self.chunks:
            yield from chunk.named_parameters(prefix, recurse, remove_duplicate)

    def forward(self, *args: Any) -> torch.Tensor:
        raise RuntimeError(
            "a ChunkedStage runs only under its pipeline schedule (or chunk by chunk)"
        )


def chunks_of(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(pipeline chunk index, module) of every chunk of a rank's model (one for a plain stage,
    whose index is then the caller's pipeline rank: returned as -1)."""
    if isinstance(model, ChunkedStage):
        return list(zip(model.chunk_ids, model.chunks))
    return [(-1, model)]


class BufferReleasingStage(PipelineStage):
    """``PipelineStage`` that frees a microbatch's received tensors once its backward ran.

    Upstream (torch 2.13 ``PipelineStage._setup_forward_recv_info`` and
    ``_setup_backward_recv_info``) allocates, at the first step, one activation receive
    buffer and one gradient receive buffer per microbatch and keeps them, and the input
    gradients computed into the activation buffers' ``.grad``, for the rest of the job:
    ``3 * M`` tensors of the stage's input shape (``(b, s, h)``) on every stage but the
    first, held through the optimizer step and the next step's forward, where a 1F1B stage
    needs at most its microbatches in flight. Here a microbatch's buffers are dropped
    after its backward (input gradients and all: the schedule's pending send keeps its own
    reference until it completes, on gloo and NCCL alike) and allocated again, empty, when
    the next step posts the receive. Torch already frees the rest: ``fwd_cache`` (the stage
    output autograd needs and the inputs) is popped at each backward. Same constructor as
    ``PipelineStage``; ``release_buffers = False`` on an instance keeps upstream's behaviour
    (for measurements).
    """

    release_buffers = True

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        for info in self.args_recv_info[fwd_chunk_id]:
            if not info.is_root_arg and _released(info):
                info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        for info in self.grad_recv_info.get(bwd_chunk_id, ()):
            if _released(info):
                info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False
    ):
        out = super().backward_one_chunk(
            bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
        )
        if not self.release_buffers:
            return out
        for info in (
            *self.args_recv_info.get(bwd_chunk_id, ()),
            *self.grad_recv_info.get(bwd_chunk_id, ()),
        ):
            if not info.is_root_arg and info.buffer is not None and info.tensor_meta is not None:
                info.buffer = _RELEASED
        return out


#: What a released receive buffer is replaced by (never sent or received into: the next
#: receive of its microbatch allocates a buffer first).
_RELEASED = torch.empty(0)


def _released(info: Any) -> bool:
    return info.buffer is _RELEASED and info.tensor_meta is not None


def received_nbytes(stage: PipelineStage) -> int:
    """Bytes of the receive buffers (and their ``.grad``) ``stage`` holds now."""
    total = 0
    for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
        for info in infos:
            for t in (info.buffer, getattr(info.buffer, "grad", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total


class FsdpPipelineStage(BufferReleasingStage):
    """``PipelineStage`` that exchanges FSDP2 parameters and gradients as the job's policy says
    (:mod:`shardsmith.layout.fsdp_policy`). Same constructor as ``PipelineStage`` plus
    ``per_microbatch``; every rank of a stage uses it. Frees received buffers as
    :class:`BufferReleasingStage` does.

    * ``per_microbatch=False`` (``never``; ``default`` under pipelining): upstream behaviour
      (torch 2.13 ``_PipelineStageBase.backward_maybe_with_nosync``): no gradient sync and no
      reshard after any microbatch's backward, the gradients accumulating unsharded in the
      reduce dtype (fp32: FSDP2's ``to_accumulated_grad_if_needed``), and one reduce-scatter
      (and HSDP all-reduce) per step in ``perform_reduce_grad``, which every torch schedule
      calls after a chunk's last backward. With parameters kept gathered after forward
      (:func:`shardsmith.trainer.parallel.apply_fsdp`), one all-gather per step.
    * ``per_microbatch=True`` (``always``): every microbatch's backward reduce-scatters each
      unit's gradient into the sharded one (FSDP2 accumulates) and reshards, so only one
      block's unsharded parameters and gradients exist at a time. The HSDP replica all-reduce
      waits for the chunk's last backward (``set_requires_all_reduce``), once per step.
      Schedules that split the backward exchange once per step whatever the policy
      (:func:`splits_backward`).

    Its shape-inference forward (upstream ``_forward_metadata_inference``, on the first step
    of every schedule: after each start and resume) runs under
    :func:`shardsmith.trainer.moe.uncounted`, so the MoE router statistics logged for that
    step are those of the training microbatches alone.
    """

    def __init__(self, *args: Any, per_microbatch: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.per_microbatch = per_microbatch

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with uncounted(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)

    def backward_maybe_with_nosync(
        self, backward_type, bwd_kwargs: dict, last_backward: bool = False
    ):
        fsdp = self.submod
        if not self.per_microbatch or backward_type != "full" or not isinstance(fsdp, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        fsdp.set_is_last_backward(False)  # the schedule's final reduce step finishes
        fsdp.set_reshard_after_backward(True)
        fsdp.set_requires_gradient_sync(True)  # (also sets requires_all_reduce: set it after)
        fsdp.set_requires_all_reduce(last_backward)
        grads = stage_backward(
            bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
        )
        return grads, None


def splits_backward(schedule: Any) -> bool:
    """Whether a torch schedule runs some backward as an input half and a later weight half
    (zero-bubble schedules). Such a schedule cannot exchange parameters per microbatch: the
    weight half maps gradients to the parameters the graph saw, which the next microbatch's
    forward would have resharded (torch's ``stage_backward_weight``), so under every policy it
    keeps them gathered and reduces the gradients once per step."""
    from torch.distributed.pipelining.schedules import BACKWARD_WEIGHT

    order = getattr(schedule, "pipeline_order", None) or {}
    return any(
        a is not None and a.computation_type == BACKWARD_WEIGHT
        for acts in order.values()
        for a in acts
    )


#: torch 2.13's ``_add_unshard_reshard`` default: chunks of a rank gathered at once.
TORCH_MAX_ACTIVE_STAGES = 3


def keep_chunks_gathered(schedule: Any, num_chunks: int) -> None:
    """Let this rank keep all its ``num_chunks`` chunks gathered through the step (the
    once-per-step exchange: FSDP2 ``reshard_after_forward=False``). torch 2.13 lowers every
    multi-chunk runtime schedule with ``_add_unshard_reshard(..., max_active_stages=3)``: with
    more than 3 chunks per rank a chunk is resharded to make room and all-gathered again before
    its next microbatch, several times a step. Lowered again here with the window widened to
    every chunk (:func:`lower_unshard_reshard`): each chunk is gathered once, before its first
    use, and resharded after its last. No-op for three chunks or fewer. Called by every rank
    of the pipeline after building its schedule."""
    if num_chunks > TORCH_MAX_ACTIVE_STAGES and isinstance(schedule, _PipelineScheduleRuntime):
        lower_unshard_reshard(schedule, max_active_stages=num_chunks)


def build_schedule(
    model: nn.Module,
    pp_rank: int,
    num_chunks: int,
    pp_group: dist.ProcessGroup,
    num_microbatches: int,
    loss_fn: Any,
    device: torch.device,
    name: str = "",
    reshard_after_forward: bool = True,
) -> Any:
    """The pipeline schedule of this rank's stage (or chunks): ``name`` from :data:`SCHEDULES`
    (default :func:`default_schedule`). Every rank of the pipeline group builds its own, with
    the same ``num_microbatches``; chunk ``c`` is pipeline stage ``c`` of ``num_chunks``.
    ``reshard_after_forward``: the FSDP policy the stage was built with
    (:class:`FsdpPipelineStage`: per microbatch when True, once per step when False)."""
    chunks = [(pp_rank if c < 0 else c, m) for c, m in chunks_of(model)]
    name = name or default_schedule(len(chunks))
    check_schedule(name, len(chunks))
    cls, multi = SCHEDULES[name]
    stages = [
        FsdpPipelineStage(
            m, c, num_chunks, device, group=pp_group, per_microbatch=reshard_after_forward
        )
        for c, m in chunks
    ]
    if multi:
        schedule = cls(stages, n_microbatches=num_microbatches, loss_fn=loss_fn)
        if reshard_after_forward and splits_backward(schedule):
            for stage in stages:  # see splits_backward: such schedules exchange once per step
                stage.per_microbatch = False
                if isinstance(stage.submod, FSDPModule):
                    stage.submod.set_reshard_after_forward(False)
            reshard_after_forward = False
        if not reshard_after_forward:
            keep_chunks_gathered(schedule, len(stages))
        return schedule
    return cls(stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn)


def lower_unshard_reshard(schedule: Any, max_active_stages: int) -> None:
    """Lower ``schedule``'s compute-only order (``pipeline_order``) again as torch 2.13's
    ``_PipelineScheduleRuntime._prepare_schedule_with_comms`` does (UNSHARD/RESHARD, the
    gradient reduction after each chunk's last backward, sends and receives), with at most
    ``max_active_stages`` chunks gathered at once instead of torch's 3."""
    order = {
        rank: _add_reduce_grad(
            _add_unshard_reshard(actions, max_active_stages=max_active_stages),
            schedule._n_microbatches,
        )
        for rank, actions in schedule.pipeline_order.items()
    }
    stage_to_rank = dict(schedule.stage_index_to_group_rank).__getitem__
    order = _add_send_recv(order, stage_to_rank=stage_to_rank, num_stages=schedule._num_stages)
    if schedule._defer_pp_recv:
        order = _defer_recv_ops(order, stage_to_rank=stage_to_rank)
    schedule.pipeline_order_with_comms = order
