"""Fault tolerance: elastic restarts, preemption, hangs, bad steps, exact state, metrics.

Unit tests first (no processes). Then ``shardsmith train`` launches on gloo, each one
covering several cases (process start-up dominates their cost), all on the tiny model of
``conftest`` with tp=2 and dp_shard left free (4 processes: tp2·dps2, 2 processes: tp2·dps1),
``STEPS`` steps, a checkpoint every 2 steps:

* ``reference``: uninterrupted, 4 processes (conftest's ``tp2_reference``, one launch shared
  with trainer/test_local_tier and e2e/test_multinode).
* ``chaos``: 4 processes, ``--max-restarts 3``; three random (rank, step) pairs SIGKILL
  themselves (test hook, once each: markers survive the restarts). Final model == reference.
* chain: ``preempted`` (4 processes; as step PREEMPT_STEP starts one rank SIGTERMs itself
  and torchrun's agent, which forwards it to every worker: checkpoint at that step's
  boundary, exit 0) -> ``hung`` (4 processes resume it exactly; one rank hangs inside step
  HANG_STEP: the 8 s collective timeout fails the job, every rank's stack is dumped) ->
  ``restarted`` (2 processes, a new layout, resume the newest checkpoint and reach STEPS
  with losses within 1e-4 of the reference).
* ``nan_run``: 2 processes; a NaN loss once (skipped, counted), then NaN gradients for
  MAX_BAD steps in a row (rolled back, data window skipped).

Ten process groups start in all (the chaos run's four included); their start-up (~4 CPU
seconds per process) is most of the ~3 CPU-minutes this file costs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from conftest import TINY_MODEL, TINY_TRAIN_FLAGS, assert_tensors_bitwise_equal, read_full_tensors
from train_runs import REFERENCE_SAVE_EVERY, REFERENCE_STEPS, Run, train_tp2

from shardsmith.errors import ConfigError, LayoutError
from shardsmith.layout import ParallelDims
from shardsmith.layout.flops import flops_per_token
from shardsmith.storage.commit import read_latest_hint, step_dir
from shardsmith.storage.store.fs import Store
from shardsmith.trainer.checkpoint.resume import choose_resume
from shardsmith.trainer.config import FaultConfig, TrainConfig
from shardsmith.trainer.fault.bad_steps import BadStepPolicy
from shardsmith.trainer.fault.elastic import fit_world_size
from shardsmith.trainer.fault.hooks import FaultHooks
from shardsmith.trainer.fault.preemption import PreemptionHandler
from shardsmith.trainer.fault.watchdog import StepWatchdog, hang_threshold
from shardsmith.trainer.observe.metrics import (
    MetricsWriter,
    iter_json_lines,
    model_flops_utilization,
)
from shardsmith.trainer.observe.plot import loss_segments, run_markers
from shardsmith.trainer.optim import OptimConfig
from shardsmith.trainer.rng import (
    capture_rng,
    pack_rng_states,
    restore_rng,
    role_seed,
    select_rng_state,
)

STEPS = REFERENCE_STEPS
SAVE_EVERY = REFERENCE_SAVE_EVERY
PREEMPT_STEP = 3  # not a save step: the preemption checkpoint is its own
HANG_STEP = 7  # after the save of step 6
MAX_BAD = 3


# ---- unit tests ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("preempt_deadline", 0),
        ("collective_timeout", -1),
        ("init_timeout", 0),
        ("hang_min_seconds", 0),
        ("hang_factor", 1.0),
        ("max_bad_steps", 0),
        ("max_rollbacks", -1),
        ("peak_flops", -1.0),
    ],
)
def test_fault_config_refuses_out_of_range(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"fault.{field}="):
        FaultConfig(**{field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("lr", 0.0),
        ("min_lr_ratio", 1.5),
        ("decay_steps", -1),
        ("warmup_steps", -1),
        ("beta2", 1.0),
        ("grad_clip", -1.0),
        ("weight_decay", -0.1),
        ("eps", 0.0),
    ],
)
def test_optim_config_refuses_out_of_range(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"optim.{field}="):
        OptimConfig(**{field: value})


def test_fault_config_round_trips_through_json() -> None:
    cfg = TrainConfig(fault=FaultConfig(max_bad_steps=5, derive_dp_shard=True, peak_flops=1e12))
    assert TrainConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
    old = cfg.to_json()
    del old["fault"]  # manifests written before FaultConfig
    assert TrainConfig.from_json(old).fault == FaultConfig()


def test_fit_world_size_rederives_free_dp_shard_only() -> None:
    free = TrainConfig(
        parallel=ParallelDims(tp=2, dp_shard=2), fault=FaultConfig(derive_dp_shard=True)
    )
    assert fit_world_size(free, 4) is free
    assert fit_world_size(free, 2).parallel == ParallelDims(tp=2, dp_shard=1)
    assert fit_world_size(free, 8).parallel == ParallelDims(tp=2, dp_shard=4)
    with pytest.raises(LayoutError, match="not a multiple of pp\\*dp_replicate\\*tp=2"):
        fit_world_size(free, 3)
    fixed = TrainConfig(parallel=ParallelDims(tp=2, dp_shard=2))
    with pytest.raises(LayoutError, match="--dp-shard -1"):
        fit_world_size(fixed, 2)


def test_bad_step_policy_skips_then_rolls_back_and_skips_the_window() -> None:
    policy = BadStepPolicy(max_bad_steps=3)
    nan = float("nan")
    assert policy.observe(2.0, 1.0, 0, 8) == "ok"
    assert policy.observe(nan, 1.0, 8, 16) == "skip"
    assert policy.observe(2.0, 1.0, 16, 24) == "ok"  # a good step ends the streak
    assert policy.observe(2.0, float("inf"), 24, 32) == "skip"
    assert policy.observe(nan, nan, 32, 40) == "skip"
    assert policy.observe(nan, 1.0, 40, 48) == "rollback"
    assert (policy.skipped_steps, policy.consecutive) == (4, 3)
    assert policy.start_rollback() == [24, 48]
    assert (policy.rollbacks, policy.consecutive, policy.skip_windows) == (1, 0, [[24, 48]])
    assert [policy.next_sample(i) for i in (16, 24, 40, 48)] == [16, 48, 48, 48]
    saved = policy.state_json()
    restored = BadStepPolicy(max_bad_steps=3)
    restored.load_state_json(json.loads(json.dumps(saved)))
    assert restored == policy
    policy.skip_windows = [[40, 56]]  # a rollback keeps what it knows
    policy.load_state_json(saved, keep_counters=True)
    assert policy.skip_windows == [[24, 56]]


def test_watchdog_dumps_every_thread_once_per_hung_step(tmp_path: Path) -> None:
    now = [100.0]
    hangs: list[tuple[int, float, float]] = []
    dog = StepWatchdog(
        factor=3,
        min_s=1,
        dump_path=str(tmp_path / "stacks" / "rank-0.txt"),
        on_hang=lambda *a: hangs.append(a),
        clock=lambda: now[0],
        start_thread=False,
    )
    assert dog.threshold() == 3.0  # factor * min_s before any step
    for seconds in (0.5, 2.0, 1.0):
        dog.begin(1)
        now[0] += seconds
        dog.end()
    assert dog.threshold() == hang_threshold([0.5, 2.0, 1.0], 3, 1) == 3.0
    dog.begin(4)
    now[0] += 2.9
    assert not dog.check() and not dog.is_hung()
    now[0] += 0.2
    assert dog.check() and dog.is_hung()
    assert not dog.check()  # once per step
    assert hangs == [(4, pytest.approx(3.1), 3.0)]
    text = (tmp_path / "stacks" / "rank-0.txt").read_text()
    assert (
        "step 4 has run 3.1s" in text
        and "test_watchdog_dumps_every_thread_once_per_hung_step" in text
    )
    dog.end()
    assert not dog.is_hung()
    dog.close()


def _signal_handler(signals: list[tuple[float, signal.Signals]]) -> list[list[int]]:
    """Deliver (clock time, signal) pairs to a fresh PreemptionHandler (5 s repeat grace);
    the exit codes it asked for after each."""
    exits: list[int] = []
    now = [0.0]
    handler = PreemptionHandler(600, exit_fn=exits.append, repeat_grace_s=5, clock=lambda: now[0])
    assert handler.install()
    seen = []
    try:
        for when, sig in signals:
            now[0] = when
            os.kill(os.getpid(), sig)
            seen.append(list(exits))
    finally:
        handler.uninstall()
    assert signal.getsignal(signal.SIGTERM) != handler._handle
    return seen


def test_preemption_handler_first_signal_asks_second_exits() -> None:
    # SIGUSR1, then the same notice again (e.g. torchrun forwarding it), then a second signal
    seen = _signal_handler([(0.0, signal.SIGUSR1), (4.9, signal.SIGTERM), (5.1, signal.SIGTERM)])
    assert seen == [[], [], [128 + signal.SIGTERM]]


def test_second_ctrl_c_forwarded_as_sigterm_exits_at_once() -> None:
    """torchrun's agent forwards the first Ctrl-C as SIGINT; a second one interrupts its
    wait and it stops the workers with SIGTERM, within the SIGTERM repeat grace: that is
    the user's second signal, not a repeat of the first."""
    assert _signal_handler([(0.0, signal.SIGINT), (0.5, signal.SIGTERM)]) == [
        [],
        [128 + signal.SIGINT],
    ]


