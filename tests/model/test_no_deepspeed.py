"""The model and kernel paths import and run without DeepSpeed (issue 30, item 3).

A GPU image whose DeepSpeed fails to import must still run the kernel and whole-model tests, so
``megatron.model`` and ``megatron.fused_kernels`` import DeepSpeed only where it is used (the pipe model, the
MoE layer, the engine). One subprocess puts a ``deepspeed`` package that raises ``ImportError`` first on
``PYTHONPATH`` and, there, imports both packages and runs a tiny GPT (learned positions, fused softmax path)
and a tiny LLaMA (RMSNorm, SwiGLU, RoPE, GQA) forward and backward on the CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys

    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        assert "blocked" in str(e), e
    else:
        raise SystemExit("the deepspeed blocker did not take effect")

    import torch

    import megatron.fused_kernels
    import megatron.model
    from megatron.config import ModelConfig
    from megatron.model import GPTModel, loss_func
    from megatron.mpu.context import ParallelContext

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=100,
                attention_dropout=0.0, hidden_dropout=0.0)
    llama = dict(normalization="rmsnorm", swiglu=True, use_rotary_position_embeddings=True,
                 add_bias_linear=False, num_key_value_heads=2, ffn_hidden_size=96)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16).expand(2, 16).contiguous()
    for kw in ({}, llama):
        model = GPTModel(ModelConfig(**base, **kw), ParallelContext(seed=1))
        losses = model(ids, pos, labels=ids)  # [b, s]
        loss = loss_func(losses, torch.ones(2, 16))
        loss.backward()
        assert torch.isfinite(loss), loss
        assert all(p.grad is not None for p in model.parameters())
    try:
        megatron.model.GPTModelPipe
    except ImportError:
        pass  # the pipe model needs DeepSpeed: asked for, it says so
    else:
        raise SystemExit("GPTModelPipe imported without DeepSpeed")
    print("ok", megatron.fused_kernels.status())
    """
)


def test_model_and_kernels_import_and_run_without_deepspeed(tmp_path: Path) -> None:
    blocker = tmp_path / "deepspeed"
    blocker.mkdir()
    (blocker / "__init__.py").write_text('raise ImportError("deepspeed blocked by the test")\n')
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr
