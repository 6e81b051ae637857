"""Tiny configurations of the architecture families a user may load, for tests that need the real
layer code of each family with random weights: 4 layers, hidden size 64, 2 key/value heads where the
family allows, sliding windows of 16 positions where it has them (so a chat prompt already crosses
the window), all with the embedded model's tokenizer. `write_folder` saves one as a folder of
config.json and tokenizer files, which `random:<folder>` loads as a user would."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import transformers as T

WINDOW = 16  # sliding window, in positions: shorter than the chat template's system prompt
_LLAMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
_MIXED = ["sliding_attention", "full_attention"] * 2  # a block of the inner loop holds both kinds


def _gemma3_text(**ids) -> T.Gemma3TextConfig:
    return T.Gemma3TextConfig(**_LLAMA, head_dim=16, sliding_window=WINDOW, layer_types=_MIXED, **ids)


def _gemma3(**ids) -> T.Gemma3Config:
    """Gemma 3's multimodal wrapper (its decoder under model.language_model), with a one-layer vision
    tower."""
    vision = T.SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    text = _gemma3_text(**ids)
    return T.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        **{k: v for k, v in ids.items() if k != "vocab_size"},
    )


FAMILIES: dict[str, Callable[..., T.PretrainedConfig]] = {
    "llama": lambda **ids: T.LlamaConfig(**_LLAMA, **ids),
    "mistral": lambda **ids: T.MistralConfig(**_LLAMA, sliding_window=WINDOW, **ids),
    "mixtral": lambda **ids: T.MixtralConfig(**_LLAMA, num_local_experts=4, num_experts_per_tok=2, **ids),
    "qwen2": lambda **ids: T.Qwen2Config(**_LLAMA, **ids),
    "qwen3": lambda **ids: T.Qwen3Config(**_LLAMA, head_dim=16, **ids),
    "qwen3_moe": lambda **ids: T.Qwen3MoeConfig(
        **_LLAMA, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **ids
    ),
    "gemma": lambda **ids: T.GemmaConfig(**_LLAMA, head_dim=16, **ids),
    "gemma2": lambda **ids: T.Gemma2Config(**_LLAMA, head_dim=16, sliding_window=WINDOW, **ids),
    "gemma3_text": _gemma3_text,
    "gemma3": _gemma3,
    "phi3": lambda **ids: T.Phi3Config(**_LLAMA, **ids),
    "gpt2": lambda **ids: T.GPT2Config(n_embd=64, n_layer=4, n_head=4, n_positions=512, **ids),
    "gptj": lambda **ids: T.GPTJConfig(n_embd=64, n_layer=4, n_head=4, n_positions=512, rotary_dim=8, **ids),
    "gpt_neox": lambda **ids: T.GPTNeoXConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=512,
        **ids,
    ),
    "opt": lambda **ids: T.OPTConfig(
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        word_embed_proj_dim=64,
        max_position_embeddings=512,
        **ids,
    ),
    "falcon": lambda **ids: T.FalconConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, **ids),
    "bloom": lambda **ids: T.BloomConfig(hidden_size=64, n_layer=4, n_head=4, **ids),
    "olmo2": lambda **ids: T.Olmo2Config(**_LLAMA, **ids),
    "gpt_oss": lambda **ids: T.GptOssConfig(
        **_LLAMA,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=_MIXED,
        **ids,
    ),
}


# Families the engine refuses by name: layers that keep a recurrent state (Qwen3-Next: linear attention).
REFUSED: dict[str, Callable[..., T.PretrainedConfig]] = {
    "qwen3_next": lambda **ids: T.Qwen3NextConfig(
        **_LLAMA,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        **ids,
    ),
}


def config(family: str, tokenizer) -> T.PretrainedConfig:
    """The family's tiny configuration for `tokenizer`'s vocabulary and special tokens."""
    return (FAMILIES | REFUSED)[family](
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )


def write_folder(family: str, tokenizer, folder: Path) -> Path:
    """A folder `random:<folder>` loads: the family's tiny config.json and the tokenizer's files."""
    folder.mkdir(parents=True, exist_ok=True)
    config(family, tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
