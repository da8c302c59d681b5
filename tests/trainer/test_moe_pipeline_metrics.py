"""MoE under pipeline parallelism logs the router statistics it computed on the first step of
a start and of a resume (torch's pipeline stage infers shapes with an extra forward on that
step, on uninitialized tensors past stage 0; that pass must not count).

One launch of 2 gloo processes (pp 2, 4 experts top-2): step 1 of a fresh job is compared
with one process running the same 4 microbatches; a job resumed from step 1 logs for its
first step (2) what the uninterrupted job logged for step 2.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import TINY_MODEL
from spawn_ranks import run_ranks

from shardsmith.layout import ParallelDims

MOE = dataclasses.replace(TINY_MODEL, num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01)


def _worker(rank: int, port: int, data_path: str, ckpt: str, results) -> None:
    import os

    import torch.distributed as dist
    from conftest import tiny_train_config

    from shardsmith.trainer.config import CheckpointConfig
    from shardsmith.trainer.train import Trainer

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
    )
    cfg = dataclasses.replace(
        tiny_train_config(ParallelDims(pp=2), data_path),
        model=MOE,
        steps=2,
        checkpoint=CheckpointConfig(url=ckpt, async_save=False),
    )
    first = Trainer.create(cfg)
    batches: list[list] = []
    forward_backward = first.step_math.forward_backward

    routers: dict[str, list] = {}
    pairs: list = []

    def spy(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        batches.append(inputs.tolist())
        pairs.append((inputs.tolist(), targets.tolist()))
        out = forward_backward(inputs, targets)
        for fqn, p in first.model.named_parameters():  # before the clip: the step's gradient
            if fqn.endswith("router.weight") and not routers.get(fqn):
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                routers[fqn] = g.tolist()
        return out

    first.step_math.forward_backward = spy
    step1 = first.train_step()
    first.save()
    step2 = first.train_step()
    resumed = Trainer.create(
        dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume="auto"))
    )
    assert resumed.resume() and resumed.step == 1
    again = resumed.train_step()
    results.put(
        (
            rank,
            {
                "step1": step1.moe,
                "step2": step2.moe,
                "resumed2": again.moe,
                "batch": batches[0],
                "routers": routers,
                "xy": pairs[0],
                "microbatches": first.step_math.num_microbatches,
            },
        )
    )
    dist.destroy_process_group()


def _one_process_stats(tokens: list, microbatches: int) -> tuple[list[float], float]:
    """Load imbalance per MoE layer and the summed mean aux loss of the whole model run on
    ``tokens`` in ``microbatches`` forwards in this process (same seeded init as the job)."""
    from shardsmith.trainer.model import Transformer
    from shardsmith.trainer.moe import moe_layers, set_aux_loss_scale
    from shardsmith.trainer.weight_init import init_weights

    model = Transformer(MOE)
    init_weights(model, 1234)
    set_aux_loss_scale(model, 0.0)
    with torch.no_grad():
        for x in torch.tensor(tokens).chunk(microbatches):
            model(x)
    layers = moe_layers(model)
    imbalance = [float(m.load.max() / m.load.mean()) for _, m in sorted(layers.items())]
    aux = sum(float(m.aux_sum) / m.num_forwards for m in layers.values())
    return imbalance, aux


def _one_process_router_grads(tokens: list, microbatches: int, coeff: float) -> dict:
    """Router weight gradients of the whole model in one process on ``tokens`` (the job's
    inputs and targets), the aux loss injected at ``coeff`` per microbatch as the job does."""
    from shardsmith.trainer.model import Transformer
    from shardsmith.trainer.moe import set_aux_loss_scale
    from shardsmith.trainer.step import loss_fn
    from shardsmith.trainer.weight_init import init_weights

    model = Transformer(MOE)
    init_weights(model, 1234)
    inputs, targets = torch.tensor(tokens[0]), torch.tensor(tokens[1])
    set_aux_loss_scale(model, coeff)
    for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches)):
        (loss_fn(model(x), y) / microbatches).backward()
    return {f: p.grad for f, p in model.named_parameters() if f.endswith("router.weight")}


@pytest.fixture(scope="module")
def launched(tmp_path_factory, data_path) -> dict:
    ckpt = tmp_path_factory.mktemp("moe_pp") / "ckpt"
    return run_ranks(_worker, 2, data_path, str(ckpt), timeout=300)


@pytest.mark.distributed
def test_load_balancing_loss_reaches_every_router_under_pipelining(launched) -> None:
    """Each stage's routers, the last stage's last layer included, get the aux loss's
    gradient: the pipelined step's router gradients equal one process's with the aux loss,
    and differ from one process's without it by far more than the tolerance."""
    stats = launched[0]
    mb = stats["microbatches"]
    coeff = MOE.moe_aux_loss_coeff / mb
    with_aux = _one_process_router_grads(stats["xy"], mb, coeff)
    without = _one_process_router_grads(stats["xy"], mb, 0.0)
    got = {**launched[0]["routers"], **launched[1]["routers"]}
    assert sorted(got) == sorted(with_aux) and len(got) == MOE.num_layers
    for fqn, grad in got.items():
        torch.testing.assert_close(torch.tensor(grad), with_aux[fqn], rtol=1e-4, atol=1e-7, msg=fqn)
        assert (with_aux[fqn] - without[fqn]).abs().max() > 100 * 1e-7, fqn


@pytest.mark.distributed
def test_first_step_after_start_and_resume_logs_the_computed_router_stats(launched) -> None:
    got = launched
    for rank in (0, 1):  # every stage logs the same, job-wide values
        assert (
            got[rank]["step1"] == got[0]["step1"] and got[rank]["resumed2"] == got[0]["resumed2"]
        ), rank
    stats = got[0]
    imbalance, aux = _one_process_stats(stats["batch"], stats["microbatches"])
    assert math.isfinite(stats["step1"]["moe_aux_loss"]), stats["step1"]
    assert stats["step1"]["moe_aux_loss"] == pytest.approx(aux, abs=1e-5)
    assert stats["step1"]["moe_load_imbalance"] == pytest.approx(imbalance, abs=1e-4)
    assert math.isfinite(stats["resumed2"]["moe_aux_loss"]), stats["resumed2"]
    assert stats["resumed2"] == stats["step2"]
