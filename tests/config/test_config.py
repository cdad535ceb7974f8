"""Typed config: flags -> frozen dataclasses, and every validation error by its message."""

from __future__ import annotations

import dataclasses

import pytest

from megatron.config import TridentConfig, parse_args, validate

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


def cfg(*extra: str) -> TridentConfig:
    return parse_args([*BASE, *extra])


def test_flags_map_to_typed_fields() -> None:
    c = cfg(
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--micro-batch-size", "2", "--global-batch-size", "16", "--swiglu", "--disable-bias-linear",
        "--num-key-value-heads", "2", "--use-rotary-position-embeddings", "--normalization", "rmsnorm",
        "--checkpoint-activations", "--zero-stage", "1", "--bf16", "--data-path", "0.3", "a", "0.7", "b",
        "--local_rank=3", "--save", "ckpt", "--metrics-file", "m.jsonl", "--log-interval", "1",
    )  # fmt: skip
    assert (
        c.parallel.tensor_model_parallel_size == 2 and c.parallel.pipeline_model_parallel_size == 2
    )
    assert c.parallel.local_rank == 3 and c.parallel.zero_stage == 1
    assert (
        c.training.micro_batch_size == 2 and c.training.global_batch_size == 16 and c.training.bf16
    )
    assert c.model.swiglu and not c.model.add_bias_linear and c.model.num_query_groups == 2
    assert c.model.normalization == "rmsnorm" and c.model.recompute_granularity == "full"
    assert c.model.ffn_size == 128  # int(4*64*2/3/64)*64
    assert c.data.data_path == ("0.3", "a", "0.7", "b")
    assert c.checkpoint.save == "ckpt" and c.logging.metrics_file == "m.jsonl"
    validate(c, world_size=8)


def test_config_is_frozen() -> None:
    c = cfg()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.model.hidden_size = 8  # type: ignore[misc]


def test_unknown_flag_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unrecognized arguments: --hiden-size"):
        parse_args([*BASE, "--hiden-size", "3"])


@pytest.mark.parametrize(
    ("extra", "world", "device", "pattern"),
    [
        (["--num-attention-heads", "12", "--hidden-size", "96", "--tensor-model-parallel-size", "5"], 5, "cpu",
         r"--num-attention-heads \(12\) must be divisible by --tensor-model-parallel-size \(5\); use 1, 2, 3, 4, 6 or 12"),
        (["--hidden-size", "66"], 1, "cpu", r"--hidden-size \(66\) must be divisible by --num-attention-heads \(4\)"),
        (["--num-key-value-heads", "3"], 1, "cpu", r"--num-key-value-heads \(3\) must divide --num-attention-heads \(4\)"),
        (["--num-key-value-heads", "1", "--tensor-model-parallel-size", "2"], 2, "cpu",
         r"--num-key-value-heads \(1\) must be divisible by --tensor-model-parallel-size \(2\)"),
        (["--ffn-hidden-size", "101", "--tensor-model-parallel-size", "2"], 2, "cpu",
         r"--ffn-hidden-size \(101\) must be divisible"),
        (["--tensor-model-parallel-size", "2"], 3, "cpu", r"world size \(3\) must be divisible by .* = 2"),
        (["--pipeline-model-parallel-size", "8"], 8, "cpu", r"--pipeline-model-parallel-size \(8\) exceeds --num-layers \(4\)"),
        (["--pipeline-model-parallel-size", "2", "--zero-stage", "2"], 2, "cpu",
         r"--zero-stage \(2\) is incompatible with --pipeline-model-parallel-size \(2\)"),
        (["--zero-stage", "4"], 1, "cpu", r"--zero-stage \(4\) must be 0, 1, 2 or 3"),
        (["--micro-batch-size", "2", "--global-batch-size", "6"], 2, "cpu",
         r"--global-batch-size \(6\) must be divisible by --micro-batch-size \(2\) x data-parallel size \(2\) = 4"),
        (["--fp16"], 1, "cpu", r"--fp16 needs a CUDA GPU \(device here: cpu\); use --bf16"),
        (["--fp16", "--bf16"], 1, "cuda", r"--bf16 and --fp16 are exclusive"),
        (["--train-iters", "3", "--train-samples", "9"], 1, "cpu", r"--train-iters and --train-samples are exclusive"),
        (["--clip-grad", "-1"], 1, "cpu", r"--clip-grad \(-1.0\) must be >= 0"),
        (["--min-lr", "1", "--lr", "0.1"], 1, "cpu", r"--min-lr \(1.0\) must not exceed --lr \(0.1\)"),
        (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], 1, "cpu", r"--lr-warmup-fraction is exclusive"),
        (["--seq-length", "64", "--max-position-embeddings", "32"], 1, "cpu",
         r"--seq-length \(64\) exceeds --max-position-embeddings \(32\)"),
        (["--num-layers", "0"], 1, "cpu", r"--num-layers \(0\) must be a positive integer"),
        (["--hidden-dropout", "1.5"], 1, "cpu", r"--hidden-dropout \(1.5\) must be in \[0, 1\)"),
        (["--no-pipeline-parallel", "--pipeline-model-parallel-size", "2"], 2, "cpu",
         r"--no-pipeline-parallel needs --pipeline-model-parallel-size 1"),
    ],
)  # fmt: skip
def test_validation_errors_name_flag_value_and_fix(
    extra: list[str], world: int, device: str, pattern: str
) -> None:
    with pytest.raises(ValueError, match=pattern):
        validate(cfg(*extra), world_size=world, device_type=device)


