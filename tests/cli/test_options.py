"""The command line's options: one definition each, defaults from the dataclasses, one size
rule, and readable ``--help``. Pure: no process group."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from shardsmith.cli.main import cli, train_config
from shardsmith.cli.options import FieldOption, default_of, make_dims
from shardsmith.cli.train_commands import train
from shardsmith.errors import LayoutError
from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.layout.sizes import format_nbytes, parse_nbytes, short_nbytes


@pytest.mark.parametrize(
    "text, nbytes",
    [
        ("4096", 4096),
        (4096, 4096),
        ("1B", 1),
        ("1 b", 1),
        ("1KB", 10**3),
        ("500MB", 500 * 10**6),
        ("5GB", 5 * 10**9),
        ("2TB", 2 * 10**12),
        ("1KiB", 2**10),
        ("256MiB", 256 * 2**20),
        ("2GiB", 2 * 2**30),
        ("1TiB", 2**40),
        ("500mb", 500 * 10**6),
        ("2gib", 2 * 2**30),
        (" 1.5KB ", 1500),
        ("1.5KiB", 1536),
        ("0.5GB", 5 * 10**8),
    ],
)
def test_size_rule_decimal_and_binary(text, nbytes) -> None:
    assert parse_nbytes(text) == nbytes


@pytest.mark.parametrize(
    "text, needle",
    [
        ("5 parsecs", "not a size"),
        ("1G", "ambiguous"),
        ("2m", "ambiguous"),
        ("", "not a size"),
        ("-1MB", "not a size"),
        ("0", ">= 1"),
        ("0.5B", "whole number"),
        ("1.0001KB", "whole number"),
        ("1e9", "not a size"),
    ],
)
def test_size_rule_refuses_garbage_with_one_line(text, needle) -> None:
    with pytest.raises(ValueError, match=needle) as err:
        parse_nbytes(text)
    assert "\n" not in str(err.value) and repr(str(text)) in str(err.value)


def test_size_spellings_round_trip() -> None:
    for n in (1, 1000, 1023, 1024, 256 * 2**20, 5 * 10**9, 2**40, 10**12, 123456789):
        assert parse_nbytes(short_nbytes(n)) == n
    assert short_nbytes(256 * 2**20) == "256MiB" and short_nbytes(5 * 10**9) == "5GB"
    assert format_nbytes(256 * 2**20) == "256.0 MiB" and format_nbytes(1000) == "1,000 B"


def test_max_buffer_and_max_shard_size_agree_on_units(tmp_path) -> None:
    """The bug this replaces: --max-buffer 500MB was 524,288,000 bytes, --max-shard-size 500MB 5e8."""
    from shardsmith.cli.hf_commands import export_hf
    from shardsmith.cli.reshard_commands import reshard

    a = reshard.make_context("reshard", ["a", "b", "--max-buffer", "500MB"]).params[
        "max_buffer_nbytes"
    ]
    b = export_hf.make_context("export-hf", ["a", "b", "--max-shard-size", "500MB"]).params[
        "max_shard_nbytes"
    ]
    assert a == b == 500_000_000
    result = CliRunner().invoke(cli, ["reshard", "a", "b", "--max-buffer", "lots"])
    assert result.exit_code == 2 and "not a size" in result.output


def _field_options(command: click.Command) -> list[FieldOption]:
    return [p for p in command.params if isinstance(p, FieldOption)]


def test_train_defaults_are_the_dataclass_defaults() -> None:
    from shardsmith.trainer.config import FaultConfig, TrainConfig

    params = train.make_context("train", []).params
    options = _field_options(train)
    assert len(options) >= 30
    for opt in options:
        assert params[opt.name] == default_of(opt.default_from), opt.name
        assert type(params[opt.name]) is type(default_of(opt.default_from)), opt.name
    # No flags at all: exactly the dataclasses' defaults (dp_shard -1 with no world size = 1).
    assert train_config(params, None) == TrainConfig(fault=FaultConfig(derive_dp_shard=True))


def test_other_commands_read_library_defaults() -> None:
    from shardsmith.cli.ckpt_commands import gc_command
    from shardsmith.cli.reshard_commands import reshard
    from shardsmith.reshard.planner import ReshardOptions
    from shardsmith.storage.gc import DEFAULT_GRACE_SECONDS

    params = reshard.make_context("reshard", ["a", "b"]).params
    assert params["max_buffer_nbytes"] == ReshardOptions().max_buffer_nbytes
    assert params["workers"] == ReshardOptions().workers
    assert gc_command.make_context("gc", ["r"]).params["grace_seconds"] == DEFAULT_GRACE_SECONDS
    help_text = CliRunner().invoke(cli, ["reshard", "--help"], terminal_width=100).output
    assert "[default: 256MiB]" in help_text and "powers of 1024" in help_text


def test_dtype_and_format_choices_are_one_set() -> None:
    from shardsmith.cli.hf_commands import export_hf
    from shardsmith.cli.reshard_commands import reshard

    def choices(command: click.Command, name: str) -> list[str]:
        return list(next(p for p in command.params if p.name == name).type.choices)

    assert choices(reshard, "dtype") == choices(export_hf, "dtype")
    assert (
        choices(reshard, "tensor_format")
        == choices(train, "tensor_format")
        == ["safetensors", "zarr"]
    )


def test_make_dims_derives_dp_shard_from_the_world_size() -> None:
    assert make_dims(2, 1, -1, 1, (), 8) == ParallelDims(tp=2, dp_shard=4)
    assert make_dims(2, 2, -1, 1, (3, 1), None) == ParallelDims(tp=2, pp=2, pipeline_split=(3, 1))
    assert ParallelDims.for_world_size(16, pp=2, tp=2) == ParallelDims(pp=2, tp=2, dp_shard=4)
    with pytest.raises(
        LayoutError, match=r"world size 6 is not a multiple of pp\*dp_replicate\*tp=4"
    ):
        make_dims(2, 2, -1, 1, (), 6)
    with pytest.raises(LayoutError, match="needs 4 processes but 2"):
        make_dims(2, 1, 2, 1, (), 2)


def test_command_summaries_fit_80_columns() -> None:
    result = CliRunner().invoke(cli, ["--help"], terminal_width=80)
    assert result.exit_code == 0
    lines = result.output.split("Commands:\n", 1)[1].splitlines()
    assert len(lines) == len(cli.commands) >= 11
    for line in lines:
        assert len(line) <= 80 and "..." not in line and "…" not in line, line


def test_every_command_help_renders() -> None:
    for name in cli.commands:
        result = CliRunner().invoke(cli, [name, "--help"], terminal_width=80)
        assert result.exit_code == 0, (name, result.output)


def test_model_flags_default_to_tiny_and_show_it() -> None:
    params = train.make_context("train", []).params
    assert params["num_layers"] is None and params["model_preset"] is None
    assert train_config(params, None).model == ModelConfig()
    help_text = CliRunner().invoke(cli, ["train", "--help"], terminal_width=100).output
    assert "llama3-8b" in help_text and "tiny: 4" in help_text


def test_inspect_shows_the_model_config(tmp_path) -> None:
    from ckpt_factory import MODEL, full_tensors, save_offline

    from shardsmith.storage.store.fs import Store

    save_offline(Store(str(tmp_path)), 3, ParallelDims(tp=2), full_tensors())
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "layout pp1·dpr1·dps1·tp2 (2 ranks)" in result.output
    from math import prod

    from shardsmith.layout.sharding import param_specs

    num_params = sum(prod(s.shape) for s in param_specs(MODEL, ParallelDims()).values())
    assert (
        "model custom: 2 layers, hidden 32, 4 heads (2 kv), ffn 64, vocab 256, seq 16"
        in result.output
    )
    assert f"; {num_params:,} parameters" in result.output
