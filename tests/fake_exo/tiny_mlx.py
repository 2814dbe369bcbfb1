"""Tiny random-weight mlx-lm models built in memory (nothing downloaded, no tokenizer): a Llama,
and a Gemma 3 text model whose sliding-window layers use mlx-lm's RotatingKVCache."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import gemma3_text
from mlx_lm.models.llama import Model, ModelArgs

VOCAB = 128


def tiny_llama(seed: int = 0, dtype: mx.Dtype = mx.float32, layers: int = 2) -> Model:
    """Hidden 64, 4 query heads and 2 KV heads of dim 16, own lm_head; deterministic per seed."""
    mx.random.seed(seed)
    args = ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=False,  # tied, a random model mostly repeats its input token
    )
    model = Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def tiny_gemma3(window: int, seed: int = 0, dtype: mx.Dtype = mx.bfloat16) -> gemma3_text.Model:
    """Gemma 3's layout in 4 layers: local (a `window`-token sliding window), global, local,
    global; hidden 64, 4 query heads and 2 KV heads of dim 16; deterministic per seed."""
    mx.random.seed(seed)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        vocab_size=VOCAB,
        sliding_window=window,
        sliding_window_pattern=2,
    )
    model = gemma3_text.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def random_tokens(count: int, seed: int) -> mx.array:
    """`count` token ids, deterministic per seed."""
    return mx.random.randint(0, VOCAB, (count,), key=mx.random.key(seed))
