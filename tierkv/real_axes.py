"""An attention block in its real axes, for engines whose kernel reads it otherwise than its shape.

vLLM CPU (0.32) allocates a layer's KV as [blocks, heads, tokens, 2 × head_size], yet its
attention kernel views each head's block as [2 × tokens, head_size] and splits it in two: the
keys (in a layout of the kernel's own: on AVX-512's "vec" path transposed, one key channel's
tokens together) and then the values. Handed over by its nominal shape, a K/V pair codec would
split keys from values in the wrong place, sink tokens and centring would act on the wrong axis
and TurboQuant's groups would run along one key channel's tokens. So for the lossy codecs the
vLLM connector hands over a block as [..., heads, 2, tokens, head_size] (K then V, each token's
channels together): `to_real_axes` before encoding, `from_real_axes` after decoding. The stored
shape differs from the nominal one, so a payload stored the other way never decodes into a block
(a miss, recomputed). Lossless payloads keep the nominal shape and are written zero-copy.

The kernel's layout is not assumed: `RealAxes.order` is the permutation the kernel itself was
seen to apply (tierkv.connectors.vllm.layout probes it), so any ISA's packing is undone.
"""

from __future__ import annotations

import numpy as np


class RealAxes:
    """One head's block as the kernel lays it out (`order`: for each value of the real
    [2, tokens, head_size] block, where it sits in the head's flat nominal block)."""

    def __init__(self, order: np.ndarray, tokens: int, head_size: int) -> None:
        size = 2 * tokens * head_size
        if order.shape != (size,) or not np.array_equal(np.sort(order), np.arange(size)):
            raise ValueError(
                f"a head block's order must be a permutation of {size} values "
                f"(2 × {tokens} tokens × {head_size})"
            )
        self.order = order.astype(np.intp)
        self.inverse = np.argsort(self.order).astype(np.intp)
        self.tokens, self.head_size = tokens, head_size

    def real_shape(self, nominal: tuple[int, ...]) -> tuple[int, ...]:
        """The real shape of a block of `nominal` shape [..., heads, tokens, 2 × head_size]."""
        if nominal[-2:] != (self.tokens, 2 * self.head_size):
            raise ValueError(
                f"a block of shape {nominal} is not [..., heads, {self.tokens}, "
                f"{2 * self.head_size}]"
            )
        return (*nominal[:-2], 2, self.tokens, self.head_size)

    def to_real_axes(self, blocks: np.ndarray) -> np.ndarray:
        """Blocks [..., heads, tokens, 2 × head_size] as a new [..., heads, 2, tokens,
        head_size] array (keys then values, one token's channels together)."""
        shape = self.real_shape(blocks.shape)
        flat = blocks.reshape(*blocks.shape[:-2], -1)
        return np.take(flat, self.order, axis=-1).reshape(shape)

    def from_real_axes(self, real: np.ndarray) -> np.ndarray:
        """Real blocks [..., heads, 2, tokens, head_size] as a new array in the nominal shape
        [..., heads, tokens, 2 × head_size] (the bytes the kernel reads)."""
        if real.shape[-3:] != (2, self.tokens, self.head_size):
            raise ValueError(f"a block of shape {real.shape} is not in its real axes")
        flat = real.reshape(*real.shape[:-3], -1)
        nominal = (*real.shape[:-3], self.tokens, 2 * self.head_size)
        return np.take(flat, self.inverse, axis=-1).reshape(nominal)
