"""Where a sampler call spends its time, from a JAX profiler trace.

    python -m bench.profile_sample [--prompts 32] [--generations 8] [--new-tokens 64] [--prompt-len 32]
                                   [--dtype float32|bfloat16] [--top 20]

Traces one compiled `Sampler` call at bench/sample.py's model shape (random weights in f32,
sampled at temperature 1; --generations 1 --temperature 0 is the greedy batch case;
--dtype bfloat16 samples with the sampler's bf16 copy of the weights, Sampler dtype) and
prints how long XLA:CPU's worker threads were busy in the prefill and the decode loop, in
each part of a decode step (attention, its KV-cache reads and writes, MLP, LM head,
sampling; matmuls and the rest, from the named scopes in engine/models/transformer.py),
and the costliest operations with their shapes. Writes bench/results/profile_sample.json.
Busy time is summed over the threads, so it can exceed the wall time.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time

import numpy as np

from bench import REPO, finish, load_line, machine, xla_busy
from bench.sample import SHAPE


def _part(op_name: str) -> str:
    """The part of the sampler an op belongs to, from its JAX op name."""
    phase = "decode" if "/while/body/" in op_name else "prefill"
    kind = "matmul" if op_name.endswith("dot_general") else "other"
    if "dynamic_update_slice" in op_name:
        return f"{phase} KV-cache write"
    for scope in ("attention", "mlp", "lm_head"):
        if re.search(rf"[/(]{scope}[/)]", op_name):
            return f"{phase} {scope} {kind}"
    return f"{phase} sampling, embedding, rest"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the sampler's dtype (Sampler dtype): bfloat16 samples with a bf16 copy of the weights",
    )
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    info = machine()

    import jax
    from flax import nnx

    from engine.inference.sample import Sampler
    from engine.models.config import ModelConfig
    from engine.models.transformer import Transformer

    cfg = ModelConfig(**SHAPE, init_std=0.2)
    params = jax.jit(lambda: nnx.to_pure_dict(nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1]))()
    prompts = (
        np.random.default_rng(0).integers(1, SHAPE["vocab_size"], (args.prompts, args.prompt_len)).astype(np.int32)
    )
    sampler = Sampler(cfg, dtype=args.dtype)

    def call():
        return sampler(
            params,
            prompts,
            np.ones_like(prompts),
            max_new_tokens=args.new_tokens,
            num_generations=args.generations,
            temperature=args.temperature,
        )

    call()  # compile
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    (fn,) = sampler._compiled.values()
    hlo = fn.lower(params, *fn_args(sampler, prompts, args)).compile().as_text()
    ops, busy = xla_busy(hlo, call)
    total = sum(busy.values()) or 1
    by_part = collections.Counter()
    for name, ns in busy.items():
        by_part[_part(ops[name][1])] += ns
    info = finish(info)

    rows = args.prompts * args.generations
    print(
        f"{rows} rows x {args.new_tokens} tokens in {seconds:.2f} s "
        f"({rows * args.new_tokens / seconds:,.0f} tokens/s); "
        f"XLA's threads were busy {total / 1e6:,.0f} ms"
    )
    print(f"\n{'part':<40} {'busy ms':>8} {'share':>6}")
    for name, ns in by_part.most_common():
        print(f"{name:<40} {ns / 1e6:>8.0f} {ns / total:>6.1%}")
    print(f"\n{'ms':>8} {'share':>6}  {'result':<30} {'part':<36} operation")
    top = []
    for name, ns in busy.most_common(args.top):
        shape, op = ops[name]
        top.append({"op": name, "ms": ns / 1e6, "shape": shape, "part": _part(op), "source": op})
        print(f"{ns / 1e6:>8.1f} {ns / total:>6.1%}  {shape[:30]:<30} {_part(op):<36} {op.split('/')[-1][:30]}")
    print(load_line(info))
    out = REPO / "bench" / "results" / "profile_sample.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python -m bench.profile_sample",
                "machine": info,
                "args": vars(args),
                "seconds": seconds,
                "busy_ms": total / 1e6,
                "parts_ms": {k: v / 1e6 for k, v in by_part.items()},
                "top_ops": top,
                "jax": jax.__version__,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out.relative_to(REPO)}")


def fn_args(sampler, prompts: np.ndarray, args) -> tuple:
    """The arguments Sampler.__call__ passes its compiled function (prompt length in its bucket)."""
    import jax

    width = sampler._bucket(prompts.shape[1])
    tokens = np.pad(prompts, ((0, 0), (width - prompts.shape[1], 0)))
    mask = np.pad(np.ones_like(prompts), ((0, 0), (width - prompts.shape[1], 0)))
    return (
        tokens,
        mask,
        jax.random.key_data(jax.random.key(0)),
        np.float32(args.temperature),
        np.asarray([-1], np.int32),
        np.int32(0),
        np.int32(args.new_tokens),
    )


if __name__ == "__main__":
    main()
