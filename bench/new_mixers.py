"""FLOPs and compiled memory per token of issue 62's new sequence mixers against full attention,
at 4k-128k positions: one mixer layer's training step (forward and backward, every parameter's
gradient, a mean-square loss of its output), compiled by XLA for this host's CPU through
`jax.jit(...).lower(...).compile()`: memory is `memory_analysis()`'s temporaries plus arguments
and outputs (the parameters, the input, the gradients), per token of the one row, a compiled
figure, not a timing, so the load does not move it. FLOPs per token are counted from the spec,
6 x (its parameters' multiply-adds + its sequence-mixing ones, `mixing_macs`): a forward and a
backward of twice its work. XLA's `cost_analysis()` figure is kept beside it
(`xla_flops_per_token`), but it counts a loop's body once: the blocked attention and the
chunked scans are loops, so theirs does not grow with the length; the DeepSeek-V4, block-sparse
and QSA layers have none, so theirs is the compiled program's: their indexers get no gradient,
and CSA's and QSA's training forms score more than the spec counts (CSA's attention every entry,
masked to the chosen ones; QSA's indexer the block starting at every key).

Each mixer kind is one entry of MIXERS (its spec at a ~1B model's width, d = 2048): grouped-
query attention (16 heads over 4 KV heads of 128, the engine's blocked attention on CPU), the
Mamba1 selective scan (engine/models/mamba1.py: inner 4096, state 16, dt rank 128, chunks of
64), Mamba2 for reference (32 heads of 128, state 128, chunks of 256), LFM2's gated short
convolution (3 taps), RecurrentGemma's RG-LRU (width 2048, 16 gate blocks, 4 taps), MiniMax's
lightning attention (16 heads of 128, chunks of 256), DeepSeek-V4's attention
(compressed_attention.py) as DeepSeek-V4-Flash's but 16 heads of 128 (one shared key-value
head, its last 64 dimensions rotary, a 1024-wide query latent, 4 output groups of 512, a 128-position
window) in its three layer kinds: the window alone (v4_window), HCA's entries of 128
positions (v4_hca), CSA's of 4 with the published indexer (64 heads of 128, top 512; v4_csa);
MiniMax-M3's block-sparse attention (block_sparse.py: the attention above with its published
indexer, 4 heads of 128 choosing 16 blocks of 128 beside the query's own) and Qwen4-Exp's QSA
(qsa.py: the attention above with an indexer of 16 heads of 128 choosing 2048 keys in blocks of
4; no published size is known). A group adding a mixer adds its entry. DeepSeek Sparse
Attention is measured by bench/long_context.py (`--part dsa`), sparse against dense-masked.

The block-sparse and QSA layers train by computing every score and masking the attention, and
CSA masks the attention over all its entries (its indexer scoring every entry): their compiled
memory per token grows with the length, as O(t x s) score matrices do. A length that XLA
refuses to compile is recorded as a row with its error.

    python -m bench.new_mixers [--lengths 4096 16384 65536 131072] [--mixers attention mamba1]
    python -m bench.new_mixers --tiny      # a dry run at 256 and 512 positions, writes nothing

Prints a table and writes bench/results/new_mixers.json (not with --tiny).
"""

from __future__ import annotations

import argparse
import json
import time

from bench import REPO, finish, machine

WIDTH = 2048
LENGTHS = (4096, 16384, 65536, 131072)


