"""Generation throughput of the engine's KV-cache sampler beside transformers `generate`
(PyTorch, same machine) on the same model: one random Llama, saved by transformers and
converted with engine/interop/hf/convert.py, so both decode the very same weights.

Each side runs in each of --dtypes: float32 (the checkpoint's), and bfloat16: the engine's
Sampler dtype=bfloat16 (a bf16 copy of the weights made once per call, products
accumulated in f32, logits and the draw in f32), transformers' model cast with
.to(torch.bfloat16) (torch's bf16 kernels use AVX512-BF16 / AMX where the CPU has them).
The ratios pair each engine dtype with transformers in float32 (its default) and in the
same dtype.

Cases (fixed length, no EOS stop, equal-length random prompts):
  batch1, batch32  greedy decoding of --new-tokens tokens for 1 and 32 prompts; also reported:
                   how many greedy tokens the two agree on in each dtype (float rounding may
                   let long greedy runs diverge; bf16 rounding more often)
  grpo             GRPO-shaped rollouts: 32 prompts x 8 completions each, sampled
                   (temperature 1, no top-k/top-p): the engine prefills each prompt once
                   (Sampler num_generations=8), transformers gets num_return_sequences=8

Engine and transformers runs alternate (A B A B ..., --repeats rounds), each in a fresh
process (bench/__init__.py); a run compiles / warms up first, then reports the best of
--inner timed calls (prefill included, host transfer included). The table gives the
median over rounds and the spread.

    python -m bench.sample [--new-tokens 64] [--prompt-len 32] [--repeats 5] [--inner 2]
                           [--cases batch1,batch32,grpo] [--dtypes float32,bfloat16] [--out FILE]

Prints a table and writes bench/results/sample.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import REPO, alternate, finish, load_line, machine, summary

SHAPE = dict(
    vocab_size=8192,
    d_model=384,
    num_layers=6,
    num_heads=6,
    num_kv_heads=2,
    head_dim=64,
    mlp_dim=1024,
    max_seq_len=512,
    tie_embeddings=False,
)  # configs/models/bench-16m.yaml
DTYPES = ("float32", "bfloat16")
CASES = {  # name: (prompts, completions per prompt, sampled)
    "batch1": (1, 1, False),
    "batch32": (32, 1, False),
    "grpo": (32, 8, True),
}


def save_model(workdir: Path) -> None:
    """A random Llama saved by transformers (workdir/hf) and converted (workdir/engine)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.interop.hf.convert import convert_hf

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=SHAPE["vocab_size"],
        hidden_size=SHAPE["d_model"],
        num_hidden_layers=SHAPE["num_layers"],
        num_attention_heads=SHAPE["num_heads"],
        num_key_value_heads=SHAPE["num_kv_heads"],
        head_dim=SHAPE["head_dim"],
        intermediate_size=SHAPE["mlp_dim"],
        max_position_embeddings=SHAPE["max_seq_len"],
        tie_word_embeddings=False,
        initializer_range=0.2,  # peaked distributions: few greedy near-ties
    )
    LlamaForCausalLM(config).eval().save_pretrained(workdir / "hf")
    convert_hf(workdir / "hf", workdir / "engine", log=lambda msg: None)


def prompts_of(case: str, prompt_len: int) -> np.ndarray:
    return np.random.default_rng(0).integers(1, SHAPE["vocab_size"], (CASES[case][0], prompt_len)).astype(np.int32)


def time_best(fn, inner: int) -> tuple[float, np.ndarray]:
    out, best = fn(), float("inf")  # the first call compiles / warms up
    for _ in range(inner):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def engine_worker(
    workdir: Path, case: str, dtype: str, prompt_len: int, new_tokens: int, inner: int
) -> tuple[float, np.ndarray]:
    import jax

    from engine.inference.sample import Sampler
    from engine.train.checkpoint import load_params, stored_configs

    model_cfg, params, _ = load_params(workdir / "engine" / "checkpoint")
    _, compute = stored_configs(workdir / "engine" / "checkpoint")  # float32, as transformers saved it
    _, generations, sampled = CASES[case]
    sampler = Sampler(model_cfg, compute, dtype=dtype)  # the params stay f32; bfloat16 samples with a bf16 copy
    params, prompts = jax.device_put(params), prompts_of(case, prompt_len)
    seeds = iter(range(1_000_000))

    def run():  # Sampler returns host arrays: the time includes the transfer
        return sampler(
            params,
            prompts,
            np.ones_like(prompts),
            seed=next(seeds),
            max_new_tokens=new_tokens,
            num_generations=generations,
            temperature=1.0 if sampled else 0.0,
        ).tokens

    return time_best(run, inner)


