"""Cross-checks of the model features of today's open families: RoPE scaling, sliding-window attention, QKV bias
and QK-norm (issue #31). Ranges of the numeric flags are in ``ranges.py``; this is what ranges cannot say.

Decisions written down:

- ``--use-rope-scaling`` (Llama 3) and ``--rotary-seq-len-interpolation-factor`` (linear) both rescale the rotary
  frequencies; no released model uses both and Hugging Face cannot express the pair, so one run takes one.
- The Llama 3 knobs (``--rope-scaling-*``) have defaults (Llama 3.1's); a value other than the default without
  ``--use-rope-scaling`` would be silently ignored, so it is refused.
- ``--window-size`` is (left, right); the GPT model is causal, so right must be 0. A window at least as long as the
  sequence is accepted: it masks nothing in training (every key is within reach) and still limits generation
  past ``--seq-length``; Mistral's 4096 with a 2048 training sequence is the common case.
- ``--add-qkv-bias`` with the linear biases on is what the model already has: accepted, nothing changes.
"""

from __future__ import annotations

from megatron.config.model import ModelConfig

_LLAMA3_KNOBS = (
    ("--rope-scaling-factor", "rope_scaling_factor"),
    ("--rope-scaling-low-freq-factor", "rope_scaling_low_freq_factor"),
    ("--rope-scaling-high-freq-factor", "rope_scaling_high_freq_factor"),
    (
        "--rope-scaling-original-max-position-embeddings",
        "rope_scaling_original_max_position_embeddings",
    ),
)


def _check_rope_scaling(m: ModelConfig) -> None:
    defaults = ModelConfig()
    if not m.use_rope_scaling:
        for flag, name in _LLAMA3_KNOBS:
            if getattr(m, name) != getattr(defaults, name):
                raise ValueError(
                    f"{flag} ({getattr(m, name)}) sets Llama 3 RoPE scaling, which is off; add "
                    f"--use-rope-scaling, or drop {flag}."
                )
    scaled = [
        flag
        for flag, on in (
            ("--use-rope-scaling", m.use_rope_scaling),
            (
                "--rotary-seq-len-interpolation-factor",
                m.rotary_seq_len_interpolation_factor is not None,
            ),
        )
        if on
    ]
    if scaled and not m.use_rotary_position_embeddings:
        raise ValueError(
            f"{scaled[0]} scales rotary position embeddings; add --use-rotary-position-embeddings, or drop "
            f"{scaled[0]}."
        )
    if len(scaled) == 2:
        raise ValueError(
            "--use-rope-scaling (Llama 3) and --rotary-seq-len-interpolation-factor (linear) both rescale the "
            "rotary frequencies; choose one (no released model uses both)."
        )
    low, high = m.rope_scaling_low_freq_factor, m.rope_scaling_high_freq_factor
    if m.use_rope_scaling and high <= low:
        raise ValueError(
            f"--rope-scaling-high-freq-factor ({high}) must exceed --rope-scaling-low-freq-factor ({low}): the "
            "blend between them divides by their difference; Llama 3.1 uses 4 and 1."
        )


def _check_window(m: ModelConfig) -> None:
    if m.window_size is None:
        return
    left, right = m.window_size
    if right != 0:
        raise ValueError(
            f"--window-size {left},{right}: the GPT model is causal, so the right side must be 0; use "
            f"--window-size {max(left, 0)}."
        )
    if left < 0:
        raise ValueError(
            f"--window-size ({left}) must be >= 0 keys to the left; leave --window-size out for full causal "
            "attention."
        )


def check_model_features(m: ModelConfig) -> None:
    """RoPE scaling and sliding-window flags fit together (module docstring).

    Raises:
        ValueError: one line naming the flag, its value and the fix.
    """
    _check_rope_scaling(m)
    _check_window(m)
