"""bench/fake_scale.py checks any `shardsmith train` job: its flag path, read by the command
line's own parser, builds the same job as the bench's built-in configurations."""

from __future__ import annotations

import json
import os
import shlex
import sys

import pytest

sys.path.insert(
    0,
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"
    ),
)

import fake_scale  # noqa: E402

#: built-in configuration -> the `shardsmith train` flags of the same job
EQUIVALENT = {
    "llama3-8b:always": "--model llama3-8b --tp 2 --dp-shard 4 --global-batch-size 8 --micro-batch-size 1 "
    "--fsdp-reshard-after-forward always",
    "llama3-8b-sac:never": "--model llama3-8b --tp 2 --dp-shard 4 --global-batch-size 8 --micro-batch-size 1 --bf16 "
    "--activation-checkpointing selective --sequence-parallel --fsdp-reshard-after-forward never",
    # the default policy under pipelining is the once-per-step exchange ("never")
    "llama3-70b:never": "--model llama3-70b --tp 8 --pp 4 --dp-shard 8 --global-batch-size 512 --micro-batch-size 1 "
    "--mixed-precision bf16 --activation-checkpointing --sequence-parallel",
}


@pytest.mark.parametrize("name", sorted(EQUIVALENT))
def test_train_flags_build_the_builtin_job(name: str) -> None:
    builtin = fake_scale._configs()[name]
    got = fake_scale.config_of_flags(shlex.split(EQUIVALENT[name]), name)
    assert got == builtin, (got, builtin)


def test_a_plan_candidate_is_read_and_unrunnable_layouts_are_refused(tmp_path) -> None:
    flags = shlex.split(EQUIVALENT["llama3-70b:never"])
    answer = {"candidates": [{"layout": "pp4·dpr1·dps8·tp8", "flags": flags}]}
    (tmp_path / "plan.json").write_text(json.dumps(answer))
    assert fake_scale.plan_flags(str(tmp_path / "plan.json"), 0) == ("pp4·dpr1·dps8·tp8", flags)
    with pytest.raises(SystemExit, match="no candidate 1"):
        fake_scale.plan_flags(str(tmp_path / "plan.json"), 1)
    with pytest.raises(SystemExit, match="no K/V exchange or token dispatch"):
        fake_scale.config_of_flags(flags + ["--cp", "2"])


V2 = "--model llama3-8b --tp 2 --pp 2 --virtual-stages 2 --dp-shard 2 --global-batch-size 8 --micro-batch-size 1"


def test_virtual_stages_build_every_chunk_a_rank_holds() -> None:
    # pp2 v2: rank 0 holds chunks 0 and 2, rank 1 chunks 1 and 3 (the last); 8 layers each
    c = fake_scale.config_of_flags(shlex.split(V2), "v2")
    assert (c.schedule, c.policy, c.num_microbatches) == ("interleaved-1f1b", "never", 4)
    assert fake_scale.signature(c, 0) == ((True, False, 8), (False, False, 8))
    assert fake_scale.signature(c, 1) == ((False, False, 8), (False, True, 8))
    # the V shape: rank 0 holds the first and the last chunk
    v = fake_scale.config_of_flags(shlex.split(V2 + " --pipeline-schedule zbv"), "zbv")
    assert fake_scale.signature(v, 0) == ((True, False, 8), (False, True, 8))
    # an uneven --pipeline-split: chunk c holds split[c] layers
    split = fake_scale.config_of_flags(shlex.split(V2 + " --pipeline-split 5,9,7,11"), "split")
    assert fake_scale.signature(split, 1) == ((False, False, 9), (False, True, 11))


def test_in_flight_comes_from_torchs_schedule_and_adds_to_the_run() -> None:
    from fake_step import in_flight_counts, measured_peak, schedule_events

    c = fake_scale.config_of_flags(shlex.split(V2), "v2")
    # torch's interleaved 1F1B, R = 2 per round: rank 0 warms up 2*(2-1-0) + 2 = 4 forwards
    assert schedule_events(c, 0)[:6] == [(0, 1), (0, 1), (1, 1), (1, 1), (0, 1), (1, -1)]
    assert in_flight_counts(c, 0, [1, 1]) == {"fwd": (3, 2), "bwd0": (4, 1), "bwd1": (3, 2)}
    assert in_flight_counts(c, 1, [1, 1])["fwd"] == (2, 1)
    assert in_flight_counts(c, 0, [10, 1])["fwd"] == (4, 1)  # weighted: the heavy chunk's peak
    # without virtual stages, 1F1B: min(P - p, M) in every phase
    one = fake_scale._configs()["llama3-70b:never"]
    assert in_flight_counts(one, 1, [5]) == {"fwd": (3,), "bwd0": (3,)}
    # each reading gets the schedule's microbatches of its phase in place of the run's
    got = {
        "per_microbatch_bytes": [10, 100],
        "in_flight": {"fwd": (3, 2), "bwd0": (3, 1), "bwd1": (3, 2)},
        "readings": [
            {"phase": "fwd", "peak_bytes": 1000, "held": [1, 1]},  # 1000 + 2*10 + 1*100
            {"phase": "bwd1", "peak_bytes": 1050, "held": [1, 1]},  # 1050 + 2*10 + 1*100
            {"phase": "bwd0", "peak_bytes": 1500, "held": [1, 0]},  # 1500 + 2*10 + 1*100
        ],
    }
    assert measured_peak(got) == (1620, got["readings"][2])
    got["readings"][2]["peak_bytes"] = 1000
    assert measured_peak(got)[0] == 1170
