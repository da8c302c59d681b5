"""Recovery from the fastest complete tier: on a (re)start every rank reports which local
steps it can load (its own copy, and the buddy copy it holds for the rank one node before),
one all-gather of those few integers makes every rank agree on the newest step complete on
every rank, and that step wins when it is not older than the persistent tier's newest. Each
rank then loads its own copy, or receives it from its buddy over the process group first.
Never a mixed step: a step counts only when every rank has it.

When the world changed (a node lost and not replaced: a shrink), the survivors reshard the
newest local step whose every old rank's copy survives somewhere, receiving over the process
group what their own node's tier lacks (:mod:`~shardsmith.trainer.checkpoint.peer_reshard`);
else the persistent tier loads, after one line naming why.

The persistent tier's step is the one the launcher resolved (:func:`persistent_source`); a
step whose data fails verification while loading is marked corrupt and, with ``--resume
auto``, the next older committed step of its run loads instead (:func:`load_resume`).

Rank 0 logs one line the benches parse: ``recovered step S from local|buddy|persistent``
(regex ``recovered step (\\d+) from (local|buddy|persistent)``), from the ``recovery`` event
it writes to metrics.jsonl (``step``, ``source``, ``detail``, ``seconds``).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import TYPE_CHECKING, Any

from shardsmith.errors import CheckpointNotFound, IntegrityError
from shardsmith.storage import (
    committed_runs,
    loadable_steps,
    mark_corrupt,
    open_manifest,
    resolve_checkpoint,
    run_id_of,
    split_step_url,
    step_dir,
)
from shardsmith.storage.store import Store
from shardsmith.trainer.checkpoint.local_load import (
    RecoveringPolicy,
    StaticManifest,
    agree,
    build_manifest,
    load_same_layout,
    restore_replicas,
)
from shardsmith.trainer.checkpoint.local_tier import (
    Lineage,
    LocalTier,
    RankCopy,
)
from shardsmith.trainer.checkpoint.peer_reshard import (
    ShrinkPlan,
    agree_shrink,
    other_layout_reachable,
)
from shardsmith.trainer.checkpoint.peer_serve import open_exchange, releases_exchange
from shardsmith.trainer.checkpoint.peer_transfer import rebuild
from shardsmith.trainer.checkpoint.resume import choose_resume, way_forward
from shardsmith.trainer.comm import broadcast_text, gather_json

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


def announce(
    policy: RecoveringPolicy, step: int, source: str, detail: str = "", seconds: float = 0.0
) -> None:
    """The ``recovery`` event: which tier a (re)start loaded (rank 0 logs it as the line
    ``recovered step S from SOURCE[ (DETAIL)]``, :mod:`shardsmith.trainer.observe.console`)."""
    policy.event(
        {
            "event": "recovery",
            "step": step,
            "source": source,
            "detail": detail,
            "seconds": round(seconds, 4),
        }
    )


def lineage_for(policy: RecoveringPolicy, persistent: tuple[Store, int] | None) -> Lineage | None:
    """Whose local copies this start may load: the run of the persistent step it would resume
    (and, after a torchrun restart, its own launch's); None when it starts something new
    (``--resume none``/URL, ``--overwrite``) or nothing ties the local tier to this job."""
    ckpt = policy.cfg.checkpoint
    if policy.restarts == 0 and (ckpt.resume != "auto" or ckpt.overwrite):
        return None
    launch = os.environ.get("TORCHELASTIC_RUN_ID", "") if policy.restarts > 0 else ""
    run = (
        run_id_of(open_manifest(persistent[0]).manifest(()).state) if persistent is not None else ""
    )
    return Lineage(run=run, launch=launch) if run or launch else None


@releases_exchange
def recover_local(policy: RecoveringPolicy) -> bool:
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
    infos = gather_json(
        {
            "own": [c.step for c in own if c.same_layout(dims)],
            "held": [c.step for c in held if c.same_layout(dims)],
            "other": any(not c.same_layout(dims) for c in own + held)
            or other_layout_reachable(tier, lineage),
        }
    )
    step, sources = agree(infos, tier.per_node, tier.replicas)
    if step is not None and step >= newest_persistent:
        copy = load_same_layout(policy, step, sources, own, held)
        if tier.replicas:
            restore_replicas(policy, step, infos, copy)
        announce(
            policy,
            step,
            "buddy" if "buddy" in sources else "local",
            seconds=time.perf_counter() - t0,
        )
    elif any(i["other"] for i in infos):  # the world changed: a shrink
        if _reshard_from_peers(policy, lineage, newest_persistent) is None:
            return False
    else:
        return False
    policy.last_saved_step = newest_persistent  # the persistent tier still needs the final save
    return True


def _scan_this_rank(
    policy: RecoveringPolicy, tier: LocalTier, lineage: Lineage
) -> tuple[list[RankCopy], list[RankCopy]]:
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
        skipped.append(
            f"local tier: cannot scan {tier.root.url}: {type(exc).__name__}: {exc}; "
            "falling back to the next tier"
        )
    for line in skipped:
        log.warning("%s", line)
        policy.event({"event": "warning", "message": line})
    return own, held


def _reshard_from_peers(
    policy: RecoveringPolicy, lineage: Lineage, newest_persistent: int
) -> int | None:
    """The world changed: reshard the newest local step whose every saved rank survives on
    some rank, from the survivors' copies (:mod:`~shardsmith.trainer.checkpoint.peer_reshard`);
    None when none is as new as the persistent tier's (after one line naming why).
    Collective."""
    t0 = time.perf_counter()
    tier = policy.local
    assert tier is not None
    group = open_exchange(lineage, newest_persistent)  # survivors outside the layout serve too
    plan, held = agree_shrink(tier, lineage, newest_persistent, group)
    if plan.why:
        _why_not_newest(policy, plan, newest_persistent)
    if plan.step is None:
        return None
    dims = policy.cfg.parallel
    rebuilt = rebuild(tier, plan, held, policy.cfg.model, dims, policy.rank, group=group)
    try:
        reader = StaticManifest(build_manifest(rebuilt.copies, rng=rebuilt.rng))
        policy.load_step(tier.top, plan.step, reason="resume", reader=reader)
    finally:
        shutil.rmtree(rebuilt.scratch, ignore_errors=True)
    received = gather_json(rebuilt.nbytes_received)
    seconds = time.perf_counter() - t0
    announce(policy, plan.step, "local", "resharded", seconds=seconds)
    policy.event(
        {
            "event": "peer_reshard",
            "step": plan.step,
            "saved_layout": plan.layout,
            "layout": dims.to_json(),
            "nbytes_received": sum(received),
            "ranks_receiving": sum(1 for n in received if n),
            "nbytes_from_leavers": rebuilt.nbytes_from_leavers,
            "leavers_serving": len({s for s in plan.servers if s >= dims.world_size}),
            "seconds": round(seconds, 4),
        }
    )
    return plan.step


def _why_not_newest(policy: RecoveringPolicy, plan: ShrinkPlan, newest_persistent: int) -> None:
    """One line (rank 0 logs it; an event): why the newest local step is not the one loaded."""
    if plan.step is not None:
        then = f"resharding step {plan.step} from the survivors instead"
    elif newest_persistent >= 0:
        then = f"loading step {newest_persistent} from the persistent tier"
    else:
        then = "no persistent step either: starting from scratch"
    line = f"local tier: {plan.why}; {then}"
    if policy.rank == 0:
        log.warning("%s", line)
    policy.event({"event": "warning", "message": line})


__all__ = ["recover_local", "agree", "build_manifest", "StaticManifest", "announce"]


# ---- the persistent tier: the step the launcher resolved, and a corrupt one ------------------


def persistent_source(policy: RecoveringPolicy) -> tuple[Store, int] | None:
    """The persistent-tier step a start loads (collective: every rank calls it once).

    On the first start it is exactly ``checkpoint.resume_step``, the URL the launcher resolved
    (:func:`shardsmith.trainer.runtime.preflight.resolve`); nobody chooses again. After an elastic
    restart (or for a config nobody resolved) rank 0 chooses with
    :func:`~shardsmith.trainer.checkpoint.resume.choose_resume` and broadcasts its choice, so
    every rank loads the same step even while a save commits another.

    Raises:
        CheckpointNotFound: on every rank, when rank 0 found no committed step at an explicit URL.
    """
    ckpt = policy.cfg.checkpoint
    if ckpt.resume_step is not None and policy.restarts == 0:
        return _step_of(ckpt.resume_step, ckpt.storage_options) if ckpt.resume_step else None
    chosen = ""
    if policy.rank == 0:
        try:
            root = None if ckpt.overwrite and policy.restarts == 0 else policy.root
            src = choose_resume(ckpt.resume, root, policy.restarts, ckpt.storage_options)
            chosen = src[0].url if src is not None else ""
        except CheckpointNotFound as exc:
            chosen = f"!{exc}"
    chosen = broadcast_text(chosen)
    if chosen.startswith("!"):
        raise CheckpointNotFound(chosen[1:])
    return _step_of(chosen, ckpt.storage_options) if chosen else None


def _step_of(url: str, storage_options: dict[str, Any]) -> tuple[Store, int]:
    _, step_store, step = resolve_checkpoint(url, storage_options)
    return step_store, step


def load_resume(policy: RecoveringPolicy, src: tuple[Store, int]) -> tuple[Store, int]:
    """Load ``src``; when its data fails verification (an ``IntegrityError`` every rank
    raises alike, see ``RecoveringPolicy._read``) mark the step corrupt
    (:func:`~shardsmith.storage.lineage.mark_corrupt`, so ``ls`` shows it and ``auto`` skips
    it), report a ``corrupt_step`` event, and with ``--resume auto`` (or after a restart) load
    the newest older committed step of the same run instead. Collective.

    Returns:
        The step loaded.

    Raises:
        IntegrityError: an explicit ``--resume`` step is corrupt, or no older step is left;
            the message names the command that goes on from the older step.
    """
    step_store, step = src
    fallback = policy.cfg.checkpoint.resume == "auto" or policy.restarts > 0
    while True:
        try:
            policy.load_step(step_store, step, reason="resume")
            return step_store, step
        except IntegrityError as exc:
            older = older_step(policy, step_store, step)
            if policy.rank == 0:
                try:
                    mark_corrupt(step_store, step=step, error=str(exc), found_by="resume")
                except OSError as mark_exc:  # read-only storage: the event still says it
                    log.warning("cannot mark %s corrupt: %s", step_store.url, mark_exc)
            go_on = older is not None and fallback
            policy.event(
                {
                    "event": "corrupt_step",
                    "step": step,
                    "url": step_store.url,
                    "error": str(exc),
                    "fallback_step": older[1] if go_on and older is not None else None,
                }
            )
            if not go_on:
                raise IntegrityError(way_forward(str(exc), step_store.url, older)) from None
            assert older is not None
            step_store, step = older


def older_step(policy: RecoveringPolicy, step_store: Store, step: int) -> tuple[Store, int] | None:
    """The newest committed step older than ``step`` of the same run, not marked corrupt (rank 0
    looks, every rank gets its answer). Collective."""
    found = ""
    if policy.rank == 0:
        root = Store(split_step_url(step_store.url)[0], policy.cfg.checkpoint.storage_options)
        run = committed_runs(root, [step]).get(step)
        steps = loadable_steps(root, {run} if run is not None else None, below=step)
        found = root.url_of(step_dir(steps[0])) if steps else ""
    found = broadcast_text(found)
    return _step_of(found, policy.cfg.checkpoint.storage_options) if found else None


def rollback_step(policy: RecoveringPolicy) -> int | None:
    """The step a rollback loads: the newest committed step of this run's lineage not marked
    corrupt (rank 0 looks, every rank gets its answer). Collective."""
    found = ""
    if policy.rank == 0 and policy.root is not None:
        steps = loadable_steps(policy.root, policy.run.lineage())
        found = str(steps[0]) if steps else ""
    found = broadcast_text(found)
    return int(found) if found else None
