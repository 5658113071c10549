"""Tiny random models built from configs: no download, fast enough for exactness tests."""

from __future__ import annotations

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _build(model_class, config) -> PreTrainedModel:
    torch.manual_seed(0)
    model = model_class(config).eval()
    model.generation_config.pad_token_id = COMMON["pad_token_id"]
    return model


def tiny_llama(**overrides) -> PreTrainedModel:
    """GQA: 4 query heads share 2 KV heads."""
    return _build(LlamaForCausalLM, LlamaConfig(**{**COMMON, **overrides}))


def tiny_mistral(**overrides) -> PreTrainedModel:
    return _build(MistralForCausalLM, MistralConfig(**{**COMMON, "sliding_window": None, **overrides}))


def tiny_qwen3(**overrides) -> PreTrainedModel:
    return _build(Qwen3ForCausalLM, Qwen3Config(**{**COMMON, "head_dim": 16, **overrides}))


def tiny_gemma3(**overrides) -> PreTrainedModel:
    """MQA (one KV head) and a mix of sliding-window (window 8) and full-attention layers."""
    config = Gemma3TextConfig(
        **{
            **COMMON,
            "num_hidden_layers": 3,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            **overrides,
        }
    )
    return _build(Gemma3ForCausalLM, config)


def tiny_deepseek_v3(**overrides) -> PreTrainedModel:
    """Multi-head latent attention: keys 16 wide (8 without RoPE + 8 with), values 8 wide."""
    config = DeepseekV3Config(
        **{
            **COMMON,
            "num_key_value_heads": 4,
            "q_lora_rank": None,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 8,
            "v_head_dim": 8,
            "moe_intermediate_size": 32,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            **overrides,
        }
    )
    return _build(DeepseekV3ForCausalLM, config)


def tiny_from_type(model_type: str, **overrides) -> PreTrainedModel:
    """Any architecture transformers knows by its ``model_type``, at the tiny size."""
    config = AutoConfig.for_model(model_type, **{**COMMON, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.pad_token_id = COMMON["pad_token_id"]
    return model


QUERY_ARCHITECTURES = {
    "mixtral": dict(num_local_experts=4),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "olmo2": {},  # its q_norm spans every head
}
"""Attention that projects, normalises and rotates its queries as Llama does, under other names:
the query-scored policies serve them by that recipe, read from the module (no list of names)."""


TINY_MODELS = {"llama": tiny_llama, "mistral": tiny_mistral, "qwen3": tiny_qwen3, "gemma3": tiny_gemma3}


def random_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def char_tokenizer(bos: bool = False):
    """A character-level tokenizer whose ids fit the tiny models' vocabulary (``VOCAB``); with
    ``bos``, ``tokenizer(text)`` opens with ``<s>`` (id 1), as Gemma's and Llama's do."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for char in "\n\t" + "".join(chr(code) for code in range(32, 127)):
        vocab[char] = len(vocab)
    assert len(vocab) <= VOCAB
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    if bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def save_tiny_model(folder, factory=tiny_llama, **overrides):
    """Save a tiny model and :func:`char_tokenizer` into ``folder``, loadable as ``--model folder``."""
    model = factory(**overrides)
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder
