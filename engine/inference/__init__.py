"""The KV-cache sampler (sample.py) and `generate` (text in, text out)."""
