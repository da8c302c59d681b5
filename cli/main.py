"""The ``shardsmith`` command line. Commands map flags onto configs and call the library.

Errors exit non-zero with one readable line; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Any

import click

from shardsmith.cli import (
    ckpt_commands,
    foreign_commands,
    hf_commands,
    plan_commands,
    reshard_commands,
    run_commands,
)
from shardsmith.cli.train_commands import train, train_config  # noqa: F401 (tests build configs)
from shardsmith.errors import ShardsmithError
from shardsmith.trainer.observe import user_spelling

#: Libraries whose log lines stay off the console unless ``--debug``.
THIRD_PARTY_LOGGERS = ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "asyncio", "torch")


class Group(click.Group):
    """Turns expected errors into one line on stderr and exit code 1."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["shardsmith.argv"] = list(args)  # for user_spelling in error lines
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BrokenPipeError:  # output piped into `head` and closed: not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(0)
        except KeyboardInterrupt:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except (ShardsmithError, ValueError, FileNotFoundError, PermissionError, OSError) as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(
                f"error: {user_spelling(str(exc), ctx.meta.get('shardsmith.argv', []))}", err=True
            )
            ctx.exit(1)


@click.group(
    cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}
)
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@click.version_option(package_name="shardsmith")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """shardsmith: 3D-parallel training with per-shard checkpoints you can reshard."""
    ctx.obj = {"debug": debug}
    if debug:
        os.environ["SHARDSMITH_DEBUG"] = "1"
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not debug:  # third-party log lines (botocore's retries ...) only with --debug
        for name in THIRD_PARTY_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)


cli.add_command(train)
for _module in (
    ckpt_commands,
    foreign_commands,
    hf_commands,
    plan_commands,
    reshard_commands,
    run_commands,
):
    _module.register(cli)


def return_freed_buffers_to_os(threshold_nbytes: int = 1 << 20) -> bool:
    """Make glibc serve allocations >= ``threshold_nbytes`` with their own mmap, returned
    to the OS on free (``mallopt(M_MMAP_THRESHOLD)``, see mallopt(3)).

    By default glibc raises that threshold dynamically up to 32 MiB after the first large
    free, after which freed slabs stay cached in per-thread arenas and the process's RSS
    exceeds the reshard executor's buffer accounting by several slabs. Process-wide, so set
    here, by the entry point that owns the process, never by the library (large allocations
    behave as before the dynamic raise). Returns False where there is no glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, int(threshold_nbytes)))  # -3 = M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def main() -> None:
    """Console-script entry point (also ``python -m shardsmith``, which scale-out reshards run)."""
    return_freed_buffers_to_os()
    cli(prog_name="shardsmith")


if __name__ == "__main__":
    main()
