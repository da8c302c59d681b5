"""Context parallelism (``--context-parallel-size``, the ``cp`` mesh axis): every rank of a
cp group holds a load-balanced slice of every sequence (:mod:`.sequence`), attention
all-gathers K/V over the group (:mod:`.attention`), and FSDP2 shards parameters over
``dp_shard`` × ``cp`` (:mod:`.mesh`), so checkpoints do not depend on cp."""

from shardsmith.trainer.context_parallel.attention import ContextParallel
from shardsmith.trainer.context_parallel.mesh import attach, context_parallel, fsdp_mesh
from shardsmith.trainer.context_parallel.sequence import (
    check_seq_length,
    local_positions,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "ContextParallel",
    "attach",
    "check_seq_length",
    "context_parallel",
    "fsdp_mesh",
    "local_positions",
    "shard_sequence",
    "unshard_sequence",
]
