"""LoRA training end to end: ``pretrain`` on spawned ranks (gloo, the real DeepSpeed engine), a base model saved by
a first run, adapters trained on it with ``--pretrained-checkpoint``.

Default (one rank, one spawn): a base run (ZeRO-1) saves; a LoRA run (ZeRO-1) trains 4 iterations saving at 2 and
4; a second LoRA run resumes from the adapter checkpoint at 2 and must log iterations 3-4 exactly as the first
did. The adapter checkpoint holds the adapters only (module and ZeRO's fp32 partitions), records its base and LoRA
settings, and ``read_lora_checkpoint`` gives back the full adapters and the base (read by the exports); the
optimizer-state bytes with and without LoRA are printed.

Slow: 10 iterations at TP = 2 (+ sequence parallelism), PP = 2 and DP = 2 (ZeRO-2), one spawn, against the
single-rank run within 1e-5 relative (layouts differ only in the order of fp32 reductions, ~1e-7 here), and the
merged adapters of each layout against the single rank's. Dropout 0: masks are layout-dependent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron.model.presets import GPT2_FLAGS, LLAMA_FLAGS
from megatron.testing import run_distributed

RTOL = 1e-5
SIZES = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
]  # fmt: skip
TRAIN = [
    "--micro-batch-size", "1", "--global-batch-size", "4",
    "--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--clip-grad", "1.0", "--weight-decay", "0.01", "--seed", "1234",
    "--mock-data", "--vocab-size", "299",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    "--eval-interval", "1000", "--eval-iters", "0", "--log-interval", "1", "--log-level", "WARNING",
]  # fmt: skip
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]


def _argv(iters: int, *extra: str, preset: list[str] = GPT2_FLAGS) -> list[str]:
    return [*preset, *SIZES, *TRAIN, "--train-iters", str(iters), *extra]


def _train_many(argvs: list[list[str]]) -> list[list[float]]:
    from megatron.config import parse_args
    from megatron.training import pretrain

    out = []
    for argv in argvs:
        result = pretrain(parse_args(argv))
        assert result.exit_code == 0, argv
        out.append(result.losses)
    return out


def _tensor_bytes(tree: object) -> int:
    if torch.is_tensor(tree):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def _optimizer_bytes(tag_dir: Path) -> int:
    """Bytes of the tensors of ZeRO's optimizer-state file(s) of a tag: fp32 partitions + Adam moments."""
    files = sorted(tag_dir.glob("*optim_states.pt"))
    assert files, tag_dir
    return sum(_tensor_bytes(torch.load(f, weights_only=False)) for f in files)


def _base(tmp: Path, preset: list[str] = GPT2_FLAGS) -> list[str]:
    return _argv(2, "--zero-stage", "1", "--save", str(tmp / "base"), preset=preset)


