"""Resume an fp32 MoE checkpoint at another expert-parallel size (and, with ZeRO-1/2, another data-parallel size)
on load, keeping the optimizer state.

What depends on the layout in a DeepSpeed-MoE checkpoint (``moe_files.py`` lists the files), and what does not::

    mp_rank_XX_model_states.pt            every non-expert weight, the client state          any EP / DP
    layer_{l}_expert_{e}_mp_rank_XX_...   one per global expert e                            any EP / DP (DeepSpeed
                                                                                              picks each rank's)
    expp_rank_{r}_mp_rank_XX_optim_...    ZeRO-0: EP rank r's torch optimizer state, keyed   THIS EP only
                                          by position in its parameter groups (the dense
                                          parameters, then each MoE layer's experts
                                          r * El .. (r + 1) * El - 1)
    zero_pp_rank_{d}_mp_rank_XX_optim_... ZeRO-1/2: DP rank d's flat fp32 partition of each   THIS EP and DP only
                                          group and its Adam moments; dense groups split
                                          over the DP group, expert groups over the expert-
                                          data-parallel group of EP rank d % ep; the file
                                          names each fragment (``param_slice_mappings``)

So the weights load through DeepSpeed's own ``load_checkpoint`` at any layout (``load_optimizer_states=False``; the
ZeRO fp32 partitions then take the loaded weights), and this module rebuilds each rank's optimizer state by NAME
(global expert ids), reading the source only, with restricted unpickling:

* ZeRO-0: the run's parameter groups give the names in the order EP rank r of the saved size listed them
  (:func:`megatron.layout.experts.expert_order_at`), which turns the saved positions into names; each parameter
  takes the state saved under its name (the dense ones from EP rank 0's file: ZeRO-0 steps every rank alike);
* ZeRO-1/2: each parameter's fragments, joined in DP-rank order, give its whole Adam moments
  (:func:`zero_states_by_name`); they are cut into the run's partitions by the fragment addresses DeepSpeed keeps on
  every parameter (``deepspeed_internals.set_zero_partition_states``).

Not converted (refused at start-up by ``rules.py``): ZeRO-0 <-> ZeRO-1/2 (as for dense checkpoints); bf16/fp16
(DeepSpeed's optimizers keep fp32 master groups of their own); TP > 1 (without --enable-expert-tensor-parallelism
DeepSpeed's expert-parallel groups span the TP ranks, so TP rank t's expert files hold other experts than rank 0's:
a TP2 x EP2 checkpoint has ``layer_0_expert_2_mp_rank_01`` but no ``..._mp_rank_00``); pipelines (other parameter
names). ZeRO-3 is refused for MoE models at start-up already.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron.checkpointing.checksums import verify_checkpoint_files
from megatron.checkpointing.safe_load import load_weights_only
from megatron.config import ModelConfig
from megatron.deepspeed_internals import set_zero_partition_states, zero_checkpoint_classes
from megatron.launch.exit_codes import ConfigError
from megatron.layout.experts import expert_id, expert_order_at, to_global_expert
from megatron.log import global_rank
from megatron.mpu.mappings import all_gather_object

logger = logging.getLogger(__name__)


def optimizer_file(tag_dir: Path, ep_rank: int, mp_rank: int) -> Path:
    """DeepSpeed's ZeRO-0 MoE optimizer file of EP rank ``ep_rank`` (``_get_optimizer_ckpt_name``)."""
    return tag_dir / f"expp_rank_{ep_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def read_saved_optimizers(tag_dir: Path, saved_ep: int, mp_rank: int) -> list[dict[str, Any]]:
    """The torch optimizer state dict of every saved EP rank (in EP-rank order), read restricted and mapped.

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a file cannot be read safely or holds no optimizer state.
    """
    out = []
    for r in range(saved_ep):
        path = optimizer_file(tag_dir, r, mp_rank)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing (MoE checkpoint saved at --moe-expert-parallel-size {saved_ep} with "
                "ZeRO-0); copy the whole checkpoint directory."
            )
        state = load_weights_only(
            path, allowed=zero_checkpoint_classes(), mmap=True, kind="DeepSpeed MoE optimizer state"
        )
        opt = state.get("optimizer") if isinstance(state, dict) else None
        if not isinstance(opt, dict) or not {"state", "param_groups"} <= set(opt):
            raise ValueError(f"{path} holds no torch optimizer state; is the checkpoint complete?")
        out.append(opt)
    return out


