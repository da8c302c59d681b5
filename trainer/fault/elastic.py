"""Elastic world sizes: after torchrun restarts the group with another number of
processes, re-derive ``dp_shard`` so the job runs in a new layout and resumes its
checkpoint by resharding."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING

from shardsmith.layout import MESH_AXES, ParallelDims

if TYPE_CHECKING:
    from shardsmith.trainer.config import TrainConfig

log = logging.getLogger(__name__)


def elastic_restart_count() -> int:
    """How many times torchrun's elastic agent has restarted this worker group (0 = first
    start; ``TORCHELASTIC_RESTART_COUNT``, set by the agent for every worker)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def warn_if_restarts_unsafe() -> None:
    """Warn when torchrun may restart this group while sharing its agent's TCPStore:
    restarted groups can then read the previous group's stale keys and fail to connect
    (pytorch#135712). ``shardsmith train`` sets the fix; external torchrun users set
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if restarts > 0 and shared and os.environ.get("RANK", "0") == "0":
        log.warning(
            "torchrun --max-restarts %d with a shared agent TCPStore: restarted groups may fail "
            "to connect (pytorch#135712); set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
            restarts,
        )


def fit_world_size(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """The config to run with ``world_size`` processes.

    When the layout already has that world size, ``cfg`` is returned unchanged. Else, if
    ``cfg.fault.derive_dp_shard`` (the user left ``--dp-shard`` free), ``dp_shard`` becomes
    ``world_size / (pp * dp_replicate * tp)``: tp, pp and dp_replicate stay as configured
    (:meth:`~shardsmith.layout.dims.ParallelDims.for_world_size`, the one rule).

    Raises:
        LayoutError: the world size does not fit (names both and what would).
    """
    parallel = cfg.parallel
    if parallel.world_size == world_size:
        return cfg
    if not cfg.fault.derive_dp_shard:
        parallel.check_world_size(world_size)
    fixed = {axis: getattr(parallel, axis) for axis in MESH_AXES if axis != "dp_shard"}
    fitted = ParallelDims.for_world_size(
        world_size,
        **fixed,
        pipeline_split=parallel.pipeline_split,
        virtual_stages=parallel.virtual_stages,
        pipeline_style=parallel.pipeline_style,
    )
    if parallel.expert_parallel > 1:  # EP spans the (re-derived) dp_shard ranks
        fitted = replace(fitted, expert_parallel=fitted.dp_shard)
    if os.environ.get("RANK", "0") == "0":
        log.warning(
            "world size %d differs from layout %s: running as %s (dp_shard re-derived)",
            world_size,
            parallel.describe(),
            fitted.describe(),
        )
    return replace(cfg, parallel=fitted)
