"""The benches' paired-round statistics (bench/robust.py) and peer lockstep (bench/lockstep.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

sys.path.insert(
    0,
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"
    ),
)

import lockstep  # noqa: E402
import robust  # noqa: E402


def test_paired_is_the_median_of_per_round_ratios_with_its_spread() -> None:
    # theirs / ours per round: 2.0, 4.0, 3.0, 10.0 -> median 3.5 (not 19 / 5.5 = 3.45, the ratio of sums)
    stat = robust.paired([2.0, 8.0, 3.0, 10.0], [1.0, 2.0, 1.0, 1.0])
    assert stat["median"] == pytest.approx(3.5)
    assert (stat["min"], stat["max"]) == (2.0, 10.0)
    assert stat["q1"] == pytest.approx(2.75) and stat["q3"] == pytest.approx(5.5)
    assert robust.paired([1.0, None, 3.0], [1.0, 1.0, 0.0])["rounds"] == [
        1.0
    ]  # missing rounds dropped
    with pytest.raises(ValueError, match="no round"):
        robust.paired([None], [1.0])


def test_a_spread_that_straddles_the_goal_is_within_noise_not_met_or_missed() -> None:
    stat = robust.spread([0.9, 1.05, 1.2])
    assert robust.verdict(stat, ">=", 1.0) == "within noise"
    assert robust.verdict(stat, ">=", 0.8) == "met"
    assert robust.verdict(stat, ">=", 1.3) == "missed"
    assert robust.verdict(stat, "<=", 1.3) == "met"
    assert robust.verdict(stat, "<=", 0.85) == "missed"
    lines, noise = robust.judge(
        {"a": (stat, ">=", 1.0), "b": (stat, ">=", 0.5), "c": (None, ">=", 1.0)}
    )
    assert list(noise) == ["a"]
    assert noise["a"]["goal"] == ">= 1" and noise["a"]["q1"] <= 1.0 <= noise["a"]["q3"]
    assert len(noise["a"]["load"]) == 3
    assert "within noise" in lines[0] and "met" in lines[1] and "not measured" in lines[2]


def test_lockstep_runs_the_peer_round_by_round_then_stops(tmp_path) -> None:
    """The peer's real round loop (lockstep.serve_rounds, one gloo rank) against the bench side."""
    import torch.distributed as dist

    ctrl = str(tmp_path)
    lockstep._write(os.path.join(ctrl, "bench"), {"pid": os.getpid()})
    seen: list[int] = []

    def one_round(r: int) -> dict:
        seen.append(r)
        return {"round": r}

    def peer() -> None:  # what every rank of a peer does
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1
        )
        try:
            lockstep.serve_rounds(ctrl, one_round)
        finally:
            dist.destroy_process_group()

    thread = threading.Thread(target=peer)
    thread.start()

    class Bench(lockstep.PeerProcess):  # the bench side, with a thread for the process
        def __init__(self) -> None:
            self.ctrl = ctrl

        def alive(self) -> bool:
            return thread.is_alive()

    bench = Bench()
    assert bench.ready(timeout_s=30)
    assert [bench.round(r, timeout_s=30)["round"] for r in range(3)] == [0, 1, 2]
    lockstep._write(os.path.join(ctrl, "stop"), {})
    thread.join(30)
    assert seen == [0, 1, 2] and not thread.is_alive()


def test_a_peer_stops_when_its_bench_is_gone(tmp_path) -> None:
    ctrl = str(tmp_path)
    lockstep._write(os.path.join(ctrl, "bench"), {"pid": os.getpid()})
    assert lockstep._bench_alive(ctrl)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lockstep._write(os.path.join(ctrl, "bench"), {"pid": dead.pid})
    assert not lockstep.peer_next(ctrl, 0)


def _figs(ours_tok: float, titan_tok: float | None, rss: float = 500.0) -> dict[str, list]:
    ours = {
        "tokens_per_s": ours_tok,
        "rss_mib": rss,
        "step_s": 1.0,
        "sync_s": 0.1,
        "async_blocked": 0.01,
    }
    titan = (
        None
        if titan_tok is None
        else {"tokens_per_s": titan_tok, "rss_mib": 800.0, "sync_s": 0.4, "async_blocked": 0.2}
    )
    return {"ours": [ours, ours, ours], "titan": [titan, titan, titan]}


def test_train_vs_peers_headline_is_the_worst_layout_torchtitan_ran() -> None:
    import train_vs_peers

    stats = train_vs_peers.ratios(
        {"1.1.2.2": _figs(1200.0, 1000.0), "2.1.1.2": _figs(900.0, 1000.0)}
    )
    assert stats["tokens_per_s_vs_torchtitan"]["median"] == pytest.approx(
        0.9
    )  # the worse of 1.2 and 0.9
    assert stats["peak_rss_vs_torchtitan"]["median"] == pytest.approx(500 / 800)
    # a layout torchtitan failed every round drops out of the headline instead of blanking it
    stats = train_vs_peers.ratios({"1.1.2.2": _figs(1200.0, 1000.0), "2.1.1.2": _figs(900.0, None)})
    assert stats["tokens_per_s_vs_torchtitan"]["median"] == pytest.approx(1.2)
    assert stats["tokens_per_s_vs_torchtitan.2.1.1.2"] is None
    assert (
        train_vs_peers.ratios({"2.1.1.2": _figs(900.0, None)})["tokens_per_s_vs_torchtitan"] is None
    )


def test_train_vs_peers_fails_a_run_whose_stage_got_no_gradients() -> None:
    import train_vs_peers

    ranks = [
        {"grads": {"with_grad": 20, "params": 20}},
        {"grads": {"with_grad": 0, "params": 19}},
        {},
    ]
    assert train_vs_peers.without_gradients(ranks) == ["rank 1: 0 of 19"]
    assert train_vs_peers.without_gradients(ranks[:1] + ranks[2:]) == []