def saved_states_by_name(
    saved: Sequence[Mapping[str, Any]],
    group_names: Sequence[Sequence[str]],
    config: ModelConfig,
    where: Path,
) -> dict[str, dict[str, Any]]:
    """The saved per-parameter optimizer states (``saved``: one torch state dict per saved EP rank) by parameter
    name with global expert ids; ``group_names``: the run's parameter groups, as names with global expert ids.

    Raises:
        ValueError: a saved group holds another number of parameters than the model would at the saved EP size
            (other parameter groups, e.g. another --weight-decay split or --create-moe-param-group).
    """
    ep = len(saved)
    by_name: dict[str, dict[str, Any]] = {}
    for r, opt in enumerate(saved):
        groups = opt["param_groups"]
        if len(groups) != len(group_names):
            raise ValueError(
                f"the optimizer file of EP rank {r} in {where} holds {len(groups)} parameter groups; this run "
                f"has {len(group_names)} (saved with other optimizer groups, e.g. --create-moe-param-group?)."
            )
        for g, (group, names) in enumerate(zip(groups, group_names, strict=True)):
            order = expert_order_at(names, config, ep=ep, ep_rank=r)
            if len(order) != len(group["params"]):
                raise ValueError(
                    f"parameter group {g} of EP rank {r} in {where} holds {len(group['params'])} parameters; "
                    f"the model at --moe-expert-parallel-size {ep} has {len(order)} there (other optimizer "
                    "groups: resume with the flags it was saved with)."
                )
            for index, name in zip(group["params"], order, strict=True):
                if r > 0 and expert_id(name) is None:
                    continue  # dense parameters: EP rank 0's copy
                state = opt["state"].get(index)
                if state is not None:
                    by_name[name] = {
                        k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()
                    }
    return by_name


def rebuilt_optimizer_state(
    live: Mapping[str, Any],
    group_names: Sequence[Sequence[str]],
    by_name: Mapping[str, Mapping[str, Any]],
    shapes: Mapping[str, torch.Size],
) -> dict[str, Any]:
    """The state dict to load into the run's optimizer (``live``: its ``state_dict()``): its own groups, each
    parameter's state the saved one of its name.

    Raises:
        ValueError: a saved moment has another shape than the run's parameter, or saved dense parameters are
            not in the run's groups (the names do not match).
    """
    state: dict[int, Any] = {}
    names = {n for group in group_names for n in group}
    stray = sorted(n for n in by_name if expert_id(n) is None and n not in names)
    if stray:
        raise ValueError(
            f"the checkpoint's optimizer state names {stray[:3]}, which this run's optimizer does not hold."
        )
    for group, group_keys in zip(live["param_groups"], group_names, strict=True):
        for index, name in zip(group["params"], group_keys, strict=True):
            saved = by_name.get(name)
            if saved is None:
                continue
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and value.dim() and value.shape != shapes[name]:
                    raise ValueError(
                        f"the checkpoint's {key} of {name} has shape {tuple(value.shape)}; the run's "
                        f"parameter has {tuple(shapes[name])}."
                    )
            state[index] = dict(saved)
    return {"state": state, "param_groups": live["param_groups"]}


@dataclass(frozen=True)
class MoeConversion:
    """The layouts of an MoE conversion on load, as this rank sees them."""

    saved_ep: int
    """--moe-expert-parallel-size of the checkpoint."""
    saved_dp: int
    """Its data-parallel size (the ZeRO-1/2 optimizer files are one per DP rank)."""
    run_ep: int
    """--moe-expert-parallel-size of the run."""
    ep_rank: int
    """This rank's EP rank in the run (its experts: ``ep_rank * El`` ..)."""
    tp_rank: int = 0
    """This rank's TP rank (the ``mp_rank_XX`` of the files it reads)."""
    zero: bool = False
    """Both sides are ZeRO-1/2 (else both ZeRO-0)."""


