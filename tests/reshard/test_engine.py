"""Tests of the reshard planner, streaming executor, resume, diff and their commands.

Source checkpoints are built in-process from random tensors through the storage API
exactly as a job saving in that layout writes them (:func:`save_direct`), so a reshard
to layout L can be compared byte for byte with a direct save in L.
"""

from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest
import torch
from ckpt_factory import RESHARD_CHUNK as CHUNK
from ckpt_factory import RESHARD_SRC_DIMS as SRC_DIMS
from ckpt_factory import RESHARD_STEP as STEP
from ckpt_factory import assert_same_as_direct_save, full_state, save_direct
from ckpt_factory import box_slices as _slices
from ckpt_factory import manifest_json as _manifest_json
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save as safetensors_save

from shardsmith.cli.main import cli
from shardsmith.errors import CheckpointError, IntegrityError, LayoutError
from shardsmith.layout import ParallelDims
from shardsmith.layout.box import Box
from shardsmith.layout.sharding import shard_file_name
from shardsmith.reshard.api import reshard
from shardsmith.reshard.diff import diff_checkpoints
from shardsmith.reshard.planner import ReshardOptions, plan_reshard
from shardsmith.reshard.progress import PROGRESS_NAME
from shardsmith.reshard.scaleout import Share, assign_files
from shardsmith.reshard.stream import BufferBudget, BufferPool
from shardsmith.storage.checksum import ChunkedCrc, chunk_crc32c, grid_crcs
from shardsmith.storage.commit import read_manifest, step_dir
from shardsmith.storage.formats.registry import read_box
from shardsmith.storage.formats.safetensors import encode_header, file_order
from shardsmith.storage.formats.tensor_files import DTYPE_NAMES
from shardsmith.storage.manifest.records import SIDECAR_SUFFIX
from shardsmith.storage.store.fs import Store

SMALL = dict(chunk_nbytes=CHUNK, slab_nbytes=512, max_buffer_nbytes=2048, workers=2)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Store, dict[str, torch.Tensor]]:
    """A committed tp2·pp2 checkpoint with optimizer state; its step store and tensors."""
    root = Store(str(tmp_path_factory.mktemp("src")))
    full = full_state()
    save_direct(root, full, SRC_DIMS)
    return root.child(step_dir(STEP)), full


TARGETS = [ParallelDims(dp_shard=3), ParallelDims(tp=4), ParallelDims(pp=3, dp_replicate=2, tp=2)]


# ---- planner ------------------------------------------------------------------------------


def test_header_is_byte_identical_to_safetensors() -> None:
    rng = random.Random(0)
    dtypes = [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    ]
    tensors = {
        f"t.{i}.{rng.randint(0, 99)}": torch.zeros(
            [rng.randint(1, 4) for _ in range(rng.randint(0, 3))], dtype=rng.choice(dtypes)
        )
        for i in range(25)
    }
    data = safetensors_save(tensors)
    order = sorted(tensors, key=lambda k: file_order(k, DTYPE_NAMES[tensors[k].dtype]))
    header, _ = encode_header(
        [
            (k, DTYPE_NAMES[tensors[k].dtype], tuple(tensors[k].shape), tensors[k].nbytes)
            for k in order
        ]
    )
    assert header == data[: len(header)]
    assert len(header) == 8 + struct.unpack("<Q", data[:8])[0]


@pytest.mark.parametrize("dims", TARGETS, ids=lambda d: d.describe())
def test_plan_covers_every_target_element_once(source, dims: ParallelDims) -> None:
    step, _ = source
    plan = plan_reshard(read_manifest(step), dims, ReshardOptions(**SMALL))
    counts = {fqn: np.zeros(shape, dtype=np.int64) for fqn, (shape, _) in plan.tensors.items()}
    for tf in plan.files:
        pos = len(tf.header)
        for e in tf.entries:
            assert e.byte_offset == pos
            pos += e.nbytes
            assert sum(s.nbytes for s in e.slabs) == e.nbytes
            rows = [
                r
                for s in e.slabs
                for r in (
                    [s.box.offsets[0], s.box.offsets[0] + s.box.lengths[0]] if s.box.lengths else []
                )
            ]
            assert rows == sorted(rows)  # slabs are consecutive rows
            for s in e.slabs:
                assert s.box.intersect(e.box) == s.box or not s.box.lengths
                for p in s.pieces:
                    counts[e.fqn][_slices(p.common)] += 1
        assert pos == tf.nbytes
    for fqn, c in counts.items():
        assert (c == 1).all(), fqn
    assert len(plan.slabs()) > sum(len(f.entries) for f in plan.files)  # big entries were cut