def test_lora_trains_saves_adapters_and_resumes_exactly(tmp_path: Path) -> None:
    from megatron.checkpointing.lora import read_lora_checkpoint
    from megatron.checkpointing.readers import read_checkpoint_weights

    base = str(tmp_path / "base")
    lora = [*LORA, "--zero-stage", "1", "--pretrained-checkpoint", base, "--save-interval", "2"]
    first = _argv(4, *lora, "--save", str(tmp_path / "a"))
    a = str(tmp_path / "a")
    resumed = _argv(
        4, *lora, "--load", a, "--load-tag", "global_step2", "--save", str(tmp_path / "b")
    )
    _, full, rest = run_distributed(
        _train_many, 1, [_base(tmp_path), first, resumed], init_process_group=False, timeout=600
    )[0]
    assert len(full) == 4 and rest == full[2:], (full, rest)  # resume is exact
    tag_dir = tmp_path / "a" / "global_step4"
    module = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert module and all(k.endswith((".lora_a", ".lora_b")) for k in module), sorted(module)
    assert len(module) == 2 * 4 * 2
    meta = json.loads((tag_dir / "trident_meta.json").read_text())
    assert meta["lora_base"]["dir"] == str(Path(base).resolve())
    assert meta["lora_base"]["tag"] == "global_step2" and meta["lora_base"]["iteration"] == 2
    assert meta["model"]["lora"]["lora_rank"] == 4 and meta["model"]["lora"]["lora_alpha"] == 8.0
    adapters, base_sd, cfg, _ = read_lora_checkpoint(tmp_path / "a")
    assert cfg.lora.scaling == 2.0 and set(adapters) == set(module)
    assert all(
        adapters[k].any() for k in adapters if k.endswith("lora_b")
    )  # B moved from its zero start
    assert all(torch.equal(adapters[k], module[k].float()) for k in module)
    want, _, _ = read_checkpoint_weights(base)
    assert set(base_sd) == set(want) and all(torch.equal(base_sd[k], want[k]) for k in want)
    # the optimizer holds the adapters only: ZeRO's fp32 partitions + two Adam moments of 16 x 4 x 64 numbers
    adapter_numel = sum(v.numel() for v in module.values())
    lora_bytes, base_bytes = (
        _optimizer_bytes(tag_dir),
        _optimizer_bytes(Path(base) / "global_step2"),
    )
    print(
        f"optimizer-state bytes: full {base_bytes}, LoRA {lora_bytes} ({adapter_numel} adapter numbers)"
    )
    assert lora_bytes < 3 * 4 * adapter_numel + 4096 < base_bytes // 10


def test_lora_bad_starts_are_one_line(tmp_path: Path) -> None:
    """Refused before training: no --pretrained-checkpoint; a missing base; a full checkpoint as --load."""
    from megatron.config import parse_args, validate

    with pytest.raises(ValueError, match="--pretrained-checkpoint"):
        validate(parse_args(_argv(2, *LORA)), world_size=1)
    with pytest.raises(ValueError, match="add --lora-rank"):
        validate(parse_args(_argv(2, "--pretrained-checkpoint", str(tmp_path))), world_size=1)


@pytest.mark.slow
def test_lora_layouts_match_one_rank(tmp_path: Path) -> None:
    from megatron.checkpointing.lora import read_lora_checkpoint

    base = str(tmp_path / "base")

    def run(name: str, *extra: str) -> list[str]:
        flags = [*LORA, "--pretrained-checkpoint", base, "--save", str(tmp_path / name)]
        return _argv(10, *flags, *extra, preset=LLAMA_FLAGS)

    _, one = run_distributed(
        _train_many,
        1,
        [_base(tmp_path, LLAMA_FLAGS), run("one")],
        init_process_group=False,
        timeout=900,
    )[0]
    layouts = {
        "tp2": run("tp2", "--tensor-model-parallel-size", "2", "--sequence-parallel"),
        "pp2": run("pp2", "--pipeline-model-parallel-size", "2"),
        "dp2": run("dp2", "--zero-stage", "2"),
    }
    results = run_distributed(
        _train_many, 2, list(layouts.values()), init_process_group=False, timeout=900
    )[0]
    want, _, _, _ = read_lora_checkpoint(tmp_path / "one")
    assert all(v.any() for k, v in want.items() if k.endswith("lora_b")), (
        "the adapters did not train"
    )
    worst = {}
    for name, losses in zip(layouts, results, strict=True):
        err = max(abs(a - b) / abs(b) for a, b in zip(losses, one, strict=True))
        worst[name] = err
        assert len(losses) == 10 and err < RTOL, (name, err, losses, one)
        got, _, _, _ = read_lora_checkpoint(tmp_path / name)
        assert set(got) == set(want), name
        for k, v in want.items():
            rel = ((got[k] - v).abs().max() / v.abs().max()).item()
            assert rel < 1e-4, (name, k, rel)
    print(f"LoRA layout parity, worst relative loss error over 10 iterations: {worst}")
