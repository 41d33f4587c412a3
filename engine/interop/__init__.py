"""Formats of other tools: Hugging Face checkpoints in and out (hf/)."""
