"""The dry run's memory estimate against what the real trainer code allocates, at full world size.

For each configuration, one rank of every pipeline rank (each in its own process:
``bench/fake_step.py``) builds every model chunk that rank holds, as the trainer does
(:func:`shardsmith.trainer.parallel.chunk_model` on ``meta``, then
:func:`shardsmith.trainer.parallel.parallelize` per chunk: TP, sequence parallelism, activation
checkpointing, FSDP2; with ``--virtual-stages V`` the V chunks ``ParallelDims.chunk_ids`` names,
``r, r + P, ...`` or the V shape of ``zbv`` / ``dualpipev``, over ``--pipeline-split``) on a fake
process group of the job's full world size
(``torch.testing._internal.distributed.fake_pg``), materializes it under ``FakeTensorMode``
(nothing is allocated), and runs one training step under PyTorch's memory tracker
(``torch.distributed._tools.mem_tracker.MemTracker``): forward, backward (the trainer's
autocast, loss parallelism and :func:`shardsmith.trainer.step.loss_fn`) and the AdamW step of
:func:`shardsmith.trainer.optim.build_optimizer`. The tracker's peak is printed next to the dry
run's ``tracked_peak_bytes`` for the same stage (:func:`shardsmith.sizing.estimate.estimate`:
the estimate before the CUDA/NCCL context and the allocator margin, which a fake tensor cannot
see).

What it proves: for every pipeline stage of each job (8, 256 and 1,024 ranks), the bytes the
real model and parallel code hold at the step's peak (tracked per storage by PyTorch, nothing
allocated) are within :data:`TOLERANCE` of the estimate, term by term visible in ``by_kind``.
What it samples: one rank per stage (tp = dp_shard = 0, the rank with the largest shares), one
microbatch per chunk, and one run per distinct stage (below).

The tracker (``fake_step._tracker_class``), two changes to ``MemTracker`` that alter no figure:

* DTensor's sharding propagation computes each op's output shape on fake tensors of the
  *global* shape (``_sharding_prop``: ``detect_fake_mode() or FakeTensorMode()``). In an eager
  run that is a fake mode of its own, which the tracker skips by its own rule; under this
  bench's outer fake mode it was the same mode, so the tracker counted global-shape shadows
  that no device ever holds (the last stage's log-softmax: two fp32 ``(b, s, V)`` tensors,
  7.8 GiB of a 13.4 GiB "peak" for 70B). The bench gives the propagation a mode of its own.
* ``MemTracker`` updates module peaks after every op by scanning every module seen so far
  (quadratic in layers); the bench looks up only the active modules by name. Profile:
  ``python -m cProfile -s cumtime bench/fake_scale.py --stage-of llama3-70b 1``.

Every job runs under both FSDP exchange policies (``--fsdp-reshard-after-forward``): ``always``
(parameters resharded after every forward, gradients reduced every microbatch) and ``never``
(the default under pipelining: the stage's parameters stay gathered and its gradients accumulate
unsharded for the step). Under ``never`` the stage runs two microbatches with gradient sync and
reshard-after-backward off, as every microbatch before a step's last does, so the second's
backward meets the first's accumulated unsharded gradients. All forwards run before the
backwards (the tracker takes one root call); each microbatch's chunks then run backward, the
last chunk first, as torch's interleaved 1F1B orders them. The bench reads the tracker's peak
once for the forwards and once per backward (the peak tracked from that backward's start), and
in each reading puts the microbatches the schedule holds in that phase (just before a backward
of that chunk) in place of those the run holds then; the measured peak is the largest reading
(``fake_step.measured_peak``; ``peak in`` names its phase). A single peak for the whole run
with every chunk's in-flight microbatches added put the 405B plan's embedding-gradient
backward (rank 0) beside 112 chunk microbatches where torch holds 16 there; without a reading
per backward a one-stage ``never`` job looked 14-21 % over-estimated (its peak held a
microbatch and a part, and a whole one was taken off).

What is not the trainer's own code path, and why:

* the pipeline schedule's sends and receives cannot run on a fake group, so each stage runs its
  forward and backward directly on inputs of the stage's input shape (hidden states
  ``(b, s, h)``, ``(b, s/tp, h)`` under sequence parallelism; tokens on stage 0) and, off the
  last stage, a gradient of the output's shape;
* the microbatches a stage holds in flight: ``k = min(P - p, M)`` under 1F1B; with virtual
  stages one count per chunk and phase, read from torch's own schedule
  (``fake_step.in_flight_counts``: the job's torch schedule class built on stand-in stages,
  its ``pipeline_order`` walked to the point of most held bytes after a forward and before each
  chunk's backwards). The stage runs one microbatch per chunk; the activation bytes each chunk
  keeps (measured: the tracker's activation total after its forward minus before it) stand
  for the chunk's other microbatches, which keeps the bench's CPU time to a minute or two;
* stages whose run would be the same (:func:`signature`: per chunk first, last, number of
  layers; e.g. the 14 middle stages of the 1,024-rank job) run once, and each is reported with
  its own microbatches in flight;
* the optimizer step runs under the tracker, but its peak is reported apart and not compared:
  under fake tensors the tracker keeps every temporary of the single-tensor AdamW counted
  (``exp_avg_sq.sqrt()`` and the like: optimizer memory 4.9x the parameter bytes on a small
  model, 2.4x with real tensors), and with real tensors the step needs the weights, gradients
  and AdamW state plus about three of the largest shard's size, below the backward peak;
* the step is a steady-state one: the rank's AdamW state
  (:func:`shardsmith.trainer.checkpoint.save_load.init_optimizer_state`) and sharded gradients exist
  before it, as in every step after the first and every microbatch after the first.

Any job, not only the built-in ones: ``--train-flags`` takes the flags of a ``shardsmith train``
command, read by the command line's own parser (``cli/train_commands.py: train_config``, then
``cli/dry_run.py: job_of``, the dry run's job), and ``--plan-json`` a ``shardsmith plan --json``
answer (its ``--candidate``-th candidate's ``flags``), so the planner's choices can be checked.
Give ``--dp-shard`` (or ``--nproc-per-node``): the world size is the layout's. Virtual stages
follow ``--virtual-stages``, ``--pipeline-split`` and ``--pipeline-schedule`` (default
``interleaved-1f1b``). Layouts with context or expert parallelism are refused: the bench runs no
K/V exchange or token dispatch.

    OMP_NUM_THREADS=1 python bench/fake_scale.py               # all configs, table + JSON last line
    python bench/fake_scale.py --only llama3-8b                # one job, both policies
    python bench/fake_scale.py --only llama3-8b:never          # one job, one policy
    python bench/fake_scale.py --train-flags "--model llama3-8b --tp 2 --dp-shard 4 --global-batch-size 8"
    python bench/fake_scale.py --train-flags "--model llama3-8b --tp 2 --pp 2 --virtual-stages 2 \\
        --dp-shard 2 --global-batch-size 8 --micro-batch-size 1"    # V = 2: two chunks a rank
    shardsmith plan --model llama3-8b --gpus 64 --gpu h100 --global-batch-size 256 --json > p.json
    python bench/fake_scale.py --plan-json p.json --candidate 0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.sizing.estimate import estimate
from shardsmith.sizing.presets import resolve_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_step import in_flight_counts, measured_peak, run_stage, stand_in_schedule  # noqa: E402

TOLERANCE = 0.15


@dataclass(frozen=True)
class Config:
    """One job: model, layout and the step's settings."""

    name: str
    model: ModelConfig
    dims: ParallelDims
    global_batch_size: int
    micro_batch_size: int = 1
    bf16: bool = False
    ac: bool | str = False  # True: full; "op" / "N": selective (TrainConfig.ac_policy)
    sp: bool = False
    policy: str = "always"
    schedule: str = ""  # --pipeline-schedule with virtual stages (trainer/pipeline.py SCHEDULES)

    @property
    def num_microbatches(self) -> int:
        """Microbatches per data-parallel rank and step, ``M``."""
        return self.global_batch_size // (self.micro_batch_size * self.dims.dp)