def test_preemption_handler_exits_when_hung_or_past_the_deadline() -> None:
    exits: list[int] = []
    hung = PreemptionHandler(600, is_hung=lambda: True, exit_fn=exits.append)
    hung.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        hung.uninstall()
    assert exits == [128 + signal.SIGTERM]
    passed = threading.Event()
    late = PreemptionHandler(0.01, exit_fn=lambda code: (exits.append(code), passed.set()))
    late.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert passed.wait(timeout=60), "the deadline timer never fired"
    finally:
        late.uninstall()
    assert exits[-1] == 1


def test_restart_line_names_the_failed_ranks_and_how_they_ended() -> None:
    from shardsmith.trainer.runtime.agent import restart_line

    # rank 1 SIGKILLed; the agent then stopped rank 0 (SIGTERM): not named
    assert restart_line(1, 3, {0: -15, 1: -9}, 2) == (
        "restart 1 of 3: rank 1 died (SIGKILL); restarting 2 processes"
    )
    # two peers' collectives broke as rank 1 died (exit code 1): counted, not named
    assert restart_line(2, 3, {3: -15, 2: 1, 1: -6, 0: 1}, 4) == (
        "restart 2 of 3: rank 1 died (SIGABRT); 2 other ranks failed with it; restarting 4 "
        "processes"
    )
    assert restart_line(1, 2, {0: -15, 1: 1}, 2) == (
        "restart 1 of 2: rank 1 exited with code 1; restarting 2 processes"
    )
    # every worker ended by SIGTERM (sent from elsewhere): all of them are named
    assert restart_line(1, 1, {0: -15, 1: -15}, 2) == (
        "restart 1 of 1: rank 0 died (SIGTERM), rank 1 died (SIGTERM); restarting 2 processes"
    )


