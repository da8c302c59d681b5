"""A shrink: a node lost and not replaced, the job continuing on fewer ranks (issue 41).

Unit tests first (no processes): the layout rule (tp, pp, cp stay; dp_shard gives way before
dp_replicate; a shrink no layout allows is refused with the reason), the agreement on the step
and its servers, which saved box each new rank reads from which copy, the transfer's batches,
and private simulated node tiers.

Then ``shardsmith train --restart in-process`` on gloo (tiny model, the local tier
every step with buddy copies, the persistent tier every 5 steps, 10 steps; node lost as step 6
starts), each against a run resumed from the persistent copy of step 5 in the new layout
(``--resume URL``, 2 processes): losses within 1e-5 and the step-10 checkpoint bitwise equal.

* tp2·dp_shard2 on 2 simulated nodes -> tp2: the survivors share node 0, which holds every
  copy (own and buddy): nothing crosses the network.
* dp_shard4 on 4 simulated nodes (one rank each) -> dp_shard2: rank 1's node is lost; its
  copy lies on node 2 (its buddy) and node 3's on node 0, so each survivor receives boxes
  from the other over the process group.
* dp_shard4 on 4 simulated nodes, node 2 lost: the 3 survivors shrink to dp_shard2 on nodes 0
  and 1, and rank 2's only copy (its buddy copy on node 3) is served by the survivor the new
  layout leaves out, over the shrink's exchange group.
* dp_shard4 with ``--spares 1`` (never refilled): node 1 lost as step 3 starts is replaced by
  the spare; node 2 lost as step 6 starts finds no spare left, so the job shrinks.
* dp_shard4 on 4 simulated nodes, nodes 1 and 2 lost: rank 1 and its buddy are gone, so the
  job loads the persistent step, saying why in one line.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, TINY_TRAIN_FLAGS, assert_tensors_bitwise_equal, read_full_tensors
from train_runs import Run

from shardsmith.errors import IntegrityError, LayoutError
from shardsmith.layout import Box, ParallelDims, checkpoint_specs, rank_boxes, shrink_layout
from shardsmith.storage.commit import step_dir
from shardsmith.storage.formats.tensor_files import TORCH_DTYPES
from shardsmith.trainer.checkpoint import local_tier, peer_transfer
from shardsmith.trainer.checkpoint.config import CheckpointConfig
from shardsmith.trainer.checkpoint.local_tier import SIMULATED_NODE_ENV, Lineage, LocalTier
from shardsmith.trainer.checkpoint.peer_copy import pack_files, unpack_files
from shardsmith.trainer.checkpoint.peer_reshard import (
    SourcePlan,
    batches,
    held_copies,
    inventory,
    plan_shrink,
)
from shardsmith.trainer.checkpoint.peer_transfer import transfer_of
from shardsmith.trainer.checkpoint.recovery import build_manifest
from shardsmith.trainer.checkpoint.save_load import load_into
from shardsmith.trainer.config import TrainConfig

STEPS = 10
LOST_AT = 6


# ---- unit tests ------------------------------------------------------------------------------


def _shrink(dims: ParallelDims, ranks: int, global_batch: int = 8, micro: int = 2) -> ParallelDims:
    return shrink_layout(
        dims, TINY_MODEL, ranks, global_batch_size=global_batch, micro_batch_size=micro
    )


def test_shrink_layout_keeps_tp_and_shrinks_dp_shard_before_dp_replicate() -> None:
    assert _shrink(ParallelDims(tp=2, dp_shard=2), 2) == ParallelDims(tp=2)
    assert _shrink(ParallelDims(tp=2, dp_shard=2), 3) == ParallelDims(
        tp=2
    )  # 3 is no multiple of tp
    assert _shrink(ParallelDims(dp_shard=4), 2) == ParallelDims(dp_shard=2)
    assert _shrink(ParallelDims(dp_shard=4), 3) == ParallelDims(
        dp_shard=2
    )  # 8 samples, 2 per microbatch
    assert _shrink(ParallelDims(dp_shard=4), 3, global_batch=6) == ParallelDims(dp_shard=3)
    assert _shrink(ParallelDims(dp_replicate=2, dp_shard=2), 3) == ParallelDims(
        dp_replicate=2
    )  # replicas kept
    assert _shrink(ParallelDims(dp_shard=4), 4) == ParallelDims(dp_shard=4)  # nothing to shrink


def test_shrink_layout_refuses_what_no_layout_allows_naming_why() -> None:
    with pytest.raises(
        LayoutError, match=r"needs tp\*pp\*cp = 4 ranks for one copy of the model; 3 survive"
    ):
        _shrink(ParallelDims(tp=2, pp=2, dp_shard=2), 3)
    with pytest.raises(LayoutError, match=r"needs tp\*pp\*cp = 2 ranks .* 1 survive"):
        _shrink(ParallelDims(tp=2, dp_shard=2), 1)


LAYOUT = ParallelDims(tp=2, dp_shard=2).to_json()


def _offer(*ranks: int, layout: dict = LAYOUT, world: int = 4) -> dict:
    return {"world": world, "layout": layout, "ranks": list(ranks)}


def test_shrink_plan_takes_the_newest_step_every_saved_rank_survives() -> None:
    # 4 nodes of one rank, node 1 lost: new rank 0 (old 0) holds its own copy and node 3's
    # (buddy), new rank 1 (old 2) its own and node 1's
    infos = [{"6": _offer(0, 3), "5": _offer(0, 3)}, {"6": _offer(1, 2), "5": _offer(1, 2)}]
    plan = plan_shrink(infos, newest_persistent=5)
    assert (plan.step, plan.servers, plan.holders, plan.why) == (
        6,
        [0, 1, 1, 0],
        [[0], [1], [1], [0]],
        "",
    )
    # both hold everything (one node's disk): serving is spread
    assert plan_shrink([{"6": _offer(0, 1, 2, 3)}] * 2, 5).servers == [0, 1, 0, 1]
    # rank 1's copy of step 6 is lost with its buddy's: step 5, and the line says why
    lost = [{"6": _offer(0, 3), "5": _offer(0, 3)}, {"6": _offer(2), "5": _offer(1, 2)}]
    plan = plan_shrink(lost, 5)
    assert plan.step == 5 and plan.why == (
        "step 6: no surviving copy of rank(s) 1 of its 4 (each one's own copy "
        "and its buddy's were lost together)"
    )
    assert plan_shrink(lost, 6).step is None  # the persistent tier is newer than step 5
    assert plan_shrink([{}, {}], -1).step is None
    mixed = [{"6": _offer(0, 1)}, {"6": _offer(2, 3, layout=ParallelDims(dp_shard=4).to_json())}]
    assert "disagree on its layout" in plan_shrink(mixed, -1).why


def test_shrink_sources_read_each_saved_box_once_own_copies_first() -> None:
    infos = [{"6": _offer(0, 3)}, {"6": _offer(1, 2)}]
    plan = plan_shrink(infos, 5)
    sources = SourcePlan(TINY_MODEL, plan, ParallelDims(tp=2))
    wq, norm = "layers.0.attention.wq.weight", "layers.0.attention_norm.weight"
    rank0 = sources.sources(0)
    # tp0's rows of wq: the two dp_shard halves saved by ranks 0 and 2 (tp0); the norm (replicated
    # over tp, halved over dp_shard) from the copies rank 0 holds: 0 and 3
    assert sorted(s for s, reads in rank0.items() if any(f == wq for f, _, _ in reads)) == [0, 2]
    assert sorted(s for s, reads in rank0.items() if any(f == norm for f, _, _ in reads)) == [0, 3]
    move = transfer_of(sources, 0, 2)
    assert sorted(move.own) == [0, 3] and sorted(move.recvs) == [1] and sorted(move.recvs[1]) == [2]
    assert sorted(move.sends) == [1] and sorted(move.sends[1]) == [
        3
    ]  # rank 1 (tp1) needs rank 3's boxes
    # every element of every box of rank 0 is read from exactly one saved box
    total: dict[str, int] = {}
    for reads in rank0.values():
        for fqn, saved, box in reads:
            common = saved.intersect(box) if box.lengths else saved
            total[fqn] = total.get(fqn, 0) + common.numel
    want = {
        f: b.numel for f, b in rank_boxes(sources.specs, ParallelDims(tp=2), 0).items() if b.numel
    }
    assert total == want


def test_shrink_transfer_batches_cut_ranges_alike_on_both_sides() -> None:
    ranges = [(0, (0, 10)), (0, (20, 25)), (3, (0, 30))]
    assert batches(ranges, limit=16) == [
        [(0, 0, 10), (0, 20, 25), (3, 0, 1)],
        [(3, 1, 17)],
        [(3, 17, 30)],
    ]
    assert batches([], limit=16) == []


def test_shrink_simulated_node_tiers_are_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = TrainConfig(
        model=TINY_MODEL,
        parallel=ParallelDims(dp_shard=4),
        checkpoint=CheckpointConfig(
            url=str(tmp_path / "ckpt"), local_ckpt=str(tmp_path / "local"), simulate_nodes=2
        ),
    )
    for node in range(2):
        (tmp_path / "local" / f"node-{node:05d}" / "replicas").mkdir(parents=True)
    tier = LocalTier(cfg, 3)
    assert [(s.root.rsplit("/", 2)[-2:], n) for s, n in tier.node_dirs()] == [
        (["local", "node-00001"], 1),
        (["node-00001", "replicas"], 1),
    ]
    monkeypatch.setenv(SIMULATED_NODE_ENV, "0")  # the process was on node 0 (in-process restart)
    tier = LocalTier(cfg, 3)
    assert tier.node == 0 and [n for _, n in tier.node_dirs()] == [0, 0]
    monkeypatch.delenv(SIMULATED_NODE_ENV)
    shared = TrainConfig(
        model=TINY_MODEL,
        parallel=ParallelDims(dp_shard=4),
        checkpoint=CheckpointConfig(url=str(tmp_path / "ckpt"), local_ckpt=str(tmp_path / "local")),
    )
    assert sorted(n for _, n in LocalTier(shared, 3).node_dirs()) == [
        0,
        0,
        1,
        1,
    ]  # one machine: all


class Mailbox:
    """Point-to-point exchanges and all-gathers between threads standing in for ranks (the
    transfer's own logic runs as is; only the process group is replaced). ``corrupt``: the
    first data range sent has its last byte flipped in transit."""

    def __init__(self, world: int, corrupt: bool = False) -> None:
        self.queues = {(a, b): queue.Queue() for a in range(world) for b in range(world)}
        self.barrier, self.slots = threading.Barrier(world), [None] * world
        self.local, self.corrupt = threading.local(), corrupt

    def exchange(self, sends: dict, recvs: list[int], group: object = None) -> dict:
        me = self.local.rank
        for dst, files in sends.items():
            files = unpack_files(pack_files(files), "test")
            data = [k for k in sorted(files) if "@" in k and not k.endswith("@header")]
            if self.corrupt and data:
                self.corrupt, raw = False, bytearray(files[data[0]])
                raw[-1] ^= 0x01
                files[data[0]] = bytes(raw)
            self.queues[(me, dst)].put(files)
        return {src: self.queues[(src, me)].get(timeout=60) for src in recvs}

    def gather(self, obj: object, group: object = None) -> list:
        self.slots[self.local.rank] = json.loads(json.dumps(obj))
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


def _tier(tmp_path: Path, dims: ParallelDims, nodes: int, rank: int) -> LocalTier:
    ckpt = CheckpointConfig(
        url=str(tmp_path / "ckpt"),
        local_ckpt=str(tmp_path / "local"),
        local_replicas=1,
        simulate_nodes=nodes,
    )
    return LocalTier(TrainConfig(model=TINY_MODEL, parallel=dims, checkpoint=ckpt), rank)


def _full_tensors(dims: ParallelDims) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(41)
    specs = checkpoint_specs(TINY_MODEL, dims, with_optimizer=True)
    return {
        f: torch.randn(s.shape, generator=gen).to(TORCH_DTYPES[s.dtype]) for f, s in specs.items()
    }


def _part(full: torch.Tensor, box: Box) -> torch.Tensor:
    return full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))].clone()


def _save_copies(tmp_path: Path, full: dict[str, torch.Tensor], dims: ParallelDims) -> None:
    """Step 5 of every rank of ``dims`` (one simulated node each) with its buddy copy."""
    specs = checkpoint_specs(TINY_MODEL, dims, with_optimizer=True)
    for rank in range(dims.world_size):
        tier = _tier(tmp_path, dims, dims.world_size, rank)
        local = {f: _part(full[f], b) for f, b in rank_boxes(specs, dims, rank).items()}
        doc = tier.rank_doc(5, state={"step": 5, "run": {"id": "r" * 32}}, config={})
        files = tier.write(tier.plan(5, local), doc)
        buddy = _tier(tmp_path, dims, dims.world_size, tier.buddy)
        buddy.store_copy(buddy.replica_root, rank, 5, files)


def _rebuild_on_threads(
    tmp_path: Path,
    new: ParallelDims,
    nodes: list[int],
    box: Mailbox,
    monkeypatch: pytest.MonkeyPatch,
) -> list:
    """Every new rank (on simulated node ``nodes[r]``) agrees and rebuilds step 5, each on a thread."""
    tiers = []
    for rank, node in enumerate(nodes):  # ranks past new.world_size: survivors left out
        monkeypatch.setenv(SIMULATED_NODE_ENV, str(node))
        tiers.append(_tier(tmp_path, new, new.world_size, min(rank, new.world_size - 1)))
    held = [held_copies(t, Lineage(run="r" * 32)) for t in tiers]
    plan = plan_shrink([inventory(h) for h in held], -1)
    assert plan.step == 5, plan
    monkeypatch.setattr(peer_transfer, "exchange_files", box.exchange)
    monkeypatch.setattr(peer_transfer, "gather_json", box.gather)
    out: list = [None] * len(nodes)

    def run(rank: int) -> None:
        box.local.rank = rank
        try:
            if rank >= new.world_size:
                out[rank] = peer_transfer.serve(
                    tiers[rank], plan, held[rank][5], TINY_MODEL, new, rank, None, 700
                )
            else:
                out[rank] = peer_transfer.rebuild(
                    tiers[rank], plan, held[rank][5], TINY_MODEL, new, rank, batch_nbytes=700
                )
        except BaseException as exc:  # noqa: BLE001 — raised below, on the test's thread
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return [(tiers[r], out[r]) for r in range(len(nodes))]


@pytest.mark.parametrize(
    "saved, new, nodes",
    [
        (ParallelDims(dp_shard=4), ParallelDims(dp_shard=2), [0, 2]),
        (ParallelDims(tp=2, dp_shard=2), ParallelDims(tp=2), [0, 2]),
        (ParallelDims(tp=2, dp_shard=2), ParallelDims(dp_shard=2), [0, 2]),  # partial rows
    ],
)
def test_shrink_transfer_rebuilds_every_box_bitwise_from_the_survivors(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    saved: ParallelDims,
    new: ParallelDims,
    nodes: list[int],
) -> None:
    """Node 1 is lost; the survivors on ``nodes`` rebuild step 5 in ``new`` from their tiers and
    each other (small chunks and batches: partial ranges, several rounds); every box loads
    bitwise equal to the saved tensors, and the RNG entry is every saved rank's."""
    monkeypatch.setattr(local_tier, "DEFAULT_CHUNK_NBYTES", 256)
    full = _full_tensors(saved)
    _save_copies(tmp_path, full, saved)
    shutil.rmtree(tmp_path / "local" / "node-00001")
    specs = checkpoint_specs(TINY_MODEL, new, with_optimizer=True)
    rebuilt = _rebuild_on_threads(tmp_path, new, nodes, Mailbox(len(nodes)), monkeypatch)
    assert all(r.nbytes_received > 0 for _, r in rebuilt)
    for rank, (tier, r) in enumerate(rebuilt):
        assert len(r.rng["roles"]) >= 1 and r.rng["layout"] == saved.to_json()
        boxes = {f: b for f, b in rank_boxes(specs, new, rank).items()}
        got = {f: torch.zeros(b.lengths, dtype=full[f].dtype) for f, b in boxes.items()}
        manifest = build_manifest(r.copies, rng=r.rng)
        load_into(tier.top, manifest, got, boxes, {f: s.shape for f, s in specs.items()})
        for fqn, b in boxes.items():
            assert torch.equal(got[fqn], _part(full[fqn], b)), (rank, fqn)


def test_shrink_transfer_takes_the_only_copy_of_a_rank_from_a_survivor_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 2 is lost; dp_shard2 runs on nodes 0 and 1 while node 3's survivor (rank 2 of the
    exchange) holds the only copy of saved rank 2 (its buddy copy): it serves it, receives
    nothing, and the members load every box bitwise equal."""
    monkeypatch.setattr(local_tier, "DEFAULT_CHUNK_NBYTES", 256)
    saved, new = ParallelDims(dp_shard=4), ParallelDims(dp_shard=2)
    full = _full_tensors(saved)
    _save_copies(tmp_path, full, saved)
    shutil.rmtree(tmp_path / "local" / "node-00002")
    box = Mailbox(3)
    rebuilt = _rebuild_on_threads(tmp_path, new, [0, 1, 3], box, monkeypatch)
    (_, sent) = rebuilt[2]
    members = rebuilt[:2]
    assert sent > 0 and all(r.nbytes_from_leavers == sent for _, r in members), (sent, members)
    specs = checkpoint_specs(TINY_MODEL, new, with_optimizer=True)
    for rank, (tier, r) in enumerate(members):
        boxes = rank_boxes(specs, new, rank)
        got = {f: torch.zeros(b.lengths, dtype=full[f].dtype) for f, b in boxes.items()}
        manifest = build_manifest(r.copies, rng=r.rng)
        load_into(tier.top, manifest, got, boxes, {f: s.shape for f, s in specs.items()})
        for fqn, b in boxes.items():
            assert torch.equal(got[fqn], _part(full[fqn], b)), (rank, fqn)
    without = plan_shrink(  # the members alone: rank 2's copy survives nowhere
        [inventory(held_copies(t, Lineage(run="r" * 32))) for t, _ in members], -1
    )
    assert without.step is None and "no surviving copy of rank(s) 2" in without.why


def test_shrink_transfer_verifies_checksums_on_the_receiving_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_tier, "DEFAULT_CHUNK_NBYTES", 256)
    saved, new = ParallelDims(dp_shard=4), ParallelDims(dp_shard=2)
    full = _full_tensors(saved)
    _save_copies(tmp_path, full, saved)
    shutil.rmtree(tmp_path / "local" / "node-00001")
    rebuilt = _rebuild_on_threads(tmp_path, new, [0, 2], Mailbox(2, corrupt=True), monkeypatch)
    specs = checkpoint_specs(TINY_MODEL, new, with_optimizer=True)
    failed = []
    for rank, (tier, r) in enumerate(rebuilt):
        boxes = rank_boxes(specs, new, rank)
        got = {f: torch.zeros(b.lengths, dtype=full[f].dtype) for f, b in boxes.items()}
        try:
            load_into(
                tier.top,
                build_manifest(r.copies, rng=r.rng),
                got,
                boxes,
                {f: s.shape for f, s in specs.items()},
            )
        except IntegrityError as exc:
            failed.append((rank, str(exc)))
    assert len(failed) == 1 and "peers-0000" in failed[0][1], failed


# ---- distributed runs ------------------------------------------------------------------------


def _launch(
    root: Path, data_path: str, nproc: int, *flags: str, env: dict[str, str] | None = None
) -> Run:
    cmd = [
        sys.executable,
        "-m",
        "shardsmith",
        "train",
        "--nproc-per-node",
        str(nproc),
        *TINY_TRAIN_FLAGS,
        "--data",
        data_path,
        "--steps",
        str(STEPS),
        "--ckpt",
        str(root),
        "--save-interval",
        "5",
        *flags,
    ]
    proc = subprocess.run(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})},
    )
    (root.parent / f"{root.name}.log").write_text(proc.stdout)
    metrics = root / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return Run(
        proc.returncode, proc.stdout, root, [json.loads(line) for line in lines if line.strip()]
    )


def shrink(
    root: Path,
    data_path: str,
    tp: int,
    nodes: int,
    lost: list[int],
    spares: int = 0,
    earlier: str = "",
) -> Run:
    """4 processes in-process with ``spares`` warm spares (never refilled); the ranks ``lost``
    lose their node as step 6 starts, after the losses ``earlier`` ("RANK:STEP,...")."""
    losses = ",".join(f"{r}:{LOST_AT}" for r in lost)
    env = {
        "SHARDSMITH_TEST_LOSE_NODE_AT": f"{earlier},{losses}" if earlier else losses,
        "SHARDSMITH_TEST_MARKER_DIR": str(root.parent / f"{root.name}-markers"),
        "SHARDSMITH_SPARES_REFILL_S": "3600",
    }
    return _launch(
        root,
        data_path,
        4,
        "--tp",
        str(tp),
        "--local-ckpt",
        f"{root}-local",
        "--local-replicas",
        "1",
        "--simulate-nodes",
        str(nodes),
        "--restart",
        "in-process",
        "--spares",
        str(spares),
        "--max-restarts",
        str(1 + len(earlier.split(",")) if earlier else 1),
        env=env,
    )


def resumed(root: Path, data_path: str, source: Run, tp: int) -> Run:
    """2 processes resuming ``source``'s persistent step 5 (the reference of a shrink)."""
    return _launch(
        root, data_path, 2, "--tp", str(tp), "--resume", str(source.root / step_dir(LOST_AT - 1))
    )


