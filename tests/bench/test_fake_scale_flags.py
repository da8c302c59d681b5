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
    with pytest.raises(SystemExit, match="one model chunk per pipeline rank"):
        fake_scale.config_of_flags(flags + ["--virtual-stages", "2"])
