"""``shardsmith plot``: commands about a training run's directory (flags onto
:mod:`shardsmith.trainer.metrics`)."""

from __future__ import annotations

import click


@click.command("plot")
@click.argument("run_dir")
@click.option("--out", "out_path", default="", metavar="PNG",
              help="Where to write the PNG (default: RUN_DIR/loss.png).")
def plot(run_dir: str, out_path: str) -> None:
    """Draw the loss curve of RUN_DIR/metrics.jsonl as a PNG, with restarts, reshards
    (a resume in another layout) and rollbacks (after bad steps) marked.

    Needs matplotlib: pip install 'shardsmith[plot]'.
    """
    from shardsmith.trainer.metrics import plot_run

    try:
        written = plot_run(run_dir, out_path)
    except ImportError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {written}")


def register(cli: click.Group) -> None:
    """Add this module's commands to the ``shardsmith`` group."""
    cli.add_command(plot)
