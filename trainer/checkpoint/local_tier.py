"""The node-local checkpoint tier: every rank writes its own state to node-local disk (or
``/dev/shm``) every ``local_save_interval`` steps, and optionally a copy to a buddy rank on
another node, with no collective per save (Gemini, SOSP'23; nvidia-resiliency-ext's local
checkpoints). Recovery (:mod:`shardsmith.trainer.checkpoint.recovery`) prefers it to the persistent tier.

On-disk layout (``--local-ckpt DIR``; one ``node-NNNNN`` per node, node = ``rank // ranks per
node``, so simulated nodes on one machine get separate directories)::

    DIR/node-00001/step-000000012/shards/rank-00003.safetensors   every box rank 3 holds
                                  shards/rank-00003.safetensors.crc32c   chunk CRCs (sidecar)
                                  rank-00003.json      the rank manifest, written LAST: its
                                                       presence is rank 3's commit of step 12
    DIR/node-00001/replicas/step-000000012/...        the same three files of the rank one
                                                       node before (this node holds its copy)

The data files are the persistent tier's (safetensors + CRC sidecar, written by the same
:class:`~shardsmith.storage.formats.registry.SafetensorsFormat`), but a rank writes *every* box it
holds (replicas included), so it can reload from its own files alone. The rank manifest
(``format: shardsmith-local-rank``) is per rank, not per step: it holds the rank's shard
records, the layout, model, config, non-tensor state, this rank's RNG state, the run id and
the torchrun launch id. A step is complete in the local tier when every rank has a committed
copy (own or buddy's): recovery finds that out with one small all-gather, so a save never
waits for another rank. Retention per rank: the two newest committed steps below the one being
written (a rank learns that a step is complete on every rank only one save later) plus that
one; everything else of that rank is deleted before the write starts.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import torch

from shardsmith.errors import ConfigError, ManifestError
from shardsmith.layout import (
    Box,
    ModelConfig,
    ParallelDims,
    TensorSpec,
    checkpoint_specs,
    rank_boxes,
    shard_file_name,
)
from shardsmith.storage import DEFAULT_CHUNK_NBYTES, crash_point, crc32c, parse_step_dir, step_dir
from shardsmith.storage.formats import SafetensorsFormat
from shardsmith.storage.manifest import load_json, sidecar_name
from shardsmith.storage.store import Store
from shardsmith.trainer.checkpoint.save_load import WritePlan, unpadded
from shardsmith.trainer.rng import capture_rng, rng_role

if TYPE_CHECKING:
    from shardsmith.trainer.config import TrainConfig

log = logging.getLogger(__name__)

LOCAL_FORMAT = "shardsmith-local-rank"
LOCAL_VERSION = 1
REPLICAS_DIR = "replicas"
#: The simulated node a process stays on across in-process restarts (set by the worker from the
#: supervisor's assignment; read only with ``--simulate-nodes``): the node whose tier it reaches.
SIMULATED_NODE_ENV = "SHARDSMITH_SIMULATED_NODE"


def rank_manifest_name(rank: int) -> str:
    """``rank-00003.json``: the rank manifest (commit marker) of ``rank`` in a step directory."""
    return f"rank-{rank:05d}.json"


def ranks_per_node(world: int, simulate_nodes: int = 0) -> int:
    """Ranks per node: ``world / simulate_nodes`` when simulating, else torchrun's
    ``LOCAL_WORLD_SIZE`` (the whole world when unset or not a divisor).

    Raises:
        ConfigError: ``simulate_nodes`` does not divide ``world``.
    """
    if simulate_nodes:
        if world % simulate_nodes:
            raise ConfigError(
                f"--simulate-nodes {simulate_nodes} does not divide the world size {world}"
            )
        return world // simulate_nodes
    per = int(os.environ.get("LOCAL_WORLD_SIZE", "") or world)
    return per if 1 <= per <= world and world % per == 0 else world


def buddy_of(rank: int, world: int, per_node: int) -> int:
    """The rank one node over, which holds ``rank``'s replica: ``(rank + per_node) % world``."""
    return (rank + per_node) % world


