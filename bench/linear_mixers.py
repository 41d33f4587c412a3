"""The chunked training forms of engine/ops/gated_delta.py and engine/ops/ssd.py against their
per-token lax.scan reference: seconds per training step (forward + backward of the whole mixer,
all parameters' gradients) at t = 1024 on CPU, and the ratio scan / chunked.

Shapes (one layer, batch 2, float32): a Gated DeltaNet of Qwen3-Next's proportions at a
smaller width (d 256, 2 key heads / 4 value heads, key and value head dim 64, conv kernel 4,
chunk 64) and a Mamba2 layer (d 256, 8 heads of dim 64, 1 group, state 64, chunk 64). Each
run is a fresh process that compiles one form and times `--steps` steps after one warm-up
step; chunked and scan runs alternate (A B A B, bench/__init__.py) and the table gives the
median and spread.

    python -m bench.linear_mixers [--seq 1024] [--steps 5] [--repeats 3]
    python -m bench.linear_mixers --tiny      # a dry run on a toy shape (seconds), writes nothing

Prints a table and writes bench/results/linear_mixers.json (not with --tiny).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench import REPO, alternate, finish, load_line, machine, summary

BATCH = 2
DELTA = dict(num_key_heads=2, num_value_heads=4, key_head_dim=64, value_head_dim=64, conv_kernel=4)
MAMBA = dict(num_heads=8, head_dim=64, state_size=64, n_groups=1, conv_kernel=4)
WIDTH, CHUNK = 256, 64
TINY_DELTA = dict(num_key_heads=1, num_value_heads=2, key_head_dim=8, value_head_dim=8, conv_kernel=4)
TINY_MAMBA = dict(num_heads=2, head_dim=8, state_size=8, n_groups=1, conv_kernel=4)
TINY_WIDTH, TINY_CHUNK = 16, 8


def random_params(shapes: dict[str, tuple[int, ...]], seed: int) -> dict:
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), len(shapes))
    params = {
        name: 0.05 * jax.random.normal(key, shape, jnp.float32)
        for key, (name, shape) in zip(keys, shapes.items(), strict=True)
    }
    for name in ("norm", "d"):
        if name in params:
            params[name] = params[name] + 1.0
    return params


def step_fn(mixer: str, form: str, tiny: bool):
    """(jitted training step, params, x): the loss is the mean square of the mixer's output."""
    import jax
    import jax.numpy as jnp

    from engine.ops import gated_delta, ssd

    width, chunk = (TINY_WIDTH, TINY_CHUNK) if tiny else (WIDTH, CHUNK)
    if mixer == "gated_delta":
        dims = gated_delta.GatedDeltaDims(**(TINY_DELTA if tiny else DELTA))
        hv, inner = dims.num_value_heads, dims.num_value_heads * dims.value_head_dim
        shapes = {
            "w_qkv": (width, dims.conv_channels),
            "w_z": (width, inner),
            "w_b": (width, hv),
            "w_a": (width, hv),
            "conv_kc": (dims.conv_kernel, dims.conv_channels),
            "a_log": (hv,),
            "dt_bias": (hv,),
            "norm": (dims.value_head_dim,),
            "w_out": (inner, width),
        }

        def forward(params, x):
            return gated_delta.gated_deltanet(params, x, dims, form=form, chunk_size=chunk)[0]
    else:
        mdims = ssd.Mamba2Dims(**(TINY_MAMBA if tiny else MAMBA))
        shapes = {
            "w_in": (width, mdims.inner + mdims.conv_channels + mdims.num_heads),
            "conv_kc": (mdims.conv_kernel, mdims.conv_channels),
            "dt_bias": (mdims.num_heads,),
            "a_log": (mdims.num_heads,),
            "d": (mdims.num_heads,),
            "norm": (mdims.inner,),
            "w_out": (mdims.inner, width),
        }

        def forward(params, x):
            return ssd.mamba2_mixer(params, x, mdims, form=form, chunk_size=chunk)[0]

    def loss(params, x):
        return jnp.mean(forward(params, x) ** 2)

    return jax.jit(jax.value_and_grad(loss)), random_params(shapes, seed=0), width


def worker(mixer: str, form: str, seq: int, steps: int, tiny: bool) -> dict:
    """Compile one form and time `steps` training steps after a warm-up."""
    sys.path.insert(0, str(REPO))
    import jax

    train_step, params, width = step_fn(mixer, form, tiny)
    x = jax.random.normal(jax.random.key(1), (BATCH, seq, width))
    started = time.perf_counter()
    loss, _ = jax.block_until_ready(train_step(params, x))
    compile_seconds = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(steps):
        loss, grads = jax.block_until_ready(train_step(params, x))
    assert all(bool(jax.numpy.isfinite(g).all()) for g in jax.tree.leaves(grads))
    return {
        "seconds_per_step": (time.perf_counter() - started) / steps,
        "compile_seconds": compile_seconds,
        "loss": float(loss),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a dry run on a toy shape; writes nothing")
    parser.add_argument("--worker", nargs=2, metavar=("MIXER", "FORM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, seq=args.seq, steps=args.steps, tiny=args.tiny)))
        return
    seq, steps, repeats = (37, 1, 1) if args.tiny else (args.seq, args.steps, args.repeats)
    info = machine()
    common = ["--seq", str(seq), "--steps", str(steps)] + (["--tiny"] if args.tiny else [])
    results: dict = {}
    for mixer in ("gated_delta", "mamba2"):
        runs = alternate(
            {form: ["bench.linear_mixers", "--worker", mixer, form, *common] for form in ("chunked", "scan")}, repeats
        )
        timings = {form: summary([run["seconds_per_step"] for run in runs[form]]) for form in runs}
        results[mixer] = {
            **timings,
            "compile_seconds": {form: [run["compile_seconds"] for run in runs[form]] for form in runs},
            "scan_over_chunked": timings["scan"]["median"] / timings["chunked"]["median"],
        }
    info = finish(info, settle=0 if args.tiny else 120)
    print(f"training step, batch {BATCH} x t {seq}, float32, CPU; {load_line(info)}")
    print(f"{'mixer':<12} {'chunked s/step':>15} {'scan s/step':>12} {'scan / chunked':>15}")
    for mixer, row in results.items():
        print(
            f"{mixer:<12} {row['chunked']['median']:>15.4f} {row['scan']['median']:>12.4f} "
            f"{row['scan_over_chunked']:>15.1f}"
        )
    if args.tiny:
        return
    shapes = {"batch": BATCH, "seq": seq, "width": WIDTH, "chunk": CHUNK, "gated_delta": DELTA, "mamba2": MAMBA}
    out = {
        "what": "seconds per training step (value_and_grad of the mixer), chunked form vs per-token lax.scan",
        "command": "python -m bench.linear_mixers " + " ".join(sys.argv[1:]),
        "shapes": shapes,
        "steps": steps,
        "repeats": repeats,
        "machine": info,
        "results": results,
    }
    path = Path(REPO, "bench", "results", "linear_mixers.json")
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
