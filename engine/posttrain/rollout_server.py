"""Rollouts from an OpenAI-compatible inference server (vLLM) instead of the engine's sampler.

GRPO's `rollout: {engine: vllm, url: ...}` (TRL's `vllm_mode="server"`): each rollout batch's
prompts go to the server's /v1/completions as token ids, G completions each, and come back as
token ids with the log-probability the server sampled each one with (the behaviour
log-probs). The policy's weights reach the server without the artifact store: after each
update they are written as Hugging Face safetensors to a directory both processes see and
the server reloads them in place (engine/posttrain/vllm_rollout.py); with LoRA the
server holds the frozen base and each update's adapter is loaded under `adapter_name`, the
model the completions then name. An `environment:`'s episodes go through the same sampler:
each turn is one request per episode still running (finished ones are not sent).

This module is the schema alone (GRPOConfig imports it, and validating a pipeline must not
load JAX). The HTTP client with its retries and the completions -> rows conversion are
engine/interop/completions.py; the sampler that pushes the weights (through the HF exporter,
engine/interop) is engine/posttrain/vllm_rollout.py, whose entry point runs GRPO with it:
`python -m engine.posttrain.vllm_rollout CONFIG.yaml` (run_grpo's sampler_factory).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config import Strict


class RolloutServerConfig(Strict):
    """GRPO's rollouts from an inference server (docs/post-training.md, "vLLM rollouts")."""

    engine: Literal["vllm"] = "vllm"
    """The server: vLLM's OpenAI-compatible server (`vllm serve`, with VLLM_SERVER_DEV_MODE=1
    for the weight reload and --logprobs-mode processed_logprobs for log-probs at the
    sampling temperature, as the engine's sampler gives them)."""
    url: str = "http://127.0.0.1:8000"
    """The server's base URL (no /v1)."""
    model: str | None = None
    """The served model name; None: the first one the server's /v1/models lists."""
    weights_dir: str | None = None
    """Where the policy's weights are written after each update for the server to reload: a
    directory the server's machine sees at the same path (a shared file system, or /dev/shm
    when it runs on this machine). None: a new temporary directory, in /dev/shm if there is one,
    removed when the run ends."""
    timeout_seconds: float = Field(600.0, gt=0)
    """How long one request may take (a rollout batch's completions, or a reload)."""
    retries: int = Field(3, ge=0)
    """Further tries of a request whose connection failed or dropped (or that got 502-504)."""
    retry_seconds: float = Field(2.0, ge=0)
    """The wait before the first retry, doubled before each next one."""
    adapter_name: str = "trainflow-policy"
    """With `lora:`, the name the policy's adapter is loaded under (/v1/load_lora_adapter) and
    that completions name as their model; the server holds the frozen base once, and each
    update replaces the adapter (its server needs --enable-lora --max-lora-rank >= lora.rank
    and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)."""
    weights_url: str | None = None
    """A server on another host: the policy's weights are staged at this URL (s3://, gs://,
    file://) in shards of at most 64 MiB, only those whose tensors changed rewritten, and the
    server's loader (`python -m engine.interop.bucket_weights URL --server ... --dir ...` on
    its host) reloads each committed version; `weights_dir` is then unused. None: the local
    path (`weights_dir`)."""


# The sampler pushes weights through the HF exporter (engine.interop), which grpo.py does not
# load: a run with `rollout:` starts at the entry point that does, engine/posttrain/vllm_rollout.py.
ROLLOUT_ENTRY_POINT = (
    "rollout: a server's sampler writes the policy's weights through the Hugging Face exporter; "
    "run GRPO with it as python -m engine.posttrain.vllm_rollout CONFIG.yaml (docs/post-training.md, vLLM rollouts)"
)
