"""Llama 2, 3 and 3.1-3.3 (LlamaForCausalLM): the shape the Family base class describes.

Every layer attends globally; Llama 3.1's long context is `rope_scaling: {kind: llama3}`,
read by the base class like any RoPE dict.
"""

from __future__ import annotations

from engine.models.families.base import Family, register_family


@register_family
class Llama(Family):
    name = "llama"
    architecture = "LlamaForCausalLM"
    model_type = "llama"
    hf_defaults = {"max_position_embeddings": 2048, "tie_word_embeddings": False}
