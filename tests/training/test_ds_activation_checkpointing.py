"""--deepspeed-activation-checkpointing and its options (Megatron-DeepSpeed's flags).

The flag checks of ``validate()``, and one real 4-rank ``pretrain`` spawn at TP = 2 x PP = 2 (ZeRO-1, fp32,
dropout 0.1): the loss curve with DeepSpeed's checkpoint (partitioned, contiguous, CPU copies, synchronize,
profile), stopped at iteration 2 and resumed to 4, equals the run without checkpointing and the run with Trident's
own checkpoint. Equal dropout masks in the recomputation need DeepSpeed's checkpoint to restore the tracker dropout
really draws from, and an exact resume needs that tracker's states saved and restored: a second tracker breaks both.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron.config import parse_args, validate
from megatron.testing import run_distributed
from tests.training.test_token_schedule import TINY

DS = ["--checkpoint-activations", "--deepspeed-activation-checkpointing"]


@pytest.mark.parametrize(
    ("flags", "device", "message"),
    [
        (["--partition-activations", "--profile-backward"], "cpu",
         "--partition-activations, --profile-backward configure DeepSpeed activation checkpointing; add "
         "--deepspeed-activation-checkpointing"),
        (["--deepspeed-activation-checkpointing"], "cpu",
         "checkpoints whole layer chunks, but --recompute-granularity is None; add --checkpoint-activations"),
        (["--deepspeed-activation-checkpointing", "--recompute-granularity", "selective"], "cpu",
         "--recompute-granularity is selective"),
        ([*DS, "--contigious-checkpointing"], "cpu", "--contiguous-checkpointing stores partitioned"),
        ([*DS, "--partition-activations", "--tensor-model-parallel-size", "2", "--sequence-parallel"], "cpu",
         "under --sequence-parallel each rank holds other tokens"),
        ([*DS, "--checkpoint-in-cpu"], "cpu", "--checkpoint-in-cpu without --partition-activations needs a GPU"),
    ],
)  # fmt: skip
def test_validate_ds_checkpointing_flags(flags: list[str], device: str, message: str) -> None:
    cfg = parse_args([*TINY, *flags])
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        validate(cfg, world_size=2, device_type=device)
    assert "\n" not in str(err.value)


def test_ds_checkpointing_flags_parse() -> None:
    m = parse_args([*DS, "--contigious-checkpointing", "--partition-activations"]).model
    assert (
        m.contiguous_checkpointing and m.partition_activations and m.recompute_granularity == "full"
    )
    assert parse_args(["--contiguous-checkpointing"]).model.contiguous_checkpointing
    ok = parse_args(
        [*TINY, *DS, "--checkpoint-in-cpu", "--synchronize-each-layer", "--profile-backward"]
    )
    validate(ok, world_size=1, device_type="cuda")  # CPU copies without partitioning: GPU only
    validate(
        parse_args([*TINY, *DS, "--partition-activations"]), world_size=1
    )  # TP = 1: as DeepSpeed


def _which_checkpoint(cfg) -> str:
    """The module of the autograd Function that checkpoints a layer chunk of ``ParallelTransformer``."""
    import torch

    from megatron import mpu
    from megatron.model.transformer import ParallelTransformer
    from megatron.mpu.context import ParallelContext
    from megatron.training.activation_checkpointing import configure_deepspeed_checkpointing

    state = mpu.initialize_model_parallel(2, 2)  # pretrain() destroyed its groups
    assert configure_deepspeed_checkpointing(cfg.model, state)
    stack = ParallelTransformer(
        cfg.model, ParallelContext.from_parallel_state(seed=1, device=torch.device("cpu"))
    )
    # [s, b, h], the same on both TP ranks
    hidden = torch.randn(16, 1, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    out = stack(hidden)
    node = out.grad_fn.next_functions[0][0]  # final_layernorm <- the last checkpointed chunk
    while node is not None and not hasattr(node, "_forward_cls"):
        node = node.next_functions[0][0]
    out.sum().backward()
    return node._forward_cls.__module__


def _scenario(tmp: str) -> dict:
    import deepspeed

    from megatron import mpu
    from megatron.training import pretrain

    base = [
        *TINY, "--num-layers", "4", "--train-iters", "4",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "1",
    ]  # fmt: skip
    plain = pretrain(parse_args(base)).losses
    ours = pretrain(parse_args([*base, "--checkpoint-activations"])).losses
    ck = str(Path(tmp) / "ckpt")
    ds_flags = [
        *base, *DS, "--partition-activations", "--contigious-checkpointing", "--checkpoint-in-cpu",
        "--synchronize-each-layer", "--profile-backward",
        "--save", ck, "--load", ck, "--save-interval", "100",
    ]  # fmt: skip
    first = pretrain(parse_args([*ds_flags, "--exit-interval", "2"]))
    second = pretrain(parse_args(ds_flags))
    cfg = parse_args([*TINY, *DS, "--partition-activations"])
    return {
        "plain": plain,
        "ours": ours,
        "ds": [*first.losses, *second.losses],
        "iterations": (first.iteration, second.iteration),
        "one_tracker": deepspeed.checkpointing.get_cuda_rng_tracker() is mpu.get_cuda_rng_tracker(),
        "checkpoint_module": _which_checkpoint(cfg),
    }


@pytest.mark.timeout(400)
def test_ds_checkpointing_loss_equals_no_checkpointing_tp2_pp2(tmp_path: Path) -> None:
    results = run_distributed(_scenario, 4, str(tmp_path), init_process_group=False, timeout=360)
    r = results[-1]  # the last pipeline stage logs the loss
    assert r["iterations"] == (2, 4)
    assert len(r["plain"]) == 4 and len(r["ds"]) == 4, r
    assert r["ours"] == r["plain"], r  # same dropout masks, same arithmetic
    assert max(abs(a - b) for a, b in zip(r["ds"], r["plain"])) <= 1e-6, r
    assert all(x["one_tracker"] for x in results)
    assert r["checkpoint_module"] == "deepspeed.runtime.activation_checkpointing.checkpointing"