def transformers_worker(
    workdir: Path, case: str, dtype: str, prompt_len: int, new_tokens: int, inner: int
) -> tuple[float, np.ndarray]:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(workdir / "hf").eval().to(getattr(torch, dtype))
    _, generations, sampled = CASES[case]
    ids = torch.from_numpy(prompts_of(case, prompt_len).astype(np.int64))
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sampled else dict(do_sample=False)

    def run():
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=0,
                num_return_sequences=generations,
                **sampling,
            )
        return out[:, prompt_len:].numpy()

    torch.manual_seed(0)
    return time_best(run, inner)


def worker(args) -> None:
    side, dtype, case, workdir = args.worker
    fn = engine_worker if side == "engine" else transformers_worker
    seconds, tokens = fn(Path(workdir), case, dtype, args.prompt_len, args.new_tokens, args.inner)
    np.save(Path(workdir) / f"tokens-{side}-{dtype}-{case}.npy", tokens)
    info = {"seconds": seconds, "rows": int(tokens.shape[0]), "tokens_per_second": tokens.size / seconds}
    if side == "engine":
        import jax

        info.update(jax=jax.__version__, jax_backend=jax.default_backend())
    else:
        import torch

        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    print(json.dumps(info))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="rounds of engine, transformers (each a process)")
    parser.add_argument("--inner", type=int, default=2, help="timed calls per process (the best is kept)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated subset of {', '.join(DTYPES)}")
    parser.add_argument(
        "--out",
        default=str(REPO / "bench" / "results" / "sample.json"),
        help="where the JSON goes (default: %(default)s)",
    )
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)  # side, dtype, case, workdir
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.worker:
        return worker(args)

    info, runs = machine(), []
    dtypes = args.dtypes.split(",")
    common = ["--new-tokens", str(args.new_tokens), "--prompt-len", str(args.prompt_len), "--inner", str(args.inner)]
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp))
        for case in args.cases.split(","):
            sides = {
                f"{side} {dtype}": ["bench.sample", "--worker", side, dtype, case, tmp, *common]
                for dtype in dtypes
                for side in ("engine", "transformers")
            }
            results = alternate(sides, args.repeats)
            speed = {name: summary([r["tokens_per_second"] for r in results[name]]) for name in sides}
            ratios = {
                f"engine {e} / transformers {t}":  # each engine dtype against float32 and its own dtype
                speed[f"engine {e}"]["median"] / speed[f"transformers {t}"]["median"]
                for e in dtypes
                for t in dtypes
                if t in ("float32", e)
            }
            run = {
                "case": case,
                "prompts": CASES[case][0],
                "completions_per_prompt": CASES[case][1],
                "sampled": CASES[case][2],
                "new_tokens": args.new_tokens,
                "prompt_len": args.prompt_len,
                "tokens_per_second": speed,
                "speedup_of_medians": ratios,
                "versions": {
                    **{k: v for k, v in results[f"engine {dtypes[0]}"][0].items() if k.startswith("jax")},
                    **{k: v for k, v in results[f"transformers {dtypes[0]}"][0].items() if k.startswith("torch")},
                },
            }
            if not CASES[case][2]:  # greedy agreement: tokens equal up to each row's first disagreement
                run["greedy_prefix_agreement"] = {}
                for dtype in dtypes:
                    a, b = (
                        np.load(Path(tmp) / f"tokens-{side}-{dtype}-{case}.npy") for side in ("engine", "transformers")
                    )
                    differs = a != b
                    agree = np.where(differs.any(1), differs.argmax(1), args.new_tokens)
                    run["greedy_prefix_agreement"][dtype] = float(agree.mean() / args.new_tokens)
            runs.append(run)
    info = finish(info)

    print(f"\n{'case':<8} {'rows':>5} {'side':<22} {'tok/s (spread)':>20}  greedy agreement")
    for r in runs:
        for name, s in r["tokens_per_second"].items():
            side, dtype = name.split()
            agreement = r.get("greedy_prefix_agreement", {}).get(dtype) if side == "engine" else None
            print(
                f"{r['case']:<8} {r['prompts'] * r['completions_per_prompt']:>5} {name:<22} "
                f"{s['median']:>12,.0f} ({s['spread']:>5.1%})  {'-' if agreement is None else f'{agreement:.0%}'}"
            )
        for name, ratio in r["speedup_of_medians"].items():
            print(f"{'':<8} {'':>5} {name:<44} {ratio:>5.2f}x")
    print(load_line(info))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    description = (
        "tokens/s = rows * new_tokens / best wall time of a full generate call (prefill included), "
        "median over alternating processes; fixed length, no EOS; same weights in both frameworks; "
        "engine bfloat16 = Sampler dtype=bfloat16 (a bf16 copy of the f32 weights per call), "
        "transformers bfloat16 = the model cast with .to(torch.bfloat16)"
    )
    out.write_text(
        json.dumps(
            {
                "command": "python -m bench.sample " + " ".join(sys.argv[1:]),
                "machine": info,
                "shape": SHAPE,
                "dtypes": dtypes,
                "description": description,
                "runs": runs,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
