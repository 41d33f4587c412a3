"""Long sequences are where linear attention pays: a Qwen3-Next-shaped model (three Gated
DeltaNet layers, then one gated attention layer) against the same model with every layer
gated full attention, at 4k, 32k and 128k positions.

    tpu   the training step compiled for a v5p-8 (4 chips) through libtpu on this host, as
          `trainflow plan` compiles it (engine.train.plan.plan_step): the qwen3-next-80b-a3b
          preset at a reduced depth (one repeating unit, 4 layers: its 48 layers' float32
          parameters and moments, 960 GB, fit no v5p-8) with its experts, float32 parameters
          and AdamW, bf16 compute, remat full, splash attention, fsdp over the 4 chips, one row
          per chip; layers not scanned (scan_layers false) so XLA's cost analysis counts every
          layer. Per chip: temporaries and total memory, each per token of the chip's row; the
          step's FLOPs per token: XLA's count of the compiled step (it counts a loop's body once
          and a Pallas kernel not at all: the gated delta rule's chunk loop is counted for one
          chunk, splash attention not), and the analytic count of the attention or delta-rule
          mixing (`mixing_flops_per_token`). Compile-time figures, not load-sensitive.
    dsa   DeepSeek Sparse Attention (engine/models/dsa.py), the same v5p-8 compile: the
          deepseek-v3.2 preset at DSA_LAYERS layers (its first layers, dense MLPs: the
          attention and its indexer are the published ones, 128 heads, top-k 2048, 64 indexer
          heads of 128), trained in the indexer's sparse phase (indexer_loss sparse), the
          dense-masked path (attention_impl reference: every score computed, then masked)
          against the sparse one (each query's 2048 selected latents gathered, chunks of
          queries in a lax.scan, whose body XLA's cost analysis counts once: the analytic
          `dsa_flops_per_token` counts every chunk).
    cpu   seconds per training step of one Gated DeltaNet layer, the chunked form against
          the per-token lax.scan reference (bench/linear_mixers.py's worker, its shapes) at
          a longer sequence; the machine's load is recorded (`uptime` before and after) and a
          ratio taken under load is marked not quotable.

    python -m bench.long_context [--part tpu dsa cpu] [--seq 4096 32768 131072] [--cpu-seq 4096]

Writes bench/results/long_context.json (after each row; the parts not rerun are kept).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import time
from pathlib import Path

import jax

from bench import REPO, alternate, finish, load_line, machine, summary
from engine.config import load_config
from engine.models.config import ModelConfig
from engine.train.config import TrainConfig
from engine.train.plan import plan_step
from engine.train.targets import GiB, get_target

OUT = REPO / "bench" / "results" / "long_context.json"
PRESET, LAYERS, CHIPS = "qwen3-next-80b-a3b", 4, 4
VARIANTS = {"hybrid": None, "full_attention": ["attention"]}
"""The model as published (the preset's mixer_pattern), or every layer gated attention."""
CHUNK = 64  # engine/models/gated_delta_block.py's chunk


def train_config(variant: str, seq_len: int) -> TrainConfig:
    model: dict = {"preset": PRESET, "num_layers": LAYERS, "max_seq_len": max(seq_len, 262144)}
    if VARIANTS[variant] is not None:
        model.update(mixer_pattern=VARIANTS[variant], gated_delta=None)
    tree = {
        "model": model,
        "mesh": {"data": 1, "fsdp": CHIPS},
        "data": {"seq_len": seq_len, "batch_size": CHIPS},
        "steps": 10,
        "compute": {"attention_impl": "splash", "scan_layers": False},
    }
    return load_config(tree=tree, schema=TrainConfig)


DSA_PRESET, DSA_LAYERS = "deepseek-v3.2", 1
DSA_VARIANTS = {"dense_masked": "reference", "sparse": "auto"}
"""attention_impl of each DSA variant: reference keeps the dense-masked path (mla.py: MLA._gathers)."""


def dsa_config(variant: str, seq_len: int) -> TrainConfig:
    tree = {
        "model": {"preset": DSA_PRESET, "num_layers": DSA_LAYERS, "max_seq_len": max(seq_len, 163840)},
        "mesh": {"data": 1, "fsdp": CHIPS},
        "data": {"seq_len": seq_len, "batch_size": CHIPS},
        "steps": 10,
        "compute": {"attention_impl": DSA_VARIANTS[variant], "scan_layers": False, "indexer_loss": "sparse"},
    }
    return load_config(tree=tree, schema=TrainConfig)


def dsa_flops_per_token(cfg: ModelConfig, variant: str, seq_len: int) -> dict:
    """Forward FLOPs per token (all layers; training is about 4x: backward 2, remat full 1) of
    the attention core, the indexer's selection and its KL. Dense-masked (mla.py: MLA._sparse
    over dot_product_attention): every score and value of all s keys, no causal skipping,
    q.k (h wide) and p.v (v zero-padded to h), the KL's target recomputed (q.k again); the
    indexer's g heads of i over all s keys. Sparse (dsa.sparse_attention): the indexer's
    scores of all s keys (selection only, no gradient), the key absorption (o x c per head),
    scores over the k selected latents and rotary keys (c + r), the weighted sum of latents (c),
    the value up-projection (c x w per head), and the KL's indexer scores of the k keys."""
    n, h, r, c, w = (
        cfg.attention.num_heads,
        cfg.attention.head_dim,
        cfg.mla.rope_head_dim,
        cfg.mla.kv_lora_rank,
        cfg.value_head_dim,
    )
    g, i, k, s = cfg.mla.index_heads, cfg.mla.index_head_dim, cfg.mla.index_topk, seq_len
    indexer = 2 * g * i * s + 2 * g * s
    if variant == "dense_masked":
        per_layer = {"attention": 2 * n * s * (2 * h) + 2 * n * s * h, "indexer": indexer}
    else:
        attention = 2 * n * (h - r) * c + 2 * n * k * (c + r) + 2 * n * k * c + 2 * n * c * w
        per_layer = {"attention": attention, "indexer": indexer + 2 * g * i * k + 2 * g * k}
    return {name: cfg.num_layers * v for name, v in per_layer.items()} | {
        "total": cfg.num_layers * sum(per_layer.values())
    }


def dsa_row(variant: str, seq_len: int) -> dict:
    started = time.perf_counter()
    cfg = dsa_config(variant, seq_len)
    plan = plan_step(cfg, get_target("v5p-8"))
    row = {
        "variant": variant,
        "seq_len": seq_len,
        "attention_impl": cfg.compute.attention_impl,
        "how": plan.how,
        "fits": plan.fits,
        **per_token(plan),
        "dsa_forward_flops_per_token": dsa_flops_per_token(cfg.model, variant, seq_len),
        "compile_seconds": time.perf_counter() - started,
    }
    if plan.compiler_message:
        row["compiler_message"] = plan.compiler_message
    return row


def per_token(plan) -> dict:
    """A compiled plan's per-chip memory (GiB), memory per token of a chip's rows (KiB) and
    XLA's FLOPs per token: the columns every row of this bench has."""
    m, tokens_per_chip = plan.memory, plan.tokens / plan.devices
    return {
        "tokens_per_chip": tokens_per_chip,
        "per_chip_gib": {
            "parameters": m.parameters / GiB,
            "optimizer_state": m.optimizer_state / GiB,
            "temporaries": m.temporaries / GiB,
            "total": m.total / GiB,
        },
        "temporaries_kib_per_token": m.temporaries / tokens_per_chip / 2**10,
        "total_kib_per_token": m.total / tokens_per_chip / 2**10,
        "xla_flops_per_token": plan.hardware_flops / plan.tokens,
        "flops_source": plan.flops_source,
    }


def mixing_flops_per_token(cfg: ModelConfig, seq_len: int) -> dict:
    """Training FLOPs per token (forward, backward = 2 forwards, remat full's forward again: x4)
    of the sequence mixing alone, all layers: attention's QK^T and PV over the causal half
    (2 x 2 x heads x head_dim x seq / 2 a layer, forward); the chunked delta rule per value head
    (forward): q.k^T and k.k^T within the chunk (2 x 2 x C x dk), the triangular solve's
    product with [v, k] (2 x C x (dv + dk)), the intra-chunk output (2 x C x dv), and the state
    read twice and written once (3 x 2 x dk x dv)."""
    kinds = [layer.mixer for layer in cfg.layer_pattern()]
    attention = 2 * cfg.attention.num_heads * cfg.attention.head_dim * seq_len  # 2 x 2 x h x d x t / 2
    g = train_config("hybrid", seq_len).model.gated_delta  # the hybrid's sizes (unused without its layers)
    delta = 0.0
    if g is not None:
        dk, dv, c = g.key_head_dim, g.value_head_dim, min(CHUNK, seq_len)
        delta = g.num_value_heads * (4 * c * dk + 2 * c * (dv + dk) + 2 * c * dv + 6 * dk * dv)
    per_forward = kinds.count("attention") * attention + kinds.count("gated_delta") * delta
    return {
        "attention_layers": kinds.count("attention"),
        "gated_delta_layers": kinds.count("gated_delta"),
        "training_flops_per_token": 4 * per_forward,
    }


def tpu_row(variant: str, seq_len: int) -> dict:
    started = time.perf_counter()
    cfg = train_config(variant, seq_len)
    plan = plan_step(cfg, get_target("v5p-8"))
    row = {
        "variant": variant,
        "seq_len": seq_len,
        "layers": [layer.mixer for layer in cfg.model.layer_pattern()],
        "how": plan.how,
        **per_token(plan),
        "analytic_model_flops_per_token": plan.model_flops / plan.tokens,
        "mixing": mixing_flops_per_token(cfg.model, seq_len),
        "compile_seconds": time.perf_counter() - started,
    }
    if plan.compiler_message:
        row["compiler_message"] = plan.compiler_message
    return row


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def cpu_part(seq_len: int, steps: int, repeats: int) -> dict:
    info, before = machine(), uptime()
    common = ["--seq", str(seq_len), "--steps", str(steps)]
    runs = alternate(
        {form: ["bench.linear_mixers", "--worker", "gated_delta", form, *common] for form in ("chunked", "scan")},
        repeats,
    )
    timings = {form: summary([run["seconds_per_step"] for run in runs[form]]) for form in runs}
    info = finish(info, settle=0)
    ratio = timings["scan"]["median"] / timings["chunked"]["median"]
    print(f"gated delta training step at t={seq_len}: scan / chunked {ratio:.2f}; {load_line(info)}", flush=True)
    return {
        "what": "seconds per training step of one Gated DeltaNet layer (bench/linear_mixers.py's shapes), "
        "chunked form vs the per-token lax.scan reference",
        "seq_len": seq_len,
        "steps": steps,
        "repeats": repeats,
        **timings,
        "scan_over_chunked": ratio,
        "quotable": info["comparable"],
        "uptime_before": before,
        "uptime_after": uptime(),
        "machine": info,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", nargs="+", default=["tpu", "cpu"])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--variant", nargs="+", default=list(VARIANTS))
    parser.add_argument("--cpu-seq", type=int, default=4096)
    parser.add_argument("--cpu-steps", type=int, default=3)
    parser.add_argument("--cpu-repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    def save(key: str, value) -> None:  # read again first: another part may run beside this one
        kept = json.loads(args.out.read_text()) if args.out.exists() else {}
        args.out.write_text(json.dumps({**kept, **out, key: value}, indent=1) + "\n")

    out: dict = {}
    out.update(
        what=__doc__.split("\n\n")[0],
        command="python -m bench.long_context",
        model={"preset": PRESET, "num_layers": LAYERS, "target": "v5p-8", "rows_per_chip": 1},
        versions={"jax": jax.__version__, "libtpu": importlib.metadata.version("libtpu")},
    )
    if "tpu" in args.part:
        previous = json.loads(args.out.read_text()).get("tpu", []) if args.out.exists() else []
        rows = {(r["variant"], r["seq_len"]): r for r in previous}
        for seq_len in args.seq:
            for variant in args.variant:
                row = rows[(variant, seq_len)] = tpu_row(variant, seq_len)
                print(
                    f"{variant:15s} t={seq_len:6d}: {row['how']}, "
                    f"total {row['per_chip_gib']['total']:.2f} GiB per chip, "
                    f"temporaries {row['temporaries_kib_per_token']:.1f} KiB per token; XLA FLOPs per token "
                    f"{row['xla_flops_per_token']:.4g}, mixing {row['mixing']['training_flops_per_token']:.4g} "
                    f"({row['compile_seconds']:.0f} s)",
                    flush=True,
                )
                save("tpu", sorted(rows.values(), key=lambda r: (r["seq_len"], r["variant"])))
    if "dsa" in args.part:
        dsa = json.loads(args.out.read_text()).get("dsa", {}) if args.out.exists() else {}
        rows = {(r["variant"], r["seq_len"]): r for r in dsa.get("rows", [])}
        for seq_len in args.seq:
            for variant in DSA_VARIANTS:
                row = rows[(variant, seq_len)] = dsa_row(variant, seq_len)
                print(
                    f"DSA {variant:12s} t={seq_len:6d}: {row['how']}, fits {row['fits']}, "
                    f"total {row['per_chip_gib']['total']:.2f} GiB per chip, "
                    f"temporaries {row['temporaries_kib_per_token']:.1f} KiB per token; XLA FLOPs per token "
                    f"{row['xla_flops_per_token']:.4g}, attention+indexer forward "
                    f"{row['dsa_forward_flops_per_token']['total']:.4g} ({row['compile_seconds']:.0f} s)",
                    flush=True,
                )
                model = {"preset": DSA_PRESET, "num_layers": DSA_LAYERS, "target": "v5p-8", "rows_per_chip": 1}
                rows_sorted = sorted(rows.values(), key=lambda r: (r["seq_len"], r["variant"]))
                save("dsa", {"model": model, "indexer_loss": "sparse", "rows": rows_sorted})
    if "cpu" in args.part:
        save("cpu", cpu_part(args.cpu_seq, args.cpu_steps, args.cpu_repeats))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