@dataclass(frozen=True)
class Lineage:
    """Which local copies a job may load: written by run ``run`` or by launch ``launch``."""

    run: str = ""
    launch: str = ""

    def admits(self, doc: dict[str, Any]) -> bool:
        return bool(self.run and doc.get("run") == self.run) or bool(
            self.launch and doc.get("launch") == self.launch
        )

    def describe(self) -> str:
        return f"run {self.run[:12]}" if self.run else f"launch {self.launch}"


@dataclass
class RankCopy:
    """One committed, checked copy of one rank's state at one step.

    Attributes:
        store: the step directory holding the data files and the rank manifest.
        doc: the parsed rank manifest.
    """

    step: int
    rank: int
    store: Store
    doc: dict[str, Any] = field(repr=False)

    def same_layout(self, dims: ParallelDims) -> bool:
        """Saved with this layout (so this rank loads its own copy, no resharding)."""
        return self.doc["layout"] == dims.to_json() and self.doc["world_size"] == dims.world_size

    def file_names(self) -> list[str]:
        """Data file, sidecar and rank manifest, in the order a copy writes them."""
        name = self.doc["records"]["file"][0]
        return [name, sidecar_name(name), rank_manifest_name(self.rank)]


def parse_rank_doc(raw: bytes, where: str, rank: int, step: int) -> dict[str, Any]:
    """Parse and check a rank manifest (untrusted JSON: types, the rank and step it claims).

    Raises:
        ManifestError: naming ``where`` and the bad field.
    """
    doc = load_json(raw, where)
    if doc.get("format") != LOCAL_FORMAT or doc.get("version") != LOCAL_VERSION:
        raise ManifestError(f"{where}: not a version-{LOCAL_VERSION} {LOCAL_FORMAT} manifest")
    for key, kind in (
        ("step", int),
        ("rank", int),
        ("world_size", int),
        ("chunk_nbytes", int),
        ("run", str),
        ("launch", str),
        ("layout", dict),
        ("model", dict),
        ("config", dict),
        ("state", dict),
        ("rng", dict),
        ("records", dict),
    ):
        if not isinstance(doc.get(key), kind) or isinstance(doc.get(key), bool):
            raise ManifestError(f"{where}: field {key!r} is missing or not a {kind.__name__}")
    if (doc["rank"], doc["step"]) != (rank, step):
        raise ManifestError(
            f"{where}: says rank {doc['rank']} step {doc['step']}, its place says rank {rank} "
            f"step {step}"
        )
    rec = doc["records"]
    try:
        name, nbytes, crc = rec["file"]
        ok = name == shard_file_name(rank) and all(
            isinstance(v, int) for v in (nbytes, crc, *rec["sidecar"])
        )
        ok = ok and all(isinstance(v, int) for s in rec["shards"].values() for v in s[:3])
    except (KeyError, TypeError, ValueError, AttributeError):
        ok = False
    if not ok:
        raise ManifestError(f"{where}: records are malformed")
    return doc


def check_copy_files(copy: RankCopy, *, crc: bool) -> str:
    """Why ``copy``'s data files cannot be used ("" when they can): missing, wrong size, or
    (``crc``) a whole-file CRC-32C other than the rank manifest's."""
    rec = copy.doc["records"]
    name = rec["file"][0]
    for key, (nbytes, want) in ((name, rec["file"][1:]), (sidecar_name(name), rec["sidecar"])):
        try:
            size = copy.store.size(key)
        except FileNotFoundError:
            return f"partial: {key} is missing"
        if size != nbytes:
            return f"partial: {key} has {size} bytes, the rank manifest says {nbytes}"
        if crc:
            got = crc32c(copy.store.read(key))
            if got != want:
                return (
                    f"corrupt: CRC-32C of {key} is {got:#010x}, the rank manifest says {want:#010x}"
                )
    return ""