def test_slab_cuts_align_to_source_checksum_chunks(tmp_path) -> None:
    """Cut between slabs where the source has a chunk boundary, so no chunk is read twice:
    converting to one file reads every source byte exactly once."""
    root = Store(str(tmp_path / "src"))
    m = save_direct(root, full_state(2), SRC_DIMS, chunk=256)
    plan = plan_reshard(m, ParallelDims(), ReshardOptions(chunk_nbytes=256, slab_nbytes=1000))
    assert len(plan.slabs()) > 2 * len(plan.tensors)
    reads = [
        (p.shard.file, p.shard.key, c)
        for s in plan.slabs()
        for p in s.pieces
        for c in range(p.read_start // 256, -(-p.read_end // 256))
    ]  # chunks of each shard
    assert len(reads) == len(set(reads))
    assert plan.nbytes_read == sum(s.nbytes for t in m.tensors.values() for s in t.shards)


# ---- executor -----------------------------------------------------------------------------


@pytest.mark.parametrize("dims", TARGETS, ids=lambda d: d.describe())
def test_streamed_files_are_byte_identical_to_a_direct_save(
    source, tmp_path, dims: ParallelDims
) -> None:
    step, full = source
    report = reshard(step, str(tmp_path / "out"), dims, options=ReshardOptions(**SMALL))
    got_step = Store(str(tmp_path / "out")).child(step_dir(STEP))
    want = assert_same_as_direct_save(got_step, Store(str(tmp_path / "want")), full, dims)
    got = read_manifest(got_step)
    data_files = [n for n in want.files if not n.endswith(SIDECAR_SUFFIX)]  # each with its sidecar
    assert report.num_files == len(data_files) and report.num_skipped == 0
    assert not got_step.exists(PROGRESS_NAME)
    # every target file opens with safetensors and holds its boxes of the logical tensors
    for name in data_files:
        with safe_open(str(tmp_path / "out" / step_dir(STEP) / name), framework="pt") as f:
            for key in f.keys():
                shard = next(s for s in got.tensors[key].shards if s.file == name)
                box = Box(tuple(shard.offsets), tuple(shard.lengths))
                assert torch.equal(f.get_tensor(key), full[key][_slices(box)]), (name, key)


def test_memory_store_and_peak_buffer_accounting(source) -> None:
    step, full = source
    opts = ReshardOptions(chunk_nbytes=CHUNK, slab_nbytes=256, max_buffer_nbytes=1500, workers=4)
    dst = Store("memory://reshard-peak")
    report = reshard(step, dst.url, ParallelDims(dp_shard=2, tp=2), options=opts)
    plan = plan_reshard(read_manifest(step), ParallelDims(dp_shard=2, tp=2), opts)
    assert 0 < report.peak_buffer_nbytes <= plan.peak_buffer_nbytes
    largest_slab = max(s.buffer_nbytes for s in plan.slabs())
    assert report.peak_buffer_nbytes <= max(opts.max_buffer_nbytes, largest_slab)
    assert report.peak_buffer_nbytes <= plan.largest_shard_nbytes + opts.max_buffer_nbytes
    assert plan.largest_shard_nbytes > opts.max_buffer_nbytes  # the bound is not trivial
    m = read_manifest(dst.child(step_dir(STEP)))
    for fqn in ("tok_embeddings.weight", "optim.exp_avg_sq.layers.2.feed_forward.w2.weight"):
        whole = read_box(dst.child(step_dir(STEP)), m, fqn, Box((0, 0), tuple(full[fqn].shape)))
        assert torch.equal(whole, full[fqn])


def test_budget_admits_an_oversized_reservation_alone() -> None:
    budget = BufferBudget(100)
    assert budget.acquire(60)
    assert not budget.acquire(60, block=False)
    budget.release(60)
    assert budget.acquire(500)  # larger than the budget, but alone
    assert not budget.acquire(1, block=False)
    budget.release(500)
    assert budget.peak == 500 and budget.in_use == 0


def test_buffer_pool_reuses_buffers_within_its_cap() -> None:
    mib = 1 << 20
    pool = BufferPool(keep_nbytes=8 * mib)
    a, b = pool.take(3 * mib), pool.take(mib // 2)
    assert (a.nbytes, b.nbytes) == (3 * mib, mib)  # rounded up to whole MiB
    pool.give(a)
    pool.give(b)
    assert pool.take(mib - 5) is b and pool.take(3 * mib) is a  # best fit, no new allocation
    assert pool.allocated == 4 * mib
    c = pool.take(6 * mib)  # over the cap while held ...
    pool.give(a)
    assert pool.allocated == 7 * mib and not pool.free  # ... so a returned buffer is freed
    pool.give(c)
    pool.give(b)
    assert pool.allocated == 7 * mib and {x.nbytes for x in pool.free} == {6 * mib, mib}
    d = pool.take(2 * mib)  # no fit: drop free ones for room
    assert d.nbytes == 2 * mib and pool.allocated <= 8 * mib


def test_chunked_crc_matches_whole_stream() -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 1000, dtype=np.uint8).tobytes()
    crc = ChunkedCrc(64)
    pos = 0
    for n in [1, 63, 64, 100, 7, 300, 465]:
        crc.update(data[pos : pos + n])
        pos += n
    assert pos == len(data) and crc.finish() == chunk_crc32c(data, 64)


def test_grid_pieces_of_slabs_combine_to_the_stream_chunks() -> None:
    """Slabs written by different threads at their offsets: each one's CRC pieces on the
    chunk grid (computed alone, in any order) add up, in stream order, to the whole stream's
    chunk CRCs; a piece crossing a chunk boundary is refused."""
    data = np.random.default_rng(1).integers(0, 256, 1000, dtype=np.uint8).tobytes()
    cuts = [0, 1, 64, 100, 107, 407, 448, 1000]
    pieces = {a: grid_crcs(data[a:b], a, 64) for a, b in reversed(list(zip(cuts, cuts[1:])))}
    crc = ChunkedCrc(64)
    for a in cuts[:-1]:
        crc.add(pieces[a])
    assert crc.nbytes == 1000 and crc.finish() == chunk_crc32c(data, 64)
    assert grid_crcs(data[64:320], 64, 64, known=[1, 2, 3, 4]) == [
        (1, 64),
        (2, 64),
        (3, 64),
        (4, 64),
    ]
    with pytest.raises(ValueError, match="crosses a 64-byte chunk boundary"):
        ChunkedCrc(64).add([(0, 40), (0, 40)])


def test_corrupt_source_names_the_file(tmp_path) -> None:
    root = Store(str(tmp_path / "src"))
    save_direct(root, full_state(1, optim=False), ParallelDims(dp_shard=2))
    name = shard_file_name(1)
    path = tmp_path / "src" / step_dir(STEP) / name
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="rank-00001.safetensors"):
        reshard(
            root.child(step_dir(STEP)),
            str(tmp_path / "out"),
            ParallelDims(),
            options=ReshardOptions(**SMALL),
        )
    assert not (tmp_path / "out" / step_dir(STEP) / "manifest.json").exists()
    assert not list(
        (tmp_path / "out" / step_dir(STEP)).rglob("*.safetensors*")
    )  # no partial nor temporary file


