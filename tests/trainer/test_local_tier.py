"""The node-local checkpoint tier, buddy replicas and recovery from the fastest complete tier.

Unit tests first (no processes): the agreement rule, what a scan accepts and skips (corrupt,
partial, another run), retention, the config checks. Then ``shardsmith train`` launches on
gloo (tiny model, tp=2, 4 processes as 2 simulated nodes, the local tier every step with a
buddy copy, the persistent tier every 5 steps, 8 steps):

* ``reference``: uninterrupted (conftest's ``tp2_reference``, shared with other modules: the
  local tier changes no loss and no weight).
* ``killed_then_node_lost``, one launch with ``--max-restarts 2``: rank 1 SIGKILLs itself as
  step 4 starts and resumes from the local tier (step 3, or 2 when step 3's write was cut
  off); then both ranks of node 1 lose their disk and die as step 7 starts and get step 6
  from their buddies' copies (the persistent tier has only 5). Losses and final model
  bitwise equal to the reference.
* ``shrunk``: the same loss without a restart, then 2 processes (a node not replaced):
  step 6 (5 when the survivors died before storing node 1's copies of 6) is resharded from the
  reachable local copies; losses within 1e-4 of the reference.
* ``chaos``: rank 1 dies before committing its local step 4, rank 2 before replicating
  step 6 (``--max-restarts 2``): each restart loads the newest step every rank committed.
* ``damaged``: a run to step 4, then rank 0's local file corrupted, rank 1's rank manifest
  removed and rank 2's marked as another run's: each is named in a warning and loaded from
  its buddy instead; the rest of the run is bitwise equal to the reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_MODEL, assert_tensors_bitwise_equal, read_full_tensors
from train_runs import RECOVERED, REFERENCE_STEPS, Run, train_tp2

from shardsmith.errors import ConfigError
from shardsmith.layout import ParallelDims
from shardsmith.layout.sharding import checkpoint_specs
from shardsmith.storage.commit import step_dir
from shardsmith.storage.formats.tensor_files import TORCH_DTYPES
from shardsmith.trainer.checkpoint.config import CheckpointConfig
from shardsmith.trainer.checkpoint.local_tier import Lineage, LocalTier, rank_manifest_name
from shardsmith.trainer.checkpoint.recovery import agree
from shardsmith.trainer.config import TrainConfig

RUN = "a" * 32


# ---- unit tests ------------------------------------------------------------------------------


def test_agree_takes_the_newest_step_every_rank_has_never_a_mixed_one() -> None:
    own = [{"own": [6, 5], "held": [6, 5]}, {"own": [5], "held": [6, 5]}]
    assert agree(own, per_node=1, replicas=False) == (5, ["local", "local"])
    # rank 1 lost its own copies; rank 0 holds its buddy copy (buddy of 1 = (1 + 1) % 2 = 0)
    lost = [{"own": [6, 5], "held": [6, 5]}, {"own": [], "held": [6]}]
    assert agree(lost, per_node=1, replicas=True) == (6, ["local", "buddy"])
    assert agree(lost, per_node=1, replicas=False) == (None, [])
    four = [
        {"own": [3], "held": [3]},
        {"own": [3], "held": [3]},
        {"own": [], "held": []},
        {"own": [], "held": []},
    ]
    assert agree(four, per_node=2, replicas=True) == (3, ["local", "local", "buddy", "buddy"])


def _tier(tmp_path: Path) -> LocalTier:
    cfg = TrainConfig(
        model=TINY_MODEL,
        parallel=ParallelDims(),
        checkpoint=CheckpointConfig(url=str(tmp_path / "ckpt"), local_ckpt=str(tmp_path / "local")),
    )
    return LocalTier(cfg, 0)


def _write(tier: LocalTier, step: int, run: str = RUN) -> None:
    specs = checkpoint_specs(tier.model_cfg, tier.dims, with_optimizer=True)
    gen = torch.Generator().manual_seed(step)
    tensors = {
        f: torch.randn(s.shape, generator=gen).to(TORCH_DTYPES[s.dtype]) for f, s in specs.items()
    }
    doc = tier.rank_doc(step, state={"step": step, "run": {"id": run}}, config={})
    tier.write(tier.plan(step, tensors), doc)


def test_scan_skips_corrupt_partial_and_foreign_copies_naming_each(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    for step in (1, 2, 3):
        _write(tier, step)
    found, skipped = tier.scan(tier.root, 0, Lineage(run=RUN))
    assert [c.step for c in found] == [3, 2, 1] and skipped == []
    step_path = tmp_path / "local" / "node-00000"
    data = step_path / step_dir(3) / "shards" / "rank-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF  # one flipped bit of tensor data
    data.write_bytes(bytes(raw))
    (step_path / step_dir(2) / rank_manifest_name(0)).unlink()  # the commit marker
    (step_path / step_dir(1) / "shards" / "rank-00000.safetensors.crc32c").unlink()
    found, skipped = tier.scan(tier.root, 0, Lineage(run=RUN))
    assert found == []
    assert [s.split(" (rank 0): ")[0].rsplit("/", 1)[-1] for s in skipped] == [
        step_dir(3),
        step_dir(2),
        step_dir(1),
    ]
    assert (
        "corrupt: CRC-32C of shards/rank-00000.safetensors" in skipped[0]
        and str(step_path) in skipped[0]
    )
    assert "partial: no commit marker rank-00000.json" in skipped[1]
    assert "partial: shards/rank-00000.safetensors.crc32c is missing" in skipped[2]
    _write(tier, 4, run="b" * 32)
    found, skipped = tier.scan(tier.root, 0, Lineage(run=RUN))
    assert found == [] and "from another run (run bbbbbbbbbbbb" in skipped[0]
    found, _ = tier.scan(tier.root, 0, Lineage(run="b" * 32))
    assert [c.step for c in found] == [4]


def test_retention_keeps_two_committed_steps_below_the_one_written(tmp_path: Path) -> None:
    tier = _tier(tmp_path)
    for step in (1, 2, 3, 4, 5):
        _write(tier, step)
    node = tmp_path / "local" / "node-00000"
    assert sorted(p.name for p in node.iterdir()) == [step_dir(3), step_dir(4), step_dir(5)]
    tier.forget_after(4)  # a rollback to step 4: step 5 is of the abandoned trajectory
    assert sorted(p.name for p in node.iterdir()) == [step_dir(3), step_dir(4)]
    _write(tier, 2)  # sent back (an older resume): newer ones go
    assert sorted(p.parent.name for p in node.glob("*/rank-*.json")) == [step_dir(2)]
    assert not list((node / step_dir(3)).rglob("*.*"))  # emptied; the directory next to the step
    assert not (node / step_dir(4)).exists()  # written stays (another rank may write it)


def test_two_ranks_copies_merge_into_one_manifest_that_reshards_bitwise(tmp_path: Path) -> None:
    """tp=2 copies (norms replicated in both files) read back whole by a 1-rank layout."""
    from shardsmith.layout.sharding import rank_boxes
    from shardsmith.trainer.checkpoint.peer_reshard import held_copies
    from shardsmith.trainer.checkpoint.recovery import build_manifest
    from shardsmith.trainer.checkpoint.save_load import load_into

    dims = ParallelDims(tp=2)
    ckpt = CheckpointConfig(url=str(tmp_path / "ckpt"), local_ckpt=str(tmp_path / "local"))
    specs = checkpoint_specs(TINY_MODEL, dims, with_optimizer=True)
    gen = torch.Generator().manual_seed(0)
    full = {
        f: torch.randn(s.shape, generator=gen).to(TORCH_DTYPES[s.dtype]) for f, s in specs.items()
    }
    for rank in (0, 1):
        tier = LocalTier(TrainConfig(model=TINY_MODEL, parallel=dims, checkpoint=ckpt), rank)
        local = {
            f: full[f][tuple(slice(o, o + n) for o, n in zip(b.offsets, b.lengths))].clone()
            for f, b in rank_boxes(specs, dims, rank).items()
        }
        tier.write(
            tier.plan(7, local), tier.rank_doc(7, state={"step": 7, "run": {"id": RUN}}, config={})
        )
    held = held_copies(tier, Lineage(run=RUN))
    assert list(held) == [7] and sorted(held[7]) == [0, 1]
    top = tier.top.url
    manifest = build_manifest(
        [(c, c.store.url[len(top) + 1 :] + "/") for _, c in sorted(held[7].items())]
    )
    assert manifest.layout["tp"] == 2 and manifest.state["step"] == 7
    one = checkpoint_specs(TINY_MODEL, ParallelDims(), with_optimizer=True)
    got = {f: torch.zeros(s.shape, dtype=TORCH_DTYPES[s.dtype]) for f, s in one.items()}
    load_into(
        tier.top,
        manifest,
        got,
        rank_boxes(one, ParallelDims(), 0),
        {f: s.shape for f, s in one.items()},
    )
    for fqn, want in full.items():
        assert torch.equal(got[fqn], want), fqn


def test_the_recovery_event_is_the_line_benches_parse() -> None:
    from shardsmith.trainer.observe.console import event_line

    line = event_line(
        {"event": "recovery", "step": 6, "source": "local", "detail": "resharded", "seconds": 0.1}
    )
    assert line == "recovered step 6 from local (resharded)" and RECOVERED.findall(line) == [
        ("6", "local")
    ]
    assert (
        event_line({"event": "recovery", "step": 3, "source": "buddy", "detail": ""})
        == "recovered step 3 from buddy"
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"local_ckpt": "/x"}, "needs --ckpt"),
        ({"local_ckpt": "/x", "url": "/c", "async_save": False}, "--async-save"),
        ({"local_ckpt": "s3://b/x", "url": "/c"}, "local directory"),
        ({"local_replicas": 2}, "choose 0 or 1"),
        ({"local_save_interval": 0}, "must be >= 1"),
    ],
)
def test_local_tier_config_refuses_bad_values(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CheckpointConfig(**kwargs)


# ---- distributed runs ------------------------------------------------------------------------

STEPS = REFERENCE_STEPS
LOCAL = ["--save-interval", "5", "--local-replicas", "1", "--simulate-nodes", "2"]


def train(
    root: Path,
    nproc: int,
    data_path: str,
    *flags: str,
    steps: int = STEPS,
    env: dict[str, str] | None = None,
) -> Run:
    """``shardsmith train`` (tp=2) with the persistent tier in ``root`` and the local one in ``root``-local."""
    return train_tp2(
        root,
        nproc,
        data_path,
        "--steps",
        str(steps),
        "--local-ckpt",
        f"{root}-local",
        *LOCAL,
        *flags,
        env=env,
    )


def _assert_same_run(got: Run, want: Run, where: str) -> None:
    ref = want.losses()
    for r in got.records:
        if "event" not in r:
            assert r["loss"] == ref[r["step"]], f"{where}: step {r['step']}"
    assert_tensors_bitwise_equal(
        read_full_tensors(str(got.root / step_dir(STEPS))),
        read_full_tensors(str(want.root / step_dir(STEPS))),
        where,
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("local-tier")


@pytest.fixture(scope="module")
def killed_then_node_lost(work: Path, data_path: str) -> Run:
    """One launch, two restarts: rank 1 SIGKILLs itself as step 4 starts, then node 1 (ranks
    2 and 3) loses its disk and dies as step 7 starts."""
    env = {
        "SHARDSMITH_TEST_KILL_AT": "1:4",
        "SHARDSMITH_TEST_LOSE_NODE_AT": "2:7,3:7",
        "SHARDSMITH_TEST_MARKER_DIR": str(work / "kill-markers"),
    }
    return train(work / "killed", 4, data_path, "--max-restarts", "2", env=env).check()


@pytest.mark.distributed
def test_a_killed_rank_resumes_from_the_local_tier_bitwise(
    tp2_reference: Run, killed_then_node_lost: Run
) -> None:
    run = killed_then_node_lost
    (step, source), _ = run.recovered()
    assert source == "local" and step in (2, 3), run.output[
        -3000:
    ]  # lost steps <= 1 (4 - 1 - step)
    resume = run.events("resume")[0]
    assert (
        resume["step"] == step and "-local/node-0000" in resume["from"] and not resume["resharded"]
    )
    _assert_same_run(run, tp2_reference, "rank killed, then node lost")


@pytest.mark.distributed
def test_kills_during_a_local_save_and_a_replication_never_load_a_mixed_step(
    tp2_reference: Run, work: Path, data_path: str
) -> None:
    env = {
        "SHARDSMITH_TEST_CRASH_AT": "1:local.before_commit:4,2:local.before_replicate:6",
        "SHARDSMITH_TEST_MARKER_DIR": str(work / "chaos-markers"),
    }
    run = train(work / "chaos", 4, data_path, "--max-restarts", "2", env=env).check()
    assert run.output.count("test hook: SIGKILL at crash point local.") == 2, run.output[-3000:]
    # rank 1 never committed step 4: step 3 on every rank; rank 2 committed 6 but its buddy
    # copy may be missing: 6 if every rank committed it, else 5 (never a step some rank lacks)
    [(first, src1), (second, src2)] = run.recovered()
    assert (first, src1) == (3, "local") and second in (5, 6) and src2 == "local", run.output[
        -3000:
    ]
    assert "partial: no commit marker rank-00001.json" in run.output
    _assert_same_run(run, tp2_reference, "killed during local saves")


@pytest.mark.distributed
def test_a_lost_node_recovers_from_buddy_copies_bitwise(
    tp2_reference: Run, killed_then_node_lost: Run
) -> None:
    run = killed_then_node_lost
    # step 6 (the persistent tier has only 5), or 5 when node 1 died before its own save of 6
    # was written (a slow background save: seen under load in CI); never a step a rank lacks
    [(step, source)] = run.recovered()[1:]
    assert source == "buddy" and step in (5, 6), run.output[-3000:]
    assert step == 6 or (
        "local tier: skipping" in run.output and "step-000000006 (rank " in run.output
    ), run.output[-3000:]
    assert [e["step"] for e in run.events("resume")][1:] == [step]
    _assert_same_run(run, tp2_reference, "rank killed, then node lost")


@pytest.mark.distributed
def test_a_node_not_replaced_continues_on_fewer_ranks(
    tp2_reference: Run, work: Path, data_path: str
) -> None:
    env = {
        "SHARDSMITH_TEST_LOSE_NODE_AT": "2:7,3:7",
        "SHARDSMITH_TEST_MARKER_DIR": str(work / "shrink-markers"),
    }
    lost = train(work / "shrunk", 4, data_path, env=env)
    assert lost.returncode != 0
    run = train(work / "shrunk", 2, data_path).check()
    # step 6, or 5 when the survivors died before writing node 1's buddy copies of 6 to disk
    [(step, source)] = run.recovered()
    assert step in (5, 6) and f"recovered step {step} from local (resharded)" in run.output, (
        run.output[-3000:]
    )
    [resume] = [e for e in run.records if e.get("event") == "resume"]
    assert resume["resharded"] and resume["saved_layout"]["world_size"] == 4
    ref = tp2_reference.losses()
    assert sorted(run.losses()) == list(range(step + 1, STEPS + 1))
    for step, loss in run.losses().items():
        assert abs(loss - ref[step]) <= 1e-4, (step, loss, ref[step])


@pytest.mark.distributed
def test_a_damaged_local_tier_is_named_and_skipped_for_the_buddy_copy(
    tp2_reference: Run, work: Path, data_path: str
) -> None:
    root = work / "damaged"
    train(root, 4, data_path, steps=4).check()
    node0 = Path(f"{root}-local") / "node-00000" / step_dir(4)
    node1 = Path(f"{root}-local") / "node-00001" / step_dir(4)
    data = node0 / "shards" / "rank-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0x10
    data.write_bytes(bytes(raw))
    (node0 / rank_manifest_name(1)).unlink()
    doc = json.loads((node1 / rank_manifest_name(2)).read_text())
    (node1 / rank_manifest_name(2)).write_text(json.dumps({**doc, "run": "f" * 32}))
    run = train(root, 4, data_path).check()
    assert run.recovered() == [(4, "buddy")], run.output[-3000:]
    assert (
        f"skipping {node0} (rank 0): corrupt: CRC-32C of shards/rank-00000.safetensors"
        in run.output
    )
    assert f"skipping {node0} (rank 1): partial: no commit marker rank-00001.json" in run.output
    assert f"skipping {node1} (rank 2): from another run (run ffffffffffff" in run.output
    _assert_same_run(run, tp2_reference, "damaged local tier")
    shutil.rmtree(f"{root}-local")
