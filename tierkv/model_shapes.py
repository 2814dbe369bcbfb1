"""Per-token KV shapes of real models that `tierkv bench` imitates (no numpy: the CLI reads them
for its help)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """A model's per-token KV shape, plus the fixed-size state of its linear-attention layers
    and the window of its sliding-window layers."""

    attention_layers: int
    """Full-attention layers: a restore needs their KV of the whole prefix."""
    kv_heads: int
    head_dim: int
    state_layers: int = 0
    state_elements: int = 0
    """Elements of one linear-attention layer's state (recurrent state + conv state)."""
    window_layers: int = 0
    window: int = 0
    """Sliding-window layers (same KV heads and head dim) and their window in tokens: a
    restore needs their KV of the blocks inside the window before the hit end only."""

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of one token of one layer's K and V, times the full-attention layers."""
        return self.attention_layers * 2 * self.kv_heads * self.head_dim * itemsize

    def window_blocks(self, blocks: int, block_tokens: int) -> int:
        """Of a prefix of `blocks` blocks, the last ones whose window-layer KV a restore needs
        (vLLM's rule: the blocks holding the `window` - 1 tokens before the next one)."""
        if not self.window_layers:
            return 0
        return blocks - max(0, blocks * block_tokens - self.window + 1) // block_tokens


def _gated_delta_net_state(k_heads: int, v_heads: int, k_dim: int, v_dim: int, conv: int) -> int:
    """Elements of one gated delta-net layer's state: v_heads × k_dim × v_dim + conv window."""
    conv_channels = 2 * k_heads * k_dim + v_heads * v_dim
    return v_heads * k_dim * v_dim + conv_channels * (conv - 1)


MODEL_SHAPES: dict[str, ModelShape] = {
    # 40 layers: every 4th is full attention, the rest gated delta-net (16 K / 32 V heads of 128).
    "qwen3.6-35b-a3b": ModelShape(10, 2, 256, 30, _gated_delta_net_state(16, 32, 128, 128, 4)),
    # 62 layers: every 6th is full attention, the rest slide over 1024 tokens (16 KV heads of 128).
    "gemma3-27b": ModelShape(10, 16, 128, window_layers=52, window=1024),
    # 26 layers: every 6th is full attention, the rest slide over 512 tokens (1 KV head of 256).
    "gemma3-1b": ModelShape(4, 1, 256, window_layers=22, window=512),
    # 18 layers, the same pattern and window.
    "gemma3-270m": ModelShape(3, 1, 256, window_layers=15, window=512),
    "qwen3-30b-a3b": ModelShape(48, 4, 128),
    "qwen2.5-7b": ModelShape(28, 4, 128),
    "llama-3.1-8b": ModelShape(32, 8, 128),
}
DEFAULT_MODEL_SHAPE = "qwen3.6-35b-a3b"
