"""LAYOUT PARITY of continued pretraining from each imported HF family (issue #31 acceptance).

For LLaMA (Llama 3 RoPE scaling), Qwen2 (QKV bias), Qwen3 (QK-norm, head dim != hidden / heads, linear RoPE, a
window) and Mistral (a window of 5 keys, shorter than the 32-token sequences): the tiny random HF model of
``tests/checkpointing/ckpt_models.py`` (``make_family``: GQA 6 / 2 heads, awkward sizes, vocabulary 101) is
converted by the real importer (``import_from_hf``, what ``tools/checkpoint/hf_to_trident.py`` runs, verified
against transformers) at the TP x PP each run needs, then trained 10 iterations with ``--load ckpt --finetune``
and the model flags of the converted checkpoint (its ``trident_meta.json`` through ``model_flags``, what
``model_args.sh`` holds), at one rank and at the issue's three layouts: TP 2 x PP 2 ZeRO-1, TP 2 + SP, DP 2
ZeRO-3. Every layout's per-iteration loss must equal the one-rank run's within 1e-5 relative (only the order of
reductions differs: the tolerance of ``test_train_parity.py``).

The one-rank run's first loss must also equal transformers' loss of the HF model on the same batch (samples 0..7 of
``--mock-data``): the run trained the imported model, window and RoPE scaling included, not a model of other flags
or fresh weights.

Data: ``--mock-data`` at the model's vocabulary 101 (deterministic per sample, any layout reads the same samples;
101 pads to 128 at TP 1 and 256 at TP 2, so the padded logits must not matter). The committed tiny corpus has a
512-token tokenizer, which would force a vocabulary without padding at any TP here.

Everything is ``-m slow``: 12 conversions (one per family and checkpoint layout: TP 1, TP 2, TP 2 x PP 2) and 3
training spawns (1, 2 and 4 ranks, each training every family's runs of its world size one after the other); 130-240 s
on a 2-core box. Measured: every layout within 2e-7 of the one-rank run, every first loss within 2e-7 of
transformers'. Dropping the TP sum of the QK-norm weights' gradients moves Qwen3 at TP 2 + SP by 4e-4; dropping
Mistral's ``--window-size`` moves its first loss by 1.4e-3. Nothing runs in the default suite: one family at one
layout (a conversion, the one-rank run and one other layout) takes about 50 s.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron.checkpointing.meta import model_config_from_meta, read_meta
from megatron.config.checkpoint_args import model_flags
from megatron.conversion.hf_import import import_from_hf
from megatron.conversion.rewrite import TargetLayout
from megatron.conversion.verify import Verification
from megatron.data.mock_dataset import MockGPTDataset
from tests.checkpointing.ckpt_models import VOCAB, make_family
from tests.training.test_train_parity import TRAIN, _layouts

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
ITERS = 10
RTOL = 1e-5
SEQ = 32
SEED = 1234  # TRAIN's --seed: the mock data of the first batch
GLOBAL_BATCH = 8  # TRAIN's --global-batch-size
CONVERT_TOL = 1e-5
LAYOUTS = {
    # name: (world, checkpoint TP, PP, extra flags)
    "tp2 pp2 zero1": (4, 2, 2, ["--zero-stage", "1"]),
    "tp2 sp": (2, 2, 1, ["--sequence-parallel"]),
    "dp2 zero3": (2, 1, 1, ["--zero-stage", "3"]),
}


def _convert(hf_dir: Path, out: Path, tp: int, pp: int) -> list[str]:
    """Import ``hf_dir`` at TP x PP (verified against transformers); the model flags of the written checkpoint."""
    cmp = import_from_hf(
        hf_dir,
        out,
        layout=TargetLayout(tp=tp, pp=pp),
        verification=Verification(steps=8, tolerance=CONVERT_TOL),
    )
    assert cmp is not None and cmp.passes(CONVERT_TOL), cmp
    tag = (out / "latest").read_text().strip()
    return _parsable(model_flags(model_config_from_meta(read_meta(out, tag))))


def _parsable(flags: list[str]) -> list[str]:
    """``model_flags`` as ``parse_args`` reads it. On main ``model_flags`` writes the window tuple as two words
    (``--window-size 4 0``), which the flag (``W`` or ``L,R``) refuses; this joins them (a no-op once fixed in
    ``checkpoint_args.py``, owned by the ``--use-checkpoint-args`` work)."""
    out = list(flags)
    if "--window-size" in out:
        i = out.index("--window-size")
        if i + 2 < len(out) and out[i + 2].isdigit():
            out[i + 1 : i + 3] = [f"{out[i + 1]},{out[i + 2]}"]
    return out


def _argv(flags: list[str], ckpt: Path, tp: int, pp: int, *extra: str) -> list[str]:
    return [
        *flags, *TRAIN, "--vocab-size", str(VOCAB - 1), "--seq-length", str(SEQ),
        "--train-iters", str(ITERS), "--load", str(ckpt), "--finetune",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), *extra,
    ]  # fmt: skip


def _hf_first_loss(hf: torch.nn.Module) -> float:
    """transformers' mean token loss of the HF model on the first global batch of ``--mock-data`` (samples
    0..7: the sampler reads them in order)."""
    data = MockGPTDataset(GLOBAL_BATCH, SEQ, VOCAB, SEED)
    text = torch.stack([torch.from_numpy(data[i]["text"]) for i in range(GLOBAL_BATCH)])  # [b, s+1]
    with torch.no_grad():
        logits = hf(text[:, :-1]).logits  # [b, s, v]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), text[:, 1:].reshape(-1))
    return float(loss)


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == ITERS
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_family_training_parity(tmp_path: Path) -> None:
    runs: dict[int, list[tuple[str, list[str]]]] = {1: [], 2: [], 4: []}
    first_loss = {}
    for kind in FAMILIES:
        hf = make_family(kind)
        first_loss[kind] = _hf_first_loss(hf)
        hf_dir = tmp_path / kind / "hf"
        hf.save_pretrained(hf_dir)
        ckpts = {(tp, pp): tmp_path / kind / f"tp{tp}pp{pp}" for tp, pp in ((1, 1), (2, 1), (2, 2))}
        metas = [_convert(hf_dir, out, tp, pp) for (tp, pp), out in ckpts.items()]
        flags = metas[0]
        # every layout's checkpoint holds the same model
        assert all(m == flags for m in metas), metas
        runs[1].append((f"{kind} one rank", _argv(flags, ckpts[1, 1], 1, 1)))
        for name, (world, tp, pp, extra) in LAYOUTS.items():
            runs[world].append((f"{kind} {name}", _argv(flags, ckpts[tp, pp], tp, pp, *extra)))
    losses = {}
    for world, named in runs.items():
        got = _layouts(world, [argv for _, argv in named], iters=ITERS)
        losses.update(zip((name for name, _ in named), got, strict=True))
    diffs, starts = {}, {}
    for kind in FAMILIES:
        one = losses[f"{kind} one rank"]
        assert one[-1] < one[0], (kind, one)  # it learns: parity is not vacuous
        starts[kind] = abs(one[0] - first_loss[kind]) / first_loss[kind]
        for name in LAYOUTS:
            diffs[f"{kind} {name}"] = _max_rel(losses[f"{kind} {name}"], one)
    for name, d in diffs.items():
        print(f"family parity {name}: max rel diff {d:.2e}")
    print(f"first loss vs transformers (rel): {starts}")
    assert all(d < RTOL for d in starts.values()), starts
    bad = {k: v for k, v in diffs.items() if v >= RTOL}
    assert not bad, f"layouts off by more than {RTOL}: {bad} (all: {diffs})"