def test_sequence_parallel_is_off_at_tp1() -> None:
    assert not cfg("--sequence-parallel").parallel.sequence_parallel_enabled
    assert cfg(
        "--sequence-parallel", "--tensor-model-parallel-size", "2"
    ).parallel.sequence_parallel_enabled


def test_every_flag_is_a_field_with_help_text() -> None:
    """The parser is built from the dataclasses: one flag per field (plus --checkpoint-activations,
    --recompute-activations, the compatibility no-ops and the refused flags), each with a sentence of help, and ``pretrain_gpt.py --help`` shows them all."""
    import subprocess
    import sys
    from pathlib import Path

    from megatron.config.arguments import SECTIONS, build_parser
    from megatron.config.flags import COMPAT_NO_OPS, NOT_FLAGS
    from megatron.config.refused import REFUSED

    actions = [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]

    def n_flags(cls: type) -> int:
        # a nested dataclass field (ModelConfig.moe) counts as its fields' flags
        return sum(n_flags(f.default_factory) if dataclasses.is_dataclass(f.default_factory) else 1
                   for f in dataclasses.fields(cls))  # fmt: skip

    n_fields = sum(n_flags(cls) for _, _, cls in SECTIONS) - len(NOT_FLAGS)
    # + --checkpoint-activations and --recompute-activations, the no-ops and the refused flags
    assert len(actions) == n_fields + 2 + len(COMPAT_NO_OPS) + len(REFUSED) == 281
    assert not [a.option_strings for a in actions if len((a.help or "").split()) < 3]
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, str(root / "pretrain_gpt.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    missing = [f for a in actions for f in a.option_strings if f not in out.stdout]
    assert not missing
    for title in ("model:", "parallelism:", "training:", "data and tokenizer:", "checkpointing:"):
        assert f"\n{title}\n" in out.stdout


def test_compatibility_flags_change_nothing_and_are_documented() -> None:
    from pathlib import Path

    from megatron.config.flags import COMPAT_NO_OPS

    given = []
    for flag in COMPAT_NO_OPS:
        for spelling in flag.flags:
            value = flag.choices[:1] if flag.choices else ("1",) if flag.takes_value else ()
            given += [spelling, *value]
    assert cfg(*given) == cfg()
    docs = Path(__file__).resolve().parents[2] / "docs"
    documented = "".join(page.read_text(encoding="utf-8") for page in sorted(docs.glob("*.md")))
    assert not [f for flag in COMPAT_NO_OPS for f in flag.flags if f"`{f}`" not in documented]


def test_recompute_method_acts_or_is_refused() -> None:
    assert cfg("--checkpoint-activations").model.recompute_granularity == "full"
    assert (
        cfg(
            "--recompute-granularity", "selective", "--checkpoint-activations"
        ).model.recompute_granularity
        == "selective"
    )
    block = cfg(
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--checkpoint-num-layers",
        "2",
    )
    assert (block.model.recompute_method, block.model.recompute_num_layers) == ("block", 2)
    validate(block, world_size=1)
    with pytest.raises(
        ValueError, match="--recompute-method uniform chooses .* add --recompute-granularity full"
    ):
        validate(cfg("--recompute-method", "uniform"), world_size=1)
    with pytest.raises(
        ValueError, match="--recompute-method block needs --pipeline-model-parallel-size 1"
    ):
        validate(
            cfg(
                "--checkpoint-activations",
                "--recompute-method",
                "block",
                "--pipeline-model-parallel-size",
                "2",
            ),
            world_size=2,
        )
