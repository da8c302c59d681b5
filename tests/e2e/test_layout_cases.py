"""The layout cases real models hit, each compared against a checkpoint
saved directly by a job in the target layout, and against the single-process run's loss.

Models:

* ``AWKWARD``: vocab 257 (padded to a multiple of tp, padding stripped on save), 4 query
  heads over 1 kv head (tp > num_kv_heads: replicated kv heads, written once), tied
  embeddings (with pp > 1: the matrix lives on the first and the last stage).
* ``UNEVEN``: dims that do not divide by dp_shard=4 (a kv projection of 6 rows: shards of
  2, 2, 2, 0 — an empty shard).

Each source checkpoint is trained on one process; a job in each target layout resumes it,
saves it again, and trains one more step (the jobs of one process count share a launch).
The offline resharder's output for the target layout must equal that job's save file for
file (names, keys, boxes) and tensor for tensor, and the target layout's next loss must
match the single-process one.

The same launches also make step-0 saves of the ``AWKWARD`` model in :data:`STEP0_LAYOUTS`
(every layout starts from the same weights, equal to the single-process init).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_tensors_bitwise_equal, open_checkpoint, read_full_tensors, run_torchrun
from safetensors import safe_open

from shardsmith.layout import ModelConfig, ParallelDims
from shardsmith.reshard.api import reshard
from shardsmith.storage.commit import step_dir
from shardsmith.storage.store.fs import Store
from shardsmith.trainer.config import DataConfig, OptimConfig, TrainConfig

pytestmark = pytest.mark.distributed

AWKWARD = ModelConfig(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    num_kv_heads=1,
    ffn_hidden_size=64,
    vocab_size=257,
    seq_length=16,
    tie_embeddings=True,
)
UNEVEN = ModelConfig(
    num_layers=2,
    hidden_size=12,
    num_attention_heads=2,
    num_kv_heads=1,
    ffn_hidden_size=18,
    vocab_size=256,
    seq_length=16,
)

#: (case name, model, target layout, processes)
CASES = [
    ("tied-pp2-tp2-padded-gqa", AWKWARD, ParallelDims(pp=2, tp=2), 4),
    ("tp4-gqa-replicated-kv", AWKWARD, ParallelDims(tp=4), 4),
    ("custom-split-3-1", AWKWARD, ParallelDims(pp=2, pipeline_split=(3, 1)), 2),
    ("uneven-empty-shards", UNEVEN, ParallelDims(dp_shard=4), 4),
]
SAVE_STEP = 2
#: Step-0 saves: 1 process, then pp2·tp2 (padded vocab, tied embedding on both
#: stages, one kv head on two TP ranks), dp_shard2, and dp_shard2·tp2 (FSDP2 ``_StridedShard``
#: rows inside TP rows); each runs in the launch of its process count.
STEP0_LAYOUTS = {
    "1.1.1.1": ParallelDims(),
    "2.1.1.2": ParallelDims(pp=2, tp=2),
    "1.1.2.1": ParallelDims(dp_shard=2),
    "1.1.2.2": ParallelDims(dp_shard=2, tp=2),
}


def _config(model: ModelConfig, dims: ParallelDims, data_path: str) -> TrainConfig:
    return TrainConfig(
        model=model,
        parallel=dims,
        optim=OptimConfig(lr=3e-3, warmup_steps=1, decay_steps=4),
        data=DataConfig(sources=(data_path,), seed=7),
        global_batch_size=8,
        micro_batch_size=2,
        seed=7,
    )


def _set(model: ModelConfig, dims: ParallelDims) -> dict:
    """A scenario task's ``set``: this model in this layout."""
    return {"model": model.to_json(), "parallel": dims.to_json()}


def _step0_tasks(work: Path, nproc: int) -> list[dict]:
    """A step-0 save into ``work/step0/<layout>`` for each of :data:`STEP0_LAYOUTS` of ``nproc`` ranks."""
    return [
        {
            "kind": "train",
            "steps": 0,
            "ckpt": str(work / "step0" / name),
            "out": str(work / "step0" / f"{name}.json"),
            "set": _set(AWKWARD, dims),
        }
        for name, dims in STEP0_LAYOUTS.items()
        if dims.world_size == nproc
    ]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("layout-cases")


@pytest.fixture(scope="module")
def sources(work: Path, data_path: str) -> dict[str, tuple[str, list]]:
    """model name -> (root of a 1-process checkpoint saved at step 2, losses of steps 1..3);
    both models, and the 1-process step-0 save, in one launch."""
    models = {"awkward": AWKWARD, "uneven": UNEVEN}
    tasks = [
        {
            "kind": "train",
            "steps": SAVE_STEP + 1,
            "ckpt": str(work / f"src-{name}"),
            "save_interval": SAVE_STEP,
            "resume": "none",
            "out": str(work / f"src-{name}.json"),
            "set": _set(model, ParallelDims()),
        }
        for name, model in models.items()
    ] + _step0_tasks(work, 1)
    (work / "step0").mkdir()
    run_torchrun(
        {"config": _config(AWKWARD, ParallelDims(), data_path).to_json(), "tasks": tasks},
        1,
        work,
        "sources",
    ).check()
    return {
        name: (str(work / f"src-{name}"), json.loads((work / f"src-{name}.json").read_text()))
        for name in models
    }


def _source_step(sources: dict[str, tuple[str, list]], model: ModelConfig) -> str:
    return f"{sources['awkward' if model is AWKWARD else 'uneven'][0]}/{step_dir(SAVE_STEP)}"


