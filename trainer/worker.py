"""Worker process body: ``python -m shardsmith.trainer.worker CONFIG.json`` (started by torchrun).

Errors are printed as one line prefixed by the rank, and the process exits 1. A run that
returns early after a preemption checkpoint exits 0. Fatal signals (SIGSEGV, SIGABRT...)
print every thread's Python stack (:mod:`faulthandler`); ``kill -USR2 PID`` prints them
on demand.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import warnings

from shardsmith.trainer.config import TrainConfig


def main(argv: list[str]) -> int:
    # Known-noisy upstream warnings (FSDP2 hook registration, torchrun's OMP notice).
    warnings.filterwarnings("ignore", message=".*_register_pre_backward_hook.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.basicConfig(level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
                        format="%(message)s")
    faulthandler.enable()                                 # stacks on SIGSEGV/SIGABRT/...
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # `kill -USR2 PID` dumps stacks
    with open(argv[0]) as f:
        cfg = TrainConfig.from_json(json.load(f))
    from shardsmith.trainer.train import run_training

    try:
        run_training(cfg)
    except Exception as exc:
        if os.environ.get("SHARDSMITH_DEBUG"):
            raise
        print(f"rank {os.environ.get('RANK', '?')}: error: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
