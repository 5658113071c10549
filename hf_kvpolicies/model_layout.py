"""What a cache needs to know about a model: its layers' attention types and sliding windows."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class LayerLayout:
    """One decoder layer: its attention type and, for sliding layers, the model's window."""

    index: int
    layer_type: str
    sliding_window: int | None = None

    @property
    def is_sliding(self) -> bool:
        return self.layer_type == "sliding_attention"


def decoder_of(model: nn.Module) -> nn.Module:
    """The module that holds the decoder layers and builds the masks (``LlamaModel`` inside
    ``LlamaForCausalLM``)."""
    return getattr(model, "base_model", model)


def text_config(model_or_config: PreTrainedModel | PretrainedConfig) -> PretrainedConfig:
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config(decoder=True)


def layer_layouts(model_or_config: PreTrainedModel | PretrainedConfig) -> list[LayerLayout]:
    """The decoder layers of ``model``, refusing attention types a KV policy cannot serve."""
    config = text_config(model_or_config)
    if not hasattr(config, "num_hidden_layers"):
        raise ValueError(
            f"{type(config).__name__} has no decoder layers (num_hidden_layers): "
            "hf-kvpolicies serves decoder-only causal language models"
        )
    layer_types, kwargs = get_layer_types_and_kwargs(config)
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise ValueError(
            f"{config.model_type} has layers of type {', '.join(unsupported)}; hf-kvpolicies serves models whose "
            f"attention layers are {' or '.join(SUPPORTED_LAYER_TYPES)} (use transformers' DynamicCache for this model)"
        )
    return [
        LayerLayout(index, layer_type, layer_kwargs.get("sliding_window"))
        for index, (layer_type, layer_kwargs) in enumerate(zip(layer_types, kwargs))
    ]


def max_positions(model_or_config: PreTrainedModel | PretrainedConfig) -> int | None:
    """The most positions the model was built for (``max_position_embeddings``), if it says."""
    value = getattr(text_config(model_or_config), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None
