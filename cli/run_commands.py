"""``shardsmith plot`` and ``demo``: commands about training runs (flags onto
:mod:`shardsmith.trainer.metrics` and :mod:`shardsmith.cli.demo`)."""

from __future__ import annotations

import click

from shardsmith.cli.options import FieldOption


@click.command("plot")
@click.argument("run_dir")
@click.option("--out", "out_path", default="", metavar="PNG",
              help="Where to write the PNG (default: RUN_DIR/loss.png).")
def plot(run_dir: str, out_path: str) -> None:
    """Draw a run's loss curve as a PNG, with events marked.

    The curve of RUN_DIR/metrics.jsonl, with restarts, reshards
    (a resume in another layout) and rollbacks (after bad steps) marked.

    Needs matplotlib: pip install 'shardsmith[plot]'.
    """
    from shardsmith.trainer.metrics import plot_run

    try:
        written = plot_run(run_dir, out_path)
    except ImportError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {written}")


@click.command(short_help="The main job: train TP2·PP2, reshard, resume on 2.")
@click.option("--dir", "workdir", default="demo-run", show_default=True,
              help="Where the demo's checkpoints go (replaced if present).")
@click.option("--steps", type=int, cls=FieldOption, default_from="shardsmith.cli.demo:run_demo.steps",
              help="Steps before the move.")
@click.option("--more-steps", type=int, cls=FieldOption, default_from="shardsmith.cli.demo:run_demo.more_steps",
              help="Steps after the move.")
def demo(workdir: str, steps: int, more_steps: int) -> None:
    """The main job: train TP2·PP2, reshard to dp_shard=2, resume.

    Trains TP2·PP2 on 4 processes on the Python stdlib, reshards the last checkpoint to
    dp_shard=2, resumes on 2 processes and compares the losses."""
    from shardsmith.cli.demo import run_demo

    run_demo(workdir, steps, more_steps)


def register(cli: click.Group) -> None:
    """Add this module's commands to the ``shardsmith`` group."""
    cli.add_command(plot)
    cli.add_command(demo)
