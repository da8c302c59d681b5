"""The layout a job continues in after losing ranks it cannot replace (a shrink).

The rule (one, printed by the launcher when it applies it): the axes that split the model
(``tp``, ``pp``, ``cp``, the stage split) stay; data parallelism gives way, ``dp_shard``
before ``dp_replicate``; of the layouts that fit the survivors, the one with the most ranks
wins, and among those the one that keeps more replicas. A layout fits when the model can be
sharded by it (:func:`~shardsmith.layout.model_config.validate_layout`) and the global batch
still splits into whole microbatches per data-parallel rank. Pure.
"""

from __future__ import annotations

from dataclasses import replace

from shardsmith.errors import ConfigError, LayoutError
from shardsmith.layout.dims import ParallelDims
from shardsmith.layout.model_config import ModelConfig, validate_layout

#: The rule :func:`shrink_layout` applies, in words (the launcher prints it).
SHRINK_RULE = (
    "the largest layout that fits the survivors: tp, pp and cp stay, dp_shard shrinks before "
    "dp_replicate, and the global batch must still split into whole microbatches"
)


def shrink_layout(
    dims: ParallelDims,
    model: ModelConfig,
    max_ranks: int,
    *,
    global_batch_size: int,
    micro_batch_size: int,
) -> ParallelDims:
    """The layout of at most ``max_ranks`` ranks a job of layout ``dims`` continues in (see the
    module docstring for the rule).

    Args:
        dims: the job's layout now; model: its model.
        max_ranks: ranks left (the survivors).
        global_batch_size, micro_batch_size: samples per step and per microbatch.

    Returns:
        ``dims`` itself when it still fits in ``max_ranks``, else the smaller layout.

    Raises:
        LayoutError: no layout fits, naming why and what would (more ranks, another batch size).
    """
    if max_ranks >= dims.world_size:
        return dims
    per_replica = dims.world_size // (dims.dp_replicate * dims.dp_shard)  # tp * pp * cp
    if max_ranks < per_replica:
        raise LayoutError(
            f"{dims.describe()} needs tp*pp*cp = {per_replica} ranks for one copy of the model; "
            f"{max_ranks} survive"
        )
    reasons: list[str] = []
    for ranks in range(max_ranks - max_ranks % per_replica, 0, -per_replica):
        for replicate in range(dims.dp_replicate, 0, -1):
            shard, rest = divmod(ranks // per_replica, replicate)
            if rest or shard > dims.dp_shard:
                continue
            found = _fits(
                dims, model, replicate, shard, global_batch_size, micro_batch_size, reasons
            )
            if found is not None:
                return found
    raise LayoutError(
        f"no layout of at most {max_ranks} ranks continues {dims.describe()}: "
        + "; ".join(dict.fromkeys(reasons))
        + " (a smaller --micro-batch-size or another "
        "--global-batch-size widens the choice)"
    )


def _fits(
    dims: ParallelDims,
    model: ModelConfig,
    replicate: int,
    shard: int,
    global_batch_size: int,
    micro_batch_size: int,
    reasons: list[str],
) -> ParallelDims | None:
    """``dims`` with these data-parallel degrees if that layout fits, else None (reason appended)."""
    unit = micro_batch_size * replicate * shard
    if global_batch_size % unit:
        reasons.append(
            f"dp={replicate * shard}: global_batch_size={global_batch_size} is not a multiple of "
            f"micro_batch_size x dp = {unit}"
        )
        return None
    try:
        ep = shard if dims.expert_parallel > 1 else 1  # EP is carved from dp_shard
        candidate = replace(dims, dp_replicate=replicate, dp_shard=shard, expert_parallel=ep)
        validate_layout(model, candidate)
    except (LayoutError, ConfigError) as exc:
        reasons.append(f"dp_replicate={replicate} dp_shard={shard}: {exc}")
        return None
    return candidate
