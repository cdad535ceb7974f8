"""Cross-checks of the Mixture-of-Experts flags (``validate()`` calls :func:`check_moe` before any process group).

What is refused, and why:

* ``--zero-stage 3``: DeepSpeed's engine refuses native ``deepspeed.moe`` layers under ZeRO-3
  ("Native DeepSpeed MoE is not supported with ZeRO Stage 3").
* ``--ds-sequence-parallel-size`` > 1 (DeepSpeed-Ulysses): not composed with MoE here.
* ``--sequence-parallel`` (Megatron's, TP > 1): DeepSpeed's MoE layer splits and re-gathers tokens over TP itself and
  expects the whole ``[s, b, h]`` input on every TP rank.
* Full activation recomputation (``--recompute-granularity full`` / ``--checkpoint-activations``): the aux loss of a
  recomputed layer is produced in backward, too late to be added to the loss.
* ``--enable-expert-tensor-parallelism`` at TP > 1 with ``--disable-moe-token-dropping``, or with a capacity not
  divisible by TP: DeepSpeed 0.19.8 splits the capacity over TP ranks without padding it for TP-split experts.
* ``--universal-checkpoint`` (and ``tools/checkpoint/to_universal.py``): DeepSpeed 0.19.8's ``ds_to_universal``
  converts AutoEP experts only, not ``deepspeed.moe`` expert files.
* ZeRO 1/2 without ``--create-moe-param-group``: DeepSpeed's ZeRO optimizer needs the expert parameters in groups of
  their own (Megatron-DeepSpeed requires the flag too; we refuse rather than turn it on silently).
* ``--num-experts-switch`` (Switch MLP) with Megatron ``--sequence-parallel``: its replicated router needs the same
  tokens on every TP rank.
* ``--save`` with whole experts at TP > 1 when TP does not divide ``--moe-expert-parallel-size``: DeepSpeed 0.19.8
  would write a checkpoint some TP ranks cannot load (:func:`check_deepspeed_saves_every_rank`).
"""

from __future__ import annotations

import math

from megatron.config.arguments import TridentConfig


def _check_counts(cfg: TridentConfig) -> None:
    moe, layers = cfg.model.moe, cfg.model.num_layers
    if moe.expert_interval < 1:
        raise ValueError(f"--expert-interval ({moe.expert_interval}) must be >= 1.")
    if any(n < 1 for n in moe.num_experts):
        raise ValueError(f"--num-experts {list(moe.num_experts)}: every count must be >= 1.")
    moe_layers = layers // moe.expert_interval
    if len(moe.num_experts) not in (1, moe_layers):
        raise ValueError(
            f"--num-experts has {len(moe.num_experts)} values {list(moe.num_experts)}; give one value, or one "
            f"per MoE layer: --num-layers ({layers}) // --expert-interval ({moe.expert_interval}) = {moe_layers}."
        )
    if any(n > 1 for n in moe.num_experts) and moe_layers == 0:
        raise ValueError(
            f"--expert-interval ({moe.expert_interval}) exceeds --num-layers ({layers}): no layer would be an "
            "MoE layer; use --expert-interval <= --num-layers."
        )
    for flag, value in (
        ("--moe-train-capacity-factor", moe.moe_train_capacity_factor),
        ("--moe-eval-capacity-factor", moe.moe_eval_capacity_factor),
    ):
        if value <= 0:
            raise ValueError(f"{flag} ({value}) must be positive.")
    if moe.moe_min_capacity < 0:
        raise ValueError(f"--moe-min-capacity ({moe.moe_min_capacity}) must be >= 0.")
    switch = moe.num_experts_switch
    if switch is not None and switch < 1:
        raise ValueError(
            f"--num-experts-switch ({switch}) must be >= 1 (omit the flag for the dense MLP)."
        )
    if switch is not None and cfg.parallel.sequence_parallel_enabled:
        raise ValueError(
            f"--num-experts-switch ({switch}) with --sequence-parallel: the Switch MLP's router is replicated "
            "over tensor-parallel ranks and needs the same tokens on each; drop --sequence-parallel."
        )


