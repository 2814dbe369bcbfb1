"""A tiny random-weight mlx-lm Llama built in memory (nothing downloaded, no tokenizer)."""

from __future__ import annotations

import mlx.core as mx
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


def random_tokens(count: int, seed: int) -> mx.array:
    """`count` token ids, deterministic per seed."""
    return mx.random.randint(0, VOCAB, (count,), key=mx.random.key(seed))
