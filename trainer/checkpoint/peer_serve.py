"""A shrink's exchange: survivors the new layout leaves out serve their copies, then leave.

A shrink keeps the largest layout that fits the survivors
(:func:`~shardsmith.layout.shrink_layout`), so some survivors may fall outside it (3 survive
a dp_shard4 job whose batch splits only over 2). They hold copies (their own and the buddy
copies of their source ranks) that may be the only ones left of some saved rank. The
in-process supervisor (:mod:`~shardsmith.trainer.runtime.supervisor`) therefore gives them a
*serving* assignment for the shrink's generation: every member and every such survivor
joins one more gloo group, the *exchange* (a ``ProcessGroupGloo`` of its own over the
generation's store: members keep their ranks, the survivors left out come after them), and
the shrink's agreement and transfer (:mod:`~shardsmith.trainer.checkpoint.peer_reshard`,
:mod:`~shardsmith.trainer.checkpoint.peer_transfer`) run over it instead of the training
group. The survivors left out receive nothing; they send what they serve, join the RNG
all-gather, and leave (back to waiting as spares), while the members train on.

The protocol over the exchange, in order:

1. **Header** (one all-gather, every rank): the members' rank 0 says whether the members
   reshard and, if so, whose copies (lineage) and the persistent tier's newest step; the
   serving survivors offer nothing. The members send it from the recovery's shrink path
   (:func:`open_exchange`), or an empty one once their local-tier recovery ended without
   resharding (:func:`release_exchange`, after
   :func:`~shardsmith.trainer.checkpoint.recovery.recover_local`), so a serving survivor
   never waits past the members' resume. The supervisor assigns serving survivors only to
   jobs with a local tier (``--local-ckpt``), where that recovery always runs.
2. **Agree, move, RNG** (:func:`~shardsmith.trainer.checkpoint.peer_reshard.agree_shrink`,
   :func:`~shardsmith.trainer.checkpoint.peer_transfer.rebuild` on the members,
   :func:`~shardsmith.trainer.checkpoint.peer_transfer.serve` on the others).

Without survivors left out there is no exchange: the shrink runs over the training group.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

from shardsmith.trainer.checkpoint.local_tier import Lineage, LocalTier
from shardsmith.trainer.checkpoint.peer_reshard import agree_shrink
from shardsmith.trainer.checkpoint.peer_transfer import serve
from shardsmith.trainer.comm import gather_json

if TYPE_CHECKING:
    from shardsmith.trainer.config import TrainConfig


class _Exchange:
    """This process's exchange group for the generation it trains in, and whether the header
    went out."""

    def __init__(self, group: Any) -> None:
        self.group, self.opened = group, False


_current: list[_Exchange] = []  # at most one: the exchange of this process's generation


def use_exchange(group: Any) -> None:
    """A member of a shrink's generation: ``group`` is the exchange its shrink runs over (the
    in-process worker sets it before building the trainer)."""
    _current[:] = [_Exchange(group)]


def open_exchange(lineage: Lineage, newest_persistent: int) -> Any:
    """The members reshard (every member calls it, from the recovery's shrink path): send the
    header and return the group the shrink runs over (None: the default group, when no
    survivor serves from outside the new layout)."""
    if not _current:
        return None
    exchange = _current[0]
    header = {"run": lineage.run, "launch": lineage.launch, "newest": newest_persistent}
    gather_json(header, exchange.group)
    exchange.opened = True
    return exchange.group


def release_exchange(recovered: bool) -> None:
    """The members' recovery ended (``recovered``) or failed: forget the exchange; when it
    ended and the members did not reshard over it, send the empty header first, so the
    survivors serving from outside the new layout leave (every member calls it)."""
    if _current and recovered and not _current[0].opened:
        gather_json(None, _current[0].group)
    _current.clear()


def releases_exchange(recover: Callable[..., bool]) -> Callable[..., bool]:
    """``recover`` (the local tier's recovery, which reshards over the exchange when the
    world shrank), then :func:`release_exchange`: the serving survivors wait until the members
    either resharded or decided not to."""

    @functools.wraps(recover)
    def wrapper(*args: Any, **kwargs: Any) -> bool:
        done = False
        try:
            loaded = recover(*args, **kwargs)
            done = True
            return loaded
        finally:
            release_exchange(done)

    return wrapper


def serve_copies(cfg: TrainConfig, group: Any, rank: int) -> str:
    """A survivor outside the new layout, as ``rank`` of the exchange ``group`` (collective
    over it): wait for the header, then serve its copies to the shrink's transfer.

    Args:
        cfg: the job's config in the new layout (its node's tier: ``cfg.checkpoint``).

    Returns:
        One line saying what it served, for its log.
    """
    header = gather_json(None, group)[0]
    if header is None:
        return "the members did not reshard: nothing to serve"
    tier = LocalTier(cfg, 0)  # its node's tier (the node: SIMULATED_NODE_ENV when simulated)
    lineage = Lineage(run=header["run"], launch=header["launch"])
    plan, held = agree_shrink(tier, lineage, int(header["newest"]), group)
    if plan.step is None:
        return "no local step to reshard: nothing to serve"
    mine = [s for s, server in enumerate(plan.servers) if server == rank]
    sent = serve(tier, plan, held, cfg.model, cfg.parallel, rank, group)
    return (
        f"served {sent} bytes of step {plan.step} (the copies of saved rank(s) {mine}) "
        "from outside the new layout"
    )


__all__ = [
    "use_exchange",
    "open_exchange",
    "release_exchange",
    "releases_exchange",
    "serve_copies",
]