def _configs() -> dict[str, Config]:
    # the 1,024-rank job of bench/scale_sim.py ("main": ~410B parameters, seq 4096)
    big = ModelConfig(
        num_layers=128,
        hidden_size=16384,
        num_attention_heads=128,
        num_kv_heads=8,
        ffn_hidden_size=53248,
        vocab_size=128256,
        seq_length=4096,
    )
    jobs = (
        Config("llama3-8b", resolve_model("llama3-8b", {}), ParallelDims(tp=2, dp_shard=4), 8),
        Config(
            "llama3-8b-sac",
            resolve_model("llama3-8b", {}),
            ParallelDims(tp=2, dp_shard=4),
            8,
            bf16=True,
            ac="op",
            sp=True,
        ),
        Config(
            "llama3-70b",
            resolve_model("llama3-70b", {}),
            ParallelDims(tp=8, pp=4, dp_shard=8),
            512,
            bf16=True,
            ac=True,
            sp=True,
        ),
        Config(
            "410b-1024",
            big,
            ParallelDims(tp=8, pp=16, dp_shard=8),
            1024,
            bf16=True,
            ac=True,
            sp=True,
        ),
    )
    # both FSDP exchange policies: per microbatch ("always") and once per step ("never")
    return {
        f"{c.name}:{policy}": dataclasses.replace(c, name=f"{c.name}:{policy}", policy=policy)
        for c in jobs
        for policy in ("always", "never")
    }


