"""Bad inputs of ``pretrain_gpt.py`` flags: non-finite floats, bad choices and types, contradictions, a
--deepspeed_config with unknown or invalid keys, missing files, LR flags against a checkpoint's schedule, a --save
another run holds.

All but the last two fail before any process group exists (about 3-5 s each); those two start one rank (the LR
schedule is compared when the checkpoint is loaded, the --save lock is taken after the process groups exist).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

from tests.badinput.cases import TINY_FLAGS, Case

TRAIN = ("pretrain_gpt.py", *TINY_FLAGS, "--train-iters", "2")


def _ds_json(content: dict) -> object:
    def setup(tmp: Path, ws: Path) -> None:
        (tmp / "ds.json").write_text(json.dumps(content))

    return setup


def _live_lock(tmp: Path, ws: Path) -> None:
    """--save holding a lock of a live process on this host."""
    save = tmp / "save"
    save.mkdir()
    pid = os.getpid()  # the test process itself: alive while the case runs
    stat = Path(f"/proc/{pid}/stat").read_text()
    ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    (save / ".trident_save.lock").write_text(
        json.dumps(
            {"host": socket.gethostname(), "pid": pid, "start_ticks": ticks, "boot_id": boot}
        )
    )


def _copy_ckpt(tmp: Path, ws: Path) -> None:
    shutil.copytree(ws / "ckpt", tmp / "ck", symlinks=True)


CASES: list[Case] = [
    Case("flag-lr-nan", (*TRAIN, "--lr=nan"), 2, "argument --lr: nan is not a finite number"),
    Case("flag-lr-inf", (*TRAIN, "--lr", "inf"), 2, "argument --lr: inf is not a finite number"),
    Case(
        "flag-weight-decay-nan",
        (*TRAIN, "--weight-decay=nan"),
        2,
        "argument --weight-decay: nan is not a finite number",
    ),
    Case(
        "flag-clip-grad-neg-inf",
        (*TRAIN, "--clip-grad=-inf"),
        2,
        "argument --clip-grad: -inf is not a finite number",
    ),
    Case("flag-lr-not-a-number", (*TRAIN, "--lr", "fast"), 2, "invalid float value: 'fast'"),
    Case(
        "flag-bad-decay-style",
        (*TRAIN, "--lr-decay-style", "exponential"),
        2,
        "argument --lr-decay-style: invalid choice: 'exponential'",
    ),
    Case("flag-unknown", (*TRAIN, "--learning-rate", "1e-3"), 2, "unrecognized arguments"),
    Case(
        "flag-min-lr-above-lr",
        (*TRAIN, "--min-lr", "1e-2"),
        2,
        "--min-lr (0.01) must not exceed --lr (0.001)",
    ),
    Case(
        "flag-both-scheduler-switches",
        (*TRAIN, "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"),
        2,
        "are exclusive; give one of them",
    ),
    Case(
        "flag-train-iters-and-samples",
        (*TRAIN, "--train-samples", "8"),
        2,
        "--train-iters and --train-samples are exclusive",
    ),
    Case(
        "flag-ulysses-seq-length-not-divisible",
        (*TRAIN, "--ds-sequence-parallel-size", "3"),
        2,
        "--seq-length (16) must be divisible by --ds-sequence-parallel-size (3)",
    ),
    Case(
        "flag-ulysses-heads-not-divisible",
        (*TRAIN, "--ds-sequence-parallel-size", "8"),
        2,
        "--num-attention-heads (4) must be divisible by --tensor-model-parallel-size (1) x "
        "--ds-sequence-parallel-size (8) = 8",
    ),
    Case(
        # packed documents at PP > 1 go through the document-id attention, which has no dropout
        "flag-reset-attention-mask-pp2-dropout",
        (*TRAIN, "--reset-attention-mask", "--pipeline-model-parallel-size", "2"),
        2,
        "--reset-attention-mask at --pipeline-model-parallel-size 2 needs --attention-dropout 0 (got 0.1)",
    ),
    Case("flag-bf16-and-fp16", (*TRAIN, "--bf16", "--fp16"), 2, "--bf16 and --fp16 are exclusive"),
    Case("flag-fp16-on-cpu", (*TRAIN, "--fp16"), 2, "--fp16 needs a CUDA GPU"),
    Case(
        "flag-timeout-zero",
        (*TRAIN, "--distributed-timeout-minutes", "0"),
        2,
        "--distributed-timeout-minutes (0.0) must be positive",
    ),
    Case(
        "flag-warmup-fraction-and-iters",
        (*TRAIN, "--lr-warmup-fraction", "0.1"),
        2,
        "--lr-warmup-fraction is exclusive with --lr-warmup-iters",
    ),
    Case(
        "flag-warmup-longer-than-decay",
        (*TRAIN, "--lr-warmup-iters", "5"),
        2,
        "exceeds the decay length",
    ),
    Case(
        "flag-deepspeed-config-missing",
        (*TRAIN, "--deepspeed_config", "{tmp}/nope.json"),
        2,
        "nope.json: no such file",
    ),
    Case(
        "flag-deepspeed-config-typo-key",
        (*TRAIN, "--deepspeed_config", "{tmp}/ds.json"),
        2,
        "unknown top-level key zero_optimisation ('zero_optimisation': did you mean 'zero_optimization'?)",
        unchanged=("{tmp}/ds.json",),
        setup=_ds_json({"zero_optimisation": {"stage": 1}}),
    ),
    Case(
        "flag-deepspeed-config-bad-nested-value",
        (*TRAIN, "--deepspeed_config", "{tmp}/ds.json"),
        2,
        "DeepSpeed rejects zero_optimization.overlap_comm",
        setup=_ds_json({"zero_optimization": {"overlap_comm": "sometimes"}}),
    ),
    Case(
        "flag-deepspeed-config-extra-nested-key",
        (*TRAIN, "--deepspeed_config", "{tmp}/ds.json"),
        2,
        "DeepSpeed rejects zero_optimization.reduce_bucket_sise (Extra inputs are not permitted)",
        setup=_ds_json({"zero_optimization": {"reduce_bucket_sise": 500}}),
    ),
    Case(
        "flag-async-save-other-checkpoint-engine",
        (*TRAIN, "--async-save", "--deepspeed_config", "{tmp}/ds.json"),
        2,
        "which selects another checkpoint engine; remove checkpoint.writer from",
        setup=_ds_json({"checkpoint": {"writer": {"decoupled": True}}}),
    ),
    Case(
        "flag-deepspeed-config-contradicts-flag",
        (*TRAIN, "--deepspeed_config", "{tmp}/ds.json"),
        2,
        "--global-batch-size (2) sets train_batch_size = 2",
        setup=_ds_json({"train_batch_size": 8}),
    ),
    Case(
        "flag-data-path-missing",
        (
            *(f for f in TRAIN if f != "--mock-data"),
            "--data-path",
            "{tmp}/missing_text_document",
        ),
        2,
        "missing_text_document",
    ),
    Case(
        "flag-lr-differs-from-checkpoint",
        (*TRAIN, "--load", "{tmp}/ck", "--lr", "5e-3"),
        2,
        "--override-opt_param-scheduler",
        unchanged=("{tmp}/ck",),
        needs=("ckpt",),
        setup=_copy_ckpt,
    ),
    Case(
        "flag-save-locked-by-live-run",
        (*TRAIN, "--save", "{tmp}/save"),
        2,
        "is in use by a running process",
        unchanged=("{tmp}/save",),
        setup=_live_lock,
    ),
]
