"""The library's reshard: one call from a committed checkpoint to a committed copy in another layout.

:func:`reshard` owns the whole orchestration, and ``shardsmith reshard`` only maps its flags
onto it (and prints):

1. :func:`prepare` resolves the source, refuses what must not run before a byte is written
   (a model record that contradicts the tensors, options a format cannot take, a layout
   that does not fit the model, DST being the source's own root) and plans;
2. :func:`run` writes the target: a conversion that involves zarr goes through
   :func:`~shardsmith.reshard.zarr_convert.convert_format` (one process); safetensors to
   safetensors through the streaming engine (:func:`~shardsmith.reshard.engine.execute`,
   resumable), in this process's share when torchrun started several, or scaled out over
   ``nproc`` local processes (this one is rank 0 and commits; see :func:`_scale_out`);
3. with ``verify``, the committed result is diffed against the source, bitwise.

The worker processes of a scale-out run this module (``python -m shardsmith.reshard.api``)
with the job in ``SHARDSMITH_RESHARD_JOB`` (JSON) and their rank in the environment
(:meth:`~shardsmith.reshard.scaleout.Share.from_env`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from shardsmith.errors import ConfigError, ShardsmithError
from shardsmith.layout import ParallelDims, is_optim_fqn
from shardsmith.reshard.engine import execute
from shardsmith.reshard.planner import ReshardOptions, ReshardPlan, plan_reshard
from shardsmith.reshard.progress import ReshardReport
from shardsmith.reshard.scaleout import Share, assign_files, publish_for_dead, spawn_local
from shardsmith.storage import (
    cycle_gc_paused,
    read_manifest,
    resolve_checkpoint,
    resolve_target,
    split_step_url,
    step_dir,
)
from shardsmith.storage.manifest import Manifest, check_model_record
from shardsmith.storage.store import Store

#: The tensor format the streaming engine reads and writes (its planner encodes safetensors
#: headers); any other source or result goes through ``zarr_convert``. A literal, so that a
#: reshard imports no torch (``storage.formats.registry`` does).
STREAMED_FORMAT = "safetensors"

#: environment variable carrying the job to a scale-out worker process (JSON, see :func:`_job_json`).
JOB_ENV = "SHARDSMITH_RESHARD_JOB"


@dataclass
class ReshardJob:
    """A checked, planned reshard, ready for :func:`run` (built by :func:`prepare`).

    Attributes:
        src: the source step directory; manifest: its manifest.
        dst_root: the target checkpoint root (the result goes to its ``step-NNNNNNNNN``).
        dst_url: the target as given (a root or a step directory).
        dims, options: the target layout and the options.
        tensor_format, codec: the result's tensor format and zarr codec.
        plan: the streaming engine's plan; ``None`` when the conversion involves zarr.
    """

    src: Store
    manifest: Manifest
    dst_root: Store
    dst_url: str
    dims: ParallelDims
    options: ReshardOptions
    tensor_format: str
    codec: str
    plan: ReshardPlan | None

    @property
    def kept_tensors(self) -> list[str]:
        """The tensors the result holds (all but ``optim.*`` with ``model_only``)."""
        if self.plan is not None:
            return list(self.plan.tensors)
        return [
            f for f in self.manifest.tensors if not (self.options.model_only and is_optim_fqn(f))
        ]

    def threads(self, processes: int = 1) -> int:
        """Read threads each of ``processes`` reshard processes on this node runs
        (:meth:`ReshardOptions.threads`; node-local source and target: a CPU-bound copy)."""
        return self.options.threads(
            self.src.capabilities.node_local and self.dst_root.capabilities.node_local, processes
        )

    def with_threads(self, processes: int) -> "ReshardJob":
        """This job with ``options.workers`` (and its plan's) resolved for ``processes`` on this node."""
        options = dataclasses.replace(self.options, workers=self.threads(processes))
        plan = dataclasses.replace(self.plan, options=options) if self.plan is not None else None
        return dataclasses.replace(self, options=options, plan=plan)

    def share_nbytes(self, share: Share | None) -> int:
        """Bytes of the target files ``share`` writes (the whole target when ``None``)."""
        if self.plan is None:
            return 0
        share = share or Share()
        return sum(tf.nbytes for tf in assign_files(self.plan.files, share.world_size)[share.rank])


def prepare(
    src: Store | str,
    dst_url: str,
    dims: ParallelDims,
    *,
    options: ReshardOptions | None = None,
    tensor_format: str | None = None,
    codec: str = "",
    storage_options: dict | None = None,
) -> ReshardJob:
    """Resolve, check and plan a reshard; writes nothing. Any process may call it (pure but for reads).

    Args:
        src: the source step directory, or a URL of a step directory or a root (its newest step).
        dst_url: target step directory (``.../step-NNNNNNNNN``, the source's step) or a root.
        dims: target layout.
        options: dtype, model-only, chunk, buffer, workers (:class:`ReshardOptions`).
        tensor_format: of the result; ``None``: the source's.
        codec: zarr compression of the optimizer state (zarr results only).
        storage_options: fsspec options of the source (given as a URL) and the target.

    Raises:
        CheckpointNotFound / ManifestError: no committed source.
        CheckpointMismatch: the manifest's model record contradicts its tensors.
        ConfigError: a codec without a zarr result, a dtype in a conversion with zarr, DST is the
            source's own root, or an unknown format or codec.
        LayoutError: ``dims`` does not fit the model, or ``dst_url`` names another step.
    """
    src = resolve_checkpoint(src, storage_options)[1] if isinstance(src, str) else src
    options = options or ReshardOptions()
    with cycle_gc_paused():  # a plan is a large tree of small objects
        manifest = read_manifest(src)
        return _prepare(
            src, manifest, dst_url, dims, options, tensor_format, codec, storage_options
        )


def _prepare(
    src: Store,
    manifest: Manifest,
    dst_url: str,
    dims: ParallelDims,
    options: ReshardOptions,
    tensor_format: str | None,
    codec: str,
    storage_options: dict | None,
) -> ReshardJob:
    check_model_record(manifest, src.url)  # refuse before a byte is written
    tensor_format = tensor_format or manifest.tensor_format
    streams = manifest.tensor_format == tensor_format == STREAMED_FORMAT
    plan = None
    if streams:
        if codec:
            raise ConfigError("--zarr-codec needs --format zarr")
        plan = plan_reshard(manifest, dims, options, src.url)
    else:
        from shardsmith.storage.formats import tensor_format as tensor_format_of

        if options.dtype:
            raise ConfigError(
                "--dtype is not supported when converting to or from zarr; convert the "
                "dtype in a safetensors reshard first"
            )
        tensor_format_of(tensor_format, codec)  # ConfigError: unknown format or codec
    dst_root = resolve_target(dst_url, manifest.step, storage_options)[0]
    refuse_source_as_target(split_step_url(src.url)[0], dst_root.url)
    return ReshardJob(src, manifest, dst_root, dst_url, dims, options, tensor_format, codec, plan)


def refuse_source_as_target(src_root_url: str, dst_root_url: str) -> None:
    """A reshard writes the source's step number under DST: with DST the source's own root
    it would overwrite the source.

    Raises:
        ConfigError: DST is the source's checkpoint root (or its step directory).
    """
    if src_root_url.rstrip("/") == dst_root_url.rstrip("/"):
        raise ConfigError(
            f"DST {dst_root_url} is the source's own checkpoint root: the result would "
            "replace the source step; choose another target directory"
        )


def run(
    job: ReshardJob,
    *,
    verify: bool = False,
    nproc: int = 1,
    share: Share | None = None,
    storage_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
    on_file_done: Callable[[str], None] | None = None,
    on_tensor: Callable[[str, Any], None] | None = None,
) -> ReshardReport:
    """Write and commit the target of a prepared job (see :func:`reshard` for the arguments)."""
    scale_out = share is None and nproc > 1
    job = job.with_threads(processes_on_node(share, nproc))
    if job.plan is None:
        from shardsmith.reshard.zarr_convert import convert_format

        report = convert_format(
            job.src,
            job.dst_url,
            job.dims,
            job.tensor_format,
            codec=job.codec,
            model_only=job.options.model_only,
            chunk_nbytes=job.options.chunk_nbytes,
            storage_options=storage_options,
        )
    elif scale_out:
        report = _scale_out(job, nproc, storage_options, progress, on_file_done)
    else:
        report = execute(
            job.plan,
            job.src,
            job.dst_root,
            share=share,
            progress=progress,
            on_file_done=on_file_done,
        )
    if verify and report.committed:
        from shardsmith.reshard.diff import diff_checkpoints

        result = Store(report.target, storage_options)
        report.verified = diff_checkpoints(
            job.src,
            job.manifest,
            result,
            read_manifest(result),
            atol=0.0,
            cast_a=job.options.dtype,
            fqns=job.kept_tensors,
            on_tensor=on_tensor,
        )
    return report


def reshard(
    src: Store | str,
    dst_url: str,
    dims: ParallelDims,
    *,
    options: ReshardOptions | None = None,
    tensor_format: str | None = None,
    codec: str = "",
    verify: bool = False,
    nproc: int = 1,
    storage_options: dict | None = None,
    share: Share | None = None,
    progress: Callable[[int], None] | None = None,
    on_file_done: Callable[[str], None] | None = None,
    on_tensor: Callable[[str, Any], None] | None = None,
) -> ReshardReport:
    """Write the checkpoint ``src`` again under layout ``dims`` (and format, dtype) and commit it.

    Called by one process, by every process torchrun started (each with its ``share``; rank 0
    commits), or by one process that starts ``nproc - 1`` more here. ``shardsmith reshard``
    is this call.

    Args:
        src: the source step directory (committed), or a URL of one or of a root.
        dst_url: target step directory (``.../step-NNNNNNNNN``, the source's step) or a root.
        dims: target layout.
        options: dtype, model-only, buffer, workers (:class:`ReshardOptions`).
        tensor_format, codec: the result's format (default: the source's) and zarr codec.
        verify: afterwards diff the committed result against the source, bitwise (rank 0):
            the :class:`~shardsmith.reshard.diff.DiffReport` is ``report.verified``.
        nproc: local processes converting shares of the target files (``share`` unset only).
        storage_options: fsspec options of the source and the target.
        share: this process's part of a scale-out torchrun started; ``None``: not started so.
        progress, on_file_done: see :func:`~shardsmith.reshard.engine.execute` (this process).
        on_tensor: with ``verify``, called with each tensor's difference (``None`` = equal).

    Returns:
        A :class:`ReshardReport`; ``committed`` on the process that committed.

    Raises:
        Everything :func:`prepare` raises; TargetCommitted (a CheckpointError): the target is
        already committed; CheckpointError: another process failed; IntegrityError: a bad
        source byte; StorageError / OSError: reading or writing failed (a rerun resumes).
    """
    job = prepare(
        src,
        dst_url,
        dims,
        options=options,
        tensor_format=tensor_format,
        codec=codec,
        storage_options=storage_options,
    )
    return run(
        job,
        verify=verify,
        nproc=nproc,
        share=share,
        storage_options=storage_options,
        progress=progress,
        on_file_done=on_file_done,
        on_tensor=on_tensor,
    )


def processes_on_node(share: Share | None, nproc: int = 1) -> int:
    """Reshard processes sharing this node's cores: torchrun's ``LOCAL_WORLD_SIZE`` for a
    ``share`` it started, else the ``nproc`` :func:`reshard` starts."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if share is not None else max(1, nproc)


def _job_json(job: ReshardJob, storage_options: dict | None) -> str:
    """What a scale-out worker needs to prepare the same job (and so the same plan)."""
    return json.dumps(
        {
            "src": job.src.url,
            "dst": job.dst_url,
            "dims": job.dims.to_json(),
            "options": dataclasses.asdict(job.options),
            "storage_options": storage_options or {},
        }
    )


def _scale_out(
    job: ReshardJob,
    nproc: int,
    storage_options: dict | None,
    progress: Callable[[int], None] | None,
    on_file_done: Callable[[str], None] | None,
) -> ReshardReport:
    """Rank 0 of ``nproc`` local processes: start ranks 1.., convert this share, commit.

    A worker that exits without publishing (killed, crashed) gets an error published for it,
    so rank 0 stops waiting and names it; if rank 0 fails, the workers are stopped.
    """
    assert job.plan is not None
    share = Share(rank=0, world_size=nproc, attempt=uuid.uuid4().hex)
    workers = spawn_local(
        [sys.executable, "-m", "shardsmith.reshard.api"],
        share,
        {JOB_ENV: _job_json(job, storage_options)},
    )
    done = threading.Event()
    dst = job.dst_root.child(step_dir(job.manifest.step))
    watch = threading.Thread(
        target=publish_for_dead,
        args=(workers, dst, share, job.plan.plan_id, done),
        name="reshard-workers",
        daemon=True,
    )
    watch.start()
    ok = False
    try:
        report = execute(
            job.plan,
            job.src,
            job.dst_root,
            share=share,
            progress=progress,
            on_file_done=on_file_done,
        )
        ok = True
        return report
    finally:
        done.set()
        for p in workers.values():
            if not ok:
                p.terminate()
            p.wait()
        watch.join()


def _worker_main() -> int:
    """A scale-out worker: prepare the job in ``SHARDSMITH_RESHARD_JOB``, convert this rank's share."""
    logging.basicConfig(
        level=logging.INFO, format="%(message)s"
    )  # as the command's (resuming: ...)
    try:
        spec = json.loads(os.environ[JOB_ENV])
        storage_options = spec["storage_options"] or None
        reshard(
            Store(spec["src"], storage_options),
            spec["dst"],
            ParallelDims.from_json(spec["dims"]),
            options=ReshardOptions(**spec["options"]),
            storage_options=storage_options,
            share=Share.from_env(),
        )
    except KeyboardInterrupt:
        return 130  # rank 0 says what happened
    except (ShardsmithError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main())
