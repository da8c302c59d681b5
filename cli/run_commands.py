"""``shardsmith plot`` and ``demo``: commands about training runs (flags onto
:mod:`shardsmith.trainer.observe.metrics` and :mod:`shardsmith.cli.demo`)."""

from __future__ import annotations

import click

from shardsmith.cli.options import FieldOption


@click.command("plot")
@click.argument("run_dirs", nargs=-1, required=True, metavar="RUN_DIR...")
@click.option(
    "--out",
    "out_path",
    default="",
    metavar="PNG",
    help="Where to write the PNG (default: the last RUN_DIR/loss.png).",
)
def plot(run_dirs: tuple[str, ...], out_path: str) -> None:
    """Draw runs' loss, LR, grad norm and tokens/s as one PNG.

    The curves of each RUN_DIR/metrics.jsonl in the order given (oldest first; the main
    job's two runs draw as one curve), with reshards (a resume in another layout),
    restarts and rollbacks (after bad steps) marked.

    Needs matplotlib, which `pip install -e .` does not install: pip install -e ".[plot]"
    in a clone (else: pip install "shardsmith[plot]").
    """
    from shardsmith.trainer.observe import plot_runs

    try:
        written = plot_runs(list(run_dirs), out_path)
    except ImportError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {written}")


@click.command(short_help="The main job: train TP2·PP2 (or MoE), reshard, resume on 2.")
@click.option(
    "--dir",
    "workdir",
    default="demo-run",
    show_default=True,
    help="Where the demo's checkpoints go (replaced if present).",
)
@click.option(
    "--steps",
    type=int,
    cls=FieldOption,
    default_from="shardsmith.cli.demo:run_demo.steps",
    help="Steps before the move.",
)
@click.option(
    "--more-steps",
    type=int,
    cls=FieldOption,
    default_from="shardsmith.cli.demo:run_demo.more_steps",
    help="Steps after the move.",
)
@click.option(
    "--moe",
    is_flag=True,
    help="A 4-expert MoE model: train PP2·EP2 on 4 processes, reshard to TP2 (EP1), resume on 2.",
)
def demo(workdir: str, steps: int, more_steps: int, moe: bool) -> None:
    """The main job: train TP2·PP2, reshard to dp_shard=2, resume.

    Trains TP2·PP2 on 4 processes on the Python stdlib, reshards the last checkpoint to
    dp_shard=2, resumes on 2 processes and compares the losses. With --moe the model is a
    Mixtral-style MoE trained PP2·EP2 and resumed as TP2 with every expert on every rank."""
    from shardsmith.cli.demo import run_demo

    run_demo(workdir, steps, more_steps, moe=moe)


def register(cli: click.Group) -> None:
    """Add this module's commands to the ``shardsmith`` group."""
    cli.add_command(plot)
    cli.add_command(demo)