@pytest.fixture(scope="module")
def jobs(work: Path, sources: dict[str, tuple[str, list]], data_path: str) -> dict[int, str]:
    """Every case's job (reload the source and save it to ``work/<case>/job``; resume it and
    train one step, metrics to ``work/<case>/job.json``) and step-0 save of that process count,
    one launch per process count:
    nproc -> "" when the launch succeeded, else its error."""
    out = {}
    for nproc in sorted({c[3] for c in CASES}):
        tasks = []
        for name, model, dims, _ in (c for c in CASES if c[3] == nproc):
            src_step = _source_step(sources, model)
            (work / name).mkdir()
            tasks += [
                {
                    "kind": "reload",
                    "src": src_step,
                    "dst": str(work / name / "job"),
                    "set": _set(model, dims),
                },
                {
                    "kind": "train",
                    "steps": SAVE_STEP + 1,
                    "resume": src_step,
                    "out": str(work / name / "job.json"),
                    "set": _set(model, dims),
                },
            ]
        tasks += _step0_tasks(work, nproc)
        first = next(c for c in CASES if c[3] == nproc)
        result = run_torchrun(
            {"config": _config(first[1], first[2], data_path).to_json(), "tasks": tasks},
            nproc,
            work,
            f"jobs-{nproc}",
        )
        out[nproc] = "" if result.returncode == 0 else result.output[-8000:]
    return out


def _file_layout(url: str) -> dict[str, dict[str, tuple]]:
    """file -> key -> (offsets, lengths) from the manifest, plus the keys the file really holds."""
    store, manifest = open_checkpoint(url)
    files: dict[str, dict[str, tuple]] = {}
    for fqn, rec in manifest.tensors.items():
        for s in rec.shards:
            files.setdefault(s.file, {})[s.key] = (tuple(s.offsets), tuple(s.lengths))
    for name, keys in files.items():
        with safe_open(
            store.fs.unstrip_protocol(store._path(name))
            if not store.is_posix
            else store._path(name),
            framework="pt",
        ) as f:
            assert sorted(f.keys()) == sorted(keys), f"{name}: file keys differ from the manifest"
    return files


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_layout_case(case, sources, jobs, work: Path, tmp_path: Path) -> None:
    name, model, dims, nproc = case
    _, src_losses = sources["awkward" if model is AWKWARD else "uneven"]
    src_step = _source_step(sources, model)
    assert not jobs[nproc], f"the {nproc}-process launch failed:\n{jobs[nproc]}"
    job_root, metrics = work / name / "job", work / name / "job.json"

    offline = tmp_path / "offline"
    reshard(Store(src_step), f"{offline}/{step_dir(SAVE_STEP)}", dims)
    job_step, off_step = f"{job_root}/{step_dir(SAVE_STEP)}", f"{offline}/{step_dir(SAVE_STEP)}"
    assert _file_layout(off_step) == _file_layout(job_step)
    want = read_full_tensors(src_step)
    assert_tensors_bitwise_equal(read_full_tensors(job_step), want, f"{name}: job save")
    assert_tensors_bitwise_equal(read_full_tensors(off_step), want, f"{name}: offline reshard")
    # The padded vocabulary is stripped on save: canonical shapes only.
    _, manifest = open_checkpoint(job_step)
    assert manifest.tensors["tok_embeddings.weight"].shape == [model.vocab_size, model.hidden_size]

    # Padding rows never reach the logits; tied and replicated copies get summed gradients:
    # the next step's loss is the single-process one.
    loss = json.loads(metrics.read_text())[-1]["loss"]
    ref = src_losses[SAVE_STEP]["loss"]
    assert abs(loss - ref) <= 1e-4 * abs(ref), (name, loss, ref)


def test_step0_checkpoints_of_every_layout_are_bitwise_equal(
    sources, jobs, work: Path, data_path: str
) -> None:
    """A job's step-0 save (its freshly materialized local shards) is the same in every
    layout, and equals the single-process init; ``shardsmith diff`` against tp1's agrees."""
    from click.testing import CliRunner

    from shardsmith.cli.main import cli
    from shardsmith.layout.sharding import OPTIM_PREFIXES
    from shardsmith.trainer.model import Transformer
    from shardsmith.trainer.weight_init import init_weights

    assert not any(jobs.values()), f"a launch failed:\n{[e for e in jobs.values() if e][0]}"
    step0 = work / "step0"
    saved = {
        name: {
            f: t
            for f, t in read_full_tensors(str(step0 / name / step_dir(0))).items()
            if not f.startswith(OPTIM_PREFIXES)
        }
        for name in STEP0_LAYOUTS
    }
    model = Transformer(AWKWARD)
    init_weights(model, _config(AWKWARD, ParallelDims(), data_path).seed)
    want = {f: p.detach() for f, p in model.named_parameters()}
    for name, got in saved.items():
        assert_tensors_bitwise_equal(got, want, f"step-0 save in {name}")
    tp1 = str(step0 / "1.1.1.1" / step_dir(0))
    for name in STEP0_LAYOUTS:  # `shardsmith diff`: every tensor, optimizer too
        result = CliRunner().invoke(cli, ["diff", tp1, str(step0 / name / step_dir(0))])
        assert result.exit_code == 0, f"shardsmith diff 1.1.1.1 {name}:\n{result.output}"
