"""One timeline per root (issue 42): a resume of an older step of a root makes that step's
descendants the head; the newer steps are marked abandoned, shown by ``ls``, never resumed by
``auto`` and deleted first by retention; a step saved again holds only its own files.

The storage rules on a built root here; the trainer's side with a one-rank trainer in this
process (the ``gloo_group`` fixture).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ckpt_factory import make_checkpoint, memory_root
from click.testing import CliRunner
from conftest import tiny_train_config

from shardsmith.layout import ParallelDims
from shardsmith.storage.commit import find_latest_committed, list_steps, read_manifest, step_dir
from shardsmith.storage.gc import describe_steps, plan_gc
from shardsmith.storage.lineage import ABANDONED_NAME, abandon_after, loadable_steps
from shardsmith.storage.steps import read_latest_hint
from shardsmith.storage.store import Store
from shardsmith.trainer.checkpoint.config import CheckpointConfig
from shardsmith.trainer.checkpoint.resume import choose_resume
from shardsmith.trainer.train import Trainer


def _statuses(root: Store) -> dict[int, str]:
    return {s.step: s.status + ("*" if s.latest else "") for s in describe_steps(root)}


def test_timeline_abandoned_steps_are_never_resumed_and_go_first_in_retention(tmp_path) -> None:
    root = Store(str(tmp_path / "ckpt"))
    for step in range(5, 45, 5):
        make_checkpoint(root, step)
    assert abandon_after(root, 20, run="r1") == [25, 30, 35, 40]
    assert abandon_after(root, 20, run="r1") == []  # marked once
    assert read_latest_hint(root) == step_dir(20)
    assert find_latest_committed(root) == 20
    assert loadable_steps(root, None) == [20, 15, 10, 5]
    assert _statuses(root) == {
        5: "committed",
        10: "committed",
        15: "committed",
        20: "committed*",
        25: "abandoned",
        30: "abandoned",
        35: "abandoned",
        40: "abandoned",
    }
    plan = {d.step: d.delete for d in plan_gc(root, keep_last=2)}
    assert [s for s, delete in plan.items() if delete] == [5, 10, 25, 30, 35, 40]
    assert not any(d.delete for d in plan_gc(root) if d.status == "abandoned")  # no retention given

    from shardsmith.cli.main import cli

    listed = CliRunner().invoke(cli, ["ls", root.url])
    assert listed.exit_code == 0, listed.output
    line = next(x for x in listed.output.splitlines() if x.split()[:1] == ["40"])
    assert "abandoned" in line
    latest = next(x for x in listed.output.splitlines() if x.startswith("*"))
    assert latest.split()[1] == "20"


def test_timeline_abandon_points_latest_back_on_any_store() -> None:
    root = memory_root()
    for step in (1, 2, 3):
        make_checkpoint(root, step)
    assert abandon_after(root, 3) == [] and read_latest_hint(root) == step_dir(3)  # the head
    assert abandon_after(root, 1) == [2, 3] and find_latest_committed(root) == 1
    mark = json.loads(root.read(f"{step_dir(3)}/{ABANDONED_NAME}"))
    assert mark["resumed_step"] == 1 and ABANDONED_NAME in mark["note"]


def test_timeline_rollback_in_the_same_root_makes_the_new_steps_the_head(
    gloo_group, tmp_path: Path, data_path: str
) -> None:
    ckpt = tmp_path / "ckpt"
    base = dataclasses.replace(
        tiny_train_config(ParallelDims(), data_path), run_dir=str(tmp_path / "run"), log_interval=0
    )
    first = CheckpointConfig(url=str(ckpt), save_interval=1, resume="none")
    Trainer.create(dataclasses.replace(base, steps=4, checkpoint=first)).run()
    stale = ckpt / step_dir(3) / "shards" / "rank-00007.safetensors"  # an old layout's shard file
    stale.write_bytes(b"old layout")

    again = dataclasses.replace(first, resume=str(ckpt / step_dir(2)))
    Trainer.create(dataclasses.replace(base, steps=3, checkpoint=again)).run()

    root = Store(str(ckpt))
    assert not stale.exists()  # the step saved again holds only its own files
    assert read_manifest(root.child(step_dir(3))).step == 3
    assert read_latest_hint(root) == step_dir(3)
    assert _statuses(root) == {1: "committed", 2: "committed", 3: "committed*", 4: "abandoned"}
    assert find_latest_committed(root) == 3
    auto = choose_resume("auto", root, restarts=1)
    assert auto is not None and auto[1] == 3  # a restart continues the new timeline
    events = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (timeline,) = [e for e in events if e.get("event") == "timeline"]
    assert timeline["resumed_step"] == 2 and timeline["abandoned_steps"] == [3, 4]
    assert [d.step for d in plan_gc(root, keep_last=2) if d.delete] == [1, 4]
    assert [s.step for s in list_steps(root) if s.committed] == [1, 2, 3, 4]
