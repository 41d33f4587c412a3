"""Qwen2 / Qwen2.5 and Qwen3 (Qwen2ForCausalLM, Qwen3ForCausalLM).

Both may slide a window over the layers from `max_window_layers` on (older configs) or per
`layer_types` (transformers 5). Qwen2 has biases on the q, k and v projections; Qwen3 drops
them for RMSNorm on queries and keys, and has head_dim independent of d_model.
"""

from __future__ import annotations

from typing import Any

from engine.models.families.base import LAYER, Family, TensorSpec, layer_types_to_hf, qk_norm_tensors, register_family

_DEFAULTS = {"max_position_embeddings": 32768, "tie_word_embeddings": False, "max_window_layers": 28}


class _Qwen(Family):
    hf_defaults = _DEFAULTS

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        if hf.get("layer_types") is not None:
            return hf["layer_types"]
        if hf.get("use_sliding_window"):  # the layers from max_window_layers on
            first = self.hf_value(hf, "max_window_layers")
            return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        return ["full_attention"] * num_layers

    def extra_hf_keys(self, cfg) -> dict[str, Any]:
        # Without a window, max_window_layers means nothing: transformers writes its default.
        is_local = cfg.layer_is_local()
        first_local = is_local.index(True) if any(is_local) else self.hf_defaults["max_window_layers"]
        return {**layer_types_to_hf(cfg), "use_sliding_window": any(is_local), "max_window_layers": first_local}


@register_family
class Qwen2(_Qwen):
    name = "qwen2"
    architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"
    fixed = {"qkv_bias": True}
    unsupported_flags = ()  # its q/k/v biases are the architecture, not a flag to refuse
    hf_constants = {}  # Qwen2Config has no bias flags

    def extra_attention_tensors(self) -> list[TensorSpec]:
        return [
            TensorSpec(
                ("attn", f"b{x}_{'nh' if x == 'q' else 'kh'}"), LAYER + f"self_attn.{x}_proj.bias", None, flatten=True
            )
            for x in "qkv"
        ]


@register_family
class Qwen3(_Qwen):
    name = "qwen3"
    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    fixed = {"qk_norm": True}
    hf_constants = {"attention_bias": False}

    def extra_attention_tensors(self) -> list[TensorSpec]:
        return qk_norm_tensors()
