"""Detect, attribute and account (:mod:`shardsmith.trainer.detect`): the straggler judgement,
the replay comparison, non-finite attribution and the goodput breakdown as pure functions,
then two 4-process runs of ``shardsmith train`` (tp2 x dp_shard2):

* ``perturbed``: rank 1 sleeps after every forward and backward (a straggler), rank 2 flips
  one bit of a gradient in step 4's replay (``--check-replay-every 2 --on-sdc continue``),
  rank 3's gradients are NaN in step 7;
* ``restarted``: nothing slowed, rank 1 SIGKILLed as step 6 starts, torchrun restarts the
  group from the step-4 checkpoint (step 5 is computed twice).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from train_runs import Run, train_tp2

from shardsmith.errors import ConfigError
from shardsmith.trainer.detect import DetectConfig
from shardsmith.trainer.detect.goodput import CATEGORIES, breakdown
from shardsmith.trainer.detect.nonfinite import attribution, first_nonfinite
from shardsmith.trainer.detect.replay import compare, replay_mismatches, rng_state
from shardsmith.trainer.detect.straggler import StragglerWatch, slow_ranks

DETECT_FLAGS = ["--straggler-every", "2", "--straggler-windows", "2", "--straggler-factor", "1.2"]


def test_straggler_named_after_k_slow_windows_in_a_row() -> None:
    assert slow_ranks([1.0, 1.1, 0.9, 3.5], 3.0) == [3]
    assert slow_ranks([1.0, 1.1, 0.9, 2.9], 3.0) == []
    watch = StragglerWatch(DetectConfig(straggler_windows=2, straggler_factor=3.0))
    fields, event = watch.judge(2, [0.1, 0.5, 0.1, 0.1], [0.4, 0.0, 0.4, 0.4])
    assert (
        fields
        == {
            "compute_s_median": 0.1,
            "compute_s_max": 0.5,
            "wait_s_max": 0.4,
            "slowest_rank": 1,
            "slowest_compute_ratio": 5.0,
        }
        and event is None
    )
    _, event = watch.judge(4, [0.1, 0.5, 0.1, 0.1], [0.4, 0.0, 0.4, 0.4])
    assert event is not None and event["ranks"] == [1] and event["compute_s"] == {"1": 0.5}
    _, event = watch.judge(6, [0.1, 0.5, 0.1, 0.1], [0.4, 0.0, 0.4, 0.4])
    assert event is None  # once per streak
    fields, _ = watch.judge(8, [0.1, 0.1, 0.1, 0.1], [0.0] * 4)
    assert "slowest_rank" not in fields and watch.streaks == {}
    with pytest.raises(ConfigError, match="straggler_factor"):
        DetectConfig(straggler_factor=1.0)


def test_sdc_replay_compare_is_bitwise_and_names_the_tensor() -> None:
    a = torch.randn(5, 3)
    b = a.clone()
    assert compare(a, b, 0.0) is None
    b.view(-1)[4:5].view(torch.int32).bitwise_xor_(1)  # the lowest mantissa bit
    assert compare(a, b, 0.0) == {
        "elements": 1,
        "max_abs_diff": pytest.approx(float((a - b).abs().max())),
    }
    assert compare(a, b, 1e-3) is None  # within a GPU-style tolerance
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
    x = torch.randn(8, 4)

    def step() -> None:
        model(x).sum().backward()

    rng = rng_state()
    step()  # dropout: the replay needs the RNG state
    before = [p.grad.clone() for p in model.parameters()]
    assert replay_mismatches(model, step, rng, 0.0) == []

    def flip(m: torch.nn.Module) -> None:
        m[2].weight.grad.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 20)

    found = replay_mismatches(model, step, rng, 0.0, flip)
    assert [f["tensor"] for f in found] == ["2.weight"] and found[0]["elements"] == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))  # originals kept


def test_replay_check_leaves_its_outcome_in_the_step_record(gloo_group: None) -> None:
    from shardsmith.trainer.detect.watch import Detectors
    from shardsmith.trainer.observe.console import step_line

    events: list[dict] = []
    detect = Detectors(DetectConfig(check_replay_every=2, on_sdc="continue"), events.append)
    model = torch.nn.Linear(3, 1)

    def step() -> None:
        model(torch.ones(2, 3)).sum().backward()

    assert detect.check_replay(1, model, step, detect.rng_before(1)) == "ok"  # not a replay step
    assert detect.timed(1, 0.1, 0.0) == {}
    step()
    assert detect.check_replay(2, model, step, detect.rng_before(2)) == "ok"
    record = detect.timed(2, 0.1, 0.0)
    assert record == {"replay": "match"} and not events
    line = {
        "step": 2,
        "loss": 1.0,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_s": 1.0,
        "seconds": 1.0,
    }
    assert "replay match" in step_line({**line, **record, "skipped": False})

    def flip(m: torch.nn.Module) -> None:
        m.weight.grad.view(-1)[:1].view(torch.int32).bitwise_xor_(1)

    assert detect.check_replay(4, model, step, detect.rng_before(4), flip) == "ok"  # continue
    assert detect.timed(4, 0.1, 0.0) == {"replay": "mismatch"} and events[0]["event"] == "sdc"
    assert detect.timed(5, 0.1, 0.0) == {}


def test_nonfinite_attribution_names_first_rank_and_parameter() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model(torch.ones(1, 2)).sum().backward()
    assert first_nonfinite(model, 1.0) is None
    model[1].bias.grad[0] = math.inf
    assert first_nonfinite(model, 1.0) == "1.bias" and first_nonfinite(model, math.nan) == "loss"
    event = attribution(7, [None, "1.bias", "0.weight", "loss"])
    assert (event["rank"], event["tensor"], event["ranks"]) == (
        3,
        "loss",
        [1, 2, 3],
    )  # the loss came first
    assert attribution(7, [None, "1.bias", "0.weight", None])["rank"] == 1


def _step(step: int, end: float, seconds: float, **kw) -> dict:
    return {"step": step, "time": end, "seconds": seconds, "loss": 1.0, "skipped": False, **kw}


def test_goodput_breakdown_tiles_the_wall_time() -> None:
    records = [
        {
            "event": "start",
            "time": 105.0,
            "launch_time": 100.0,
            "restart_count": 0,
        },  # old job: ignored
        {"event": "start", "time": 1010.0, "launch_time": 1000.0, "restart_count": 0},
        _step(1, 1012.0, 1.0),  # start-up 1000..1011
        _step(2, 1013.0, 1.0),
        {"event": "save", "time": 1013.6, "step": 2, "blocked_seconds": 0.5},
        _step(3, 1014.0, 0.5),  # interval 1013..1014 holds the save's 0.5 s
        _step(4, 1015.0, 1.0, skipped=True),  # skipped: lost
        {"event": "start", "time": 1020.0, "launch_time": 1000.0, "restart_count": 1},
        {"event": "resume", "time": 1021.0, "step": 2, "reason": "resume", "seconds": 1.0},
        _step(3, 1023.0, 1.0),  # recovery 1015..1022; step 3 of attempt 1 is lost
        _step(4, 1024.0, 1.0),
        {"event": "resume", "time": 1024.2, "step": 2, "reason": "rollback", "seconds": 0.3},
        _step(3, 1025.0, 0.5),  # 0.3 s of this interval is the rollback
        _step(4, 1026.0, 1.0),
        {"event": "save", "time": 1027.0, "step": 4, "blocked_seconds": 0.8},
    ]
    g = breakdown(records, end_time=1028.0)
    assert g["wall_s"] == 28.0 and g["restarts"] == 1
    seconds = {k: g[f"{k}_s"] for k in CATEGORIES}
    assert seconds == pytest.approx(
        {
            "startup": 11.0,
            "productive": 1.0 + 1.0 + 0.7 + 1.0,
            "lost": 0.5 + 1.0 + 1.0 + 1.0,
            "checkpoint": 1.3,
            "recovery": 7.0 + 0.3,
            "other": 1.2,
        }
    )
    assert sum(g[k] for k in CATEGORIES) == pytest.approx(1.0, abs=0.02)
    assert (
        g["goodput"] == pytest.approx(3.7 / 28, abs=1e-4)
        and g["steps_counted"] == 4
        and g["steps_lost"] == 4
    )
    with pytest.raises(ValueError, match="no metrics records"):
        breakdown([])


# ---- two real launches -------------------------------------------------------------------


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory: pytest.TempPathFactory, data_path: str) -> Run:
    env = {
        "SHARDSMITH_TEST_SLOW": "1:2",
        "SHARDSMITH_TEST_FLIP_BIT_AT": "2:4",
        "SHARDSMITH_TEST_NAN_AT": "3:6:grad",
    }
    return train_tp2(
        tmp_path_factory.mktemp("detect") / "perturbed",
        4,
        data_path,
        "--steps",
        "8",
        *DETECT_FLAGS,
        "--check-replay-every",
        "2",
        "--on-sdc",
        "continue",
        env=env,
    ).check()


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory, data_path: str) -> Run:
    root = tmp_path_factory.mktemp("detect") / "restarted"
    env = {
        "SHARDSMITH_TEST_KILL_AT": "1:6",
        "SHARDSMITH_TEST_MARKER_DIR": str(root.parent / "markers"),
    }
    return train_tp2(
        root,
        4,
        data_path,
        "--steps",
        "8",
        "--save-interval",
        "2",
        "--max-restarts",
        "1",
        *DETECT_FLAGS,
        env=env,
    ).check()


@pytest.mark.distributed
@pytest.mark.slow
def test_straggler_and_sdc_replay_named_in_a_run(perturbed: Run) -> None:
    stragglers = perturbed.events("straggler")
    assert stragglers and all(e["ranks"] == [1] for e in stragglers), stragglers
    assert stragglers[0]["step"] <= 6  # within a few windows
    steps = {r["step"]: r for r in perturbed.records if "event" not in r}
    assert steps[2]["slowest_rank"] == 1 and "slowest rank 1" in perturbed.output
    sdc = perturbed.events("sdc")
    assert [(e["step"], e["ranks"]) for e in sdc] == [(4, [2])], sdc  # replays of 2, 6, 8 match
    assert sdc[0]["tensor"] == "tok_embeddings.weight" or sdc[0]["tensor"].endswith("weight")
    assert sdc[0]["mismatches"][0]["elements"] == 1 and sdc[0]["policy"] == "continue"
    replays = {s: r.get("replay") for s, r in steps.items()}
    assert replays == {
        1: None,
        2: "match",
        3: None,
        4: "mismatch",
        5: None,
        6: "match",
        7: None,
        8: "match",
    }, replays
    assert "replay match" in perturbed.output and "replay mismatch" in perturbed.output
    nonfinite = perturbed.events("nonfinite")
    assert [(e["step"], e["rank"], e["ranks"]) for e in nonfinite] == [(7, 3, [3])], nonfinite
    assert nonfinite[0]["tensor"] == sdc[0]["tensor"]  # the hooks hit the first local gradient


@pytest.mark.distributed
@pytest.mark.slow
def test_goodput_after_a_restart_and_no_straggler_unperturbed(restarted: Run) -> None:
    assert not restarted.events("straggler"), restarted.events("straggler")
    goodput = restarted.events("goodput")
    assert len(goodput) == 1, goodput
    g = goodput[0]
    assert sum(g[k] for k in CATEGORIES) == pytest.approx(1.0, abs=0.02)
    assert (
        g["restarts"] == 1 and g["steps_counted"] == 8 and g["steps_lost"] == 1
    )  # step 5, run twice
    assert (
        g["recovery_s"] > 0
        and g["startup_s"] > 0
        and g["checkpoint_s"] > 0
        and 0 < g["goodput"] < 1
    )
    assert "goodput " in restarted.output and f"{g['goodput']:.1%}" in restarted.output


def test_plot_of_two_runs_captions_each_runs_goodput_under_its_name(tmp_path: Path) -> None:
    import json

    from shardsmith.trainer.observe.plot import runs_caption

    for name, end in (("a", 20.0), ("b", 40.0)):
        (tmp_path / name).mkdir()
        records = [
            {"event": "start", "time": 10.0, "launch_time": 0.0, "restart_count": 0},
            _step(1, end, 5.0),
        ]
        (tmp_path / name / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records)
        )
    both = runs_caption([str(tmp_path / "a"), str(tmp_path / "b")]).split("\n")
    assert [line.split(":")[0] for line in both] == ["a", "b"], both
    assert both[0].startswith("a: goodput 25.0% ") and both[1].startswith("b: goodput 12.5% ")
    assert runs_caption([str(tmp_path / "b")]).startswith("goodput 12.5% ")  # one run: no name


def test_goodput_caption_of_the_plot() -> None:
    from shardsmith.trainer.observe.plot import goodput_caption

    records = [
        {"event": "start", "time": 10.0, "launch_time": 0.0, "restart_count": 0},
        _step(1, 20.0, 5.0),
    ]
    assert goodput_caption(records) == (
        "goodput 25.0% (lost 0.0%, checkpoint 0.0%, recovery 0.0%, startup 75.0%, "
        "other 0.0%) of 20.0 s"
    )
    final = {"event": "goodput", "time": 21.0, **breakdown(records, end_time=40.0)}
    assert (
        goodput_caption([*records, final]).startswith("goodput 12.5% ")
        and goodput_caption([]) == ""
    )


def test_replay_and_straggler_flags_reach_the_config_and_round_trip(data_path: str) -> None:
    from click.testing import CliRunner

    from shardsmith.cli.train_commands import train, train_config
    from shardsmith.trainer.config import TrainConfig

    ctx = train.make_context(
        "train",
        [
            "--data",
            data_path,
            "--check-replay-every",
            "5",
            "--on-sdc",
            "skip-step",
            "--straggler-every",
            "10",
            "--wandb",
        ],
    )
    cfg = train_config(ctx.params, 1)
    assert (
        cfg.detect == DetectConfig(check_replay_every=5, on_sdc="skip-step", straggler_every=10)
        and cfg.wandb
    )
    assert TrainConfig.from_json(cfg.to_json()) == cfg
    plain = TrainConfig()
    assert (
        "detect" not in plain.to_json() and "wandb" not in plain.to_json()
    )  # manifests of plain runs unchanged
    result = CliRunner().invoke(train, ["--data", data_path, "--on-sdc", "skip-rank"])
    assert result.exit_code == 2 and "skip-rank" in result.output


def test_goodput_bench_hook_kills_after_every_n_seconds_of_training(
    monkeypatch, tmp_path: Path
) -> None:
    import shardsmith.trainer.fault.hooks as fault_hooks

    clock, kills = [1000.0], []
    monkeypatch.setattr(fault_hooks.time, "time", lambda: clock[0])
    monkeypatch.setattr(fault_hooks.os, "kill", lambda pid, sig: kills.append(sig))
    env = {"SHARDSMITH_TEST_KILL_EVERY": "1:30", "SHARDSMITH_TEST_MARKER_DIR": str(tmp_path)}
    other, hooks = fault_hooks.FaultHooks(0, env=env), fault_hooks.FaultHooks(1, env=env)
    for step, t in (
        (1, 1000.0),
        (2, 1029.0),
    ):  # the first step starts the clock: no kill before 30 s
        clock[0] = t
        hooks.at_step_start(step)
    assert kills == []
    clock[0] = 1030.0
    other.at_step_start(3)
    hooks.at_step_start(3)
    assert len(kills) == 1 and sorted(p.name for p in tmp_path.iterdir()) == [
        "kill-every-rank1-step3"
    ]