def test_launcher_sets_worker_malloc_env_unless_set(monkeypatch) -> None:
    from shardsmith.trainer.runtime import launch

    for name in (
        "MALLOC_MMAP_THRESHOLD_",
        "OMP_NUM_THREADS",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        "TORCHELASTIC_SIGNALS_TO_HANDLE",
    ):
        monkeypatch.setenv(name, "")  # so that monkeypatch restores what was there
        monkeypatch.delenv(name)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")  # the user's own value stays
    launch.set_worker_env()
    assert (os.environ["MALLOC_MMAP_THRESHOLD_"], os.environ["MALLOC_ARENA_MAX"]) == ("65536", "4")
    assert os.environ["OMP_NUM_THREADS"] == "1"


def test_rng_state_is_saved_by_role_and_rederived_on_new_roles() -> None:
    dims = ParallelDims(tp=2, dp_shard=2)
    torch.manual_seed(1)
    a = capture_rng()
    torch.rand(3)
    b = capture_rng()
    gathered = [
        {"rank": r, "role": f"pp0.tp{r % 2}", "state": a if r % 2 == 0 else b} for r in range(4)
    ]
    saved = json.loads(json.dumps(pack_rng_states(gathered, dims)))
    assert sorted(saved["roles"]) == ["pp0.tp0", "pp0.tp1"] and saved["ranks"] == {}
    coords = dims.coords(3)
    assert select_rng_state(saved, dims, 3, coords) == b  # same layout
    fewer = ParallelDims(tp=2)
    assert select_rng_state(saved, fewer, 1, fewer.coords(1)) == b  # only dp changed
    other_tp = ParallelDims(dp_shard=4)
    assert select_rng_state(saved, other_tp, 1, other_tp.coords(1)) is None  # new roles: re-derive
    gathered[2]["state"] = b  # rank 2 drifted from its role
    drifted = pack_rng_states(gathered, dims)
    assert drifted["ranks"] == {"2": b}
    assert select_rng_state(drifted, dims, 2, dims.coords(2)) == b
    assert select_rng_state(drifted, fewer, 0, fewer.coords(0)) is None  # no rank to map it to
    restore_rng(b)
    first = torch.rand(4)
    restore_rng(b)
    assert torch.equal(torch.rand(4), first)
    assert role_seed(7, 10, coords) == role_seed(7, 10, dict(coords))
    assert (
        len({role_seed(7, s, c) for s in (10, 11) for c in (dims.coords(0), dims.coords(1))}) == 4
    )