def mixers() -> dict:
    """Mixer name -> its spec (engine/models/specs.py), built by transformer.MIXERS."""
    from engine.models.specs import (
        AttentionSpec,
        BlockIndexerSpec,
        CompressedAttentionSpec,
        LightningSpec,
        Mamba1Spec,
        Mamba2Spec,
        QSAIndexerSpec,
        RGLRUSpec,
        RotarySpec,
        ShortConvSpec,
    )

    attention = AttentionSpec(num_heads=16, num_kv_heads=4, head_dim=128, rope=RotarySpec())
    deepseek_v4 = CompressedAttentionSpec(  # DeepSeek-V4-Flash's attention at this width (16 heads, not 64 of 512)
        num_heads=16,
        head_dim=128,
        rope_head_dim=64,
        q_lora_rank=1024,
        out_groups=4,
        out_rank=512,
        window=128,
        index_topk=512,
        index_heads=64,
        index_head_dim=128,
    )
    return {
        "attention": attention,
        "mamba1": Mamba1Spec(inner=4096, state_size=16, dt_rank=128, chunk_size=64),
        "mamba2": Mamba2Spec(num_heads=32, head_dim=128, state_size=128, n_groups=1, chunk_size=256),
        "short_conv": ShortConvSpec(width=2048, conv_kernel=3),
        "rglru": RGLRUSpec(width=2048, num_heads=16, conv_kernel=4),
        "lightning": LightningSpec(num_heads=16, head_dim=128, chunk_size=256),
        "v4_window": deepseek_v4,
        "v4_hca": deepseek_v4.model_copy(update={"compress_ratio": 128}),
        "v4_csa": deepseek_v4.model_copy(update={"compress_ratio": 4, "sparse": True}),
        "block_sparse": attention.model_copy(
            update={"block_indexer": BlockIndexerSpec(heads=4, head_dim=128, block=128, topk_blocks=16)}
        ),
        "qsa": attention.model_copy(
            update={"qsa_indexer": QSAIndexerSpec(heads=16, head_dim=128, budget=2048, block=4)}
        ),
    }


def compiled_step(spec, length: int, width: int):
    """The compiled training step of one mixer layer of `spec` over (1, length, width)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from engine.models.common import Build
    from engine.models.config import ComputeConfig
    from engine.models.transformer import MIXERS

    module = MIXERS[spec.kind](spec, Build(width, ComputeConfig()), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(module)
    positions = jnp.arange(length, dtype=jnp.int32)[None]

    def loss(params, x):
        out = nnx.merge(graphdef, params)(x, positions, None, spec)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    x = jax.ShapeDtypeStruct((1, length, width), jnp.float32)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    return jax.jit(jax.value_and_grad(loss)).lower(abstract, x).compile()


def measure(name: str, spec, length: int, width: int) -> dict:
    started = time.perf_counter()
    compiled = compiled_step(spec, length, width)
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # a list of one per program in older jax
    total = memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
    return {
        "mixer": name,
        "positions": length,
        "flops_per_token": 6 * (spec.params(width) + spec.mixing_macs(length)),
        "bytes_per_token": round(total / length),
        "temp_bytes_per_token": round(memory.temp_size_in_bytes / length),
        "mixing_macs_per_token": spec.mixing_macs(length),
        "xla_flops_per_token": round(cost["flops"] / length),
        "params": spec.params(width),
        "compile_seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--mixers", nargs="+", default=None)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    specs = mixers()
    names = args.mixers or list(specs)
    lengths, width = ([256, 512], 256) if args.tiny else (args.lengths, WIDTH)
    info = machine()
    rows = []
    print(f"{'mixer':<12}{'positions':>10}{'GFLOP/token':>14}{'MiB/token':>12}{'temp MiB/token':>16}")
    for name in names:
        for length in lengths:
            try:
                row = measure(name, specs[name], length, width)
            except Exception as error:  # XLA refusing a program (its memory or a size limit): a row that says so
                rows.append({"mixer": name, "positions": length, "error": f"{type(error).__name__}: {error}"[:500]})
                print(f"{name:<12}{length:>10}  not compiled: {rows[-1]['error']}", flush=True)
                continue
            rows.append(row)
            print(
                f"{name:<12}{length:>10}{row['flops_per_token'] / 1e9:>14.4f}"
                f"{row['bytes_per_token'] / 2**20:>12.4f}{row['temp_bytes_per_token'] / 2**20:>16.4f}",
                flush=True,
            )
    if args.tiny:
        return
    out = REPO / "bench" / "results" / "new_mixers.json"
    old = json.loads(out.read_text())["rows"] if out.exists() else []
    keys = {(row["mixer"], row["positions"]) for row in rows}
    kept = [row for row in old if (row["mixer"], row["positions"]) not in keys]
    result = {"width": width, "rows": kept + rows, "machine": finish(info, settle=0)}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