def test_refuses_a_committed_target_and_a_wrong_step(source, tmp_path) -> None:
    step, _ = source
    reshard(step, str(tmp_path / "out"), ParallelDims(), options=ReshardOptions(**SMALL))
    with pytest.raises(CheckpointError, match="already a committed checkpoint"):
        reshard(step, str(tmp_path / "out"), ParallelDims(tp=2), options=ReshardOptions(**SMALL))
    with pytest.raises(LayoutError, match="names step 8"):
        reshard(step, str(tmp_path / "other" / step_dir(8)), ParallelDims())


# ---- resume -------------------------------------------------------------------------------


class Interrupt(Exception):
    pass


def _interrupt_after_first(name: str) -> None:
    raise Interrupt(name)


def test_resume_skips_verified_files_and_redoes_a_corrupted_one(source, tmp_path) -> None:
    step, full = source
    dims = ParallelDims(dp_shard=3)
    opts = ReshardOptions(**{**SMALL, "workers": 1})
    out = tmp_path / "out"
    with pytest.raises(Interrupt) as exc:
        reshard(step, str(out), dims, options=opts, on_file_done=_interrupt_after_first)
    first = str(exc.value)
    step_out = Store(str(out)).child(step_dir(STEP))
    assert not step_out.exists("manifest.json")  # nothing looks committed
    assert list(json.loads(step_out.read(PROGRESS_NAME))["files"]) == [first]
    report = reshard(step, str(out), dims, options=opts)
    assert report.num_skipped == 1 and report.num_files == 2
    want_root = Store(str(tmp_path / "want"))
    want = save_direct(want_root, full, dims)
    assert _manifest_json(read_manifest(step_out)) == _manifest_json(want)

    # interrupted again, then the kept file is damaged: the rerun writes it again
    out2 = tmp_path / "out2"
    with pytest.raises(Interrupt):
        reshard(step, str(out2), dims, options=opts, on_file_done=_interrupt_after_first)
    path = out2 / step_dir(STEP) / first
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    report = reshard(step, str(out2), dims, options=opts)
    assert report.num_skipped == 0 and report.num_files == 3
    got = Store(str(out2)).child(step_dir(STEP))
    for name in want.files:
        assert got.read(name) == want_root.child(step_dir(STEP)).read(name)


