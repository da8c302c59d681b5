"""Fault injection for tests: environment variables make a rank die, get a signal, hang
or produce NaNs at a chosen step, or die at a named point inside a save. Inert unless one
of them is set (never in production).

``SHARDSMITH_TEST_CRASH_AT="RANK:POINT[:STEP],..."`` SIGKILLs a rank at a crash point inside
a save (``save.begin``, ``fs.mid_write@FILE``, ``commit.after_manifest`` ...): see
:mod:`shardsmith.storage.crashpoints`, where :func:`crash_point` lives so that storage code
can call it too; it is re-exported here.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from shardsmith.trainer.fault.preemption import say


class FaultHooks:
    """Faults injected by tests through environment variables; inert when none is set.

    ``SHARDSMITH_TEST_KILL_AT="RANK:STEP,..."``: that rank SIGKILLs itself as step STEP starts.
    ``SHARDSMITH_TEST_SIGNAL_AT="RANK:STEP[:SIGNAME[:agent]],..."``: sends itself SIGTERM (or
    SIGNAME), and with ``agent`` its parent too (torchrun's agent, which forwards it to all).
    ``SHARDSMITH_TEST_HANG_AT="RANK:STEP,..."``: sleeps (an hour) inside step STEP, before
    its first world collective, so the other ranks wait in it.
    ``SHARDSMITH_TEST_NAN_AT="RANK:BATCH[:loss|grad],..."``: makes the local loss (default)
    or a gradient of the step that trains on global batch BATCH (sample index / global
    batch size) NaN.
    ``SHARDSMITH_TEST_LOSE_NODE_AT="RANK:STEP,..."``: as step STEP starts, that rank waits for
    its save in flight, deletes its node's local checkpoint tier (the node's disk is gone) and
    SIGKILLs itself; name every rank of a node to lose the whole node. ``RANK:STEP:GEN``: only
    in restart generation GEN (``TORCHELASTIC_RESTART_COUNT``), e.g. a step re-run after a restart.
    ``SHARDSMITH_TEST_KILL_EVERY="RANK:SECONDS"``: that rank SIGKILLs itself as the first step
    starts that is SECONDS after the first step of its trainer (each restart makes a new one):
    a failure after every SECONDS of training, however long start-up and recovery take.
    ``SHARDSMITH_TEST_SLOW="RANK:SECONDS,..."``: that rank sleeps SECONDS after every step's
    forward and backward (a straggler: its compute time grows, its peers wait).
    ``SHARDSMITH_TEST_SLOW_IN="RANK:WHERE:SECONDS,..."``: that rank sleeps SECONDS inside every
    forward of each ``attention`` module (before it computes) or each ``matmul`` (after the
    feed-forward's output projection ``w2``, before its result goes on): a rank slow inside
    its forward, whose peers wait in the collectives of that forward.
    ``SHARDSMITH_TEST_FLIP_BIT_AT="RANK:STEP[:FQN[:BIT]],..."``: in the replay of step STEP
    (``--check-replay-every``), flip bit BIT (default 0) of the first element of the local
    gradient FQN (default: the first parameter with one): a silent data corruption.
    ``SHARDSMITH_TEST_MARKER_DIR``: kills, signals and hangs fire once per (rank, step)
    across restarts (a marker file each); without it, once per process.
    """

    def __init__(self, rank: int, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        self.rank = rank
        self.kill = self._parse(env.get("SHARDSMITH_TEST_KILL_AT", ""))
        self.signal = self._parse(env.get("SHARDSMITH_TEST_SIGNAL_AT", ""))
        self.hang = self._parse(env.get("SHARDSMITH_TEST_HANG_AT", ""))
        self.nan = self._parse(env.get("SHARDSMITH_TEST_NAN_AT", ""))
        self.lose_node = self._parse(env.get("SHARDSMITH_TEST_LOSE_NODE_AT", ""))
        self.marker_dir = env.get("SHARDSMITH_TEST_MARKER_DIR", "")
        self.generation = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        slow = [
            item.split(":")
            for item in env.get("SHARDSMITH_TEST_SLOW", "").split(",")
            if item.strip()
        ]
        self.slow_s = sum(float(seconds) for r, seconds in slow if int(r) == rank)
        self.flip = self._parse(env.get("SHARDSMITH_TEST_FLIP_BIT_AT", ""))
        inside = [
            i.split(":") for i in env.get("SHARDSMITH_TEST_SLOW_IN", "").split(",") if i.strip()
        ]
        self.slow_in = {where: float(sec) for r, where, sec in inside if int(r) == rank}
        every = [
            item.split(":")
            for item in env.get("SHARDSMITH_TEST_KILL_EVERY", "").split(",")
            if item.strip()
        ]
        self.kill_every_s = sum(float(seconds) for r, seconds in every if int(r) == rank)
        self._first_step_t: float | None = None
        self._fired: set[str] = set()

    def _parse(self, spec: str) -> dict[int, str]:
        out: dict[int, str] = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            parts = item.split(":")
            if int(parts[0]) == self.rank:
                out[int(parts[1])] = ":".join(parts[2:])
        return out

    def _once(self, kind: str, step: int) -> bool:
        key = f"{kind}-rank{self.rank}-step{step}"
        if not self.marker_dir:
            if key in self._fired:
                return False
            self._fired.add(key)
            return True
        os.makedirs(self.marker_dir, exist_ok=True)
        try:
            os.close(
                os.open(os.path.join(self.marker_dir, key), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            )
        except FileExistsError:
            return False
        return True

    def at_step_start(self, step: int, on_node_loss: Callable[[], None] | None = None) -> None:
        """Kill or signal this rank as step ``step`` starts, if asked (a node loss calls
        ``on_node_loss`` first: wipe the local tier)."""
        gen = self.lose_node.get(step, "")
        if (
            step in self.lose_node
            and (not gen or int(gen) == self.generation)
            and self._once("lose-node", step)
        ):
            say(f"rank {self.rank}: test hook: node lost at step {step}")
            if on_node_loss is not None:
                on_node_loss()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kill_every_s and self._first_step_t is None:
            self._first_step_t = time.time()
        if (
            self.kill_every_s
            and time.time() - (self._first_step_t or 0) >= self.kill_every_s
            and self._once("kill-every", step)
        ):
            say(
                f"rank {self.rank}: test hook: SIGKILL at step {step} ({self.kill_every_s:g} s since the last)"
            )
            os.kill(os.getpid(), signal.SIGKILL)
        if step in self.kill and self._once("kill", step):
            say(f"rank {self.rank}: test hook: SIGKILL at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        if step in self.signal and self._once("signal", step):
            name, _, to_agent = self.signal[step].partition(":")
            sig = signal.Signals[name or "SIGTERM"]
            os.kill(os.getpid(), sig)
            if to_agent == "agent":  # torchrun's agent: it forwards to all
                os.kill(os.getppid(), sig)

    def in_step(self, step: int) -> None:
        """Hang inside step ``step``, if asked."""
        if step in self.hang and self._once("hang", step):
            say(f"rank {self.rank}: test hook: hanging in step {step}")
            _test_hang_sleep()

    def nan_target(self, batch: int) -> str:
        """``"loss"``, ``"grad"`` or ``""``: what to make NaN in the step training on ``batch``."""
        if batch not in self.nan:
            return ""
        return self.nan[batch] or "loss"

    def corrupt(self, batch: int, model: torch.nn.Module, local_loss: torch.Tensor) -> torch.Tensor:
        """The local loss to report for global batch ``batch``: NaN if asked; or, for
        ``grad``, the first local gradient filled with NaN (after backward)."""
        target = self.nan_target(batch)
        if target == "loss":
            return local_loss * float("nan")
        if target == "grad":
            for p in model.parameters():
                if p.grad is not None:
                    (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).fill_(
                        float("nan")
                    )
                    break
        return local_loss

    def slow_down(self) -> None:
        """Sleep ``SHARDSMITH_TEST_SLOW``'s seconds for this rank (after forward and backward)."""
        if self.slow_s > 0:
            time.sleep(self.slow_s)

    def slow_inside(self, model: torch.nn.Module) -> None:
        """Make this rank's forward slow inside ``SHARDSMITH_TEST_SLOW_IN``'s modules."""
        if not self.slow_in:
            return
        attention, matmul = self.slow_in.get("attention", 0.0), self.slow_in.get("matmul", 0.0)
        for name, module in model.named_modules():
            if attention and type(module).__name__ == "Attention":
                module.register_forward_pre_hook(lambda *_: time.sleep(attention))
            if matmul and name.endswith("feed_forward.w2"):
                module.register_forward_hook(lambda *_: time.sleep(matmul))

    def flip_bit(self, step: int, model: torch.nn.Module) -> None:
        """Flip the asked bit of one local gradient element, in step ``step``'s replay."""
        if step not in self.flip:
            return
        fqn, _, bit = self.flip[step].partition(":")
        for name, p in model.named_parameters():
            if p.grad is not None and (not fqn or name == fqn):
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                flat = g.view(-1)[:1].view(
                    {2: torch.int16, 4: torch.int32, 8: torch.int64}[g.element_size()]
                )
                flat ^= 1 << int(bit or 0)
                say(
                    f"rank {self.rank}: test hook: flipped bit {bit or 0} of {name}[0] in step {step}'s replay"
                )
                return


def _test_hang_sleep() -> None:
    """Named so a stack dump shows where the test hook hangs."""
    time.sleep(3600)
