"""VaultGemma (VaultGemmaForCausalLM; google/vaultgemma-1b): Gemma 2 without its post-sublayer
norms.

As Gemma 2: GeGLU, zero-centred RMSNorm scales, embeddings times sqrt(d_model), tied
embeddings, sliding-window layers (every other one from the first by default, or
`layer_types`), query_pre_attn_scalar and the attention and final logit soft-caps. Unlike it,
each layer has only its two input norms, input_layernorm and pre_feedforward_layernorm: the
sublayers' outputs are added unnormalised.
"""

from __future__ import annotations

from engine.models.families.base import LAYER, TensorSpec, register_family
from engine.models.families.gemma import _GEMMA, Gemma2


@register_family
class VaultGemma(Gemma2):
    name = "vaultgemma"
    architecture = "VaultGemmaForCausalLM"
    model_type = "vaultgemma"
    fixed = _GEMMA
    hf_constants = {"attention_bias": False}  # (transformers' class has no use_bidirectional_attention)

    def mlp_norm_tensors(self) -> list[TensorSpec]:
        return [TensorSpec(("mlp_norm", "scale"), LAYER + "pre_feedforward_layernorm.weight", None)]