def test_flops_per_token_follows_palm_appendix_b() -> None:
    m = TINY_MODEL  # D=32, H=4, K=2, F=64, V=256, L=4, T=16
    head_dim, kv = m.hidden_size // m.num_attention_heads, m.num_kv_heads
    per_layer = (
        2 * m.hidden_size * m.hidden_size
        + 2 * kv * head_dim * m.hidden_size
        + 3 * m.hidden_size * m.ffn_hidden_size
        + 2 * m.hidden_size
    )
    n = (
        m.num_layers * per_layer + m.hidden_size + m.vocab_size * m.hidden_size
    )  # no input embedding
    attention = 12 * m.num_layers * m.num_attention_heads * head_dim * m.seq_length
    assert flops_per_token(m) == 6 * n + attention
    assert model_flops_utilization(1000.0, 2e6, 0.0, 4) is None
    assert model_flops_utilization(1000.0, 2e6, 1e9, 4) == pytest.approx(0.5)


def _commit_stub(root: Path, step: int) -> None:
    """A real committed step of the tiny model (choose_resume reads the newest one's run id)."""
    from ckpt_factory import MODEL, full_tensors, save_offline

    from shardsmith.layout import ParallelDims

    save_offline(Store(str(root)), step, ParallelDims(), full_tensors(MODEL), MODEL)


def test_choose_resume_prefers_the_job_root_after_a_restart(tmp_path: Path) -> None:
    root, other = tmp_path / "root", tmp_path / "other"
    _commit_stub(other, 5)
    outside = str(other / step_dir(5))
    store = Store(str(root))
    assert choose_resume("auto", store, 0) is None
    assert choose_resume("none", store, 1) is None
    assert choose_resume(outside, store, 0)[1] == 5  # empty root: the URL
    _commit_stub(root, 2)
    _commit_stub(root, 4)
    (root / step_dir(6)).mkdir()  # not committed: ignored
    assert choose_resume("auto", store, 0)[1] == 4
    assert choose_resume("none", store, 0) is None
    assert choose_resume("none", store, 2)[1] == 4  # a restart never starts over
    assert choose_resume(outside, store, 0)[1] == 4  # a requeued job continues
    inside = str(root / step_dir(2))
    assert choose_resume(inside, store, 0)[1] == 2  # explicit step in the root
    assert choose_resume(inside, store, 1)[1] == 4


def test_fault_hooks_fire_once_per_rank_and_step(tmp_path: Path) -> None:
    env = {
        "SHARDSMITH_TEST_KILL_AT": "1:3, 0:5",
        "SHARDSMITH_TEST_NAN_AT": "1:2,1:4:grad,0:9",
        "SHARDSMITH_TEST_SIGNAL_AT": "1:6:SIGUSR1:agent",
        "SHARDSMITH_TEST_MARKER_DIR": str(tmp_path),
    }
    hooks = FaultHooks(1, env)
    assert hooks.kill == {3: ""} and hooks.nan_target(2) == "loss" and hooks.nan_target(4) == "grad"
    assert hooks.nan_target(9) == "" and FaultHooks(0, env).kill == {5: ""}
    assert hooks.signal == {6: "SIGUSR1:agent"}
    assert hooks._once("kill", 3) and not hooks._once("kill", 3)
    assert not FaultHooks(1, env)._once("kill", 3)  # a restarted process too
    assert (tmp_path / "kill-rank1-step3").exists()
    inert = FaultHooks(0, {})
    inert.at_step_start(1)
    inert.in_step(1)
    loss = torch.tensor(2.0)
    assert inert.corrupt(0, torch.nn.Linear(1, 1), loss) is loss


