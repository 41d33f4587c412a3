"""Generation throughput of the engine's KV-cache sampler beside transformers `generate`
(PyTorch, same machine) on the same model: one random Llama, saved by transformers and
converted with engine/interop/hf/convert.py, so both decode the very same weights.

Greedy decoding of a fixed number of new tokens (no EOS stop) from equal-length random
prompts, at batch 1 and batch 32. Compilation (JAX) and the first call (torch) are warm-up,
not timed; each figure is the best of `--repeats` timed calls. Also reported: how many
greedy tokens the two agree on (float rounding may let long greedy runs diverge).

    python -m bench.sample [--new-tokens 64] [--prompt-len 32] [--repeats 3]

Prints a table and writes bench/results/sample.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench import machine

import numpy as np

REPO = Path(__file__).resolve().parent.parent
SHAPE = dict(vocab_size=8192, d_model=384, num_layers=6, num_heads=6, num_kv_heads=2, head_dim=64,
             mlp_dim=1024, max_seq_len=512, tie_embeddings=False)  # configs/models/bench-16m.yaml
BATCHES = (1, 32)


def make_models(workdir: Path):
    """(torch LlamaForCausalLM, engine ModelConfig, ComputeConfig, params): the same random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.interop.hf.convert import convert_hf
    from engine.train.checkpoint import load_params, stored_configs

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["d_model"], num_hidden_layers=SHAPE["num_layers"],
        num_attention_heads=SHAPE["num_heads"], num_key_value_heads=SHAPE["num_kv_heads"],
        head_dim=SHAPE["head_dim"], intermediate_size=SHAPE["mlp_dim"], max_position_embeddings=SHAPE["max_seq_len"],
        tie_word_embeddings=False, initializer_range=0.2,  # peaked distributions: few greedy near-ties
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(workdir / "hf")
    convert_hf(workdir / "hf", workdir / "engine", log=lambda msg: None)
    model_cfg, params, _ = load_params(workdir / "engine" / "checkpoint")
    _, compute = stored_configs(workdir / "engine" / "checkpoint")  # float32, as transformers saved it
    return model, model_cfg, compute, params


def time_best(fn, repeats: int) -> tuple[float, object]:
    out, best = None, float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def bench_engine(model_cfg, compute, params, prompts: np.ndarray, new_tokens: int,
                 repeats: int) -> tuple[float, np.ndarray]:
    import jax

    from engine.inference.sample import Sampler

    sampler = Sampler(model_cfg, compute)  # one device, no mesh
    params = jax.device_put(params)
    mask = np.ones_like(prompts)

    def run():
        out = sampler(params, prompts, mask, max_new_tokens=new_tokens, temperature=0.0)
        return out.tokens  # Sampler returns host arrays: the time includes the transfer

    run()  # compile
    return time_best(run, repeats)


def bench_torch(model, prompts: np.ndarray, new_tokens: int, repeats: int) -> tuple[float, np.ndarray]:
    import torch

    ids = torch.from_numpy(prompts.astype(np.int64))
    attention = torch.ones_like(ids)

    def run():
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=attention, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[:, prompts.shape[1]:].numpy()

    run()  # warm-up
    return time_best(run, repeats)


def _machine() -> dict:
    import jax
    import torch

    return machine(jax=jax.__version__, jax_backend=jax.default_backend(), jax_devices=jax.device_count(),
                   torch=torch.__version__, torch_threads=torch.get_num_threads())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))

    with tempfile.TemporaryDirectory() as tmp:
        model, model_cfg, compute, params = make_models(Path(tmp))
    rng = np.random.default_rng(0)
    runs = []
    for batch in BATCHES:
        prompts = rng.integers(1, SHAPE["vocab_size"], (batch, args.prompt_len)).astype(np.int32)
        print(f"batch {batch}: engine ...", file=sys.stderr)
        engine_s, engine_tokens = bench_engine(model_cfg, compute, params, prompts, args.new_tokens, args.repeats)
        print(f"batch {batch}: transformers ...", file=sys.stderr)
        torch_s, torch_tokens = bench_torch(model, prompts, args.new_tokens, args.repeats)
        generated = batch * args.new_tokens
        # Greedy agreement: tokens equal up to each row's first disagreement.
        differs = engine_tokens != torch_tokens
        agree = np.where(differs.any(1), differs.argmax(1), args.new_tokens)
        runs.append({
            "batch": batch, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
            "engine_seconds": engine_s, "engine_tokens_per_second": generated / engine_s,
            "transformers_seconds": torch_s, "transformers_tokens_per_second": generated / torch_s,
            "speedup": torch_s / engine_s, "greedy_prefix_agreement": float(agree.mean() / args.new_tokens),
        })

    print(f"\n{'batch':>5} {'engine tok/s':>13} {'transformers tok/s':>19} {'speedup':>8} {'greedy agreement':>17}")
    for r in runs:
        print(f"{r['batch']:>5} {r['engine_tokens_per_second']:>13,.0f} {r['transformers_tokens_per_second']:>19,.0f} "
              f"{r['speedup']:>7.2f}x {r['greedy_prefix_agreement']:>16.0%}")
    out = REPO / "bench" / "results" / "sample.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    description = ("greedy generation, fixed length, no EOS; tokens/s = batch * new_tokens / best wall time of "
                   "a full generate call (prefill included); same weights in both frameworks")
    out.write_text(json.dumps({"machine": _machine(), "shape": SHAPE, "description": description, "runs": runs},
                              indent=2))
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
