"""Recovery from the fastest complete tier: on a (re)start every rank reports which local
steps it can load (its own copy, and the buddy copy it holds for the rank one node before),
one all-gather of those few integers makes every rank agree on the newest step complete on
every rank, and that step wins when it is not older than the persistent tier's newest. Each
rank then loads its own copy, or receives it from its buddy over the process group first.
Never a mixed step: a step counts only when every rank has it.

When the world changed (a node lost and not replaced), every rank looks for the old ranks'
copies it can reach on its filesystem (all of them on one machine) and, when some step is
complete, loads it by box intersection (resharding) from the local tier; else from the
persistent tier.

Rank 0 logs one line the benches parse: ``recovered step S from local|buddy|persistent``
(regex ``recovered step (\\d+) from (local|buddy|persistent)``), from the ``recovery`` event
it writes to metrics.jsonl (``step``, ``source``, ``detail``, ``seconds``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from shardsmith.errors import CheckpointError, ManifestError
from shardsmith.layout.plan import checkpoint_specs
from shardsmith.storage.commit import open_manifest, parse_step_dir
from shardsmith.storage.formats import SafetensorsFormat
from shardsmith.storage.fs import Store
from shardsmith.storage.lineage import run_id_of
from shardsmith.storage.manifest import Manifest, ManifestBuilder
from shardsmith.trainer.comm import gather_json
from shardsmith.trainer.local_tier import (Lineage, LocalTier, RankCopy, buddy_of, check_copy_files,
                                           parse_rank_doc, rank_manifest_name, saved_dims)
from shardsmith.trainer.peer_copy import exchange_files
from shardsmith.trainer.rng import pack_rng_states

if TYPE_CHECKING:
    from shardsmith.trainer.checkpointing import CheckpointPolicy

log = logging.getLogger(__name__)


class StaticManifest:
    """A manifest already in memory, read like a :class:`~shardsmith.storage.manifest_read.ManifestReader`."""

    def __init__(self, manifest: Manifest) -> None:
        self._manifest = manifest

    def manifest(self, fqns: Any = None) -> Manifest:
        """The whole manifest (``fqns`` is ignored: it is in memory already)."""
        return self._manifest


def announce(policy: CheckpointPolicy, step: int, source: str, detail: str = "", seconds: float = 0.0) -> None:
    """The ``recovery`` event: which tier a (re)start loaded (rank 0 logs it as the line
    ``recovered step S from SOURCE[ (DETAIL)]``, :mod:`shardsmith.trainer.console`)."""
    policy.event({"event": "recovery", "step": step, "source": source, "detail": detail,
                  "seconds": round(seconds, 4)})


def agree(infos: list[dict[str, Any]], per_node: int, replicas: bool) -> tuple[int | None, list[str]]:
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


def lineage_for(policy: CheckpointPolicy, persistent: tuple[Store, int] | None) -> Lineage | None:
    """Whose local copies this start may load: the run of the persistent step it would resume
    (and, after a torchrun restart, its own launch's); None when it starts something new
    (``--resume none``/URL, ``--overwrite``) or nothing ties the local tier to this job."""
    ckpt = policy.cfg.checkpoint
    if policy.restarts == 0 and (ckpt.resume != "auto" or ckpt.overwrite):
        return None
    launch = os.environ.get("TORCHELASTIC_RUN_ID", "") if policy.restarts > 0 else ""
    run = run_id_of(open_manifest(persistent[0]).manifest(()).state) if persistent is not None else ""
    return Lineage(run=run, launch=launch) if run or launch else None


def build_manifest(copies: list[tuple[RankCopy, str]]) -> Manifest:
    """One in-memory manifest over rank copies of one step (file names prefixed with where
    each copy lies relative to the store the load reads); each distinct box once.

    Raises:
        ManifestError: a copy names a tensor the saved model does not have.
    """
    first = copies[0][0].doc
    model, dims = saved_dims(first)
    specs = checkpoint_specs(model, dims, with_optimizer=True)
    state = {**first["state"], "rng": pack_rng_states([c.doc["rng"] for c, _ in sorted(copies, key=lambda x: x[0].rank)],
                                                      dims)}
    builder = ManifestBuilder(step=copies[0][0].step, dims=dims, model=first["model"], config=first["config"],
                              state=state, tensors={f: (s.shape, s.dtype) for f, s in specs.items()},
                              chunk_nbytes=first["chunk_nbytes"])
    seen: set[tuple[str, tuple[int, ...]]] = set()
    gathered = []
    for copy, prefix in copies:
        rec, shards = copy.doc["records"], {}
        for fqn, shard in rec["shards"].items():
            if fqn not in specs:
                raise ManifestError(f"{copy.store.url}: rank {copy.rank} holds {fqn!r}, not in the saved model")
            key = (fqn, tuple(shard[3]))
            if key not in seen:
                seen.add(key)
                shards[fqn] = shard
        gathered.append({"file": [prefix + rec["file"][0], *rec["file"][1:]], "sidecar": rec["sidecar"],
                         "shards": shards})
    SafetensorsFormat().add_records(builder, gathered, copies[0][0].store, specs, dims)
    manifest = builder.build()
    # A rank file holds every box of its rank, replicas included, and the duplicates are left
    # out above: like a partial read, a file may hold entries its records do not name.
    manifest.all_tensors = tuple(manifest.tensors)
    return manifest


def recover_local(policy: CheckpointPolicy) -> bool:
    """Load the newest step complete in the local tier when it is not older than the
    persistent tier's (collective; every rank calls it, after ``_check_root``).

    Returns:
        True when a local step was loaded; False: load from the persistent tier as before.
    """
    t0 = time.perf_counter()
    tier = policy.local
    assert tier is not None
    persistent = policy.resume_source()
    lineage = lineage_for(policy, persistent)
    if lineage is None:
        return False
    newest_persistent = persistent[1] if persistent is not None else -1
    dims = policy.cfg.parallel
    own, held = _scan_this_rank(policy, tier, lineage)
    infos = gather_json({"own": [c.step for c in own if c.same_layout(dims)],
                         "held": [c.step for c in held if c.same_layout(dims)],
                         "other": any(not c.same_layout(dims) for c in own + held)})
    step, sources = agree(infos, tier.per_node, tier.replicas)
    if step is not None and step >= newest_persistent:
        _load_same_layout(policy, step, sources, own, held)
        announce(policy, step, "buddy" if "buddy" in sources else "local", seconds=time.perf_counter() - t0)
    elif any(i["other"] for i in infos):
        step = _reshard_from_local(policy, lineage, newest_persistent)
        if step is None:
            return False
        announce(policy, step, "local", "resharded", seconds=time.perf_counter() - t0)
    else:
        return False
    policy.last_saved_step = newest_persistent       # the persistent tier still needs the final save
    return True


def _scan_this_rank(policy: CheckpointPolicy, tier: LocalTier, lineage: Lineage) -> tuple[list[RankCopy], list[RankCopy]]:
    """This rank's own copies and the buddy copies it holds; each skipped copy is warned about
    (path, reason). A scan that fails (an unreadable disk) counts as finding nothing, so the
    all-gather that follows still runs on every rank."""
    own: list[RankCopy] = []
    held: list[RankCopy] = []
    skipped: list[str] = []
    try:
        own, skipped = tier.scan(tier.root, policy.rank, lineage)
        if tier.replicas:
            assert tier.source is not None
            held, more = tier.scan(tier.replica_root, tier.source, lineage)
            skipped += more
    except Exception as exc:  # noqa: BLE001 — reported, and the next tier is used
        skipped.append(f"local tier: cannot scan {tier.root.url}: {type(exc).__name__}: {exc}; "
                       "falling back to the next tier")
    for line in skipped:
        log.warning("%s", line)
        policy.event({"event": "warning", "message": line})
    return own, held


def _load_same_layout(policy: CheckpointPolicy, step: int, sources: list[str], own: list[RankCopy],
                      held: list[RankCopy]) -> None:
    """Every rank loads its own copy of ``step``; ranks without one first receive it from
    the rank holding their buddy copy (point-to-point) and store it as their own."""
    tier, rank = policy.local, policy.rank
    assert tier is not None
    world = len(sources)
    needers = [r for r, s in enumerate(sources) if s == "buddy"]
    sends = {r: tier.read_copy(next(c for c in held if c.step == step)) for r in needers
             if buddy_of(r, world, tier.per_node) == rank}
    recvs = [buddy_of(rank, world, tier.per_node)] if rank in needers else []
    if sends or recvs:
        got = exchange_files(sends, recvs)
    if recvs:
        files = got[recvs[0]]
        store = tier.store_copy(tier.root, rank, step, files)
        copy = RankCopy(step, rank, store, parse_rank_doc(files[rank_manifest_name(rank)], store.url, rank, step))
        why = check_copy_files(copy, crc=True)
        if why:
            raise CheckpointError(f"rank {rank}: the copy of step {step} received from rank {recvs[0]}: {why}")
    else:
        copy = next(c for c in own if c.step == step)
    policy._load(copy.store, step, reason="resume", reader=StaticManifest(build_manifest([(copy, "")])))


def reachable_steps(tier: LocalTier, lineage: Lineage) -> dict[int, list[tuple[RankCopy, str]]]:
    """Steps for which this process can reach a copy of every rank of the layout they were
    saved in (own or replica directories of any node), each with those copies and their
    paths relative to ``tier.top``. Whole-file CRCs are checked (a world change is rare; with
    node-local disks a rank reaches only its own node's few copies)."""
    found: dict[int, dict[int, RankCopy]] = {}
    for store, _ in tier.node_dirs():
        for name in store.list_dir():
            step = parse_step_dir(name)
            if step is None:
                continue
            for f in store.list_dir(name):
                if f.startswith("rank-") and f.endswith(".json") and f[5:-5].isdigit():
                    copy, _ = tier.check(store.child(name), int(f[5:-5]), step, lineage, True)
                    if copy is not None:
                        found.setdefault(step, {}).setdefault(copy.rank, copy)
    out = {}
    for step, copies in found.items():
        layouts = {(c.doc["world_size"], str(sorted(c.doc["layout"].items()))) for c in copies.values()}
        world = next(iter(copies.values())).doc["world_size"]
        if len(layouts) == 1 and sorted(copies) == list(range(world)):
            out[step] = [(c, c.store.url[len(tier.top.url) + 1:] + "/") for _, c in sorted(copies.items())]
    return out


def _reshard_from_local(policy: CheckpointPolicy, lineage: Lineage, newest_persistent: int) -> int | None:
    """The world changed: load the newest step every rank can reach completely (the same on
    every rank: one all-gather), resharding; None when there is none newer than persistent."""
    tier = policy.local
    assert tier is not None
    try:
        steps = reachable_steps(tier, lineage)
    except Exception as exc:  # noqa: BLE001 — as in _scan_this_rank: nothing found, next tier
        log.warning("local tier: cannot scan %s: %s: %s; falling back to the persistent tier",
                    tier.top.url, type(exc).__name__, exc)
        steps = {}
    common = set.intersection(*(set(s) for s in gather_json(sorted(steps))))
    step = max(common) if common else None
    if step is None or step < newest_persistent:
        return None
    copies = steps[step]
    policy._load(tier.top, step, reason="resume", reader=StaticManifest(build_manifest(copies)))
    return step


__all__ = ["recover_local", "agree", "build_manifest", "StaticManifest", "announce"]
