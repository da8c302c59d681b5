"""A click option that takes every following value up to the next option (``nargs='*'``).

click has no variable-length options; Megatron's ``--data-path 0.7 a 0.3 b`` needs one. The
parser's handler for the option is wrapped so that it also consumes the following arguments
that do not start with ``-`` (the train command has no positional arguments). The option is
still repeatable: ``--data a --data b`` works as before.
"""

from __future__ import annotations

from typing import Any

import click


class GreedyOption(click.Option):
    """``multiple=True`` option that also swallows the values after it (see module doc)."""

    def add_to_parser(self, parser: Any, ctx: click.Context) -> None:
        super().add_to_parser(parser, ctx)
        for name in self.opts:
            option = parser._long_opt.get(name) or parser._short_opt.get(name)
            if option is None:
                continue
            process = option.process

            def greedy(value: Any, state: Any, process: Any = process) -> None:
                process(value, state)
                while state.rargs and not state.rargs[0].startswith("-"):
                    process(state.rargs.pop(0), state)

            option.process = greedy
