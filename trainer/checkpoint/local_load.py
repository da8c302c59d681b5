"""Recovery in the saved layout from the node-local tier: which step every rank can load
(:func:`agree`, pure), loading it (each rank's own copy, or its buddy's received first:
:func:`load_same_layout`), and giving the buddies back the copies a failure took
(:func:`restore_replicas`); :func:`build_manifest` turns rank copies into one in-memory
manifest (also for a shrink's reshard, :mod:`~shardsmith.trainer.checkpoint.peer_reshard`).
Called by :func:`shardsmith.trainer.checkpoint.recovery.recover_local`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

from shardsmith.errors import CheckpointError, ManifestError
from shardsmith.layout import checkpoint_specs
from shardsmith.storage.formats import SafetensorsFormat
from shardsmith.storage.manifest import Manifest, ManifestBuilder
from shardsmith.trainer.checkpoint.local_tier import (
    RankCopy,
    buddy_of,
    check_copy_files,
    parse_rank_doc,
    rank_manifest_name,
    replicate,
    saved_dims,
)
from shardsmith.trainer.checkpoint.peer_copy import exchange_files
from shardsmith.trainer.comm import any_rank
from shardsmith.trainer.rng import pack_rng_states

if TYPE_CHECKING:
    from shardsmith.storage.manifest import ManifestReader
    from shardsmith.storage.store import Store
    from shardsmith.trainer.checkpoint.local_tier import LocalTier
    from shardsmith.trainer.checkpoint.run_checks import RunIdentity
    from shardsmith.trainer.config import TrainConfig


class RecoveringPolicy(Protocol):
    """What recovery needs of the job's checkpoint policy
    (:class:`~shardsmith.trainer.checkpoint.policy.RecoveringPolicy`): its configuration, rank,
    restart count, tiers, run identity, event sink and the one load it performs. A protocol, so
    recovery (which the policy calls) imports nothing of the policy."""

    cfg: TrainConfig
    rank: int
    restarts: int
    root: Store | None
    local: LocalTier | None
    last_saved_step: int
    run: RunIdentity
    event: Callable[[dict[str, Any]], None]

    def resume_source(self) -> tuple[Store, int] | None: ...

    def load_step(
        self,
        step_store: Store,
        step: int,
        *,
        reason: str,
        reader: ManifestReader | StaticManifest | None = None,
    ) -> None: ...


class StaticManifest:
    """A manifest already in memory, read like a :class:`~shardsmith.storage.manifest.read.ManifestReader`."""

    def __init__(self, manifest: Manifest) -> None:
        self._manifest = manifest

    def manifest(self, fqns: Any = None) -> Manifest:
        """The whole manifest (``fqns`` is ignored: it is in memory already)."""
        return self._manifest


def agree(
    infos: list[dict[str, Any]], per_node: int, replicas: bool
) -> tuple[int | None, list[str]]:
    """The newest step every rank can load in the current layout, and each rank's source.

    Args:
        infos: per rank (in rank order) ``{"own": [steps], "held": [steps of the copy it
            holds for the rank one node before]}``.
        per_node: ranks per node (the buddy of rank r is ``(r + per_node) % world``).
        replicas: whether buddy copies exist.

    Returns:
        (step or None, per rank ``"local"`` or ``"buddy"``). Pure; the same on every rank.
    """
    world = len(infos)
    avail = []
    for r in range(world):
        steps = set(infos[r]["own"])
        if replicas:
            steps |= set(infos[buddy_of(r, world, per_node)]["held"])
        avail.append(steps)
    common = set.intersection(*avail) if avail else set()
    if not common:
        return None, []
    step = max(common)
    return step, ["local" if step in infos[r]["own"] else "buddy" for r in range(world)]


def build_manifest(
    copies: list[tuple[RankCopy, str]], rng: dict[str, Any] | None = None
) -> Manifest:
    """One in-memory manifest over rank copies of one step (file names prefixed with where
    each copy lies relative to the store the load reads); each distinct box once. ``rng``: the
    RNG entry (default: packed from the copies' states, which must then be every rank's).

    Raises:
        ManifestError: a copy names a tensor the saved model does not have.
    """
    first = copies[0][0].doc
    model, dims = saved_dims(first)
    specs = checkpoint_specs(model, dims, with_optimizer=True)
    if rng is None:
        rng = pack_rng_states(
            [c.doc["rng"] for c, _ in sorted(copies, key=lambda x: x[0].rank)], dims
        )
    state = {**first["state"], "rng": rng}
    builder = ManifestBuilder(
        step=copies[0][0].step,
        dims=dims,
        model=first["model"],
        config=first["config"],
        state=state,
        tensors={f: (s.shape, s.dtype) for f, s in specs.items()},
        chunk_nbytes=first["chunk_nbytes"],
    )
    seen: set[tuple[str, tuple[int, ...]]] = set()
    gathered = []
    for copy, prefix in copies:
        rec, shards = copy.doc["records"], {}
        for fqn, shard in rec["shards"].items():
            if fqn not in specs:
                raise ManifestError(
                    f"{copy.store.url}: rank {copy.rank} holds {fqn!r}, not in the saved model"
                )
            key = (fqn, tuple(shard[3]))
            if key not in seen:
                seen.add(key)
                shards[fqn] = shard
        gathered.append(
            {
                "file": [prefix + rec["file"][0], *rec["file"][1:]],
                "sidecar": rec["sidecar"],
                "shards": shards,
            }
        )
    SafetensorsFormat().add_records(builder, gathered, copies[0][0].store, specs, dims)
    manifest = builder.build()
    # A rank file holds every box of its rank, replicas included, and the duplicates are left
    # out above: like a partial read, a file may hold entries its records do not name.
    manifest.all_tensors = tuple(manifest.tensors)
    return manifest


def load_same_layout(
    policy: RecoveringPolicy,
    step: int,
    sources: list[str],
    own: list[RankCopy],
    held: list[RankCopy],
) -> RankCopy:
    """Every rank loads its own copy of ``step``; ranks without one first receive it from
    the rank holding their buddy copy (point-to-point) and store it as their own. Returns
    this rank's own copy."""
    tier, rank = policy.local, policy.rank
    assert tier is not None
    world = len(sources)
    needers = [r for r, s in enumerate(sources) if s == "buddy"]
    sends = {
        r: tier.read_copy(next(c for c in held if c.step == step))
        for r in needers
        if buddy_of(r, world, tier.per_node) == rank
    }
    recvs = [buddy_of(rank, world, tier.per_node)] if rank in needers else []
    if sends or recvs:
        got = exchange_files(sends, recvs)
    if recvs:
        files = got[recvs[0]]
        store = tier.store_copy(tier.root, rank, step, files)
        copy = RankCopy(
            step,
            rank,
            store,
            parse_rank_doc(files[rank_manifest_name(rank)], store.url, rank, step),
        )
        why = check_copy_files(copy, crc=True)
        if why:
            raise CheckpointError(
                f"rank {rank}: the copy of step {step} received from rank {recvs[0]}: {why}"
            )
    else:
        copy = next(c for c in own if c.step == step)
    policy.load_step(
        copy.store, step, reason="resume", reader=StaticManifest(build_manifest([(copy, "")]))
    )
    return copy


def restore_replicas(
    policy: RecoveringPolicy, step: int, infos: list[dict[str, Any]], copy: RankCopy
) -> None:
    """Give back the redundancy a failure took: every rank whose buddy holds no copy of the
    recovered ``step`` (its node was lost, or the failure cut that step's replication short)
    sends its own ``copy`` to its buddy again, so that the next failure, even of a whole node
    while the next save is in flight, still finds ``step`` on a survivor. Point-to-point
    between the pairs concerned, the same decision on every rank (``infos`` is all-gathered),
    then one small all-reduce: no rank trains on (and may fail) before every copy is stored.
    """
    tier, rank = policy.local, policy.rank
    assert tier is not None
    world = len(infos)
    missing = {
        r for r in range(world) if step not in infos[buddy_of(r, world, tier.per_node)]["held"]
    }
    if not missing:
        return
    send, receive = rank in missing, tier.source in missing
    if send or receive:
        files = tier.read_copy(copy) if send else {}
        replicate(tier, step, files, None, send=send, receive=receive)
    any_rank(False)  # every rank: the copies are stored before anyone goes on
