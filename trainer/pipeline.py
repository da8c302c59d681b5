"""Pipeline parallelism: the stages of one rank and the schedule that runs them
(``torch.distributed.pipelining``).

Without virtual stages a rank holds one :class:`~shardsmith.trainer.model.Transformer`
stage. With ``virtual_stages = V`` it holds V model chunks, ``r, r + P, r + 2P, ...``
(Megatron's interleaved assignment, Narayanan et al. 2021 sec. 2.2.2), in a
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
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
)
from torch.distributed.pipelining._backward import stage_backward

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


class ShardedGradPipelineStage(PipelineStage):
    """``PipelineStage`` that keeps FSDP2 gradients sharded between microbatches.

    Upstream (torch 2.13 ``_PipelineStageBase.backward_maybe_with_nosync``) turns FSDP's
    gradient sync and reshard-after-backward off for every microbatch and reduces once at
    the end: each rank then holds its whole stage's parameters *and* gradients unsharded
    (``dp_shard`` times its share of each), which defeats ZeRO-3. Here every microbatch's
    backward reduce-scatters each block's gradient into the sharded one (FSDP2 accumulates)
    and reshards, at the price of one all-gather and one reduce-scatter per block and
    microbatch. Same constructor as ``PipelineStage``; every rank of a stage uses it.

    Its shape-inference forward (upstream ``_forward_metadata_inference``, on the first step
    of every schedule: after each start and resume) runs under
    :func:`shardsmith.trainer.moe.uncounted`, so the MoE router statistics logged for that
    step are those of the training microbatches alone.
    """

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with uncounted(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)

    def backward_maybe_with_nosync(
        self, backward_type, bwd_kwargs: dict, last_backward: bool = False
    ):
        if backward_type != "full" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(False)  # the schedule's final reduce step finishes
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(
            bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
        )
        return grads, None


def build_schedule(
    model: nn.Module,
    pp_rank: int,
    num_chunks: int,
    pp_group: dist.ProcessGroup,
    num_microbatches: int,
    loss_fn: Any,
    device: torch.device,
    name: str = "",
) -> Any:
    """The pipeline schedule of this rank's stage (or chunks): ``name`` from :data:`SCHEDULES`
    (default :func:`default_schedule`). Every rank of the pipeline group builds its own, with
    the same ``num_microbatches``; chunk ``c`` is pipeline stage ``c`` of ``num_chunks``."""
    chunks = [(pp_rank if c < 0 else c, m) for c, m in chunks_of(model)]
    name = name or default_schedule(len(chunks))
    check_schedule(name, len(chunks))
    cls, multi = SCHEDULES[name]
    stages = [ShardedGradPipelineStage(m, c, num_chunks, device, group=pp_group) for c, m in chunks]
    if multi:
        return cls(stages, n_microbatches=num_microbatches, loss_fn=loss_fn)
    return cls(stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn)