class LocalTier:
    """One rank's view of the local tier (see the module docstring). Construct on every rank.

    Args:
        cfg: the run's config (``checkpoint.local_*``, ``parallel``, ``model``).
        rank: this rank.

    Attributes:
        top: the ``--local-ckpt`` directory; root: this node's ``node-NNNNN`` under it;
        replica_root: where this node keeps its buddies' copies.
        buddy: the rank holding this rank's replica; source: the rank whose replica this
        rank holds (None without replicas).
    """

    def __init__(self, cfg: TrainConfig, rank: int) -> None:
        ckpt, dims = cfg.checkpoint, cfg.parallel
        self.model_cfg, self.dims, self.rank, self.interval = (
            cfg.model,
            dims,
            rank,
            ckpt.local_save_interval,
        )
        self.per_node = ranks_per_node(dims.world_size, ckpt.simulate_nodes)
        self.num_nodes = dims.world_size // self.per_node
        self.simulated = bool(ckpt.simulate_nodes)
        sticky = os.environ.get(SIMULATED_NODE_ENV, "") if self.simulated else ""
        self.node = int(sticky) if sticky.isdigit() else rank // self.per_node
        path = (
            ckpt.local_ckpt[len("file://") :]
            if ckpt.local_ckpt.startswith("file://")
            else ckpt.local_ckpt
        )
        self.path = os.path.abspath(path)
        self.top = Store(self.path)
        self.root = self.top.child(f"node-{self.node:05d}")
        self.replica_root = self.root.child(REPLICAS_DIR)
        self.replicas = bool(ckpt.local_replicas) and self.num_nodes > 1
        if ckpt.local_replicas and not self.replicas and rank == 0:
            log.warning(
                "--local-replicas 1 with a single node (%d ranks per node): no buddy node to copy to; "
                "use --simulate-nodes K to test on one machine",
                self.per_node,
            )
        self.buddy = buddy_of(rank, dims.world_size, self.per_node) if self.replicas else None
        self.source = (rank - self.per_node) % dims.world_size if self.replicas else None
        self._plans: dict[bool, tuple[dict[str, TensorSpec], dict[str, Box]]] = {}

    def due(self, step: int) -> bool:
        """True when the local tier is written after ``step``."""
        return step % self.interval == 0

    # ---- saving (the snapshot on the training thread, the rest in the save thread) -----------

    def plan(self, step: int, tensors: dict[str, torch.Tensor]) -> WritePlan:
        """Every (fqn, local tensor, box) this rank holds (empty boxes left out): what it writes."""
        with_optim = any(k.startswith("optim.") for k in tensors)
        if with_optim not in self._plans:  # pure in (model, layout, rank): once per run
            specs = checkpoint_specs(self.model_cfg, self.dims, with_optimizer=with_optim)
            self._plans[with_optim] = (specs, rank_boxes(specs, self.dims, self.rank))
        specs, boxes = self._plans[with_optim]
        entries = [
            (fqn, unpadded(tensors[fqn], box), box) for fqn, box in boxes.items() if box.numel
        ]
        return WritePlan(step, specs, entries)

    def rank_doc(
        self, step: int, *, state: dict[str, Any], config: dict[str, Any]
    ) -> dict[str, Any]:
        """The rank manifest without its records (call on the training thread at the save: it
        captures this rank's RNG state). ``state`` holds ``state["run"]`` (the run record)."""
        coords = self.dims.coords(self.rank)
        return {
            "format": LOCAL_FORMAT,
            "version": LOCAL_VERSION,
            "step": step,
            "rank": self.rank,
            "world_size": self.dims.world_size,
            "run": state["run"]["id"],
            "launch": os.environ.get("TORCHELASTIC_RUN_ID", ""),
            "layout": self.dims.to_json(),
            "model": self.model_cfg.to_json(),
            "config": config,
            "state": state,
            "rng": {"rank": self.rank, "role": rng_role(coords), "state": capture_rng()},
            "chunk_nbytes": DEFAULT_CHUNK_NBYTES,
            "records": {},
        }

    def write(self, plan: WritePlan, doc: dict[str, Any]) -> dict[str, bytes]:
        """Write this rank's files of ``plan.step`` (data, sidecar, then the rank manifest: the
        commit) after retention. Save thread. Returns the three files' bytes for the buddy
        (``{}`` without replicas)."""
        step_store = self.root.child(step_dir(plan.step))
        self.retain(self.root, self.rank, plan.step)
        crash_point("local.before_write", step=plan.step)  # test hooks (storage/crashpoints.py)
        records = SafetensorsFormat().write_rank(
            step_store, self.rank, plan.entries, plan.specs, self.dims, DEFAULT_CHUNK_NBYTES
        )
        raw = json.dumps({**doc, "records": records}).encode()
        crash_point("local.before_commit", step=plan.step)
        step_store.write(rank_manifest_name(self.rank), raw)
        if not self.replicas:
            return {}
        name = records["file"][0]  # read back from the page cache, for the buddy
        return {
            name: step_store.read(name),
            sidecar_name(name): step_store.read(sidecar_name(name)),
            rank_manifest_name(self.rank): raw,
        }

    def store_copy(self, root: Store, rank: int, step: int, files: dict[str, bytes]) -> Store:
        """Write a received copy of ``rank``'s files of ``step`` under ``root`` (data first,
        the rank manifest last), after retention. Returns the step directory."""
        self.retain(root, rank, step)
        step_store = root.child(step_dir(step))
        marker = rank_manifest_name(rank)
        for name in sorted(files, key=lambda n: n == marker):
            step_store.write(name, files[name])
        return step_store

    def retain(self, root: Store, rank: int, step: int) -> None:
        """Before writing ``rank``'s ``step`` under ``root``: keep its two newest committed
        steps below ``step``, delete the rest of its files (rank manifest first).

        The ranks of a node share step directories, and while this rank writes ``step`` another
        may be writing ``step`` or the step one interval before or after (each rank has one save
        in flight and the training collectives keep them within one step): those directories
        are never removed, even when empty, or that rank's write would lose its directory."""
        committed: list[int] = []
        others: list[int] = []
        for s in self._step_dirs(root):
            marker = f"{step_dir(s)}/{rank_manifest_name(rank)}"
            (committed if s < step and root.exists(marker) else others).append(s)
        for s in sorted(committed)[:-2] + others:
            self._delete(root, rank, s, remove_dir=abs(s - step) > self.interval)

    def forget_after(self, step: int) -> None:
        """Delete this rank's copies (own and held) of steps after ``step`` (a rollback went
        back to it: they belong to the abandoned trajectory)."""
        for root, rank in ((self.root, self.rank), (self.replica_root, self.source)):
            if rank is not None:
                for s in self._step_dirs(root):
                    if s > step:
                        self._delete(root, rank, s)

    def _step_dirs(self, root: Store) -> list[int]:
        try:
            names = root.list_dir()
        except FileNotFoundError:
            return []
        return [
            s
            for s in (parse_step_dir(n.rstrip("/").rsplit("/", 1)[-1]) for n in names)
            if s is not None
        ]

    def _delete(self, root: Store, rank: int, step: int, remove_dir: bool = True) -> None:
        name = step_dir(step)
        data = shard_file_name(rank)
        for key in (rank_manifest_name(rank), data, sidecar_name(data)):
            root.delete(f"{name}/{key}")
        for sub in (f"{name}/shards", name) if remove_dir else ():  # if empty; others' files stay
            try:
                os.rmdir(os.path.join(root.root, sub))  # a local store's root is its path
            except OSError:
                pass

    # ---- what a restart finds -----------------------------------------------------------------

    def scan(
        self, root: Store, rank: int, lineage: Lineage, *, crc: bool = True
    ) -> tuple[list[RankCopy], list[str]]:
        """Committed, intact copies of ``rank`` under ``root`` written by ``lineage`` (newest
        first), and one warning per copy skipped (path and reason: partial, corrupt, another run)."""
        found, skipped = [], []
        for s in sorted(self._step_dirs(root), reverse=True):
            copy, why = self.check(root.child(step_dir(s)), rank, s, lineage, crc)
            if copy is not None:
                found.append(copy)
            elif why:
                skipped.append(
                    f"local tier: skipping {root.url_of(step_dir(s))} (rank {rank}): {why}; "
                    "falling back to the next tier"
                )
        return found, skipped

    def check(
        self, store: Store, rank: int, step: int, lineage: Lineage, crc: bool
    ) -> tuple[RankCopy | None, str]:
        """``rank``'s copy of ``step`` in step directory ``store`` if it is committed, of
        ``lineage`` and intact (``crc``: whole-file CRC-32C too); else None and why ("" when
        the rank has nothing there)."""
        marker = rank_manifest_name(rank)
        try:
            raw = store.read(marker)
        except FileNotFoundError:
            partial = store.exists(shard_file_name(rank))
            return None, f"partial: no commit marker {marker}" if partial else ""
        try:
            doc = parse_rank_doc(raw, store.url_of(marker), rank, step)
        except ManifestError as exc:
            return None, f"corrupt: {exc}"
        if not lineage.admits(doc):
            return None, (
                f"from another run (run {doc['run'][:12]}, launch {doc['launch']}); this job "
                f"continues {lineage.describe()}"
            )
        copy = RankCopy(step, rank, store, doc)
        why = check_copy_files(copy, crc=crc)
        return (None, why) if why else (copy, "")

    def read_copy(self, copy: RankCopy) -> dict[str, bytes]:
        """The three files of ``copy`` (to send to the rank that lost its own)."""
        return {name: copy.store.read(name) for name in copy.file_names()}

    def node_dirs(self) -> Iterable[tuple[Store, int]]:
        """Every ``node-NNNNN`` directory (and its replicas) this process can reach, with the
        node number: on a cluster, its node's (node-local disks). With ``--simulate-nodes``
        only its own simulated node's (private node tiers, as on a cluster, although one
        machine could reach them all); else every one under ``--local-ckpt``."""
        if self.simulated:
            return [(self.root, self.node), (self.replica_root, self.node)]
        try:
            names = self.top.list_dir()
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            base = n.rstrip("/").rsplit("/", 1)[-1]
            if base.startswith("node-") and base[5:].isdigit():
                out.append((self.top.child(base), int(base[5:])))
                out.append((self.top.child(f"{base}/{REPLICAS_DIR}"), int(base[5:])))
        return out


def saved_dims(doc: dict[str, Any]) -> tuple[ModelConfig, ParallelDims]:
    """The model and layout a rank manifest was saved with."""
    return ModelConfig.from_json(doc["model"]), ParallelDims.from_json(doc["layout"])


def replicate(
    tier: LocalTier,
    step: int,
    files: dict[str, bytes],
    group: Any,
    *,
    send: bool = True,
    receive: bool = True,
) -> None:
    """Send this rank's files of ``step`` to its buddy and store the copy received from its
    source rank under ``replica_root`` (save thread; every rank of ``group`` calls it). After
    a recovery only the pairs whose copy is missing take part: ``send`` / ``receive`` False
    leave out either half (point-to-point, so the peer of a half left out leaves it out too)."""
    from shardsmith.trainer.checkpoint.peer_copy import exchange_files

    assert tier.buddy is not None and tier.source is not None
    got = exchange_files(
        {tier.buddy: files} if send else {}, [tier.source] if receive else [], group
    )
    if receive:
        tier.store_copy(tier.replica_root, tier.source, step, got[tier.source])
