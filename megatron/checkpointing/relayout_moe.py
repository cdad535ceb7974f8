"""Resume an MoE checkpoint at another expert-parallel size (and so another data-parallel size) on load.

What depends on the EP size in a DeepSpeed-MoE checkpoint saved with fp32 ZeRO-0 (``moe_files.py`` lists the
files), and what does not::

    mp_rank_XX_model_states.pt            every non-expert weight, the client state          any EP
    layer_{l}_expert_{e}_mp_rank_XX_...   one per global expert e                            any EP (DeepSpeed picks
                                                                                              each rank's experts)
    expp_rank_{r}_mp_rank_XX_optim_states.pt   EP rank r's torch optimizer state:            THIS EP only
                                          Adam moments and step of every parameter it holds,
                                          keyed by position in its parameter groups (the
                                          dense parameters, then for each MoE layer its
                                          experts r * El .. (r + 1) * El - 1)

So the weights load through DeepSpeed's own ``load_checkpoint`` at any EP size (``load_optimizer_states=False``);
this module then rebuilds each rank's optimizer state by NAME: the run's parameter groups (global expert ids) give
the names in the order EP rank r of the saved size listed them (:func:`megatron.layout.experts.expert_order_at`),
which turns the saved positions into names; each of the run's parameters takes the state saved under its name
(the dense ones from EP rank 0's file: ZeRO-0 steps every data-parallel rank alike). Nothing is written: the
source is only read, with restricted unpickling.

Not converted (refused at start-up by ``rules.py``): ZeRO-1/2 checkpoints, whose expert state lies flattened in
partitions of the expert-data-parallel groups; bf16/fp16 (DeepSpeed's ZeRO-0 wrappers keep fp32 master groups);
TP > 1 (without --enable-expert-tensor-parallelism DeepSpeed's expert-parallel groups span the TP ranks, so TP rank
t's expert files hold other experts than rank 0's: a TP2 x EP2 checkpoint has ``layer_0_expert_2_mp_rank_01`` but
no ``..._mp_rank_00``); pipelines (other parameter names).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron.checkpointing.checksums import verify_checkpoint_files
from megatron.checkpointing.safe_load import load_weights_only
from megatron.config import ModelConfig
from megatron.deepspeed_internals import zero_checkpoint_classes
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
                f"the optimizer file of EP rank {r} in {where} holds {len(groups)} parameter groups; this run has {len(group_names)} (saved with other optimizer groups, e.g. --create-moe-param-group?)."
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


def load_saved_moe_optimizer(
    optimizer: torch.optim.Optimizer,
    module: torch.nn.Module,
    tag_dir: Path,
    config: ModelConfig,
    *,
    saved_ep: int,
    run_ep: int,
    ep_rank: int,
    mp_rank: int,
) -> int:
    """Set ``optimizer``'s state (the run's, EP rank ``ep_rank`` of ``run_ep``) from the ZeRO-0 optimizer files
    of ``tag_dir`` (saved at ``saved_ep``); returns the parameters given a state.

    Raises:
        FileNotFoundError / ValueError: as :func:`read_saved_optimizers`, :func:`saved_states_by_name`,
            :func:`rebuilt_optimizer_state`.
    """
    names_of = {id(p): n for n, p in module.named_parameters()}
    group_params = [list(g["params"]) for g in optimizer.param_groups]
    if any(id(p) not in names_of for params in group_params for p in params):
        raise ValueError("the optimizer holds a parameter the model does not name; cannot convert.")
    group_names = [
        [to_global_expert(names_of[id(p)], config, ep=run_ep, ep_rank=ep_rank) for p in params]
        for params in group_params
    ]
    shapes = {
        n: p.shape
        for params, names in zip(group_params, group_names, strict=True)
        for p, n in zip(params, names, strict=True)
    }
    saved = read_saved_optimizers(tag_dir, saved_ep, mp_rank)
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
    expert_parallel: tuple[int, int],
    tp_rank: int,
    hashes: bool = True,
) -> tuple[dict[str, Any], float]:
    """Load the checkpoint tag ``tag_dir`` (an fp32 ZeRO-0 MoE checkpoint of another EP size, ``meta``) into
    ``engine``: rank 0 checks every file against its checksums, every rank loads the weights through DeepSpeed and
    rebuilds its optimizer state (:func:`load_saved_moe_optimizer`; ``expert_parallel``: the run's EP size and this
    rank's EP rank; ``tp_rank``: its TP rank); ``layouts``: (saved, run) as the log names them.
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
        count = load_saved_moe_optimizer(
            engine.optimizer,
            engine.module,
            tag_dir,
            config,
            saved_ep=int(meta["moe_expert_parallel_size"]),
            run_ep=expert_parallel[0],
            ep_rank=expert_parallel[1],
            mp_rank=tp_rank,
        )
    except (OSError, ValueError, RuntimeError) as err:
        error = str(err)
    _raise_any(error, what)
    seconds = time.perf_counter() - start
    if global_rank() == 0:
        logger.info(
            "converted checkpoint %s from %s to %s in %.2f s (optimizer state of %d parameters placed by "
            "global expert id; source unchanged)",
            tag_dir,
            *layouts,
            seconds,
            count,
        )
    return client or {}, seconds
