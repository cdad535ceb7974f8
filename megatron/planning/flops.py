"""Model FLOPs per token, TFLOP/s per device and MFU (PaLM convention, no recompute credit).

    FLOPs per token = 6 * N + 12 * L * h * s            (PaLM, Chowdhery et al. 2022, appendix B)

``N`` here is every parameter that takes part in a token's matmuls: all transformer-layer weights and biases (in an
MoE layer the gate and the top-k experts a token is routed to, not all experts), the final norm,
and the output projection (``v x h``, padded vocab, counted once whether tied or not). The input embedding tables
(word and learned position) are left out: a lookup is not a matmul. This differs from PaLM's "non-embedding N"
only by the logit projection, which is real compute and large for small models. ``12 * L * h * s`` is the
attention score and value matmuls (forward + backward). Activation recomputation is NOT credited: MFU counts the
model's FLOPs, not the hardware's.

    tokens/s            = global batch * s / iteration time
    TFLOP/s per device  = FLOPs per token * tokens/s / world size / 1e12
    MFU                 = TFLOP/s per device / peak TFLOP/s per device

Peak: ``--peak-tflops``, else a table of dense bf16/fp16 tensor-core peaks of known GPUs (:data:`PEAK_TFLOPS`); on
CPU (or an unknown GPU) without --peak-tflops, MFU is not available (None, shown as ``n/a``).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config import ModelConfig

# Dense (no sparsity) bf16/fp16 tensor-core peak, TFLOP/s per device, from the vendors' data sheets. The first
# substring (case-insensitive) of torch.cuda.get_device_name() that matches wins, so specific names come first.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("GH200", 989.0),
    ("H100 PCIE", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("A30", 165.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A6000", 155.0),
    ("V100", 125.0),
    ("T4", 65.0),
)


def layer_params(m: ModelConfig, padded_vocab: int) -> int:
    """Matmul parameters N of the model (see module docstring), from the config alone (layout-independent)."""
    h, hn = m.hidden_size, m.head_dim
    nq, nkv, ffn = m.num_attention_heads, m.num_query_groups, m.ffn_size
    bias = 1 if m.add_bias_linear else 0
    norm = h * (2 if m.normalization == "layernorm" else 1)
    qkv = h * (nq + 2 * nkv) * hn + (1 if m.qkv_bias else 0) * (nq + 2 * nkv) * hn
    proj = nq * hn * h + bias * h
    if m.swiglu:
        mlp = 3 * h * ffn + bias * (2 * ffn + h)
    else:
        mlp = 2 * h * ffn + bias * (ffn + h)
    per_layer = qkv + proj + 2 * norm
    total = 0
    for experts in m.moe.experts_per_layer(m.num_layers):
        # an MoE layer: the gate, and the top-k experts each token goes through (+ PR-MoE's dense MLP and mix)
        moe = (
            experts * h
            + m.moe.topk * mlp
            + (mlp + 2 * h + 2 if m.moe.mlp_type == "residual" else 0)
        )
        total += per_layer + (mlp if experts == 1 else moe)
    return total + norm + padded_vocab * h


def flops_per_token(m: ModelConfig, padded_vocab: int) -> float:
    """6 N + 12 L (n hn) s: forward + backward model FLOPs for one token (the attention scores and context use the
    query width n x hn, which is h unless --kv-channels says otherwise)."""
    n = layer_params(m, padded_vocab)
    width = m.num_attention_heads * m.head_dim
    return 6.0 * n + 12.0 * m.num_layers * width * m.seq_length


def lookup_peak_tflops(device_name: str | None) -> float | None:
    """Peak dense bf16 TFLOP/s of a GPU by name, or None when unknown (or no GPU)."""
    if not device_name:
        return None
    upper = device_name.upper()
    for key, peak in PEAK_TFLOPS:
        if key in upper:
            return peak
    return None


def detect_peak_tflops(override: float | None, device_type: str) -> float | None:
    """--peak-tflops when given, else the table entry of this process's CUDA device when the run is on CUDA, else
    None. A CPU run never asks torch.cuda (a visible GPU would get a CUDA context per rank)."""
    if override is not None:
        return override
    if device_type != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return lookup_peak_tflops(torch.cuda.get_device_name())


def throughput(
    *,
    tokens_per_iteration: int,
    seconds_per_iteration: float,
    flops_per_tok: float,
    world_size: int,
    peak_tflops: float | None,
) -> tuple[float, float, float | None]:
    """(tokens/s, TFLOP/s per device, MFU or None)."""
    if seconds_per_iteration <= 0:
        return 0.0, 0.0, None
    tokens_per_sec = tokens_per_iteration / seconds_per_iteration
    tflops = flops_per_tok * tokens_per_sec / world_size / 1e12
    mfu = tflops / peak_tflops if peak_tflops else None
    return tokens_per_sec, tflops, mfu


@dataclass(frozen=True)
class Throughput:
    """What turns an iteration time into the progress line's rates: :func:`throughput` with the run's constants."""

    tokens_per_iteration: int
    """Global batch x sequence length."""
    flops_per_token: float
    world_size: int
    peak_tflops: float | None

    def rates(
        self, seconds_per_iteration: float, tokens_per_iteration: float | None = None
    ) -> tuple[float, float, float | None]:
        """(tokens/s, TFLOP/s per device, MFU or None) at ``seconds_per_iteration``; ``tokens_per_iteration``
        overrides the run's constant (a --rampup-batch-size batch, a curriculum length)."""
        return throughput(
            tokens_per_iteration=(
                self.tokens_per_iteration if tokens_per_iteration is None else tokens_per_iteration
            ),
            seconds_per_iteration=seconds_per_iteration,
            flops_per_tok=self.flops_per_token,
            world_size=self.world_size,
            peak_tflops=self.peak_tflops,
        )
