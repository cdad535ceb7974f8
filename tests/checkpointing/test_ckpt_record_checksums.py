"""``DeepSpeedCheckpointer(record_checksums=False)``: DeepSpeed's own ``torch.save``, a meta without digests, and a
checkpoint that still loads (the checksum benchmark's "off" side)."""

from __future__ import annotations

import json
from pathlib import Path

from megatron.testing import run_distributed

FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--vocab-size", "1000", "--tokenizer-type", "NullTokenizer",
    "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "2",
    "--lr", "1e-4", "--zero-stage", "1", "--log-level", "WARNING",
]  # fmt: skip


def _save_both_ways(save: str) -> dict[int, list[str]]:
    """Iteration 1 saved with checksums, 2 without; then 2 loaded back. Per iteration: its meta's keys."""
    from megatron import mpu
    from megatron.config import parse_args
    from megatron.training import initialize, preflight
    from megatron.training.lr_scheduler import build_lr_scheduler
    from megatron.training.model_setup import build_engine
    from megatron.training.pretrain import build_checkpointer
    from megatron.training.state import TrainState

    pre = preflight(parse_args([*FLAGS, "--save", save]))
    cfg, plan = pre.cfg, pre.plan
    run = initialize.init_distributed(cfg.parallel)
    bundle = build_engine(cfg.model, cfg.training, cfg.parallel, plan, pre.ds_config, run)
    sched = build_lr_scheduler(cfg.training, plan.global_batch_size, bundle.client_optimizer)
    keys = {}
    for iteration, record in ((1, True), (2, False)):
        state = TrainState()
        state.iteration = iteration
        build_checkpointer(pre, run, record_checksums=record).save(bundle.engine, sched, state)
        meta = Path(save) / f"global_step{iteration}" / "trident_meta.json"
        keys[iteration] = sorted(json.loads(meta.read_text()))
    loaded = TrainState()
    build_checkpointer(preflight(parse_args([*FLAGS, "--load", save])), run).load(
        bundle.engine, sched, loaded
    )
    mpu.destroy_model_parallel()
    return {**keys, 0: [str(loaded.iteration)]}


def test_save_without_checksums_records_none_and_loads(tmp_path: Path) -> None:
    save = tmp_path / "ck"
    out = run_distributed(_save_both_ways, 1, str(save), init_process_group=False, timeout=300)[0]
    assert "checksums" in out[1] and "checksums" not in out[2]
    assert sorted(p.name for p in (save / "global_step2").iterdir()) == [
        "mp_rank_00_model_states.pt",
        "rng_state_rank00000.safetensors",
        "trident_meta.json",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    ]  # no sidecar left behind
    assert out[0] == ["2"]  # the latest (unrecorded) checkpoint loads
