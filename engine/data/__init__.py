"""Data: corpus readers (sources.py), tokenizers, the tokenize stage, token shards, the Grain
pipeline, chat templates, and the quickstart's synthetic problems."""