def zero_optimizer_file(tag_dir: Path, dp_rank: int, mp_rank: int) -> Path:
    """DeepSpeed's fp32 ZeRO-1/2 optimizer file of DP rank ``dp_rank``."""
    return tag_dir / f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def read_zero_partitions(tag_dir: Path, saved_dp: int, mp_rank: int) -> list[dict[str, Any]]:
    """The ZeRO-1/2 optimizer state of every saved DP rank (in DP-rank order), read restricted and mapped.

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a file cannot be read safely or lacks the partitions' names.
    """
    out = []
    for d in range(saved_dp):
        path = zero_optimizer_file(tag_dir, d, mp_rank)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing (MoE checkpoint saved by {saved_dp} data-parallel ranks with ZeRO-1/2); "
                "copy the whole checkpoint directory."
            )
        state = load_weights_only(
            path,
            allowed=zero_checkpoint_classes(),
            mmap=True,
            kind="DeepSpeed ZeRO optimizer state",
        )
        osd = state.get("optimizer_state_dict") if isinstance(state, dict) else None
        if not isinstance(osd, dict) or not {"base_optimizer_state", "param_slice_mappings"} <= set(
            osd
        ):
            raise ValueError(
                f"{path} holds no ZeRO partitions with parameter names (param_slice_mappings); is it a "
                "checkpoint of DeepSpeed >= 0.10?"
            )
        out.append(osd)
    return out


def _group_state(base: Any, g: int) -> Mapping[str, Any]:
    """Group ``g``'s flat-partition state in a ZeRO file's ``base_optimizer_state`` (a torch state dict, or a list
    per group with elastic checkpoints)."""
    if isinstance(base, dict) and "state" in base:
        return base["state"][base["param_groups"][g]["params"][0]]
    return base[g]


def zero_states_by_name(
    partitions: Sequence[Mapping[str, Any]], config: ModelConfig, *, saved_ep: int
) -> tuple[dict[str, dict[str, torch.Tensor]], Any]:
    """Every parameter's whole Adam moments (flat, by name with global expert ids) from the ZeRO-1/2 partitions of
    the saved DP ranks, and the Adam step. Each file names the fragments of its partition
    (``param_slice_mappings``: offset and length in the flat partition); a parameter's fragments lie in the
    partitions of consecutive ranks of its group (the DP group; for experts the expert-data-parallel group of EP
    rank ``d % saved_ep``, whose ranks ``d`` ascend with their partition index), so in DP-rank order they
    concatenate to the whole parameter."""
    pieces: dict[str, dict[str, list[tuple[int, torch.Tensor]]]] = {}
    step = None
    for d, osd in enumerate(partitions):
        base = osd["base_optimizer_state"]
        for g, mapping in enumerate(osd["param_slice_mappings"]):
            group = _group_state(base, g)
            step = group.get("step", step)
            for local, frag in mapping.items():
                name = to_global_expert(local, config, ep=saved_ep, ep_rank=d % saved_ep)
                slot = pieces.setdefault(name, {})
                for key in ("exp_avg", "exp_avg_sq"):
                    flat = group[key].narrow(0, frag.start, frag.numel)  # [partition] -> [fragment]
                    slot.setdefault(key, []).append((d, flat))
    full = {
        name: {
            key: torch.cat([t for _, t in sorted(frags, key=lambda x: x[0])])
            for key, frags in slot.items()
        }
        for name, slot in pieces.items()
    }
    return full, step


def _load_zero_partitions(
    engine: Any, names: Mapping[int, str], tag_dir: Path, config: ModelConfig, conv: MoeConversion
) -> int:
    """ZeRO-1/2: the run's partitions from the saved ones, by name (:func:`zero_states_by_name`)."""
    partitions = read_zero_partitions(tag_dir, conv.saved_dp, conv.tp_rank)
    by_name, step = zero_states_by_name(partitions, config, saved_ep=conv.saved_ep)

    def state_of(param: torch.nn.Parameter) -> dict[str, torch.Tensor] | None:
        state = by_name.get(names[id(param)])
        if state is not None and any(t.numel() != param.numel() for t in state.values()):
            raise ValueError(
                f"the checkpoint's Adam state of {names[id(param)]} has {state['exp_avg'].numel()} elements; "
                f"the run's parameter has {param.numel()}."
            )
        return state

    return set_zero_partition_states(engine.optimizer, state_of, step)