def test_resume_with_other_options_starts_over(source, tmp_path) -> None:
    step, _ = source
    with pytest.raises(Interrupt):
        reshard(
            step,
            str(tmp_path / "out"),
            ParallelDims(dp_shard=2),
            options=ReshardOptions(**{**SMALL, "workers": 1}),
            on_file_done=_interrupt_after_first,
        )
    report = reshard(
        step,
        str(tmp_path / "out"),
        ParallelDims(dp_shard=2),
        options=ReshardOptions(**{**SMALL, "model_only": True}),
    )
    assert report.num_skipped == 0 and report.num_files == 2


# ---- dtype and model-only -----------------------------------------------------------------


def test_bf16_model_only_copy(source, tmp_path) -> None:
    step, full = source
    opts = ReshardOptions(**{**SMALL, "dtype": "BF16", "model_only": True})
    reshard(step, str(tmp_path / "out"), ParallelDims(tp=2), options=opts)
    got_step = Store(str(tmp_path / "out")).child(step_dir(STEP))
    got = read_manifest(got_step)
    assert not [k for k in got.tensors if k.startswith("optim.")]
    assert set(got.tensors) == {k for k in full if not k.startswith("optim.")}
    want_root = Store(str(tmp_path / "want"))
    converted = {k: t.to(torch.bfloat16) for k, t in full.items() if not k.startswith("optim.")}
    want = save_direct(want_root, converted, ParallelDims(tp=2))
    assert _manifest_json(got) == _manifest_json(want)  # same bytes as a bf16 save
    assert {t.dtype for t in got.tensors.values()} == {"BF16"}


def test_bf16_keeps_step_counters_exact(source, tmp_path) -> None:
    step, _ = source
    reshard(
        step,
        str(tmp_path / "out"),
        ParallelDims(),
        options=ReshardOptions(**{**SMALL, "dtype": "BF16"}),
    )
    got = read_manifest(Store(str(tmp_path / "out")).child(step_dir(STEP)))
    assert got.tensors["optim.step.norm.weight"].dtype == "F32"
    assert got.tensors["optim.exp_avg.norm.weight"].dtype == "BF16"


# ---- diff and the commands ----------------------------------------------------------------


def test_diff_equal_across_layouts_and_one_changed_element(source, tmp_path) -> None:
    step, full = source
    runner = CliRunner()
    other = Store(str(tmp_path / "b"))
    save_direct(other, full, ParallelDims(dp_shard=3))
    result = runner.invoke(cli, ["diff", step.url, other.url])
    assert result.exit_code == 0, result.output
    assert "equal: " in result.output

    changed = dict(full)
    changed["layers.1.attention.wk.weight"] = full["layers.1.attention.wk.weight"].clone()
    changed["layers.1.attention.wk.weight"][5, 3] += 0.25
    third = Store(str(tmp_path / "c"))
    save_direct(third, changed, ParallelDims(tp=2, dp_shard=2))
    result = runner.invoke(cli, ["diff", step.url, third.url])
    assert result.exit_code == 1
    line = next(ln for ln in result.output.splitlines() if ln.startswith("differs"))
    assert "layers.1.attention.wk.weight" in line and "max abs diff 0.25" in line and "1 of" in line
    assert runner.invoke(cli, ["diff", step.url, third.url, "--atol", "0.3"]).exit_code == 0


def test_diff_reports_tensors_only_on_one_side(source, tmp_path) -> None:
    step, full = source
    other = Store(str(tmp_path / "b"))
    save_direct(
        other, {k: v for k, v in full.items() if not k.startswith("optim.")}, ParallelDims()
    )
    report = diff_checkpoints(
        step,
        read_manifest(step),
        other.child(step_dir(STEP)),
        read_manifest(other.child(step_dir(STEP))),
    )
    assert not report.equal and not report.differing and not report.only_b
    assert set(report.only_a) == {k for k in full if k.startswith("optim.")}
    result = CliRunner().invoke(cli, ["diff", other.url, step.url])
    assert result.exit_code == 1 and "only in B   optim.exp_avg.norm.weight" in result.output


