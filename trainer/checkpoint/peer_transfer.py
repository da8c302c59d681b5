"""A shrink's transfer: the boxes a rank lacks, received from the survivors that hold them.

Steps 2 and 3 of a shrink (:mod:`~shardsmith.trainer.checkpoint.peer_reshard` has the picture
and step 1): from the agreed plan each rank derives, purely, what it reads from which saved
rank's copy (:class:`~shardsmith.trainer.checkpoint.peer_reshard.SourcePlan`) and so what it
sends and receives (:func:`transfer_of`); :func:`move` runs the point-to-point exchanges
(:func:`~shardsmith.trainer.checkpoint.peer_copy.exchange_files`: metadata first, then byte
ranges in batches of at most :data:`~shardsmith.trainer.checkpoint.peer_reshard.PEER_BATCH_NBYTES`
per pair of ranks) into sparse copies on this node's tier, and :func:`rebuild` describes the
copies the load then reads, verifying every chunk against its CRC.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

from shardsmith.errors import CheckpointError
from shardsmith.layout import Box, ModelConfig, ParallelDims
from shardsmith.storage import crc32c, step_dir
from shardsmith.storage.manifest import sidecar_name
from shardsmith.trainer.checkpoint.local_tier import (
    LocalTier,
    RankCopy,
    parse_rank_doc,
    rank_manifest_name,
)
from shardsmith.trainer.checkpoint.peer_copy import exchange_files
from shardsmith.trainer.checkpoint.peer_reshard import (
    PEER_BATCH_NBYTES,
    PEERS_DIR,
    ShrinkPlan,
    SourcePlan,
    batches,
)
from shardsmith.trainer.comm import gather_json
from shardsmith.trainer.rng import pack_rng_states

_HEADER_LEN_NBYTES = 8


@dataclass
class Transfer:
    """One rank's side of the transfer: what it sends (per receiver) and receives (per server)."""

    sends: dict[int, dict[int, list[tuple[str, Box, Box]]]]  # receiver -> saved rank -> reads
    recvs: dict[int, dict[int, list[tuple[str, Box, Box]]]]  # server -> saved rank -> reads
    own: dict[int, list[tuple[str, Box, Box]]]  # saved rank -> reads, held here


def transfer_of(sources: SourcePlan, rank: int, world: int) -> Transfer:
    """This rank's :class:`Transfer` (pure): it serves, to every current rank that does not
    hold a saved rank's copy itself, the reads that rank takes from a copy this rank serves."""
    plan = sources.plan
    served = [s for s, server in enumerate(plan.servers) if server == rank]
    sends: dict[int, dict[int, list[tuple[str, Box, Box]]]] = {}
    if served:
        for r in range(world):
            for saved, reads in sources.sources(r).items():
                if plan.servers[saved] == rank and r not in plan.holders[saved]:
                    sends.setdefault(r, {})[saved] = reads
    own: dict[int, list[tuple[str, Box, Box]]] = {}
    recvs: dict[int, dict[int, list[tuple[str, Box, Box]]]] = {}
    for saved, reads in sources.sources(rank).items():
        if rank in plan.holders[saved]:
            own[saved] = reads
        else:
            recvs.setdefault(plan.servers[saved], {})[saved] = reads
    return Transfer(sends, recvs, own)


def _header(copy: RankCopy) -> bytes:
    """The safetensors header of a copy's data file (length prefix included)."""
    name = copy.doc["records"]["file"][0]
    n = int.from_bytes(copy.store.read_range(name, 0, _HEADER_LEN_NBYTES), "little")
    return copy.store.read_range(name, 0, _HEADER_LEN_NBYTES + n)


def _meta_files(copies: dict[int, RankCopy], saved_ranks: list[int]) -> dict[str, bytes]:
    """Round 0 of a transfer: the rank manifest, sidecar and header of each copy named."""
    out = {}
    for s in saved_ranks:
        copy = copies[s]
        name = copy.doc["records"]["file"][0]
        out[rank_manifest_name(s)] = copy.store.read(rank_manifest_name(s))
        out[sidecar_name(name)] = copy.store.read(sidecar_name(name))
        out[f"{name}@header"] = _header(copy)
    return out


