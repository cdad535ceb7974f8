"""Import a Megatron-DeepSpeed checkpoint (DeepSpeed format from ``--deepspeed`` runs, or Megatron-native) as a
Trident checkpoint.

Megatron-native (runs without ``--deepspeed``): ``DIR/latest_checkpointed_iteration.txt`` names ``iter_{N:07d}`` (or
``release``); ``mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt`` holds ``args`` and ``model``, the nested state dict
below with each pipeline stage's ``layers.{i}`` numbered from 0 (renumbered here with Megatron's uniform
``num_layers // pp`` split; the last stage's ``word_embeddings_for_head`` copy of a tied embedding is dropped).

What is read (see ``../shared/reference/megatron-compat.md`` §9.2 for the layout)::

    DIR/latest                                             the tag (``global_stepN``), or --tag
    DIR/TAG/mp_rank_{mp:02d}_model_states.pt               client state: ``args`` (the run's argparse Namespace),
                                                           ``universal_checkpoint_info``; with PP = 1 also
                                                           ``module``: Megatron's NESTED state dict
                                                           {'language_model': {'embedding': {...}, 'encoder': {...},
                                                           'output_layer': {...}}}
    DIR/TAG/layer_{idx:02d}-model_{tp:02d}-model_states.pt pipeline runs: one file per GPTModelPipe layer
                                                           (01 embedding, 02..L+1 blocks, L+2 final norm, L+3 lm_head
                                                           when untied): the layout Trident's pipeline uses too
    DIR/TAG/[bf16_]zero_pp_rank_*_mp_rank_*                ZeRO-3 (PP = 1): the fp32 partitions (``zero3.py``)

The model shape comes from ``args`` (num_layers, hidden_size, num_attention_heads, num_key_value_heads,
ffn_hidden_size, normalization, swiglu, use_rotary_position_embeddings, rope_theta, add_bias_linear,
untie_embeddings_and_output_weights, rotary_percent, add_position_embedding, apply_layernorm_1p (which
Megatron-DeepSpeed applies to LayerNorm only), ...); variants Trident does not implement (MoE, post-LN residual,
squared ReLU, erf GeLU) are refused by name. The true vocabulary is
``universal_checkpoint_info.original_vocab_size`` when saved, else the recorded tokenizer's size, else the padded
size (a warning: the padding rows then count as tokens). Fused QKV rows are Megatron-DeepSpeed's per-KV-group
layout (before its FPDT change); checkpoints of the FPDT-era ``[q | k | v]`` split per TP rank convert with
``qkv_layout="thirds"``.

The ``.pt`` files are pickles: they are read with ``torch.load(weights_only=True)``, allowing
``argparse.Namespace``, NumPy arrays (RNG states) and, as inert placeholders, classes of Megatron-DeepSpeed's own
``megatron`` package (e.g. ``megatron.core.enums.ModelType`` inside ``args``); any other pickled class is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron.checkpointing.pointers import check_tag, check_tag_inside
from megatron.checkpointing.readers import (
    Progress,
    build_megatron_model,
    no_progress,
    read_checkpoint_weights,
)
from megatron.checkpointing.safe_load import load_state_dict_of
from megatron.checkpointing.zero3 import is_zero3_checkpoint, read_zero3_tp_shard
from megatron.config import ModelConfig
from megatron.conversion.output_dirs import check_new_save_dir
from megatron.conversion.rewrite import (
    StagedWrite,
    TargetLayout,
    check_target_layout,
    write_verified_checkpoint,
)
from megatron.conversion.verify import (
    LogitComparison,
    Verification,
    compare_logits,
    fixed_prompts,
    megatron_logits_fn,
)
from megatron.layout.names import FINAL_NORM
from megatron.layout.pipeline import pipe_layers_to_megatron
from megatron.layout.qkv import fuse_qkv
from megatron.layout.tensor_parallel import merge_tp_shards
from megatron.tokenizer.info import tokenizer_info

logger = logging.getLogger(__name__)

NATIVE_TRACKER = "latest_checkpointed_iteration.txt"
_NUMPY_GLOBALS = (
    "numpy.dtype",
    "numpy.ndarray",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray.scalar",
    "numpy.core.multiarray.scalar",
)


class ForeignObject:
    """Stands in for an object of Megatron-DeepSpeed's own classes (enums in ``args``): keeps what it was built
    from, runs nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _resolve(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def load_mds_file(path: Path) -> dict[str, Any]:
    """A Megatron-DeepSpeed ``*_model_states.pt`` with ``weights_only=True`` and the allowlist of the docstring.

    Raises:
        ValueError: the file holds another pickled class (named), or is not a dict.
    """
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as err:  # not a torch zip file
        raise ValueError(f"{path} is not a readable PyTorch checkpoint file ({err}).") from None
    allowed: list[Any] = []
    for name in names:
        if name == "argparse.Namespace":
            allowed.append(argparse.Namespace)
        elif name in _NUMPY_GLOBALS or name.startswith("numpy.dtypes."):
            allowed.append(_resolve(name))
        elif name.split(".")[0] == "megatron":
            allowed.append((ForeignObject, name))
        else:
            raise ValueError(
                f"{path} holds a pickled {name}, which Trident does not unpickle (it could run code); if the "
                "file is from a trusted run, re-save its tensors as safetensors."
            )
    if any(
        name.startswith("numpy.") for name in names
    ):  # arrays of any dtype (RNG states are uint32)
        import numpy.dtypes

        allowed += [
            getattr(numpy.dtypes, n)
            for n in dir(numpy.dtypes)
            if n.endswith("DType") and n[0].isupper()
        ]
    return load_state_dict_of(path, allowed=allowed)


def find_mds_tag(root: Path, tag: str | None) -> Path:
    """The tag directory to import: ``tag``, else the one ``latest`` names.

    Raises:
        FileNotFoundError: no such directory / no ``latest``.
    """
    given = tag is not None
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            raise FileNotFoundError(
                f"--load {root} has no 'latest' (DeepSpeed format) nor {NATIVE_TRACKER} (Megatron-native); "
                "point --load at a Megatron-DeepSpeed --save directory, or pass --tag."
            )
        tag = check_tag(latest.read_text(encoding="utf-8").strip(), str(latest))
    else:
        check_tag(tag, "--tag")
    check_tag_inside(root, tag, "--tag" if given else str(root / "latest"))
    tag_dir = root / tag
    if not tag_dir.is_dir():
        raise FileNotFoundError(f"--load {root}: no checkpoint directory {tag!r} in it.")
    return tag_dir


def _client_state_file(tag_dir: Path) -> Path:
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (tag_dir / name).is_file():
            return tag_dir / name
    raise FileNotFoundError(
        f"{tag_dir} has no mp_rank_00_model_states.pt: not a DeepSpeed-format Megatron-DeepSpeed checkpoint."
    )


def _refuse_variants(a: dict[str, Any], source: Path, version: float) -> None:
    experts = a.get("num_experts") or [1]
    experts = experts if isinstance(experts, list | tuple) else [experts]
    problems = []
    if max(int(e) for e in experts) > 1:
        problems.append(f"mixture of experts (num_experts {experts})")
    for flag, what in (
        ("apply_residual_connection_post_layernorm", "post-LayerNorm residual"),
        ("squared_relu", "squared ReLU"),
        ("standalone_embedding_stage", "a standalone embedding pipeline stage"),
    ):
        if a.get(flag):
            problems.append(what)
    # Megatron's MLP uses the tanh GeLU (Trident's) only through the fused bias-GeLU or --openai-gelu; without the
    # fusion (--no-bias-gelu-fusion, or no biases) or with --onnx-safe it is the exact erf GeLU.
    tanh = a.get("openai_gelu") or (
        a.get("bias_gelu_fusion", True)
        and a.get("add_bias_linear", True)
        and not a.get("onnx_safe")
    )
    if not a.get("swiglu") and not tanh:
        problems.append("the exact (erf) GeLU (Trident's MLP uses the tanh approximation)")
    if version < 2.0:
        problems.append(
            f"checkpoint_version {version} (before 2.0 the fused QKV rows had another order)"
        )
    if a.get("use_rotary_position_embeddings") and a.get("add_position_embedding", False):
        problems.append("rotary AND learned position embeddings")
    if problems:
        raise ValueError(
            f"{source}: the checkpoint uses {', '.join(problems)}, which Trident's model does not implement."
        )


def _true_vocab(a: dict[str, Any], client: dict[str, Any], tok: dict[str, str] | None) -> int:
    """The tokenizer's vocabulary: the larger of ``original_vocab_size`` and the recorded tokenizer's size (for
    HFTokenizer, Megatron-DeepSpeed records a size WITHOUT added tokens, whose rows are trained: they must not be
    dropped as padding); the padded size when neither is known, or for an HFTokenizer that cannot be built here."""
    padded = int(a["padded_vocab_size"])
    info = client.get("universal_checkpoint_info") or {}
    original = int(info.get("original_vocab_size") or 0)
    built = 0
    if tok is not None:
        from megatron.tokenizer import build_tokenizer

        try:
            built = int(build_tokenizer(**tok).vocab_size)
        except (ValueError, FileNotFoundError) as err:
            logger.warning("the recorded tokenizer cannot be built (%s)", err)
    if built == 0 and (tok or {}).get("tokenizer_type") == "HFTokenizer":
        logger.warning(
            "HFTokenizer not available here: keeping all %d rows of the vocabulary (its recorded size %d may "
            "omit added tokens)",
            padded,
            original,
        )
        return padded
    true = max(original, built)
    if true == 0:
        logger.warning(
            "no vocabulary size recorded: using the padded size %d (the padding rows become tokens)",
            padded,
        )
        return padded
    return min(true, padded)


def mds_model_config(
    a: dict[str, Any], true_vocab: int, source: Path, version: float = 3.0
) -> ModelConfig:
    """Trident's ``ModelConfig`` for a Megatron-DeepSpeed run's ``args`` (as a dict).

    Raises:
        ValueError: a model variant Trident does not implement, or a missing field.
    """
    _refuse_variants(a, source, version)
    rotary = bool(a.get("use_rotary_position_embeddings", False))
    norm = str(a.get("normalization", "layernorm")).lower()
    try:
        heads = int(a["num_attention_heads"])
        kv = a.get("num_key_value_heads")
        return ModelConfig(
            num_layers=int(a["num_layers"]),
            hidden_size=int(a["hidden_size"]),
            num_attention_heads=heads,
            num_key_value_heads=None if kv in (None, heads) else int(kv),
            kv_channels=a.get("kv_channels"),
            ffn_hidden_size=a.get("ffn_hidden_size"),
            seq_length=int(a["seq_length"]),
            max_position_embeddings=a.get("max_position_embeddings"),
            normalization=norm,  # type: ignore[arg-type]
            layernorm_epsilon=float(a.get("layernorm_epsilon", 1e-5)),
            swiglu=bool(a.get("swiglu", False)),
            use_rotary_position_embeddings=rotary,
            rotary_position_embeddings_theta=float(a.get("rope_theta", 10000)),
            rotary_percent=float(a.get("rotary_percent", 1.0)) if rotary else 1.0,
            add_position_embedding=bool(a.get("add_position_embedding", True)) and not rotary,
            # Megatron-DeepSpeed's RMSNorm ignores --apply-layernorm-1p: its weights are the plain scale.
            apply_layernorm_1p=bool(a.get("apply_layernorm_1p", False)) and norm == "layernorm",
            add_bias_linear=bool(a.get("add_bias_linear", True)),
            untie_embeddings_and_output_weights=bool(
                a.get("untie_embeddings_and_output_weights", False)
            ),
            make_vocab_size_divisible_by=int(a.get("make_vocab_size_divisible_by", 128)),
            vocab_size=true_vocab,
            attention_dropout=0.0,
            hidden_dropout=0.0,
        )
    except KeyError as err:
        raise ValueError(
            f"{source}: args lacks {err}; is it a Megatron-DeepSpeed GPT checkpoint?"
        ) from None


def _flatten(nested: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in nested.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        elif isinstance(value, torch.Tensor):
            out[name] = value.float()
    return out


def _thirds_to_grouped(shard: dict[str, torch.Tensor], cfg: ModelConfig, tp: int) -> None:
    """In place: each TP shard's ``[q | k | v]`` QKV rows -> the per-group interleave (``layout.fuse_qkv``)."""
    n, g, hn = cfg.num_attention_heads // tp, cfg.num_query_groups // tp, cfg.head_dim
    for key in [k for k in shard if ".self_attention.query_key_value." in k]:
        q, k, v = torch.split(shard[key], [n * hn, g * hn, g * hn], dim=0)  # rows [q | k | v]
        shard[key] = fuse_qkv(q, k, v, num_heads=n, num_groups=g, head_dim=hn)


def _config_from_client(
    client: dict[str, Any], source: Path
) -> tuple[ModelConfig, dict[str, str] | None, int, int]:
    """``(ModelConfig, tokenizer info, TP, PP)`` from a checkpoint file's saved ``args``."""
    args = client.get("args")
    if not isinstance(args, argparse.Namespace):
        raise ValueError(
            f"{source}: the checkpoint file holds no Megatron 'args'; not a Megatron-DeepSpeed checkpoint."
        )
    a = vars(args)
    tok = tokenizer_info(
        tokenizer_type=a.get("tokenizer_type"),
        vocab_file=a.get("vocab_file"),
        merge_file=a.get("merge_file"),
        tokenizer_model=a.get("tokenizer_model"),
    )
    version = float(client.get("checkpoint_version") or 3.0)
    cfg = mds_model_config(a, _true_vocab(a, client, tok), source, version)
    tp = int(a.get("tensor_model_parallel_size", 1))
    return cfg, tok, tp, int(a.get("pipeline_model_parallel_size", 1))


def _ds_format_shard(
    tag_dir: Path, r: int, cfg: ModelConfig, tp: int, pp: int
) -> dict[str, torch.Tensor]:
    """TP rank ``r``'s weights (Megatron names) of a DeepSpeed-format checkpoint."""
    layer_files = sorted(tag_dir.glob(f"layer_*-model_{r:02d}-model_states.pt"))
    if layer_files:
        layers = {
            int(f.name.split("-")[0].removeprefix("layer_")): load_mds_file(f) for f in layer_files
        }
        shard = pipe_layers_to_megatron(
            _canonical_pipe_indices(layers, cfg, tag_dir), cfg.num_layers
        )
        if cfg.apply_layernorm_1p and f"{FINAL_NORM}.weight" in shard:
            # Their GPTModelPipe builds the final LayerNorm without apply_layernorm_1p (the layers' norms have it):
            # its stored weight is the plain scale; ours stores scale - 1 for every norm.
            shard[f"{FINAL_NORM}.weight"] = shard[f"{FINAL_NORM}.weight"] - 1
        return shard
    if is_zero3_checkpoint(tag_dir):
        return read_zero3_tp_shard(tag_dir, r)
    path = tag_dir / f"mp_rank_{r:02d}_model_states.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (checkpoint of TP = {tp}, PP = {pp}).")
    module = load_mds_file(path).get("module")
    if not isinstance(module, dict) or not module:
        raise ValueError(f"{path} holds no module weights.")
    return _flatten(module)


def _canonical_pipe_indices(
    layers: dict[int, dict[str, torch.Tensor]], cfg: ModelConfig, tag_dir: Path
) -> dict[int, dict[str, torch.Tensor]]:
    """Layer files keyed by GPTModelPipe's current spec indices (1 embedding, 2..L+1 blocks, L+2 final norm, L+3
    lm head), recognized by their keys: older Megatron-DeepSpeed (and BigScience) specs put a transpose function at
    index 2, which shifts the blocks to 3..L+2 and the final norm to L+4."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    blocks = []
    for idx in sorted(layers):
        sd = {k: v.float() for k, v in layers[idx].items()}
        keys = set(sd)
        if any(k.startswith("word_embeddings.") for k in keys):
            out[1] = sd
        elif any(k.startswith("input_layernorm.") for k in keys):
            blocks.append(sd)
        elif keys == {"lm_head.weight"}:
            out[cfg.num_layers + 3] = sd
        elif keys <= {"weight", "bias"}:
            out[cfg.num_layers + 2] = sd
        else:
            raise ValueError(
                f"{tag_dir}: pipeline layer file {idx} holds {sorted(keys)[:4]}, which is no GPT layer Trident "
                "knows (an embedding, a transformer block, the final norm or the LM head)."
            )
    if len(blocks) != cfg.num_layers:
        raise ValueError(
            f"{tag_dir}: {len(blocks)} transformer-block files for a {cfg.num_layers}-layer model (args)."
        )
    out.update({2 + i: sd for i, sd in enumerate(blocks)})
    return out


def find_native_iteration_dir(root: Path, tag: str | None) -> Path:
    """Megatron-native layout: ``tag`` (e.g. ``iter_0001000`` or ``release``), else what
    ``latest_checkpointed_iteration.txt`` names.

    Raises:
        FileNotFoundError: no such directory.
    """
    if tag is None:
        text = (root / NATIVE_TRACKER).read_text(encoding="utf-8").strip()
        tag = "release" if text == "release" else f"iter_{int(text):07d}"
    check_tag(tag, "--tag")
    check_tag_inside(root, tag, "--tag")
    it_dir = root / tag
    if not it_dir.is_dir():
        raise FileNotFoundError(f"--load {root}: no checkpoint directory {tag!r} in it.")
    return it_dir


def _native_shard(it_dir: Path, r: int, cfg: ModelConfig, pp: int) -> dict[str, torch.Tensor]:
    """TP rank ``r``'s weights of a Megatron-native checkpoint: the stages' ``model`` dicts, with each stage's
    local ``layers.{i}`` renumbered by its offset (``num_layers // pp`` per stage, Megatron's uniform split)."""
    out: dict[str, torch.Tensor] = {}
    per_stage = cfg.num_layers // pp
    for stage in range(pp):
        name = f"mp_rank_{r:02d}" if pp == 1 else f"mp_rank_{r:02d}_{stage:03d}"
        path = it_dir / name / "model_optim_rng.pt"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing (checkpoint of PP = {pp}).")
        state = load_mds_file(path)
        if "model" not in state:
            raise ValueError(
                f"{path} has no 'model' (virtual pipeline checkpoints with model0..k are not supported)."
            )
        for key, t in _flatten(state["model"]).items():
            if key.startswith("word_embeddings_for_head."):
                continue  # the last stage's copy of the tied embedding
            prefix = "language_model.encoder.layers."
            if key.startswith(prefix):
                local, _, rest = key[len(prefix) :].partition(".")
                key = f"{prefix}{int(local) + stage * per_stage}.{rest}"
            out[key] = t
    found = {int(k.split(".")[3]) for k in out if k.startswith("language_model.encoder.layers.")}
    if found != set(range(cfg.num_layers)):
        raise ValueError(
            f"{it_dir}: the stages hold layers {sorted(found)[:8]}... after renumbering with "
            f"{per_stage} per stage; expected 0..{cfg.num_layers - 1} (an uneven pipeline split is not "
            "supported)."
        )
    return out


def read_mds_checkpoint(
    load: str | Path,
    *,
    tag: str | None = None,
    qkv_layout: str = "grouped",
    progress: Progress = no_progress,
) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, str] | None]:
    """``(full TP = 1 Megatron state dict, ModelConfig, tokenizer info)`` of a Megatron-DeepSpeed checkpoint, in
    DeepSpeed format (``latest`` + ``global_stepN/``) or Megatron-native (``latest_checkpointed_iteration.txt``
    + ``iter_NNNNNNN/mp_rank_*/model_optim_rng.pt``).

    Raises:
        FileNotFoundError / ValueError: missing files, refused pickles, unsupported model variants.
    """
    if qkv_layout not in ("grouped", "thirds"):
        raise ValueError(f"--qkv-layout {qkv_layout!r}: choose 'grouped' or 'thirds'.")
    root = Path(load)
    native = not (root / "latest").is_file() and (root / NATIVE_TRACKER).is_file()
    if native:
        it_dir = find_native_iteration_dir(root, tag)
        first = sorted(it_dir.glob("mp_rank_00*/model_optim_rng.pt"))
        if not first:
            raise FileNotFoundError(f"{it_dir} has no mp_rank_00*/model_optim_rng.pt.")
        cfg, tok, tp, pp = _config_from_client(load_mds_file(first[0]), it_dir)
    else:
        tag_dir = find_mds_tag(root, tag)
        cfg, tok, tp, pp = _config_from_client(load_mds_file(_client_state_file(tag_dir)), tag_dir)
    shards = []
    for r in range(tp):
        shard = (
            _native_shard(it_dir, r, cfg, pp)
            if native
            else _ds_format_shard(tag_dir, r, cfg, tp, pp)
        )
        if qkv_layout == "thirds":
            _thirds_to_grouped(shard, cfg, tp)
        shards.append(shard)
        progress("reading TP shards", r + 1, tp)
    full = merge_tp_shards(shards, cfg) if tp > 1 else shards[0]
    return full, dataclasses.replace(cfg), tok