def _check_expert_parallel(cfg: TridentConfig, world_size: int) -> None:
    p, moe = cfg.parallel, cfg.model.moe
    ep = p.moe_expert_parallel_size
    if ep < 1:
        raise ValueError(f"--moe-expert-parallel-size ({ep}) must be >= 1.")
    if not moe.is_moe(cfg.model.num_layers):
        if ep > 1 or p.enable_expert_tensor_parallelism:
            flag = (
                f"--moe-expert-parallel-size {ep}"
                if ep > 1
                else "--enable-expert-tensor-parallelism"
            )
            raise ValueError(
                f"{flag} needs MoE layers, but --num-experts {list(moe.num_experts)} makes every layer dense; "
                "pass --num-experts N (N > 1) or drop the flag."
            )
        return
    dp = p.data_parallel_size(world_size)
    if dp % ep:
        raise ValueError(
            f"--moe-expert-parallel-size ({ep}) must divide the data-parallel size ({dp} = world size "
            f"{world_size} / (TP x PP)): expert-parallel groups are carved out of data-parallel ranks; choose "
            f"an expert-parallel size that divides {dp}."
        )
    counts = sorted({n for n in moe.experts_per_layer(cfg.model.num_layers) if n > 1})
    bad = [n for n in counts if n % ep]
    if bad:
        raise ValueError(
            f"--num-experts {list(moe.num_experts)}: every MoE layer's expert count must be divisible by "
            f"--moe-expert-parallel-size ({ep}); {bad} are not. Each expert-parallel rank holds count / {ep} experts."
        )


def _check_composition(cfg: TridentConfig) -> None:
    p, m, moe = cfg.parallel, cfg.model, cfg.model.moe
    sp = getattr(p, "ds_sequence_parallel_size", 1)
    if sp > 1:
        raise ValueError(
            f"--num-experts {list(moe.num_experts)} with --ds-sequence-parallel-size ({sp}): MoE is not composed "
            "with DeepSpeed-Ulysses sequence parallelism; use one of them (--ds-sequence-parallel-size 1)."
        )
    if p.zero_stage == 3:
        raise ValueError(
            "--zero-stage 3 with MoE layers: DeepSpeed refuses native deepspeed.moe layers under ZeRO-3 ('Native "
            "DeepSpeed MoE is not supported with ZeRO Stage 3'); use --zero-stage 0, 1 or 2."
        )
    if p.zero_stage > 0 and not moe.create_moe_param_group:
        raise ValueError(
            f"--zero-stage {p.zero_stage} with MoE layers needs --create-moe-param-group: DeepSpeed's ZeRO "
            "optimizer keeps expert parameters in parameter groups of their own (as in Megatron-DeepSpeed); "
            "add the flag."
        )
    if p.sequence_parallel_enabled:
        raise ValueError(
            "--sequence-parallel with MoE layers: DeepSpeed's MoE layer splits tokens over tensor-parallel ranks "
            "itself and needs the whole [s, b, h] input on each; drop --sequence-parallel."
        )
    if cfg.checkpoint.universal_checkpoint:
        raise ValueError(
            "--universal-checkpoint with MoE layers: universal checkpoints are refused for MoE models (DeepSpeed "
            "0.19.8's ds_to_universal does not convert deepspeed.moe expert files); resume at the saved layout, "
            "or reshard the weights with tools/checkpoint/reshard.py."
        )
    if m.recompute_granularity == "full":
        raise ValueError(
            "--recompute-granularity full (--checkpoint-activations) with MoE layers: a recomputed layer's "
            "load-balancing loss would only exist in backward; use --recompute-granularity selective or none."
        )


