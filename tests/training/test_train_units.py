"""Unit tests of the single-process training pieces: ds_config, optimizer groups, LR schedule, FLOPs, metrics."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import torch

from megatron.config import RunPlan, parse_args, validate
from megatron.config.plan import effective_zero_stage
from megatron.launch import exit_codes
from megatron.planning.flops import flops_per_token, layer_params, lookup_peak_tflops, throughput
from megatron.training.ds_config import build_ds_config
from megatron.training.lr_scheduler import (
    LRSchedule,
    OptimizerParamScheduler,
    build_lr_scheduler,
)
from megatron.training.metrics import (
    EVAL_KEYS,
    TRAIN_KEYS,
    EvalRecord,
    MetricsWriter,
    TrainRecord,
    format_train_line,
    read_metrics,
)
from megatron.training.optimizer import build_optimizer, get_param_groups

BASE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
]


def _cfg(*extra: str):
    return parse_args([*BASE, *extra])


def _plan(cfg, world_size: int) -> RunPlan:
    if cfg.training.train_iters is None and cfg.training.train_samples is None:
        cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, train_iters=10))
    return RunPlan.build(cfg, world_size=world_size, true_vocab=100)


def _ds(cfg, world_size: int, user: dict | None = None) -> dict:
    return build_ds_config(cfg, _plan(cfg, world_size), user)


# ---------------------------------------------------------------- ds_config


def test_ds_config_generated_from_flags() -> None:
    cfg = _cfg("--micro-batch-size", "2", "--global-batch-size", "16", "--zero-stage", "2")
    cfg_pp = _cfg("--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--bf16")
    validate(cfg, world_size=4)
    ds = _ds(cfg, 4)
    assert ds["train_batch_size"] == 16
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 2 == _plan(cfg, 4).gradient_accumulation_steps
    assert ds["zero_optimization"] == {"stage": 2}
    assert ds["gradient_clipping"] == 1.0
    assert ds["bf16"] == {"enabled": False} and ds["fp16"] == {"enabled": False}
    assert ds["steps_per_print"] >= 10**6 and ds["wall_clock_breakdown"] is False
    assert ds["zero_force_ds_cpu_optimizer"] is False
    # Pipeline + clipping + ZeRO-0 is upgraded to ZeRO-1 (DeepSpeed 0.19.8 grad-norm bug).
    ds_pp = _ds(cfg_pp, 4)
    assert effective_zero_stage(cfg_pp) == 1 and ds_pp["zero_optimization"]["stage"] == 1
    assert ds_pp["bf16"]["enabled"] is True and ds_pp["gradient_accumulation_steps"] == 4
    no_clip = _cfg("--pipeline-model-parallel-size", "2", "--clip-grad", "0")
    assert effective_zero_stage(no_clip) == 0


def test_ds_config_fp16_and_sgd_keys() -> None:
    cfg = _cfg(
        "--fp16", "--initial-loss-scale", "65536", "--loss-scale-window", "50", "--optimizer", "sgd"
    )
    ds = _ds(cfg, 1)
    assert ds["fp16"]["enabled"] is True and ds["fp16"]["initial_scale_power"] == 16
    assert ds["fp16"]["loss_scale"] == 0.0 and ds["fp16"]["loss_scale_window"] == 50
    assert ds["zero_allow_untested_optimizer"] is True


def test_user_json_adds_keys_and_conflicts_name_both_sources(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
                "train_batch_size": 8,
                "steps_per_print": 5,
            }
        )
    )
    cfg = _cfg("--zero-stage", "2", "--global-batch-size", "8", "--deepspeed_config", str(path))
    ds = _ds(cfg, 2)
    assert ds["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}
    assert ds["steps_per_print"] == 5  # not a flag-owned key: the user's value stays
    bad = _cfg("--zero-stage", "1", "--global-batch-size", "8", "--deepspeed_config", str(path))
    with pytest.raises(ValueError, match=r"--zero-stage \(1\).*zero_optimization.stage = 1.*= 2"):
        _ds(bad, 2)
    bad_gbs = _cfg(
        "--zero-stage", "2", "--global-batch-size", "16", "--deepspeed_config", str(path)
    )
    with pytest.raises(ValueError, match=r"--global-batch-size \(16\).*train_batch_size = 8"):
        _ds(bad_gbs, 2)
    with pytest.raises(ValueError, match=r"--bf16 \(False\).*bf16.enabled = true"):
        _ds(_cfg(), 1, user={"bf16": {"enabled": True}})
    with pytest.raises(ValueError, match="'optimizer' section"):
        _ds(_cfg(), 1, user={"optimizer": {"type": "Adam"}})
    # Same value in both places is fine.
    _ds(_cfg("--clip-grad", "1"), 1, user={"gradient_clipping": 1})


def test_zero_offload_only_at_stages_that_have_it() -> None:
    opt = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(
        ValueError, match=r"offload_optimizer \(device cpu\).*stage is 0.*--zero-stage 1"
    ):
        _ds(_cfg(), 1, user=opt)
    assert _ds(_cfg("--zero-stage", "1"), 1, user=opt)["zero_optimization"][
        "offload_optimizer"
    ] == {"device": "cpu"}
    off = {"zero_optimization": {"offload_optimizer": {"device": "none"}}}
    _ds(_cfg(), 1, user=off)  # "none" is no offload
    param = {"zero_optimization": {"offload_param": {"device": "nvme"}}}
    with pytest.raises(
        ValueError, match=r"offload_param \(device nvme\).*stage is 2.*--zero-stage 3"
    ):
        _ds(_cfg("--zero-stage", "2"), 1, user=param)
    with pytest.raises(ValueError, match=r"offload_param.device = nvme but no nvme_path"):
        _ds(_cfg("--zero-stage", "3"), 1, user=param)  # the right stage; NVMe needs its directory
    with pytest.raises(ValueError, match=r"offload_param in .* is 'cpu'.*\{\"device\": \"cpu\"\}"):
        _ds(_cfg("--zero-stage", "3"), 1, user={"zero_optimization": {"offload_param": "cpu"}})


def test_user_json_file_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="--deepspeed_config .*no such file"):
        _ds(_cfg("--deepspeed_config", str(tmp_path / "nope.json")), 1)
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1,\n  oops}')
    with pytest.raises(ValueError, match="invalid JSON at line 2"):
        _ds(_cfg("--deepspeed_config", str(bad)), 1)
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        _ds(_cfg("--deepspeed_config", str(arr)), 1)


# ---------------------------------------------------------------- optimizer


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.frozen = torch.nn.Parameter(torch.zeros(2, 2), requires_grad=False)


def test_param_groups_megatron_rule() -> None:
    model = _Tiny()
    groups = get_param_groups(model, weight_decay=0.1)
    assert [len(g["params"]) for g in groups] == [1, 3]
    assert groups[0]["params"][0] is model.linear.weight and groups[0]["weight_decay"] == 0.1
    assert groups[1]["weight_decay"] == 0.0
    ids = {id(p) for p in groups[1]["params"]}
    assert ids == {id(model.linear.bias), id(model.norm.weight), id(model.norm.bias)}
    opt = build_optimizer(model, _cfg("--weight-decay", "0.1").training)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["betas"] == (0.9, 0.999)
    sgd = build_optimizer(model, _cfg("--optimizer", "sgd", "--sgd-momentum", "0.5").training)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.5


# ---------------------------------------------------------------- LR schedule


def test_lr_schedule_shapes() -> None:
    def lrs(style: str, warmup: int = 10, decay: int = 100) -> list[float]:
        s = OptimizerParamScheduler(
            None,
            LRSchedule(
                max_lr=1.0,
                min_lr=0.1,
                lr_warmup_steps=warmup,
                lr_decay_steps=decay,
                lr_decay_style=style,  # type: ignore[arg-type]
            ),
        )
        out = []
        for _ in range(12):
            out.append(s.get_lr())
            s.step(10)
        return out

    lin = lrs("linear")
    assert lin[0] == 0.0 and lin[1] == 1.0  # warmup 0 -> max at 10 samples
    assert lin[2] == pytest.approx(0.1 + 0.9 * (1 - 10 / 90))
    assert lin[10] == pytest.approx(0.1) and lin[11] == 0.1
    cos = lrs("cosine")
    assert cos[2] == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 10 / 90) + 1))
    assert cos[11] == 0.1
    assert lrs("constant")[5] == 1.0
    isq = lrs("inverse-square-root")
    assert isq[4] == pytest.approx(math.sqrt(10) / math.sqrt(40))
    with pytest.raises(ValueError, match="exceeds the decay length"):
        OptimizerParamScheduler(
            None,
            LRSchedule(
                max_lr=1, min_lr=0, lr_warmup_steps=5, lr_decay_steps=2, lr_decay_style="linear"
            ),
        )


def test_lr_schedule_from_flags_and_state_dict() -> None:
    t = _cfg("--train-iters", "100", "--lr", "0.01", "--lr-warmup-iters", "10").training
    model = _Tiny()
    opt = build_optimizer(model, t)
    s = build_lr_scheduler(t, global_batch=8, optimizer=opt)
    assert s.lr_decay_steps == 800 and s.lr_warmup_steps == 80
    assert all(g["lr"] == 0.0 for g in opt.param_groups)
    s.step(40)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.005)
    state = s.state_dict()
    s2 = build_lr_scheduler(t, global_batch=8, optimizer=None)
    s2.load_state_dict(state)
    assert s2.num_steps == 40 and s2.get_lr() == s.get_lr()
    frac = _cfg("--train-samples", "1000", "--lr-warmup-fraction", "0.1").training
    s3 = build_lr_scheduler(frac, global_batch=8, optimizer=None)
    assert (s3.lr_decay_steps, s3.lr_warmup_steps) == (1000, 100)


# ---------------------------------------------------------------- FLOPs / MFU


def test_flops_gpt2_small_matches_hand_count() -> None:
    cfg = parse_args(
        [
            "--num-layers",
            "12",
            "--hidden-size",
            "768",
            "--num-attention-heads",
            "12",
            "--seq-length",
            "1024",
        ]
    )
    v = 50304
    # GPT-2 small: 85,054,464 transformer-layer parameters (12 x 7,087,872) + final LN + tied head.
    assert layer_params(cfg.model, v) == 12 * 7_087_872 + 2 * 768 + v * 768
    assert flops_per_token(cfg.model, v) == 6 * layer_params(cfg.model, v) + 12 * 12 * 768 * 1024
    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert lookup_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert lookup_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert lookup_peak_tflops(None) is None and lookup_peak_tflops("Some CPU") is None
    tok, tf, mfu = throughput(
        tokens_per_iteration=1000,
        seconds_per_iteration=0.5,
        flops_per_tok=1e9,
        world_size=2,
        peak_tflops=None,
    )
    assert (tok, tf, mfu) == (2000.0, 1.0, None)
    assert throughput(
        tokens_per_iteration=1000,
        seconds_per_iteration=0.5,
        flops_per_tok=1e9,
        world_size=2,
        peak_tflops=10.0,
    )[2] == pytest.approx(0.1)


# ---------------------------------------------------------------- metrics


def test_metrics_jsonl_tensorboard_and_line(tmp_path) -> None:
    rec = TrainRecord(3, 24, 6.5, 1e-4, None, 1.0, 0, 1234.5, 0.01, None)
    w = MetricsWriter(str(tmp_path / "m" / "metrics.jsonl"), str(tmp_path / "tb"), enabled=True)
    w.train(rec)
    w.evaluation(EvalRecord(3, 6.0, math.exp(6.0)))
    w.close()
    train, evals = read_metrics(tmp_path / "m" / "metrics.jsonl")
    assert list(train[0]) == list(TRAIN_KEYS) and train[0]["grad_norm"] is None
    assert list(evals[0]) == list(EVAL_KEYS) and evals[0]["valid_ppl"] == pytest.approx(
        403.4287934927351
    )
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    off = MetricsWriter(str(tmp_path / "other.jsonl"), None, enabled=False)
    off.train(rec)
    off.close()
    assert not (tmp_path / "other.jsonl").exists()
    line = format_train_line(rec, train_iters=10, elapsed_ms=12.0, skipped_total=0)
    assert "lm loss: 6.500000E+00" in line and "MFU: n/a" in line and "grad norm: n/a" in line
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\nnope\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_metrics(tmp_path / "bad.jsonl")


def test_exit_codes_distinct() -> None:
    codes = [
        exit_codes.EXIT_OK,
        exit_codes.EXIT_CONFIG_ERROR,
        exit_codes.EXIT_INTERVAL,
        exit_codes.EXIT_DURATION,
        exit_codes.EXIT_SIGNAL,
        exit_codes.EXIT_NON_FINITE,
        exit_codes.EXIT_HANG,
        exit_codes.EXIT_PEER_LOST,
        exit_codes.EXIT_INTERRUPTED,
    ]
    assert len(set(codes)) == len(codes) and 1 not in codes
    assert set(exit_codes.EXIT_REASONS) == set(codes)


def test_sp_with_pipeline_sends_whole_activations() -> None:
    cfg = _cfg("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--sequence-parallel")  # fmt: skip
    ds = _ds(cfg, 4)
    assert ds["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}
    assert "pipeline" not in _ds(_cfg("--pipeline-model-parallel-size", "2"), 2)
    with pytest.raises(ValueError, match="pipeline.pipe_partitioned = false"):
        _ds(cfg, 4, user={"pipeline": {"pipe_partitioned": True}})


def test_rendezvous_env(monkeypatch) -> None:
    from megatron.launch.rendezvous import ensure_rendezvous_env, world_size_from_env

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert ensure_rendezvous_env() is True
    assert world_size_from_env() == 1 and int(os.environ["MASTER_PORT"]) > 0
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert ensure_rendezvous_env() is False  # already complete: untouched
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="MASTER_ADDR not set"):
        ensure_rendezvous_env(local_rank=1)
    assert os.environ["LOCAL_RANK"] == "1"


def test_slurm_rendezvous_env() -> None:
    from megatron.launch.rendezvous import first_slurm_host, slurm_rendezvous_env

    assert first_slurm_host("gpu[007-010,12],cpu1") == "gpu007"
    assert first_slurm_host("rack[1-2]-node[05-06]") == "rack1-node05"
    assert first_slurm_host("a1,a2") == first_slurm_host("a1") == "a1"
    with pytest.raises(ValueError, match="set MASTER_ADDR"):
        first_slurm_host("node[1-2")
    step = {
        "SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "16", "SLURM_LOCALID": "1",
        "SLURM_STEP_NODELIST": "n[3-4]", "SLURM_JOB_ID": "123456", "SLURM_NTASKS": "16",
        "SLURM_STEP_ID": "2",
    }  # fmt: skip
    assert slurm_rendezvous_env(step) == {
        "RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "MASTER_ADDR": "n3",
        "MASTER_PORT": str(15000 + 16 * 456 + 2),
    }  # fmt: skip
    other_step = slurm_rendezvous_env({**step, "SLURM_STEP_ID": "3"})["MASTER_PORT"]
    assert other_step != slurm_rendezvous_env(step)["MASTER_PORT"]
    assert slurm_rendezvous_env({**step, "MASTER_PORT": "777"})["MASTER_PORT"] == "777"
    # A batch script's own shell (no srun step): one process, nothing derived.
    batch = {k: v for k, v in step.items() if k != "SLURM_STEP_NUM_TASKS"}
    assert slurm_rendezvous_env(batch) == {}


def test_metrics_writer_resume_keeps_history_and_drops_records_past_the_checkpoint(
    tmp_path: Path,
) -> None:
    from megatron.training.metrics import MetricsWriter

    path = tmp_path / "m.jsonl"
    lines = [{"iteration": i, "lm_loss": float(i)} for i in (1, 2, 3, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"iteration": 5, "lm_lo')
    w = MetricsWriter(
        str(path), None, enabled=True, resume_from=2
    )  # resumed from a checkpoint at it. 2
    w.close()
    assert [json.loads(x)["iteration"] for x in path.read_text().splitlines()] == [1, 2]
    w = MetricsWriter(
        str(path), None, enabled=True, resume_from=0
    )  # a fresh run starts the file anew
    w.close()
    assert path.read_text() == ""
