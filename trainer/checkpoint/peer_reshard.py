"""A shrink: the newest local step resharded from the survivors' tiers, over the process group.

When the world changed (a node lost and not replaced: an in-process restart on fewer ranks,
or an elastic torchrun restart with fewer nodes), the survivors together still hold every
byte of the newest local step: their own copies and the buddy copies of the lost node's
ranks. This module rebuilds that step in the new layout from them, without reading the
persistent store (DESIGN.md, "Recovery from peers"); every rank calls :func:`agree_shrink`
then :func:`rebuild`, and loads what it returns
(:func:`~shardsmith.trainer.checkpoint.recovery.recover_local`):

1. **Agree.** Every rank lists the committed, CRC-checked copies it reaches (its node's
   tier: on a cluster node-local disks; with ``--simulate-nodes`` only its own simulated
   node's, :meth:`~shardsmith.trainer.checkpoint.local_tier.LocalTier.node_dirs`), and one
   all-gather of those lists makes every rank agree (:func:`plan_shrink`, pure) on the newest
   step whose every saved rank survives somewhere, and on which survivor serves each.
2. **Plan.** Where each of this rank's boxes (the sharding plan in the new layout) meets a
   saved box (the plan in the saved layout), the same box intersection as every reshard,
   it reads that saved box from the lowest saved rank holding it among the copies it holds
   itself, else among all (:class:`SourcePlan`). Both sides of a transfer compute the same
   plan, and the same byte ranges: those a load reads, widened to whole checksum chunks
   (:func:`~shardsmith.storage.reading.planned_spans`).
3. **Move.** Copies a rank holds are read in place. The others come from their serving rank,
   point to point (:func:`~shardsmith.trainer.checkpoint.peer_copy.exchange_files`, no
   pickle): first the rank manifest, the chunk-CRC sidecar and the safetensors header, then
   the ranges, in batches of at most :data:`PEER_BATCH_NBYTES` per pair of ranks (memory is
   bounded by the batch, not the model), written into a sparse copy of the file on this
   node's tier. The load that follows is the ordinary one over an in-memory manifest of the
   copies, so every received chunk is verified against its CRC on the receiving side before
   use (a range the plan failed to send would fail that check; it is never used silently).

The manifest's RNG entry is packed from every saved rank's state, as a persistent save packs
it, so a shrink restores or re-derives the RNG exactly as a resume from that step's
persistent copy would.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from shardsmith.layout import (
    DTYPE_NBYTES,
    Box,
    ModelConfig,
    ParallelDims,
    checkpoint_specs,
    rank_boxes,
)
from shardsmith.storage import parse_step_dir
from shardsmith.storage.reading import planned_spans
from shardsmith.trainer.checkpoint.local_tier import Lineage, LocalTier, RankCopy
from shardsmith.trainer.comm import gather_json

log = logging.getLogger(__name__)

#: Bytes of file ranges one rank sends another per round of a shrink's transfer (at most):
#: bounds the memory a transfer holds per pair of ranks, whatever the model's size.
PEER_BATCH_NBYTES = 64 << 20
#: ``<node dir>/peers-RANK/``: where a rank keeps the sparse copies it received (removed after the load).
PEERS_DIR = "peers"


# ---- 1. agree ------------------------------------------------------------------------------


def held_copies(tier: LocalTier, lineage: Lineage) -> dict[int, dict[int, RankCopy]]:
    """Step -> saved rank -> copy, for every committed copy of ``lineage`` this process reaches
    (:meth:`LocalTier.node_dirs`), whole-file CRCs checked (a copy that fails is left out: it
    is not offered to anyone)."""
    found: dict[int, dict[int, RankCopy]] = {}
    for store, _ in tier.node_dirs():
        try:
            names = store.list_dir()
        except FileNotFoundError:
            continue
        for name in names:
            base = name.rstrip("/").rsplit("/", 1)[-1]
            step = parse_step_dir(base)
            if step is None:
                continue
            for f in store.list_dir(base):
                f = f.rstrip("/").rsplit("/", 1)[-1]
                if f.startswith("rank-") and f.endswith(".json") and f[5:-5].isdigit():
                    copy, _ = tier.check(store.child(base), int(f[5:-5]), step, lineage, True)
                    if copy is not None:
                        found.setdefault(step, {}).setdefault(copy.rank, copy)
    return found


def inventory(held: dict[int, dict[int, RankCopy]]) -> dict[str, Any]:
    """What this rank offers, JSON for the all-gather: ``{step: {"world", "layout", "ranks"}}``
    (copies whose layout differs from the step's first are left out)."""
    out: dict[str, Any] = {}
    for step, copies in held.items():
        first = copies[min(copies)].doc
        ranks = [
            r
            for r, c in sorted(copies.items())
            if (c.doc["world_size"], c.doc["layout"]) == (first["world_size"], first["layout"])
        ]
        out[str(step)] = {"world": first["world_size"], "layout": first["layout"], "ranks": ranks}
    return out


@dataclass(frozen=True)
class ShrinkPlan:
    """What every rank agreed on (the same on every rank).

    Attributes:
        step: the step resharded, None when no local step will do.
        world: its saved world size; layout: its saved layout (``ParallelDims`` JSON).
        holders: per saved rank, the current ranks holding its copy.
        servers: per saved rank, the current rank that sends its copy to those who need it.
        why: one line naming the newest local step that could not be rebuilt and why ("": none).
    """

    step: int | None
    world: int = 0
    layout: dict[str, Any] = field(default_factory=dict)
    holders: list[list[int]] = field(default_factory=list)
    servers: list[int] = field(default_factory=list)
    why: str = ""


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (
        f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    )


def plan_shrink(infos: list[dict[str, Any]], newest_persistent: int) -> ShrinkPlan:
    """The newest step not older than ``newest_persistent`` whose every saved rank's copy is
    held by some current rank (all in one layout), and who serves each: of its holders, the
    one serving fewest so far (ties: the lowest rank). Pure.

    Args:
        infos: every current rank's :func:`inventory`, in rank order.
        newest_persistent: the persistent tier's newest step (-1: none).
    """
    steps = sorted({int(s) for info in infos for s in info}, reverse=True)
    why = ""
    for step in (s for s in steps if s >= newest_persistent):
        offers = [(r, info[str(step)]) for r, info in enumerate(infos) if str(step) in info]
        world, layout = offers[0][1]["world"], offers[0][1]["layout"]
        if any((o["world"], o["layout"]) != (world, layout) for _, o in offers):
            why = why or f"step {step}: the survivors' copies disagree on its layout"
            continue
        holders: list[list[int]] = [[] for _ in range(world)]
        for r, offer in offers:
            for saved in offer["ranks"]:
                if 0 <= saved < world:
                    holders[saved].append(r)
        missing = [saved for saved, h in enumerate(holders) if not h]
        if missing:
            why = why or (
                f"step {step}: no surviving copy of rank(s) {_ranks_text(missing)} of its {world} "
                "(each one's own copy and its buddy's were lost together)"
            )
            continue
        served = [0] * len(infos)
        servers = []
        for h in holders:
            server = min(h, key=lambda r: (served[r], r))
            served[server] += 1
            servers.append(server)
        return ShrinkPlan(step, world, layout, holders, servers, why)
    return ShrinkPlan(None, why=why)


# ---- 2. plan ---------------------------------------------------------------------------------


class SourcePlan:
    """Which saved boxes each current rank reads from which saved rank's copy (pure; built the
    same on every rank from the agreed :class:`ShrinkPlan`).

    For a current rank ``r`` and each of its non-empty boxes, every distinct saved box that
    meets it is read from the lowest saved rank holding that box among the copies ``r`` holds
    itself, else the lowest of all (its server sends it). Replicated boxes (norms over TP,
    whole replicas over ``dp_replicate``) are thus fetched once.
    """

    def __init__(self, model: ModelConfig, plan: ShrinkPlan, dims: ParallelDims) -> None:
        self.plan, self.dims = plan, dims
        self.saved = ParallelDims.from_json(plan.layout)
        self.saved_specs = checkpoint_specs(model, self.saved, with_optimizer=True)
        self.specs = checkpoint_specs(model, dims, with_optimizer=True)
        # fqn -> [(saved box, saved ranks holding it, lowest first)]
        boxes: dict[str, dict[tuple[int, ...], tuple[Box, list[int]]]] = {}
        for saved_rank in range(plan.world):
            for fqn, box in rank_boxes(self.saved_specs, self.saved, saved_rank).items():
                if box.numel:
                    boxes.setdefault(fqn, {}).setdefault(box.offsets, (box, []))[1].append(
                        saved_rank
                    )
        self.saved_boxes = {f: list(b.values()) for f, b in boxes.items()}

    def sources(self, rank: int) -> dict[int, list[tuple[str, Box, Box]]]:
        """Saved rank -> ``(fqn, saved box, this rank's box)`` that ``rank`` reads from its copy
        (nothing for a rank outside the new layout: a survivor that only serves)."""
        if rank >= self.dims.world_size:
            return {}
        mine = {s for s, h in enumerate(self.plan.holders) if rank in h}
        out: dict[int, list[tuple[str, Box, Box]]] = {}
        for fqn, box in rank_boxes(self.specs, self.dims, rank).items():
            if not box.numel:
                continue
            for saved, holders in self.saved_boxes.get(fqn, []):
                if box.lengths and saved.intersect(box) is None:
                    continue
                src = next((h for h in holders if h in mine), holders[0])
                out.setdefault(src, []).append((fqn, saved, box))
        return out

    def spans(
        self, doc: dict[str, Any], reads: list[tuple[str, Box, Box]]
    ) -> list[tuple[int, int]]:
        """Sorted, merged byte ranges ``[start, end)`` of a copy's data file (rank manifest
        ``doc``) that ``reads`` touch, widened to whole checksum chunks as a load widens them."""
        shards, chunk = doc["records"]["shards"], doc["chunk_nbytes"]
        out = []
        for fqn, saved, box in reads:
            offset, nbytes = shards[fqn][0], shards[fqn][1]
            common = saved.intersect(box) if box.lengths else saved
            if common is not None and common.numel:
                itemsize = DTYPE_NBYTES[self.saved_specs[fqn].dtype]
                out += [
                    (offset + a, offset + b)
                    for a, b in planned_spans(saved, common, itemsize, chunk, nbytes)
                ]
        merged: list[tuple[int, int]] = []
        for a, b in sorted(out):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
            else:
                merged.append((a, b))
        return merged


def batches(
    ranges: list[tuple[int, tuple[int, int]]], limit: int = PEER_BATCH_NBYTES
) -> list[list[tuple[int, int, int]]]:
    """``(saved rank, (start, end))`` ranges cut into rounds of at most ``limit`` bytes each:
    ``[[(saved rank, start, end), ...], ...]`` (a range longer than ``limit`` is split). Pure:
    the sender and the receiver cut alike."""
    out: list[list[tuple[int, int, int]]] = []
    size = limit
    for saved, (a, b) in ranges:
        while a < b:
            if size >= limit:
                out.append([])
                size = 0
            end = min(b, a + limit - size)
            out[-1].append((saved, a, end))
            size += end - a
            a = end
    return out


# ---- the whole shrink --------------------------------------------------------------------------


def agree_shrink(
    tier: LocalTier, lineage: Lineage, newest_persistent: int, group: Any = None
) -> tuple[ShrinkPlan, dict[int, RankCopy]]:
    """Step 1 (collective: every rank of ``group`` calls it; default: the default group):
    this rank's copies and one all-gather of every rank's offer; returns the agreed
    :class:`ShrinkPlan` and the copies of its step this rank holds (saved rank -> copy).
    ``group`` is the shrink's exchange when survivors outside the new layout serve too
    (:mod:`~shardsmith.trainer.checkpoint.peer_serve`): its ranks past the new world size
    are those survivors."""
    try:
        held = held_copies(tier, lineage)
    except Exception as exc:  # noqa: BLE001 — an unreadable disk offers nothing; the all-gather still runs
        log.warning("local tier: cannot scan %s: %s: %s", tier.path, type(exc).__name__, exc)
        held = {}
    plan = plan_shrink(gather_json(inventory(held), group), newest_persistent)
    return plan, held.get(plan.step, {}) if plan.step is not None else {}


def other_layout_reachable(tier: LocalTier, lineage: Lineage) -> bool:
    """Whether this process reaches a committed copy of ``lineage`` saved in another layout
    (rank manifests only, no data read): the world changed since it was written."""
    layout, world = tier.dims.to_json(), tier.dims.world_size
    for store, _ in tier.node_dirs():
        try:
            names = store.list_dir()
        except FileNotFoundError:
            continue
        for name in names:
            base = name.rstrip("/").rsplit("/", 1)[-1]
            if parse_step_dir(base) is None:
                continue
            for f in store.list_dir(base):
                f = f.rstrip("/").rsplit("/", 1)[-1]
                if f.startswith("rank-") and f.endswith(".json"):
                    try:
                        doc = json.loads(store.read(f"{base}/{f}"))
                    except (OSError, ValueError):
                        continue
                    if (
                        isinstance(doc, dict)
                        and lineage.admits(doc)
                        and (doc.get("layout") != layout or doc.get("world_size") != world)
                    ):
                        return True
    return False


__all__ = [
    "agree_shrink",
    "plan_shrink",
    "ShrinkPlan",
    "SourcePlan",
    "batches",
    "held_copies",
    "inventory",
    "other_layout_reachable",
    "PEER_BATCH_NBYTES",
]
