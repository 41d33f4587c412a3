"""Model families: one module per family group, each registering its Hugging Face class,
config.json mapping both ways and tensor table (base.py says what a family is).

Importing this package registers the built-in families; it imports no JAX, so config
validation (engine/models/config.py checks `family` here) stays cheap.
"""

from engine.models.families.base import (
    Family, TensorSpec, family_names, family_of_model_type, get_family, register_family,
)

# Importing a family module registers it; this order is the one error messages list.
from engine.models.families import llama, mistral, qwen, gemma, moe, gpt_oss, deepseek  # noqa: F401, I001

__all__ = ["Family", "TensorSpec", "family_names", "family_of_model_type", "get_family", "register_family"]