def config_of_flags(flags: list[str], name: str = "flags") -> Config:
    """The job of ``shardsmith train`` flags, read by the command line's own parser
    (``train``'s click context, ``train_config``, ``check_layout``, ``job_of``), under the
    FSDP exchange policy the flags resolve to (``default``: ``never`` under pipelining;
    ``never`` under a zero-bubble schedule, as ``trainer/pipeline.py: build_schedule`` does).

    Raises:
        click.UsageError / ConfigError / LayoutError: flags ``train`` itself refuses.
        SystemExit: a layout this bench cannot build (module doc).
    """
    from shardsmith.cli.dry_run import job_of
    from shardsmith.cli.train_commands import train, train_config
    from shardsmith.layout import reshards_after_forward
    from shardsmith.trainer.config import default_schedule
    from shardsmith.trainer.pipeline import splits_backward

    params = train.make_context("train", list(flags)).params
    cfg = train_config(params, params["nproc_per_node"])
    cfg.check_layout()
    job = job_of(cfg)
    d = job.dims
    if d.cp > 1 or d.expert_parallel > 1:
        raise SystemExit(
            f"{name}: layout {d.describe()}: this bench runs no K/V exchange or token dispatch; "
            "check a candidate with --cp 1 and --expert-parallel 1"
        )
    c = Config(
        name,
        job.model,
        d,
        job.global_batch_size,
        job.micro_batch_size,
        bf16=job.mixed_precision == "bf16",
        ac=job.activation_checkpointing,
        sp=job.sequence_parallel,
        policy="always"
        if reshards_after_forward(job.fsdp_reshard_after_forward, d.pp)
        else "never",
        schedule=(cfg.pipeline_schedule or default_schedule(d.virtual_stages))
        if d.virtual_stages > 1
        else "",
    )
    if c.schedule and splits_backward(stand_in_schedule(c, 0)):
        c = dataclasses.replace(c, policy="never")  # as build_schedule: once per step
    return c


def plan_flags(path: str, candidate: int) -> tuple[str, list[str]]:
    """(layout name, ``flags``) of candidate ``candidate`` of a ``shardsmith plan --json``
    answer in ``path`` (``-``: standard input)."""
    text = sys.stdin.read() if path == "-" else open(path).read()
    cands = json.loads(text).get("candidates") or []
    if not 0 <= candidate < len(cands):
        raise SystemExit(f"{path}: no candidate {candidate} (it has {len(cands)})")
    return cands[candidate]["layout"], list(cands[candidate]["flags"])


def estimate_of(c: Config) -> Any:
    """The dry run's estimate of ``c`` (:func:`shardsmith.sizing.estimate.estimate`) for the
    sampled rank of each stage (``first_rank_only``: tp = dp_shard = 0, as :func:`run_stage`)."""
    return estimate(
        c.model,
        c.dims,
        first_rank_only=True,
        micro_batch_size=c.micro_batch_size,
        global_batch_size=c.global_batch_size,
        activation_checkpointing=c.ac,
        mixed_precision="bf16" if c.bf16 else "fp32",
        sequence_parallel=c.sp,
        fsdp_reshard_after_forward=c.policy,
    )


def signature(c: Config, stage: int) -> tuple[tuple[bool, bool, int], ...]:
    """What a pipeline rank's run depends on: for each of its chunks (in order), first, last
    and its number of layers. Ranks with equal signatures build the same modules on the same
    shapes (only the rank's mesh coordinates differ), so one run stands for all of them; each
    is reported with its own microbatches in flight."""
    from shardsmith.layout import chunk_layers

    layers, last = chunk_layers(c.model, c.dims), c.dims.num_chunks - 1
    return tuple((k == 0, k == last, len(layers[k])) for k in c.dims.chunk_ids(stage))