def _assert_continues_like(run: Run, ref: Run, where: str) -> None:
    want = ref.losses()
    assert set(range(LOST_AT, STEPS + 1)) <= set(want), where
    for step in range(LOST_AT, STEPS + 1):
        assert abs(run.losses()[step] - want[step]) <= 1e-5, (
            where,
            step,
            run.losses()[step],
            want[step],
        )
    assert_tensors_bitwise_equal(
        read_full_tensors(str(run.root / step_dir(STEPS))),
        read_full_tensors(str(ref.root / step_dir(STEPS))),
        where,
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shrink")


@pytest.fixture(scope="module")
def dp4(work: Path, data_path: str) -> Run:
    return shrink(work / "dp4", data_path, 1, 4, [1]).check()


@pytest.fixture(scope="module")
def dp4_ref(work: Path, data_path: str, dp4: Run) -> Run:
    """dp_shard2 resumed from the persistent step 5 of dp_shard4 (every dp_shard4 run here
    trains steps 1-5 alike)."""
    return resumed(work / "dp4-ref", data_path, dp4, 1).check()


def _assert_no_persistent_read_after_the_loss(run: Run) -> None:
    """Every resume after a restart read the local tier: 0 bytes from the persistent store."""
    resumes = [e for e in run.events("resume") if e["restart_count"] > 0]
    assert resumes and all("-local" in e["from"] for e in resumes), resumes
    assert "no surviving copy" not in run.output, run.output[-4000:]


@pytest.mark.distributed
def test_shrink_tp2_dp_shard2_to_tp2_on_the_survivors_of_a_node(work: Path, data_path: str) -> None:
    run = shrink(work / "tp2", data_path, 2, 2, [2, 3]).check()
    assert (
        "no spare left: shrinking pp1·dpr1·dps2·tp2 (4 ranks) -> pp1·dpr1·dps1·tp2 (2 ranks)"
        in run.output
    ), run.output[-4000:]
    assert run.recovered() == [(LOST_AT - 1, "local")] and "(resharded)" in run.output, run.output[
        -4000:
    ]
    [resume] = [e for e in run.events("resume") if e["restart_count"] > 0]
    assert (
        resume["resharded"]
        and resume["saved_layout"]["world_size"] == 4
        and "-local" in resume["from"]
    )
    [peers] = run.events("peer_reshard")
    assert peers["nbytes_received"] == 0  # both survivors read node 0's disk: own and buddy copies
    _assert_continues_like(
        run, resumed(work / "tp2-ref", data_path, run, 2).check(), "tp2·dp_shard2 -> tp2"
    )


@pytest.mark.distributed
def test_shrink_dp_shard4_to_dp_shard2_receives_the_lost_nodes_boxes_from_peers(
    work: Path, data_path: str, dp4: Run, dp4_ref: Run
) -> None:
    run = dp4
    assert "-> pp1·dpr1·dps2·tp1 (2 ranks)" in run.output, run.output[-4000:]
    assert run.recovered() == [(LOST_AT - 1, "local")], run.output[-4000:]
    [peers] = run.events("peer_reshard")
    assert peers["nbytes_received"] > 0 and peers["ranks_receiving"] == 2, peers
    [resume] = [e for e in run.events("resume") if e["restart_count"] > 0]
    assert "-local" in resume["from"] and resume["saved_layout"]["dp_shard"] == 4
    _assert_continues_like(run, dp4_ref, "dp_shard4 -> dp_shard2")


@pytest.mark.distributed
def test_shrink_reads_the_only_copy_of_a_rank_from_a_survivor_the_new_layout_drops(
    work: Path, data_path: str, dp4_ref: Run
) -> None:
    """Node 2 lost: rank 2's only surviving copy is the buddy copy on node 3, whose rank the
    new layout (dp_shard2 on nodes 0 and 1) leaves out; it serves that copy over the
    exchange, then leaves, and nothing is read from the persistent store."""
    run = shrink(work / "dp4-leaver", data_path, 1, 4, [2]).check()
    assert (
        "-> pp1·dpr1·dps2·tp1 (2 ranks)" in run.output
        and "1 survivor(s) outside it serve their copies, then wait as spares" in run.output
    ), run.output[-4000:]
    served = [line for line in run.output.splitlines() if "survivor outside the layout" in line]
    assert len(served) == 1 and "of step 5 (the copies of saved rank(s) [2])" in served[0], (
        run.output[-4000:]
    )
    assert run.recovered() == [(LOST_AT - 1, "local")], run.output[-4000:]
    _assert_no_persistent_read_after_the_loss(run)
    [peers] = run.events("peer_reshard")
    assert peers["leavers_serving"] == 1 and peers["nbytes_from_leavers"] > 0, peers
    assert "1 survivor(s) outside the new layout served" in run.output
    _assert_continues_like(run, dp4_ref, "dp_shard4 -> dp_shard2, a copy from outside it")


@pytest.mark.distributed
def test_shrink_when_the_spares_run_out_after_a_replacement(
    work: Path, data_path: str, dp4_ref: Run
) -> None:
    """1 warm spare, never refilled: node 1 lost as step 3 starts (the spare takes its
    slot, dp_shard4 goes on), then node 2 as step 6 starts (no spare left: the survivors
    shrink to dp_shard2, and the survivor left out serves its copies)."""
    run = shrink(work / "dp4-spare", data_path, 1, 4, [2], spares=1, earlier="1:3").check()
    restarts = [line for line in run.output.splitlines() if line.startswith("restart ")]
    assert len(restarts) == 2, run.output[-4000:]  # one line per restart, the supervisor's
    assert restarts[0] == (
        "restart 1 of 2: rank 1 died (SIGKILL); replaced by a warm spare, the other 3 ranks "
        "restart in place"
    ), restarts
    assert restarts[1].startswith(
        "restart 2 of 2: rank 2 died (SIGKILL); no spare left: shrinking pp1·dpr1·dps4·tp1 "
        "(4 ranks) -> pp1·dpr1·dps2·tp1 (2 ranks)"
    ), restarts
    starts = [(e["restart_count"], e["world_size"]) for e in run.events("start")]
    assert starts == [(0, 4), (1, 4), (2, 2)], starts
    assert [s for s, _ in run.recovered()] == [2, LOST_AT - 1], run.output[-4000:]
    _assert_no_persistent_read_after_the_loss(run)
    _assert_continues_like(run, dp4_ref, "dp_shard4, a spare, then dp_shard2")


@pytest.mark.distributed
def test_shrink_with_a_rank_and_its_buddy_lost_loads_the_persistent_step_saying_why(
    work: Path, data_path: str, dp4: Run
) -> None:
    run = shrink(work / "dp4-buddy", data_path, 1, 4, [1, 2]).check()
    why = [line for line in run.output.splitlines() if "no surviving copy of rank(s)" in line]
    assert len(why) == 1 and "step 5: no surviving copy of rank(s) 1 of its 4" in why[0], (
        run.output[-4000:]
    )
    assert "loading step 5 from the persistent tier" in why[0]
    assert run.recovered() == [(LOST_AT - 1, "persistent")], run.output[-4000:]
    _assert_continues_like(run, dp4, "dp_shard4 -> dp_shard2 from the persistent tier")
