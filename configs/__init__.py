"""Shipped model presets, example pipelines and stage configs: YAML package data, read with importlib.resources."""