def test_metrics_jsonl_segments_and_markers(tmp_path: Path) -> None:
    writer = MetricsWriter(str(tmp_path), tensorboard=False)
    records: list[dict[str, Any]] = [
        {"event": "start", "restart_count": 0},
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.5},
        {"step": 3, "loss": None, "skipped": True},
        {"event": "start", "restart_count": 1},
        {"event": "resume", "reason": "resume", "step": 2, "resharded": True},
        {"step": 3, "loss": 2.4},
        {"step": 4, "loss": 2.2},
        {"event": "rollback", "from_step": 4, "to_step": 2},
        {"event": "resume", "reason": "rollback", "step": 2, "resharded": False},
        {"step": 3, "loss": 2.3},
    ]
    for r in records:
        writer.write(r)
    writer.close()
    back = list(iter_json_lines(str(tmp_path / "metrics.jsonl")))
    assert back == records
    assert loss_segments(back) == [[(1, 3.0), (2, 2.5), (3, 2.4), (4, 2.2)], [(3, 2.3)]]
    assert run_markers(back) == {"restarts": [2], "reshards": [2], "rollbacks": [2]}
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')
    with pytest.raises(ValueError, match="metrics.jsonl:2: not a JSON record"):
        list(iter_json_lines(str(tmp_path / "metrics.jsonl")))


