"""A tiny random LLaMA with a real (tiny) GPT-2 BPE tokenizer, as a Hugging Face directory and as the Trident
checkpoint our importer writes from it: the model lm_eval's ``hf`` backend and :class:`TridentLM` both evaluate."""

from __future__ import annotations

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "tests" / "fixtures" / "tiny"
TASKS = ROOT / "examples" / "eval_tasks"
VOCAB = 512  # the fixture tokenizer's
CONTEXT = 64


def make_hf_dir(out: Path) -> Path:
    """``out``: a random ``LlamaForCausalLM`` (4 layers, GQA, untied output) + the fixture's GPT-2 BPE files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron.conversion.hf_tokenizer import export_tokenizer
    from megatron.tokenizer.info import tokenizer_info

    out.mkdir(parents=True, exist_ok=True)
    info = tokenizer_info(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=str(TOKENIZER / "vocab.json"),
        merge_file=str(TOKENIZER / "merges.txt"),
    )
    export_tokenizer(info, out, VOCAB)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out)
    return out


def make_checkpoint(hf_dir: Path, out: Path) -> Path:
    """Our importer's checkpoint of ``hf_dir`` (TP 1 x PP 1 files; any layout reads it)."""
    from megatron.conversion.hf_import import import_from_hf
    from megatron.conversion.rewrite import TargetLayout

    import_from_hf(hf_dir, out, layout=TargetLayout(tp=1, pp=1), verification=None)
    return out


def whole_model_engine(hf_dir: Path):  # noqa: ANN201 - (engine, tokenizer)
    """One process, no checkpoint: the HF weights converted in memory into a whole-model ``GPTStage``, its
    :class:`InferenceEngine` and our tokenizer of the directory (what ``TextGenerator.from_checkpoint`` builds from
    the imported checkpoint, minus the files)."""
    from megatron.conversion.hf_import import hf_to_full
    from megatron.conversion.hf_tokenizer import hf_dir_tokenizer
    from megatron.model.stage import GPTStage
    from megatron.mpu.context import ParallelContext
    from megatron.text_generation.engine import InferenceEngine
    from megatron.tokenizer.info import tokenizer_from_info

    full, cfg, _ = hf_to_full(hf_dir, 1)
    parallel = ParallelContext(seed=0, tp_group=None, params_dtype=torch.float32, device="cpu")
    stage = GPTStage(cfg, parallel, layers=(0, cfg.num_layers), pre_process=True, post_process=True)
    stage.load_state_dict(full, strict=True)
    engine = InferenceEngine(stage.eval(), pp_group=None, device=torch.device("cpu"))
    return engine, tokenizer_from_info(hf_dir_tokenizer(hf_dir))
