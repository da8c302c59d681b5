"""Checkpoint-vs-job compatibility checks (pure): shape fields refuse, harmless ones warn."""

from __future__ import annotations

import dataclasses

import pytest

from shardsmith.errors import CheckpointMismatch
from shardsmith.layout import ModelConfig
from shardsmith.layout.compat import (
    check_has_optimizer_state,
    check_model_compatible,
    check_tensor_names,
    model_differences,
)
from shardsmith.layout.dims import ParallelDims
from shardsmith.layout.sharding import checkpoint_specs

BASE = ModelConfig(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=128,
    seq_length=64,
)


def _saved(**changes):
    return dataclasses.asdict(dataclasses.replace(BASE, **changes))


def test_same_model_has_no_difference():
    assert model_differences(_saved(), BASE) == ([], [])
    assert check_model_compatible(_saved(), BASE, source="runs/a") == []


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_layers", 2),
        ("hidden_size", 128),
        ("num_kv_heads", 4),
        ("ffn_hidden_size", 256),
        ("vocab_size", 512),
        ("tie_embeddings", True),
        ("num_attention_heads", 8),
    ],
)
def test_shape_field_refused_naming_both_values(field, value):
    with pytest.raises(CheckpointMismatch) as err:
        check_model_compatible(_saved(**{field: value}), BASE, source="runs/a/step-000000008")
    msg = str(err.value)
    assert f"{field}: checkpoint {value!r}, this job {getattr(BASE, field)!r}" in msg
    assert "runs/a/step-000000008" in msg and "\n" not in msg


def test_every_differing_shape_field_is_named():
    with pytest.raises(CheckpointMismatch) as err:
        check_model_compatible(
            _saved(num_layers=2, vocab_size=300, seq_length=32), BASE, source="x"
        )
    assert "num_layers" in str(err.value) and "vocab_size" in str(err.value)
    assert "seq_length" not in str(err.value)


def test_harmless_fields_warn():
    warnings = check_model_compatible(_saved(seq_length=128, rope_theta=500000.0), BASE, source="x")
    assert len(warnings) == 1
    assert "seq_length: checkpoint 128, this job 64" in warnings[0]
    assert "rope_theta: checkpoint 500000.0, this job 10000.0" in warnings[0]


def test_old_record_missing_a_field_uses_the_default():
    saved = _saved()
    del saved["norm_eps"]
    assert model_differences(saved, BASE) == ([], [])


def test_tensor_names_missing_and_unexpected():
    specs = checkpoint_specs(BASE, ParallelDims(), with_optimizer=False)
    names = set(specs)
    check_tensor_names(names, names, source="x")
    with pytest.raises(CheckpointMismatch, match=r"missing 1: output\.weight"):
        check_tensor_names(names - {"output.weight"}, names, source="x")
    with pytest.raises(CheckpointMismatch, match=r"unexpected 1: layers\.9\.attention\.wq\.weight"):
        check_tensor_names(names | {"layers.9.attention.wq.weight"}, names, source="x")
    # weights-only loads ignore the optimizer state a full checkpoint holds
    full = set(checkpoint_specs(BASE, ParallelDims()))
    check_tensor_names(full, names, source="x", optimizer_prefixes=("optim.",))
    with pytest.raises(CheckpointMismatch, match="unexpected"):
        check_tensor_names(full, names, source="x")


def test_resume_without_optimizer_state_refused():
    check_has_optimizer_state(set(checkpoint_specs(BASE, ParallelDims())), source="x")
    with pytest.raises(CheckpointMismatch, match="--init-from.*--reset-optimizer"):
        check_has_optimizer_state(
            set(checkpoint_specs(BASE, ParallelDims(), with_optimizer=False)),
            source="runs/mo/step-000000004",
        )
