"""Model families: one module per family group, each registering its Hugging Face class,
config.json mapping both ways and tensor table (base.py says what a family is).

Importing this package registers the built-in families; it imports no JAX, so config
validation (engine/models/config.py checks `family` here) stays cheap.
"""

# Importing a family module registers it; this order is the one error messages list.
from engine.models.families import deepseek, gemma, gpt_oss, llama, mistral, moe, qwen  # noqa: F401, I001
from engine.models.families import glm, minimax, olmo, phi3, smollm3  # noqa: F401, I001
from engine.models.families import llama4  # noqa: F401, I001
from engine.models.families import deepseek_v32  # noqa: F401, I001
from engine.models.families import gemma4  # noqa: F401, I001
from engine.models.families import qwen3_next  # noqa: F401, I001
from engine.models.families import nemotron_h, granite_hybrid  # noqa: F401, I001
from engine.models.families import falcon_h1  # noqa: F401, I001
from engine.models.families import kimi_linear  # noqa: F401, I001
from engine.models.families import qwen2_moe, olmoe, granite_moe  # noqa: F401, I001
from engine.models.families import llama_variants  # noqa: F401, I001
from engine.models.families import ministral, hunyuan  # noqa: F401, I001
from engine.models.families import gpt_neox, phi, gptj, stablelm, starcoder2, falcon, cohere, nemotron  # noqa: F401, I001
from engine.models.families import granite, glm_dense, exaone4, vaultgemma, minicpm3  # noqa: F401, I001
from engine.models.families import apertus  # noqa: F401, I001
from engine.models.families import routed_gqa  # noqa: F401, I001
from engine.models.families import ernie  # noqa: F401, I001
from engine.models.families import hunyuan_moe  # noqa: F401, I001
from engine.models.families import glm_lite  # noqa: F401, I001
from engine.models.families import afmoe  # noqa: F401, I001
from engine.models.families import gpt2, opt, olmo1, jais2, dbrx, phimoe, mpt, bloom  # noqa: F401, I001
from engine.models.families import cohere2_moe  # noqa: F401, I001
from engine.models.families import jetmoe  # noqa: F401, I001
from engine.models.families import cwm, youtu, hy_v3, minicpm5_moe, sarvam, apertus1p5  # noqa: F401, I001
from engine.models.families import mamba, bamba, jamba  # noqa: F401, I001
from engine.models.families import mimo_v2_flash  # noqa: F401, I001
from engine.models.families import minimax_m3  # noqa: F401, I001
from engine.models.families import lfm2, recurrent_gemma, minimax01  # noqa: F401, I001
from engine.models.families import deepseek_v4  # noqa: F401, I001
from engine.models.families import gemma3n  # noqa: F401, I001
from engine.models.families import olmo_hybrid, bailing_hybrid  # noqa: F401, I001
from engine.models.families import laguna, hy_v4, longcat_flash  # noqa: F401, I001
from engine.models.families import dots3  # noqa: F401, I001
from engine.models.families import zamba2  # noqa: F401, I001
from engine.models.families import qwen4_exp  # noqa: F401, I001
from engine.models.families.base import (
    Family,
    TensorSpec,
    family_names,
    family_of_model_type,
    get_family,
    register_family,
)

__all__ = ["Family", "TensorSpec", "family_names", "family_of_model_type", "get_family", "register_family"]