def test_metrics_go_to_tensorboard_when_installed(tmp_path: Path, monkeypatch) -> None:
    from shardsmith.trainer.observe import metrics

    class Recorder:
        def __init__(self) -> None:
            self.scalars: list[tuple[str, float, int]] = []
            self.texts: list[str] = []

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            self.scalars.append((tag, value, step))

        def add_text(self, tag: str, text: str, step: int) -> None:
            self.texts.append(tag)

        def close(self) -> None:
            pass

    recorder = Recorder()
    monkeypatch.setattr(metrics, "_tensorboard_writer", lambda log_dir: recorder)
    writer = MetricsWriter(str(tmp_path))
    writer.write(
        {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": None, "skipped": False, "mfu": 0.4}
    )
    writer.write(
        {"event": "save", "step": 4, "nbytes": 100, "seconds": 0.5, "blocked_seconds": 0.1}
    )
    writer.write({"event": "resume", "step": 4, "seconds": 0.25, "nbytes_read": 60})
    assert recorder.scalars == [
        ("train/loss", 2.5, 3),
        ("train/lr", 1e-3, 3),
        ("train/mfu", 0.4, 3),
        ("checkpoint/save_seconds", 0.5, 4),
        ("checkpoint/save_blocked_seconds", 0.1, 4),
        ("checkpoint/save_nbytes", 100, 4),
        ("checkpoint/load_seconds", 0.25, 4),
        ("checkpoint/load_nbytes", 60, 4),
    ]
    assert recorder.texts == ["events", "events"]


def test_plot_draws_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from shardsmith.cli.main import cli

    writer = MetricsWriter(str(tmp_path), tensorboard=False)
    for r in (
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.0},
        {"event": "resume", "reason": "resume", "step": 1, "resharded": True},
        {"step": 2, "loss": 2.1},
    ):
        writer.write(r)
    result = CliRunner().invoke(cli, ["plot", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = CliRunner().invoke(cli, ["plot", str(tmp_path / "nothing")])
    assert result.exit_code == 1 and "metrics.jsonl does not exist" in result.output


def test_cli_maps_fault_flags_and_hands_workers_absolute_paths(
    tmp_path, monkeypatch, data_path
) -> None:
    from shardsmith.cli.main import cli
    from shardsmith.trainer.runtime import launch

    seen: list[tuple[TrainConfig, int, int]] = []
    monkeypatch.setattr(
        launch, "launch", lambda cfg, n, max_restarts=0: seen.append((cfg, n, max_restarts))
    )
    monkeypatch.chdir(tmp_path)
    flags = [
        "train",
        "--nproc-per-node",
        "4",
        "--tp",
        "2",
        *TINY_TRAIN_FLAGS,
        "--data",
        data_path,
        "--ckpt",
        "rel/ckpt",
        "--max-restarts",
        "2",
        "--preempt-deadline",
        "30",
        "--collective-timeout",
        "7",
        "--init-timeout",
        "90",
        "--hang-factor",
        "4",
        "--hang-min-seconds",
        "2",
        "--max-bad-steps",
        "5",
        "--max-rollbacks",
        "1",
        "--peak-flops",
        "1e12",
    ]
    for extra, derive in (([], True), (["--dp-shard", "2"], False)):
        result = CliRunner().invoke(cli, flags + extra)
        assert result.exit_code == 0, result.output
        cfg, nproc, restarts = seen[-1]
        assert (nproc, restarts, cfg.parallel) == (4, 2, ParallelDims(tp=2, dp_shard=2))
        assert cfg.fault == FaultConfig(
            preempt_deadline=30,
            collective_timeout=7,
            init_timeout=90,
            hang_factor=4,
            hang_min_seconds=2,
            max_bad_steps=5,
            max_rollbacks=1,
            peak_flops=1e12,
            derive_dp_shard=derive,
        )
    payload = launch.config_payload(seen[-1][0])
    assert payload["checkpoint"]["url"] == str(tmp_path / "rel" / "ckpt")
    assert payload["checkpoint"]["resume"] == "auto"


# ---- distributed runs ------------------------------------------------------------------------


def train(
    root: Path, nproc: int, data_path: str, *flags: str, env: dict[str, str] | None = None
) -> Run:
    """``shardsmith train`` on ``nproc`` processes (tp=2, dp_shard from the world size),
    ``STEPS`` steps, a checkpoint every ``SAVE_EVERY``."""
    return train_tp2(
        root,
        nproc,
        data_path,
        "--steps",
        str(STEPS),
        "--save-interval",
        str(SAVE_EVERY),
        *flags,
        env=env,
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fault")


@pytest.fixture(scope="module")
def reference(tp2_reference: Run) -> Run:
    """The uninterrupted 4-process run (the session's, shared with other modules)."""
    return tp2_reference


@pytest.fixture(scope="module")
def chaos_plan() -> tuple[int, list[tuple[int, int]]]:
    """Three (rank, step) kills, drawn from a seed (``SHARDSMITH_CHAOS_SEED`` to replay one)."""
    seed = int(os.environ.get("SHARDSMITH_CHAOS_SEED", random.randrange(2**31)))
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(2, STEPS + 1), 3))
    return seed, [(rng.randrange(4), step) for step in steps]


@pytest.fixture(scope="module")
def chaos(work: Path, data_path: str, chaos_plan) -> Run:
    _, kills = chaos_plan
    env = {
        "SHARDSMITH_TEST_KILL_AT": ",".join(f"{r}:{s}" for r, s in kills),
        "SHARDSMITH_TEST_MARKER_DIR": str(work / "chaos-markers"),
    }
    return train(work / "chaos", 4, data_path, "--max-restarts", "3", env=env)


@pytest.mark.distributed
def test_chaos_kills_restart_to_a_bitwise_identical_model(
    reference: Run, chaos: Run, chaos_plan
) -> None:
    seed, kills = chaos_plan
    where = f"chaos seed {seed} (SHARDSMITH_CHAOS_SEED={seed} replays it), kills {kills}"
    assert chaos.returncode == 0, f"{where}:\n{chaos.output[-8000:]}"
    assert chaos.output.count("test hook: SIGKILL") == 3, where
    restarts = [line for line in chaos.output.splitlines() if line.startswith("restart ")]
    assert len(restarts) == len(kills), f"{where}: one line per restart: {restarts}"
    for n, (rank, _) in enumerate(kills, start=1):  # the agent names the rank and the signal
        assert any(
            line.startswith(f"restart {n} of 3: rank {rank} died (SIGKILL)")
            and line.endswith("; restarting 4 processes")
            for line in restarts
        ), f"{where}: restart {n} not named: {restarts}"
    assert [e["restart_count"] for e in chaos.events("start")] == [0, 1, 2, 3], where
    for resumed in chaos.events("resume"):
        assert resumed["step"] % SAVE_EVERY == 0 and resumed["rng"] == "restored", where
        assert not resumed["resharded"], where
    ref_losses = reference.losses()
    assert sorted(ref_losses) == list(range(1, STEPS + 1))
    for r in chaos.records:  # every step, each time it ran
        if "event" not in r:
            assert r["loss"] == ref_losses[r["step"]], f"{where}: step {r['step']}"
    assert chaos.committed()[-1] == STEPS
    assert_tensors_bitwise_equal(
        read_full_tensors(str(chaos.root / step_dir(STEPS))),
        read_full_tensors(str(reference.root / step_dir(STEPS))),
        where,
    )
    with open(chaos.root / step_dir(STEPS) / "manifest.json") as f:
        state = json.load(f)["state"]
    with open(reference.root / step_dir(STEPS) / "manifest.json") as f:
        want = json.load(f)["state"]
    run, want_run = state.pop("run"), want.pop("run")  # each run has its own id
    assert state == want, where  # counters, data, scheduler, rng, fault
    with open(chaos.root / step_dir(SAVE_EVERY) / "manifest.json") as f:
        first = json.load(f)["state"]["run"]
    assert run["id"] == first["id"] != want_run["id"], f"{where}: restarts continue one run"
    assert run_markers(chaos.records)["restarts"] == [e["step"] for e in chaos.events("resume")]


@pytest.fixture(scope="module")
def preempted(work: Path, data_path: str) -> Run:
    # rank 2 signals itself (so the step is known) and torchrun's agent, which forwards
    # SIGTERM to every worker (a repeat for rank 2) and waits for them: the production path.
    env = {
        "SHARDSMITH_TEST_SIGNAL_AT": f"2:{PREEMPT_STEP}:SIGTERM:agent",
        "SHARDSMITH_TEST_MARKER_DIR": str(work / "chain-markers"),
    }
    return train(work / "chain", 4, data_path, env=env)


@pytest.fixture(scope="module")
def hung(preempted: Run, work: Path, data_path: str) -> Run:
    preempted.check()
    env = {
        "SHARDSMITH_TEST_HANG_AT": f"1:{HANG_STEP}",
        "SHARDSMITH_TEST_MARKER_DIR": str(work / "chain-markers"),
    }
    return train(
        work / "chain",
        4,
        data_path,
        "--collective-timeout",
        "8",
        "--hang-factor",
        "2",
        "--hang-min-seconds",
        "0.5",
        env=env,
    )


@pytest.fixture(scope="module")
def restarted(hung: Run, work: Path, data_path: str) -> Run:
    assert hung.returncode != 0, hung.output[-4000:]
    return train(work / "chain", 2, data_path)


@pytest.mark.distributed
def test_sigterm_checkpoints_at_the_next_step_boundary_and_exits_0(preempted: Run) -> None:
    preempted.check()
    assert preempted.committed() == [2, PREEMPT_STEP]
    assert read_latest_hint(Store(str(preempted.root))) == step_dir(PREEMPT_STEP)
    [event] = preempted.events("preempt")
    assert (event["step"], event["checkpoint"]) == (PREEMPT_STEP, True)
    assert "rank 2: SIGTERM: checkpointing at the next step boundary" in preempted.output
    assert "preempted by SIGTERM: the workers checkpointed" in preempted.output  # the launcher
    assert max(preempted.losses()) == PREEMPT_STEP


@pytest.mark.distributed
def test_resume_after_preemption_is_exact(reference: Run, hung: Run) -> None:
    resumed = [r for r in hung.records if "event" not in r and r["step"] > PREEMPT_STEP]
    assert [r["step"] for r in resumed] == list(range(PREEMPT_STEP + 1, HANG_STEP))
    ref = reference.losses()
    assert all(r["loss"] == ref[r["step"]] for r in resumed), resumed
    for step in (4, 6):  # its checkpoints equal the reference's
        assert_tensors_bitwise_equal(
            read_full_tensors(str(hung.root / step_dir(step))),
            read_full_tensors(str(reference.root / step_dir(step))),
            f"step {step}",
        )


@pytest.mark.distributed
def test_hung_rank_fails_the_job_with_every_stack_dumped(hung: Run) -> None:
    assert hung.returncode != 0
    assert "Timed out waiting 8000ms" in hung.output  # the configured collective timeout
    stacks = {
        rank: (hung.root / "hang-stacks" / f"rank-{rank:05d}.txt").read_text() for rank in range(4)
    }
    assert "_test_hang_sleep" in stacks[1]  # where the hung rank sleeps
    for rank in (0, 2, 3):
        assert "global_loss" in stacks[rank] and "all_reduce" in stacks[rank], stacks[rank][-2000:]
    assert any(e["step"] == HANG_STEP for e in hung.events("hang_suspected"))
    assert hung.committed()[-1] == HANG_STEP - 1


@pytest.mark.distributed
def test_restart_on_two_processes_resumes_in_a_new_layout(reference: Run, restarted: Run) -> None:
    restarted.check()
    resume = restarted.events("resume")[-1]
    assert resume["step"] == HANG_STEP - 1 and resume["resharded"]
    assert (resume["saved_layout"]["world_size"], resume["layout"]["dp_shard"]) == (4, 1)
    assert resume["rng"] == "restored"  # same (pp, tp) roles: DP ranks share
    losses, ref = restarted.losses(), reference.losses()
    assert max(losses) == STEPS
    for step in range(HANG_STEP, STEPS + 1):
        assert losses[step] == pytest.approx(ref[step], rel=1e-4), step
    assert restarted.committed()[-1] == STEPS
    assert run_markers(restarted.records) == {
        "restarts": [HANG_STEP - 1],
        "reshards": [HANG_STEP - 1],
        "rollbacks": [],
    }


@pytest.fixture(scope="module")
def nan_run(work: Path, data_path: str) -> Run:
    # batch 2 (step 3): NaN loss on rank 0, skipped. Batches 5, 6, 7 (steps 6, 7, 8): NaN
    # gradients on rank 1, three in a row: roll back to step 6 and skip samples [40, 64).
    env = {"SHARDSMITH_TEST_NAN_AT": "0:2:loss,1:5:grad,1:6:grad,1:7:grad"}
    return train(
        work / "nan", 2, data_path, "--steps", "10", "--max-bad-steps", str(MAX_BAD), env=env
    )


@pytest.mark.distributed
def test_nan_steps_are_skipped_then_rolled_back_past_their_data(nan_run: Run) -> None:
    nan_run.check()
    steps = [r for r in nan_run.records if "event" not in r]
    skipped = [r["step"] for r in steps if r["skipped"]]
    assert skipped == [3, 6, 7, 8]
    assert steps[2]["loss"] is None and steps[5]["grad_norm"] is None
    lr = {r["step"]: r["lr"] for r in steps if r["step"] in (6, 7, 8) and r["skipped"]}
    assert len(set(lr.values())) == 1  # no scheduler step on a skipped step
    [rollback] = nan_run.events("rollback")
    assert (rollback["from_step"], rollback["to_step"], rollback["skip_samples"]) == (
        8,
        6,
        [40, 64],
    )
    [jump] = nan_run.events("data_skip")
    assert (jump["from_sample"], jump["to_sample"]) == (48, 64)
    after = steps[[r["rollbacks"] for r in steps].index(1) :]
    assert [r["step"] for r in after] == [7, 8, 9, 10] and not any(r["skipped"] for r in after)
    with open(nan_run.root / step_dir(10) / "manifest.json") as f:
        state = json.load(f)["state"]
    assert state["fault"]["skipped_steps"] == 4 and state["fault"]["rollbacks"] == 1
    assert state["fault"]["skip_windows"] == [[40, 64]]
    assert state["data"] == {"sample_index": 12 * 8}  # 10 steps + the 2 skipped batches
    final = read_full_tensors(str(nan_run.root / step_dir(10)))
    assert all(torch.isfinite(t).all() for t in final.values())


def test_collective_timeout_set_again_after_init_warns_only_on_a_change(
    gloo_group: None, caplog: pytest.LogCaptureFixture
) -> None:
    from torch.distributed import distributed_c10d

    from shardsmith.trainer.fault.watchdog import apply_collective_timeout

    before = distributed_c10d.default_pg_timeout
    try:
        with caplog.at_level("WARNING", logger="shardsmith.trainer.fault.watchdog"):
            apply_collective_timeout(before.total_seconds())  # an in-process generation's again
            assert not caplog.records
            apply_collective_timeout(before.total_seconds() + 1)
            assert [r.getMessage() for r in caplog.records] == [
                "collective timeout set after init_process_group: applies to new groups only"
            ]
    finally:
        distributed_c10d.default_pg_timeout = distributed_c10d.default_pg_nccl_timeout = before
