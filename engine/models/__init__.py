"""The decoder (transformer.py), its KV cache, architecture and compute configs, params and
their shardings, and the families (families/: one module per Hugging Face family)."""
