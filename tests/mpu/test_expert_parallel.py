"""Expert-parallel groups: the documented worked example (pure) and equality with the groups DeepSpeed builds."""

from __future__ import annotations

import pytest

from megatron.mpu.expert_parallel import expert_parallel_groups, expert_parallel_rank
from megatron.testing import run_distributed


def _groups(world: int, tp: int, pp: int, ep: int, expert_tp: bool):
    return expert_parallel_groups(
        world_size=world,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_parallel_size=ep,
        expert_tensor_parallel=expert_tp,
    )


def test_worked_example_of_the_docstring() -> None:
    """world 8, TP 2, PP 1 (DP 4), EP 2: the lists megatron/mpu/expert_parallel.py shows."""
    whole = _groups(8, 2, 1, 2, False)
    assert whole.expert_parallel == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert whole.expert_data_parallel == ((0, 2, 4, 6), (1, 3, 5, 7))
    split = _groups(8, 2, 1, 2, True)
    assert split.expert_parallel == ((0, 2), (4, 6), (1, 3), (5, 7))
    assert split.expert_data_parallel == ((0, 4), (2, 6), (1, 5), (3, 7))
    # PP 2: the same lists inside each stage block of 8 ranks
    staged = _groups(16, 2, 2, 2, True)
    assert staged.group_of(9) == (9, 11) and staged.group_of(13, data=True) == (9, 13)
    kw = {"world_size": 8, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}
    assert [expert_parallel_rank(r, **kw, expert_parallel_size=2, expert_tensor_parallel=False) for r in range(4)] == [
        0, 1, 0, 1,
    ]  # fmt: skip
    assert [expert_parallel_rank(r, **kw, expert_parallel_size=2, expert_tensor_parallel=True) for r in range(4)] == [
        0, 0, 1, 1,
    ]  # fmt: skip


def _deepspeed_groups(cases: list[tuple[int, int, int, bool]]) -> list[tuple[list[int], list[int]]]:
    """On each rank, for each (tp, pp, ep, expert TP): the EP and EDP group DeepSpeed's MoE layer created."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    from megatron import mpu
    from megatron.config import ModelConfig
    from megatron.config.moe import MoEConfig
    from megatron.model.moe import MoEMLP, set_moe_groups
    from megatron.mpu import parallel_state
    from megatron.mpu.context import ParallelContext

    out = []
    for tp, pp, ep, expert_tp in cases:
        parallel_state.initialize_model_parallel(tp, pp)
        for table in (
            groups._EXPERT_PARALLEL_GROUP,
            groups._EXPERT_PARALLEL_GROUP_RANKS,
            groups._EXPERT_DATA_PARALLEL_GROUP,
            groups._EXPERT_DATA_PARALLEL_GROUP_RANKS,
        ):
            table.clear()
        groups.mpu = None
        config = ModelConfig(
            num_layers=1,
            hidden_size=16,
            num_attention_heads=2,
            vocab_size=64,
            moe=MoEConfig(num_experts=(4,)),
        )
        ctx = ParallelContext.from_parallel_state(
            seed=1, moe_expert_parallel_size=ep, enable_expert_tensor_parallelism=expert_tp
        )
        layer = MoEMLP(config, ctx, layer_number=0, num_experts=4)
        set_moe_groups(layer, mpu)
        name = f"ep_size_{ep}"
        ep_ranks = list(groups._get_expert_parallel_group_ranks(name))
        assert dist.get_rank(groups._get_expert_parallel_group(name)) == ctx.expert_parallel_rank
        out.append((ep_ranks, list(groups._get_expert_data_parallel_group_ranks(name))))
        parallel_state.destroy_model_parallel()
    return out


CASES = [(1, 1, 4, False), (2, 1, 2, False), (2, 1, 2, True), (1, 2, 2, False)]


@pytest.mark.slow
@pytest.mark.parametrize("world", [4])
def test_groups_equal_what_deepspeed_builds(world: int) -> None:
    """World 4: EP 4 at TP 1; TP 2 x EP 2 whole and TP-split experts; PP 2 x EP 2."""
    per_rank = run_distributed(_deepspeed_groups, world, CASES, timeout=300)
    for rank, got in enumerate(per_rank):
        for (tp, pp, ep, expert_tp), (ep_ranks, edp_ranks) in zip(CASES, got, strict=True):
            mine = _groups(world, tp, pp, ep, expert_tp)
            assert tuple(ep_ranks) == mine.group_of(rank), (rank, tp, pp, ep, expert_tp)
            assert tuple(edp_ranks) == mine.group_of(rank, data=True), (rank, tp, pp, ep, expert_tp)