def import_megatron_deepspeed(
    load: str | Path,
    save: str | Path,
    *,
    layout: TargetLayout,
    tag: str | None = None,
    qkv_layout: str = "grouped",
    verification: Verification | None = Verification(),
    progress: Progress = no_progress,
    say: Callable[[str], None] = logger.warning,
) -> LogitComparison | None:
    """Convert a Megatron-DeepSpeed checkpoint into a Trident checkpoint for ``layout.tp`` x ``layout.pp`` ranks
    (weights only, iteration 0: training loads it like --finetune). Written and verified in a staging directory,
    moved into ``save`` only when verification passes (``rewrite.write_verified_checkpoint``).

    Returns:
        The imported weights vs the written checkpoint, both run in a TP = 1 ``GPTModel`` (None without
        ``verification``).

    Raises:
        FileNotFoundError / ValueError: see :func:`read_mds_checkpoint`; a --save that is not new; a model that
            does not split over ``layout``. All before any rank is spawned.
    """
    check_new_save_dir(save, load=load)
    full, cfg, tok = read_mds_checkpoint(load, tag=tag, qkv_layout=qkv_layout, progress=progress)
    check_target_layout(cfg, layout)

    def verify(written: Path) -> LogitComparison:
        back, back_cfg, _ = read_checkpoint_weights(written)
        a, b = build_megatron_model(full, cfg), build_megatron_model(back, back_cfg)
        max_pos = cfg.max_position_embeddings or cfg.seq_length
        prompts, n = fixed_prompts(cfg.vocab_size, max_pos, steps)
        with torch.no_grad():
            return compare_logits(
                megatron_logits_fn(a), megatron_logits_fn(b), prompts, n, vocab_size=cfg.vocab_size
            )

    steps = 0 if verification is None else verification.steps
    result = write_verified_checkpoint(
        StagedWrite(full, cfg, source=str(load), tokenizer=tok),
        save,
        layout=layout,
        verify=None if verification is None else verify,
        tolerance=None if verification is None else verification.tolerance,
        say=say,
    )
    progress("writing", 1, 1)
    return result