def test_reshard_command_dry_run_and_verify(source, tmp_path) -> None:
    step, _ = source
    runner = CliRunner()
    out = str(tmp_path / "out")
    result = runner.invoke(cli, ["reshard", step.url, out, "--tp", "3", "--dry-run"])
    assert result.exit_code == 1 and "tp=3 does not divide num_attention_heads=4" in result.output
    result = runner.invoke(cli, ["reshard", step.url, out, "--pp", "4", "--dry-run"])
    assert result.exit_code == 1 and "pp=4 exceeds num_layers=3" in result.output
    result = runner.invoke(
        cli, ["reshard", step.url, out, "--dp-shard", "3", "--dry-run", "--max-buffer", "1MiB"]
    )
    assert result.exit_code == 0, result.output
    for word in ("read ", "write ", "peak buffer", "shards/rank-00002.safetensors"):
        assert word in result.output
    assert not (tmp_path / "out").exists()
    result = runner.invoke(
        cli, ["reshard", step.url, out, "--tp", "2", "--dtype", "bf16", "--verify", "-q"]
    )
    assert result.exit_code == 0, result.output
    assert "resharded step 7" in result.output and "equal: " in result.output


# ---- scale-out ----------------------------------------------------------------------------


def _two_ranks(step: Store, out: str, dims: ParallelDims, attempt: str, fail_rank1: bool = False):
    """Run ranks 1 (in a thread) and 0 of a 2-process reshard; (rank 0 outcome, rank 1 outcome)."""
    import threading

    outcome: dict[int, object] = {}

    def run(rank: int) -> None:
        hook = _interrupt_after_first if (fail_rank1 and rank == 1) else None
        try:
            outcome[rank] = reshard(
                step,
                out,
                dims,
                options=ReshardOptions(**{**SMALL, "workers": 1}),
                share=Share(rank=rank, world_size=2, attempt=attempt),
                on_file_done=hook,
            )
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome[rank] = exc

    other = threading.Thread(target=run, args=(1,))
    other.start()
    run(0)
    other.join()
    return outcome[0], outcome[1]


def test_two_processes_share_the_files_and_rank0_commits(source, tmp_path) -> None:
    step, full = source
    dims = ParallelDims(dp_shard=3, tp=2)
    r0, r1 = _two_ranks(step, str(tmp_path / "out"), dims, "a1")
    assert r0.committed and not r1.committed
    assert r0.num_files + r1.num_files == 6 and r0.num_files and r1.num_files
    want_root = Store(str(tmp_path / "want"))
    want = save_direct(want_root, full, dims)
    got = Store(str(tmp_path / "out")).child(step_dir(STEP))
    assert _manifest_json(read_manifest(got)) == _manifest_json(want)
    assert [n for n in got.list_dir() if n.startswith(".reshard")] == []


def test_a_failed_rank_stops_the_commit_and_a_rerun_resumes(source, tmp_path) -> None:
    step, full = source
    dims = ParallelDims(dp_shard=3, tp=2)
    out = str(tmp_path / "out")
    r0, r1 = _two_ranks(step, out, dims, "a1", fail_rank1=True)
    assert isinstance(r1, Interrupt)
    assert isinstance(r0, CheckpointError) and "rank 1 failed" in str(r0)
    assert not Store(out).child(step_dir(STEP)).exists("manifest.json")
    r0, r1 = _two_ranks(step, out, dims, "a2")
    assert r0.committed and r0.num_skipped + r1.num_skipped >= 2  # both ranks' finished files kept
    assert _manifest_json(read_manifest(Store(out).child(step_dir(STEP)))) == _manifest_json(
        save_direct(Store(str(tmp_path / "want")), full, dims)
    )


def test_assign_files_balances_bytes(source) -> None:
    step, _ = source
    plan = plan_reshard(
        read_manifest(step), ParallelDims(dp_shard=3, tp=2), ReshardOptions(**SMALL)
    )
    shares = assign_files(plan.files, 4)
    assert sorted(f.name for s in shares for f in s) == sorted(f.name for f in plan.files)
    loads = [sum(f.nbytes for f in s) for s in shares]
    assert max(loads) - min(loads) <= max(f.nbytes for f in plan.files)


@pytest.mark.distributed
def test_nproc_per_node_command(source, tmp_path) -> None:
    step, _ = source
    out = str(tmp_path / "out")
    result = CliRunner().invoke(
        cli,
        [
            "reshard",
            step.url,
            out,
            "--tp",
            "2",
            "--dp-shard",
            "2",
            "--nproc-per-node",
            "2",
            "--max-buffer",
            "64KiB",
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    assert CliRunner().invoke(cli, ["diff", step.url, out]).exit_code == 0
