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
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
from flax import nnx
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from bench import REPO, machine
from engine.data.tokenizer import TokenizerBundle, save_tokenizer
from engine.models.config import ModelConfig
from engine.models.transformer import Transformer
from engine.posttrain.config import GRPOConfig
from engine.posttrain.grpo import run_grpo
from engine.train.checkpoint import Checkpointer

DIGITS = [str(d) for d in range(10)]
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


def make_task(out: Path) -> None:
    vocab = {"<pad>": 0, "<eos>": 1, **{d: i + 2 for i, d in enumerate(DIGITS)}, "=": 12}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<pad>", "<eos>"])
    save_tokenizer(TokenizerBundle(tok, eos_token="<eos>", pad_token="<pad>"), out / "tokenizer")
    params = nnx.to_pure_dict(nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))[1])
    ckpt = Checkpointer(out / "checkpoint", async_save=False)
    ckpt.save(0, params, {"unused": np.zeros((), np.int32)}, {"step": 0, "model": CFG.model_dump(mode="json")}, {})
    ckpt.close()
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{d}=", "answer": d}) + "\n" for d in DIGITS))


def run(task: Path, replay: bool, args) -> dict:
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
        }
    )
    run_grpo(cfg, log=lambda line: None)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    row: dict = {"router_replay": replay, "steps": len(records)}
    for name, key in GAP.items():
        values = [r[key] for r in records]
        row[f"{name}_mean_over_steps"] = float(np.mean(values))
        row[f"{name}_max_over_steps"] = float(np.max(values))
    row["reward_last_3"] = float(np.mean([r["reward"] for r in records[-3:]]))
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rollout-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--clip", type=float, nargs=2, default=[0.8, 1.2], help="the clipped fraction's range")
    args = parser.parse_args()
    task = Path(tempfile.mkdtemp(prefix="bench-router-replay-task-"))
    make_task(task)
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