def _store_meta(
    scratch: Any, step: int, files: dict[str, bytes], saved: int, server: int
) -> RankCopy:
    """Write a received copy's sidecar (its CRC checked against the rank manifest) and a sparse
    data file holding its header; the ranges follow in later rounds."""
    where = f"rank manifest of rank {saved} from rank {server}"
    doc = parse_rank_doc(files[rank_manifest_name(saved)], where, saved, step)
    name, nbytes, _ = doc["records"]["file"]
    side = files.get(sidecar_name(name), b"")
    want_n, want_crc = doc["records"]["sidecar"]
    if len(side) != want_n or crc32c(side) != want_crc:
        raise CheckpointError(
            f"step {step}: the chunk-CRC sidecar of rank {saved} received from rank {server} "
            f"does not match its rank manifest ({len(side)} bytes, CRC-32C {crc32c(side):#010x})"
        )
    scratch.write(sidecar_name(name), side)
    path = os.path.join(scratch.root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:  # sparse: only the ranges received are written
        f.truncate(nbytes)
        f.write(files[f"{name}@header"])
    return RankCopy(step, saved, scratch, doc)


def _write_ranges(
    scratch: Any,
    copies: dict[int, RankCopy],
    batch: list[tuple[int, int, int]],
    files: dict[str, bytes],
    server: int,
) -> int:
    """Write one received batch into the sparse files; returns its bytes."""
    total = 0
    for saved, a, b in batch:
        data = files.get(f"{saved}@{a}")
        if data is None or len(data) != b - a:
            raise CheckpointError(
                f"rank {server} sent no or short bytes [{a}, {b}) of rank {saved}'s copy"
            )
        path = os.path.join(scratch.root, copies[saved].doc["records"]["file"][0])
        with open(path, "r+b") as f:
            f.seek(a)
            f.write(data)
        total += len(data)
    return total


def move(
    tier: LocalTier,
    held: dict[int, RankCopy],
    sources: SourcePlan,
    move_plan: Transfer,
    step: int,
    rank: int,
    batch_nbytes: int = PEER_BATCH_NBYTES,
    group: Any = None,
) -> tuple[dict[int, RankCopy], int, int]:
    """Run this rank's side of the transfer (every rank of ``group`` calls it; point to point
    only), in rounds of at most ``batch_nbytes`` per pair of ranks.

    Returns:
        (saved rank -> received copy, in ``tier``'s scratch directory; bytes received; bytes
        of ranges sent).
    """
    scratch = tier.root.child(f"{PEERS_DIR}-{rank:05d}/{step_dir(step)}")
    shutil.rmtree(scratch.root, ignore_errors=True)
    meta = {r: _meta_files(held, sorted(by_saved)) for r, by_saved in move_plan.sends.items()}
    got = exchange_files(meta, sorted(move_plan.recvs), group)
    received: dict[int, RankCopy] = {}
    for server, by_saved in move_plan.recvs.items():
        for saved in by_saved:
            received[saved] = _store_meta(scratch, step, got[server], saved, server)
    docs = {**{s: c.doc for s, c in held.items()}, **{s: c.doc for s, c in received.items()}}

    def rounds(
        pairs: dict[int, dict[int, list[tuple[str, Box, Box]]]],
    ) -> dict[int, list[list[tuple[int, int, int]]]]:
        return {
            peer: batches(
                [
                    (s, span)
                    for s, reads in sorted(by_saved.items())
                    for span in sources.spans(docs[s], reads)
                ],
                batch_nbytes,
            )
            for peer, by_saved in pairs.items()
        }

    out_rounds, in_rounds = rounds(move_plan.sends), rounds(move_plan.recvs)
    nbytes = sent = 0
    for k in range(max([len(b) for b in (*out_rounds.values(), *in_rounds.values())], default=0)):
        sends = {
            r: {
                f"{s}@{a}": held[s].store.read_range(held[s].doc["records"]["file"][0], a, b)
                for s, a, b in rb[k]
            }
            for r, rb in out_rounds.items()
            if k < len(rb)
        }
        recvs = [server for server, rb in in_rounds.items() if k < len(rb)]
        sent += sum(len(data) for files in sends.values() for data in files.values())
        got = exchange_files(sends, recvs, group)
        for server in recvs:
            nbytes += _write_ranges(scratch, received, in_rounds[server][k], got[server], server)
    return received, nbytes, sent


@dataclass
class Rebuilt:
    """A step rebuilt on this rank: the copies its load reads (each with its path relative to
    the tier's top, records only of the boxes read from it), the RNG entry of every saved rank,
    the bytes received, the scratch directory to remove after the load, and the bytes the
    survivors outside the new layout sent (all ranks: the same number)."""

    copies: list[tuple[RankCopy, str]]
    rng: dict[str, Any]
    nbytes_received: int
    scratch: str
    nbytes_from_leavers: int = 0


def rebuild(
    tier: LocalTier,
    plan: ShrinkPlan,
    held: dict[int, RankCopy],
    model: ModelConfig,
    dims: ParallelDims,
    rank: int,
    batch_nbytes: int = PEER_BATCH_NBYTES,
    group: Any = None,
) -> Rebuilt:
    """Steps 2 and 3 (collective over ``group``, default: the default group): plan this
    rank's reads, run the transfer, gather the RNG states (one all-gather of the served saved
    ranks'), and describe the copies to load. Ranks of ``group`` past ``dims.world_size``
    (survivors outside the new layout) call :func:`serve` instead.

    Raises:
        CheckpointError: a peer sent malformed or short data (received chunks are verified by
            the load that follows).
    """
    assert plan.step is not None
    sources = SourcePlan(model, plan, dims)
    move_plan = transfer_of(sources, rank, dims.world_size)
    received, nbytes, _ = move(tier, held, sources, move_plan, plan.step, rank, batch_nbytes, group)
    packed, leavers = _gather_rng(plan, held, rank, 0, dims.world_size, group)
    reads = {
        **move_plan.own,
        **{s: r for by_saved in move_plan.recvs.values() for s, r in by_saved.items()},
    }
    copies = [
        (_only(c, reads[s]), c.store.url[len(tier.top.url) + 1 :] + "/")
        for s, c in sorted({**{s: held[s] for s in move_plan.own}, **received}.items())
    ]
    if not copies:
        raise CheckpointError(
            f"rank {rank}: the shrink of step {plan.step} planned nothing to read (internal error)"
        )
    scratch = os.path.join(tier.root.root, f"{PEERS_DIR}-{rank:05d}")
    return Rebuilt(copies, packed, nbytes, scratch, leavers)


def serve(
    tier: LocalTier,
    plan: ShrinkPlan,
    held: dict[int, RankCopy],
    model: ModelConfig,
    dims: ParallelDims,
    rank: int,
    group: Any,
    batch_nbytes: int = PEER_BATCH_NBYTES,
) -> int:
    """The side of a survivor outside the new layout (``rank >= dims.world_size`` of
    ``group``) in steps 2 and 3: it sends the ranges of the copies it serves, as any server,
    receives nothing, and joins the RNG all-gather. Collective over ``group``.

    Returns:
        Bytes of ranges it sent.
    """
    assert plan.step is not None and rank >= dims.world_size
    sources = SourcePlan(model, plan, dims)
    move_plan = transfer_of(sources, rank, dims.world_size)
    _, _, sent = move(tier, held, sources, move_plan, plan.step, rank, batch_nbytes, group)
    _gather_rng(plan, held, rank, sent, dims.world_size, group)
    return sent


def _gather_rng(
    plan: ShrinkPlan, held: dict[int, RankCopy], rank: int, sent: int, world: int, group: Any
) -> tuple[dict[str, Any], int]:
    """One all-gather: the RNG states of the saved ranks each rank serves, and the bytes each
    rank outside the new layout sent. Returns (the packed RNG entry, those bytes in all)."""
    parts = gather_json(
        {
            "rng": [[s, held[s].doc["rng"]] for s, srv in enumerate(plan.servers) if srv == rank],
            "sent": sent if rank >= world else 0,
        },
        group,
    )
    packed = pack_rng_states(
        [d for _, d in sorted((s, d) for part in parts for s, d in part["rng"])],
        ParallelDims.from_json(plan.layout),
    )
    return packed, sum(part["sent"] for part in parts)


def _only(copy: RankCopy, reads: list[tuple[str, Box, Box]]) -> RankCopy:
    """``copy`` with only the records of the tensors read from it (each saved box has one source)."""
    fqns = {fqn for fqn, _, _ in reads}
    records = copy.doc["records"]
    shards = {f: v for f, v in records["shards"].items() if f in fqns}
    return RankCopy(
        copy.step, copy.rank, copy.store, {**copy.doc, "records": {**records, "shards": shards}}
    )


__all__ = ["rebuild", "serve", "Rebuilt", "Transfer", "transfer_of", "move"]