def _check_expert_tensor_parallel(cfg: TridentConfig) -> None:
    """DeepSpeed 0.19.8 splits each expert's capacity ``C`` over TP ranks; with TP-split experts it does not pad
    ``C`` to a multiple of TP, so ``C`` must divide evenly: it is fixed only with token dropping."""
    p, m, moe = cfg.parallel, cfg.model, cfg.model.moe
    tp = p.tensor_model_parallel_size
    if not p.enable_expert_tensor_parallelism or tp == 1:
        return
    if not moe.moe_token_dropping:
        raise ValueError(
            f"--enable-expert-tensor-parallelism with --tensor-model-parallel-size {tp} and "
            "--disable-moe-token-dropping: DeepSpeed then sizes each expert's capacity by its load, which need "
            f"not divide by {tp}, and fails; keep token dropping, or drop --enable-expert-tensor-parallelism "
            "(whole experts on every TP rank)."
        )
    tokens = cfg.training.micro_batch_size * m.seq_length
    for n in sorted({n for n in moe.experts_per_layer(m.num_layers) if n > 1}):
        for flag, factor in (
            ("--moe-train-capacity-factor", moe.moe_train_capacity_factor),
            ("--moe-eval-capacity-factor", moe.moe_eval_capacity_factor),
        ):
            cap = max(math.ceil(tokens / n * factor * moe.topk), moe.moe_min_capacity)
            if cap % tp:
                raise ValueError(
                    f"--enable-expert-tensor-parallelism: expert capacity {cap} (= max(ceil(micro-batch "
                    f"{cfg.training.micro_batch_size} x seq {m.seq_length} / {n} experts x {flag} {factor} x "
                    f"topk {moe.topk}), --moe-min-capacity {moe.moe_min_capacity})) must be divisible by "
                    f"--tensor-model-parallel-size ({tp}); change the factor or drop the flag."
                )


def check_deepspeed_saves_every_rank(
    tp: int,
    ep: int,
    *,
    expert_tensor_parallel: bool = False,
    flags: tuple[str, str] = ("--tp", "--ep"),
) -> None:
    """DeepSpeed 0.19.8 can write a loadable MoE checkpoint at this layout.

    With whole experts (no expert tensor parallelism) DeepSpeed's expert-data-parallel groups are the ranks
    ``i, i + ep, i + 2 ep, ...`` of a stage, and ``_save_moe_checkpoint`` returns early on every rank that is not
    expert-data-parallel rank 0, before it writes ``mp_rank_XX_model_states.pt``: only the first ``ep`` ranks of a
    stage write. Rank ``r < ep`` is TP rank ``r % p`` and EP rank ``r``, and a loading rank looks for the files of
    its own (TP rank, EP rank): all exist exactly when ``p`` divides ``ep``. E.g. TP = 2, EP = 1: TP rank 1 writes
    nothing and ``engine.load_checkpoint`` cannot find ``mp_rank_01_model_states.pt``.

    Raises:
        ValueError: naming both flags, the rule and the sizes that work.
    """
    if expert_tensor_parallel or tp == 1 or ep % tp == 0:
        return
    tp_flag, ep_flag = flags
    raise ValueError(
        f"{ep_flag} ({ep}) with {tp_flag} ({tp}): DeepSpeed 0.19.8 writes an MoE checkpoint whose experts are whole "
        "on every TP rank only from the first expert-parallel group of each stage (expert-data-parallel rank 0), "
        "which here leaves some TP ranks without their mp_rank_XX_model_states.pt or expert files, so the "
        f"checkpoint could not be loaded at this layout; use an {ep_flag} that is a multiple of {tp_flag} "
        f"(e.g. {tp}), or {tp_flag} 1."
    )


def check_moe(cfg: TridentConfig, world_size: int) -> None:
    """Raise ``ValueError`` for the first inconsistent MoE setting (see the module docstring for the refusals).

    Checks: ``--num-experts`` length (1 or one per MoE layer), counts and interval >= 1, capacity factors > 0;
    ``--moe-expert-parallel-size`` divides the data-parallel size and every layer's expert count, and needs MoE
    layers; the refused compositions.
    """
    _check_counts(cfg)
    _check_expert_parallel(cfg, world_size)
    if cfg.model.moe.is_moe(cfg.model.num_layers):
        _check_composition(cfg)
        _check_expert_tensor_parallel(cfg)
        if cfg.checkpoint.save:
            check_deepspeed_saves_every_rank(
                cfg.parallel.tensor_model_parallel_size,
                cfg.parallel.moe_expert_parallel_size,
                expert_tensor_parallel=cfg.parallel.enable_expert_tensor_parallelism,
                flags=("--tensor-model-parallel-size", "--moe-expert-parallel-size"),
            )
