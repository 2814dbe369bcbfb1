"""The hook's reading of mlx-lm's RotatingKVCache (tierkv/connectors/exo/hook.py: `_Held`,
`Window`): whatever the history of prefill chunks and single-token steps, it finds every token
where the buffer holds it, and the state a restore builds (the window, oldest first) attends to
the same tokens as the layer it came from at every later step."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import RotatingKVCache

from tierkv.connectors.exo.hook import Window, _Held

pytestmark = pytest.mark.mlx


def marked(start: int, stop: int) -> tuple[mx.array, mx.array]:
    """Keys and values of tokens start..stop-1 whose one feature is their position."""
    positions = mx.arange(start, stop).astype(mx.float32).reshape(1, 1, -1, 1)
    return positions, positions


def feed(layer: RotatingKVCache, steps: list[int]) -> None:
    """Feed `steps` tokens at a time (1: mlx-lm's in-place step, more: its prefill step)."""
    for count in steps:
        layer.update_and_fetch(*marked(layer.offset, layer.offset + count))


def restored(layer: RotatingKVCache) -> RotatingKVCache:
    """What a restore builds at the layer's offset from the tokens it holds."""
    window = Window(layer.max_size, layer.keep)
    held = _Held.of(layer)
    slots = [held.slots_of(p, p + 1) for p in window.positions(layer.offset).tolist()]
    assert all(slot is not None for slot in slots)
    state = RotatingKVCache(layer.max_size, layer.keep)
    state.keys = layer.keys[:, :, mx.array(np.concatenate(slots)), :]
    state.values, state.offset, state._idx = state.keys, layer.offset, state.keys.shape[2]
    return state


def seen(keys: mx.array) -> list[int]:
    return sorted(int(p) for p in np.array(keys).ravel())


histories = st.tuples(
    st.integers(4, 12),  # max_size
    st.integers(0, 3),  # keep
    st.lists(st.integers(1, 9), min_size=1, max_size=12),  # the steps so far
    st.lists(st.integers(1, 5), min_size=1, max_size=8),  # the steps after the restore
)


@settings(max_examples=150, deadline=None)
@given(histories)
def test_a_restored_window_attends_to_the_same_tokens_as_the_original(
    history: tuple[int, int, list[int], list[int]],
) -> None:
    max_size, keep, before, after = history
    layer = RotatingKVCache(max_size, keep)
    feed(layer, before)
    held = _Held.of(layer)
    keys = np.array(layer.keys).ravel()
    for position in Window(max_size, keep).positions(layer.offset).tolist():
        slot = held.slots_of(position, position + 1)
        assert slot is not None and keys[slot].tolist() == [position]

    again = restored(layer)
    for count in after:  # every later step sees the same tokens
        start = layer.offset
        assert seen(layer.update_and_fetch(*marked(start, start + count))[0]) == seen(
            again.update_and_fetch(*marked(start, start + count))[0]
        )


def test_tokens_a_rotated_buffer_no_longer_holds_are_not_found() -> None:
    layer = RotatingKVCache(max_size=8, keep=2)
    feed(layer, [5, *[1] * 18])  # rotated: tokens 0, 1 and 17..22 in slots 0, 1, 5..7, 2..4
    held = _Held.of(layer)
    assert np.array(layer.keys).ravel().tolist() == [0, 1, 20, 21, 22, 17, 18, 19]
    assert held.slots_of(0, 2).tolist() == [0, 1]
    assert held.slots_of(17, 23).tolist() == [5, 6, 7, 2, 3, 4]
    assert held.slots_of(16, 18) is None and held.slots_of(1, 3) is None
    assert held.slots_of(22, 24) is None  # not seen yet


def test_a_window_names_the_blocks_it_is_restored_from() -> None:
    window = Window(max_size=32, keep=0)
    assert window.positions(20).tolist() == list(range(20))
    assert window.blocks(96, 16) == [4, 5]
    assert window.blocks(100, 16) == [4, 5, 6]  # [68, 100)
    sinks = Window(max_size=32, keep=4)  # mlx-lm's max_kv_size caches keep 4
    assert sinks.positions(96).tolist() == [0, 1, 2, 3, *range(68, 96)]
    assert sinks.blocks(96, 16) == [0, 4, 5]
