"""GRPO's sampler on a vLLM server: the policy's weights pushed to it, completions read back.

    python -m engine.interop.vllm_server CONFIG.yaml [key=value ...]   GRPO, `rollout:` set

The entry point is GRPO's (engine/posttrain/grpo.py) with this sampler: it lives here, above
posttrain, because it writes the weights with the Hugging Face exporter.

Called as engine.inference.sample.Sampler is (GRPO's rollout seam does not know which it
holds), it returns the same SampleOutput: tokens, the server's log-prob of each sampled token
(the behaviour log-probs), the mask (EOS included) and lengths, rows p * G + g.

How the weights move (TRL's vllm_mode="server" moves them over NCCL, which needs CUDA; vLLM
0.32's weight-transfer engines, --weight-transfer-config nccl / ipc, are CUDA-only too): when
the params it is given are not the ones it pushed last, that is after every update, they are
written from memory as Hugging Face safetensors (engine/interop/hf/export.py, write_hf_model)
into `rollout.weights_dir`, and the server is told to load them in place: POST /collective_rpc
{"method": "reload_weights", "kwargs": {"weights_path": dir}} (the worker's reload_weights,
which reads the directory with the model's own loader), then /reset_prefix_cache so no prompt
is served from KV computed with the old weights. Both endpoints are vLLM's development API
(VLLM_SERVER_DEV_MODE=1). No artifact store, no server restart; the cost is one write and
one read of the weights per update (in /dev/shm: memory bandwidth).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np

from engine.config import ConfigError
from engine.inference.sample import SampleOutput
from engine.interop.hf.export import write_hf_model
from engine.interop.hf.files import copy_tokenizer
from engine.parallel.mesh import to_host
from engine.posttrain.async_rollout import RolloutWorkerError
from engine.posttrain.config import GRPOConfig
from engine.posttrain.finetune import tokenizer_dir
from engine.posttrain.grpo import run_grpo
from engine.posttrain.rewards import RewardError
from engine.posttrain.rollout_server import CompletionsClient, RolloutServerError, completion_rows
from engine.train.checkpoint import read_meta
from engine.train.cli import run_cli

SHARED_MEMORY = Path("/dev/shm")
MAX_CONCURRENT_REQUESTS = 64


class VLLMSampler:
    """A GRPOConfig's `rollout` server as its sampler (engine/posttrain/rollout_server.py)."""

    def __init__(self, cfg, trainer, model_cfg, bundle):
        rollout = cfg.rollout
        if cfg.lora is not None:
            raise ConfigError("rollout.engine vllm with lora is not supported yet: drop lora or the rollout section")
        if cfg.rollout_workers:
            raise ConfigError("rollout.engine vllm samples on the server: set rollout_workers 0")
        if jax.process_count() > 1:
            raise ConfigError("rollout.engine vllm runs in a single-process GRPO stage (launcher local)")
        self.client = CompletionsClient(
            rollout.url,
            model=rollout.model,
            timeout_seconds=rollout.timeout_seconds,
            retries=rollout.retries,
            retry_seconds=rollout.retry_seconds,
        )
        self.model_cfg, self.compute = model_cfg, trainer.cfg.compute
        self.check_server(cfg)
        if rollout.weights_dir:
            self.weights_dir = Path(rollout.weights_dir)
            self.weights_dir.mkdir(parents=True, exist_ok=True)
        else:
            shm = SHARED_MEMORY if SHARED_MEMORY.is_dir() and os.access(SHARED_MEMORY, os.W_OK) else None
            self.weights_dir = Path(tempfile.mkdtemp(prefix="trainflow-rollout-weights-", dir=shm))
            # A copy of the model in memory (/dev/shm): removed with the sampler, or at exit.
            weakref.finalize(self, shutil.rmtree, self.weights_dir, ignore_errors=True)
        self.hf_meta = read_meta(cfg.checkpoint.init_from)[1].get("hf")  # token ids for config.json
        copy_tokenizer(tokenizer_dir(cfg), self.weights_dir)  # a complete HF directory, servable as it is
        self.pushed = None  # the params the server holds (by identity)
        self.pushes, self.push_seconds = 0, 0.0

    def check_server(self, cfg) -> None:
        """Refuse, before the first step, a server that cannot serve this run: too short a
        context, no development API (no weight reload), log-probs not at the sampling temperature."""
        url, need = self.client.url, cfg.max_prompt_length + cfg.max_completion_length
        limit = self.client.max_model_len()
        if limit is not None and limit < need:
            raise ConfigError(
                f"the rollout server at {url} serves {limit} tokens, fewer than max_prompt_length + "
                f"max_completion_length ({need}); start it with --max-model-len {need} or more"
            )
        try:
            info = self.client.request("/server_info?config_format=json")
        except RolloutServerError as e:
            if " 404 " not in str(e):
                raise
            raise ConfigError(
                f"the rollout server at {url} has no development API to reload weights through; "
                f"start it with VLLM_SERVER_DEV_MODE=1"
            ) from None
        mode = (info.get("vllm_config") or {}).get("model_config", {}).get("logprobs_mode")
        sampled_as_is = cfg.temperature == 1.0 and cfg.top_k == 0 and cfg.top_p == 1.0
        if mode not in (None, "processed_logprobs") and not sampled_as_is:
            raise ConfigError(
                f"the rollout server at {url} returns {mode}, the log-probs before temperature and "
                f"top-k/top-p; start it with --logprobs-mode processed_logprobs"
            )

    def push(self, params) -> None:
        """The policy's weights into the server: safetensors to weights_dir, reload, fresh caches."""
        start = time.perf_counter()
        host = jax.tree.map(to_host, params)
        write_hf_model(host, self.model_cfg, self.compute, self.weights_dir, self.hf_meta)
        self.client.request(
            "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(self.weights_dir)}}
        )
        self.client.request("/reset_prefix_cache", {})
        self.pushed, self.pushes = params, self.pushes + 1
        self.push_seconds += time.perf_counter() - start

    def __call__(
        self,
        params,
        prompt_tokens_bp,
        prompt_mask_bp,
        *,
        seed=0,
        max_new_tokens: int,
        num_generations: int = 1,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_ids=(),
        pad_id: int = 0,
    ) -> SampleOutput:
        """Sampler's contract: `num_generations` completions of each left-padded prompt."""
        if params is not self.pushed:
            self.push(params)
        # One request per prompt, each with its own seed, so that prompts do not share draws
        # (vLLM seeds a request, not a row); from the step's key, so a rerun asks the same.
        base = int(jax.random.randint(jax.random.key(seed) if isinstance(seed, int) else seed, (), 0, 2**30))
        prompts = [row[mask.astype(bool)].tolist() for row, mask in zip(np.asarray(prompt_tokens_bp), prompt_mask_bp)]

        def complete(p: int):
            return self.client.complete(
                prompts[p],
                n=num_generations,
                max_tokens=max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=base + p,
                stop_token_ids=eos_ids,
            )

        # All at once: the server batches concurrent requests (continuous batching).
        with ThreadPoolExecutor(min(len(prompts), MAX_CONCURRENT_REQUESTS)) as pool:
            completions = [row for rows in pool.map(complete, range(len(prompts))) for row in rows]
        tokens, logprobs, mask = completion_rows(completions, max_new_tokens, pad_id)
        return SampleOutput(tokens=tokens, logprobs=logprobs, mask=mask, lengths=mask.sum(1).astype(np.int32))


def run_grpo_on_server(cfg: GRPOConfig, log=None) -> dict:
    """GRPO whose rollouts come from `cfg.rollout`'s server (run_grpo with this sampler)."""
    if cfg.rollout is None:
        raise ConfigError(
            "rollout: give the server to sample on, e.g. rollout: {engine: vllm, url: http://127.0.0.1:8000}"
        )
    return run_grpo(cfg, log, sampler_factory=VLLMSampler)


def main(argv: list[str] | None = None) -> int:
    failures = (RewardError, RolloutWorkerError, RolloutServerError)
    return run_cli(argv, "engine.interop.vllm_server", GRPOConfig, run_grpo_on_server, failures=failures)


if __name__ == "__main__":
    sys.exit(main())
