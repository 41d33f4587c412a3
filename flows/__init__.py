"""Pipelines: the YAML spec and its validation (spec.py), the Prefect flow (pipeline.py),
the `trainflow` CLI (cli.py) and the read-only views of a store (inspect.py)."""