def _stage_subprocess(name: str, stage: int, extra: tuple[str, ...]) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--stage-of", name, str(stage), *extra],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode:
        raise RuntimeError(f"{name} stage {stage} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_config(c: Config, workers: int, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every stage of ``c`` (in ``workers`` processes at a time) against the estimate;
    ``extra``: the arguments that name a flag job to the stage processes."""
    t0 = time.perf_counter()
    est = estimate_of(c)
    by_stage = {r.stage: r for r in est.roles}
    sigs = {p: signature(c, p) for p in range(c.dims.pp)}
    firsts = sorted({sig: p for p, sig in reversed(list(sigs.items()))}.values())
    with ThreadPoolExecutor(workers) as pool:
        ran = dict(zip(firsts, pool.map(lambda p: _stage_subprocess(c.name, p, extra), firsts)))
    rows = []
    for p, sig in sigs.items():
        src = next(q for q in firsts if sigs[q] == sig)
        got = {
            **ran[src],
            "stage": p,
            "rank": c.dims.rank_of({"pp": p, "dp_replicate": 0, "dp_shard": 0, "tp": 0}),
            "in_flight": in_flight_counts(c, p, ran[src]["per_microbatch_bytes"]),
            "same_run_as_stage": src,
        }
        got["measured_peak_bytes"], at = measured_peak(got)
        got.update(peak_phase=at["phase"], by_kind=at["by_kind"])
        want = by_stage[p].tracked_peak_nbytes
        rows.append(
            {
                **got,
                "estimate_bytes": want,
                "rel_error": (want - got["measured_peak_bytes"]) / got["measured_peak_bytes"],
            }
        )
    return {
        "name": c.name,
        "ranks": c.dims.world_size,
        "layout": c.dims.describe(),
        "params": est.total_params,
        "bf16": c.bf16,
        "activation_checkpointing": c.ac,
        "sequence_parallel": c.sp,
        "micro_batch_size": c.micro_batch_size,
        "global_batch_size": c.global_batch_size,
        "stages": rows,
        "max_rel_error": max(abs(r["rel_error"]) for r in rows),
        "seconds": time.perf_counter() - t0,
    }


def _counts(in_flight: list[int]) -> str:
    return str(in_flight[0]) if len(in_flight) == 1 else "+".join(map(str, in_flight))


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", action="append", help="config name(s); default all")
    ap.add_argument("--workers", type=int, default=2, help="stage processes at a time")
    ap.add_argument("--train-flags", metavar="FLAGS", help="a `shardsmith train` job's flags")
    ap.add_argument("--plan-json", metavar="FILE", help="a `shardsmith plan --json` answer")
    ap.add_argument("--candidate", type=int, default=0, help="which of --plan-json's candidates")
    ap.add_argument("--stage-of", nargs=2, metavar=("CONFIG", "STAGE"), help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    args = _arguments()
    configs, extra = _configs(), ()
    if args.plan_json:
        name, flags = plan_flags(args.plan_json, args.candidate)
        args.train_flags, args.plan_json = shlex.join(flags), None
        args.only = [name]
    if args.train_flags:  # this job only; the stage processes get the same flags
        extra = ("--train-flags", args.train_flags)
        name = args.stage_of[0] if args.stage_of else (args.only or ["flags"])[0]
        configs = {name: config_of_flags(shlex.split(args.train_flags), name)}
        args.only = [name]
    if args.stage_of:
        print(json.dumps(run_stage(configs[args.stage_of[0]], int(args.stage_of[1]))))
        return
    t0 = time.perf_counter()
    results = []
    only = args.only or list(configs)  # a name, or its model part for both policies
    for name in [n for n in configs if any(n == o or n.split(":")[0] == o for o in only)]:
        r = run_config(configs[name], args.workers, extra)
        results.append(r)
        print(
            f"{r['name']}: {r['layout']} = {r['ranks']:,} ranks, {r['params'] / 1e9:.1f}B params "
            f"({r['seconds']:.0f} s): max |error| {r['max_rel_error']:.1%}",
            flush=True,
        )
        for s in r["stages"]:
            print(
                f"  stage {s['stage']:>2} (rank {s['rank']:>4}, {_counts(s['in_flight']['fwd'])} in flight, peak in {s['peak_phase']}): measured "
                f"{s['measured_peak_bytes'] / 2**30:7.2f} GiB, estimate {s['estimate_bytes'] / 2**30:7.2f} GiB, "
                f"{s['rel_error']:+.1%}",
                flush=True,
            )
    worst = max(r["max_rel_error"] for r in results)
    print(
        json.dumps(
            {
                "configs": results,
                "max_rel_error": worst,
                "tolerance": TOLERANCE,
                "ok": worst <= TOLERANCE,
                "seconds": time.perf_counter() - t0,
            }
        )
    )


if __name__ == "__main__":
    main()