def load_saved_moe_optimizer(
    engine: Any, tag_dir: Path, config: ModelConfig, conv: MoeConversion
) -> int:
    """Set ``engine``'s optimizer state from the optimizer files of ``tag_dir`` by parameter name: ZeRO-0's per EP
    rank (:func:`saved_states_by_name`) or ZeRO-1/2's per DP rank (:func:`zero_states_by_name`); returns the
    parameters given a state.

    Raises:
        FileNotFoundError / ValueError: a file is missing or unreadable, or does not match the run's parameters.
    """
    names_of = {
        id(p): to_global_expert(n, config, ep=conv.run_ep, ep_rank=conv.ep_rank)
        for n, p in engine.module.named_parameters()
    }
    if conv.zero:
        return _load_zero_partitions(engine, names_of, tag_dir, config, conv)
    optimizer = engine.optimizer
    group_params = [list(g["params"]) for g in optimizer.param_groups]
    if any(id(p) not in names_of for params in group_params for p in params):
        raise ValueError("the optimizer holds a parameter the model does not name; cannot convert.")
    group_names = [[names_of[id(p)] for p in params] for params in group_params]
    shapes = {names_of[id(p)]: p.shape for params in group_params for p in params}
    saved = read_saved_optimizers(tag_dir, conv.saved_ep, conv.tp_rank)
    by_name = saved_states_by_name(saved, group_names, config, tag_dir)
    rebuilt = rebuilt_optimizer_state(optimizer.state_dict(), group_names, by_name, shapes)
    optimizer.load_state_dict(rebuilt)
    return len(rebuilt["state"])


def _raise_any(error: str | None, what: str) -> None:
    """Every rank raises the first rank's error (a collective: every rank calls it)."""
    errors = [e for e in all_gather_object(error, group=dist.group.WORLD) if e]
    if errors:
        raise ConfigError(f"{what}: {errors[0]}")


def load_at_new_expert_parallel_size(
    engine: Any,
    tag_dir: Path,
    meta: dict[str, Any],
    config: ModelConfig,
    *,
    layouts: tuple[str, str],
    conv: MoeConversion,
    hashes: bool = True,
) -> tuple[dict[str, Any], float]:
    """Load the checkpoint tag ``tag_dir`` (an fp32 ZeRO-0 MoE checkpoint of another EP size, ``meta``) into
    ``engine``: rank 0 checks every file against its checksums, every rank loads the weights through DeepSpeed and
    rebuilds its optimizer state (:func:`load_saved_moe_optimizer`, with ``conv``); ``layouts``: (saved, run) as
    the log names them.
    Returns (the client state, the seconds taken).

    Raises:
        ConfigError: on every rank, when any rank could not read the checkpoint.
    """
    start = time.perf_counter()
    load_dir, tag = str(tag_dir.parent), tag_dir.name
    what = f"--load {load_dir} (tag {tag}): converting it from {layouts[0]} to this run's {layouts[1]} failed"
    error = None
    if global_rank() == 0:
        logger.info("converting checkpoint %s from %s to %s", tag_dir, *layouts)
        try:
            verify_checkpoint_files(tag_dir, meta, hashes=hashes)
        except (OSError, ValueError) as err:
            error = str(err)
    _raise_any(error, what)
    _, client = engine.load_checkpoint(
        load_dir,
        tag=tag,
        load_module_strict=True,
        load_optimizer_states=False,
        load_lr_scheduler_states=False,
        load_module_only=False,
    )
    error, count = None, 0
    try:
        count = load_saved_moe_optimizer(engine, tag_dir, config, conv)
    except (OSError, ValueError, RuntimeError) as err:
        error = str(err)
    _raise_any(error, what)
    seconds = time.perf_counter() - start
    if global_rank() == 0:
        logger.info(
            "converted checkpoint %s from %s to %s in %.2f s (optimizer state of %d parameters on rank 0 placed "
            "by name and global expert id; source unchanged)",
            tag_dir,
            *layouts,
            seconds,
            count,
        )
    return client or {}, seconds
