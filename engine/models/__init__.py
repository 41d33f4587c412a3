"""The decoder (transformer.py), its KV cache, architecture and compute configs, params and
their shardings, and the families (families/: one module per Hugging Face family).

Importing any of it imports the families package first, which registers the built-in
families (engine/models/family_registry.py) before a ModelConfig validates its `family`;
the families import no JAX, so config validation stays cheap.
"""

from engine.models import families  # noqa: F401  (registers the built-in families)
