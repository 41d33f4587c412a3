"""The engine's sampler on one accelerator: generated tokens per second at batch 1, 32 and 256,
and the quickstart GRPO stage's rollout shape, for a model preset at random weights.

    python -m bench.tpu_rollouts [--preset llama3-1b] [--prompt-len 128] [--new-tokens 128] [--out FILE]

Each case compiles (a first call), then the best of --inner calls is timed (prefill, decoding
and the host transfer of the tokens included: Sampler returns host arrays). Greedy decoding
for batch 1 / 32 / 256; the GRPO case samples (temperature 1) `num_generations` completions of
each prompt, the prompt prefilled once (the quickstart's grpo stage: 32 prompts x 8
completions, prompts of 64 tokens, completions of 6, configs/pipelines/quickstart.yaml).
Weights: the preset's own initialiser, stored in --param-dtype, sampled in bfloat16. Writes
its rows to bench/results/tpu-rollouts.json (appended, with the device and date).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import numpy as np

from bench import REPO

OUT = REPO / "bench" / "results" / "tpu-rollouts.json"
# name -> (prompts, num_generations, prompt_len or None for --prompt-len, new tokens or None, sampled)
CASES = {
    "batch1": (1, 1, None, None, False),
    "batch32": (32, 1, None, None, False),
    "batch256": (256, 1, None, None, False),
    "quickstart_grpo": (32, 8, 64, 6, True),
}


def run_case(sampler, params, vocab: int, case: str, prompt_len: int, new_tokens: int, inner: int) -> dict:
    prompts, generations, fixed_prompt, fixed_new, sampled = CASES[case]
    prompt_len, new_tokens = fixed_prompt or prompt_len, fixed_new or new_tokens
    tokens = np.random.default_rng(0).integers(1, vocab, (prompts, prompt_len)).astype(np.int32)
    mask = np.ones_like(tokens)

    def call(seed: int):
        return sampler(
            params,
            tokens,
            mask,
            seed=seed,
            max_new_tokens=new_tokens,
            num_generations=generations,
            temperature=1.0 if sampled else 0.0,
        )

    started = time.perf_counter()
    call(0)
    first = time.perf_counter() - started
    best = float("inf")
    for seed in range(1, inner + 1):
        started = time.perf_counter()
        out = call(seed)
        best = min(best, time.perf_counter() - started)
    generated = prompts * generations * new_tokens
    return {
        "case": case,
        "prompts": prompts,
        "num_generations": generations,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "seconds": best,
        "first_call_seconds": first,
        "tokens_per_second": generated / best,
        "rows_out": int(out.tokens.shape[0]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-1b")
    parser.add_argument("--param-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--inner", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    import jax

    from engine.config import resolve_model_preset
    from engine.inference.sample import Sampler
    from engine.models.config import ComputeConfig, ModelConfig
    from engine.models.params import init_params
    from engine.parallel.config import MeshConfig
    from engine.parallel.mesh import make_mesh

    # the preset as a run reads it (its recommended compute settings set aside: this bench sets its own)
    cfg = ModelConfig(**resolve_model_preset({"model": args.preset}, "--preset")["model"])
    compute = ComputeConfig(param_dtype=args.param_dtype, dtype="bfloat16")
    params = init_params(cfg, compute, make_mesh(MeshConfig(data=-1), jax.devices()[:1]), seed=0)
    sampler = Sampler(cfg, compute, dtype="bfloat16")
    results = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
    for case in args.cases.split(","):
        row = {"preset": args.preset, "param_dtype": args.param_dtype, "dtype": "bfloat16"}
        try:
            row.update(run_case(sampler, params, cfg.vocab_size, case, args.prompt_len, args.new_tokens, args.inner))
        except Exception as e:  # a case that does not fit keeps its row
            row.update(case=case, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        row.update(device_kind=jax.devices()[0].device_kind, jax=jax.__version__)
        row["date"] = datetime.date.today().isoformat()
        results["runs"].append(row)
        print(json.dumps(row), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
