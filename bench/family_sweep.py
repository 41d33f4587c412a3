"""Expert parallelism and GRPO on every family's tiny preset (issues 50 and 51).

EP: for each family with experts, one training step and then a second (after an SGD update
of the first step's gradients) on 8 simulated CPU devices, with the batch split over `data`
alone (expert=1) and with the experts split over `expert` = 2 and 4 (where the expert count
allows; the rest of the 8 devices split the batch): the loss, the router's balance loss, the
gradient norm and every gradient compared with the expert=1 run. Float32; the tokens reach
their experts by all-to-all (engine/models/moe_ep.py), so the experts' weight gradients sum
their rows in another order: equal to ~1e-6 relative, bitwise where the order is the same.

GRPO: for every family (dense ones too), a checkpoint of the tiny preset (vocabulary cut to
16: the copy task's character tokenizer, tests/test_grpo.py) trained for two GRPO steps
(rollouts with the KV-cache / recurrent sampler, rewards, the policy update) on 8 devices of
`data`; for families with experts also on `data` 4 x `expert` 2, whose metrics are compared.

    python -m bench.family_sweep                     # both parts, every family
    python -m bench.family_sweep --part ep --families tiny-mixtral tiny-llama4

Prints a table per part and writes bench/results/family_sweep.json (merged with what an
earlier run of the other part wrote).
"""

from __future__ import annotations

import os

from engine import compat

# 8 simulated devices, compiled the cheap way as the test suite compiles (tests/conftest.py);
# on a loaded machine a device thread can miss XLA:CPU's 40 s collective rendezvous, which
# aborts the process, so the sweep waits longer.
FAST_COMPILE = " ".join(["--xla_backend_optimization_level=0", *compat.cpu_loop_emitter_flags()])
PATIENT = "--xla_cpu_collective_call_terminate_timeout_seconds=600"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE} {PATIENT}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import REPO  # noqa: E402
from bench.copy_task import write_copy_task  # noqa: E402

sys.path.insert(0, str(REPO))


from engine.config import load_config, resolve_model_preset  # noqa: E402
from engine.models.config import ComputeConfig, LoraConfig, ModelConfig  # noqa: E402
from engine.models.families import family_names  # noqa: E402
from engine.models.lora import join, split_adapter  # noqa: E402
from engine.models.params import graphdef_of, init_params, param_shardings  # noqa: E402
from engine.ops.partitioning import use_mesh  # noqa: E402
from engine.parallel.config import MeshConfig  # noqa: E402
from engine.parallel.mesh import batch_sharding, global_array, make_mesh  # noqa: E402
from engine.posttrain.config import GRPOConfig  # noqa: E402
from engine.posttrain.grpo import run_grpo  # noqa: E402
from engine.train.config import TrainConfig  # noqa: E402
from engine.train.plan import plan_step  # noqa: E402
from engine.train.step import lm_loss_fn  # noqa: E402
from engine.train.targets import get_target  # noqa: E402

RESULTS = REPO / "bench" / "results" / "family_sweep.json"

# name -> (preset, overrides). The families without a tiny preset of their own are a tiny
# preset of their architecture with the published variant's keys (as their tests build them).
GEMMA4_MOE = dict(
    num_experts=4,
    experts_per_token=2,
    expert_mlp_dim=24,
    moe_beside_mlp=True,
    router_input_norm=True,
    router_expert_scale=True,
)
NEMOTRON3_MOE = dict(
    ffn_pattern=["none", "moe"],
    num_experts=8,
    experts_per_token=2,
    expert_mlp_dim=32,
    router_score="sigmoid",
    router_bias=True,
    router_renormalize=True,
    router_scale=2.5,
    num_shared_experts=1,
    shared_expert_mlp_dim=48,
)
CASES: dict[str, tuple[str, dict]] = {
    # with experts
    "tiny-mixtral": ("tiny-mixtral", {"num_experts": 4}),  # 5 experts split over no expert axis > 1
    "tiny-qwen3-moe": ("tiny-qwen3-moe", {}),
    "tiny-qwen3-moe-mixed": ("tiny-qwen3-moe-mixed", {}),
    "tiny-gpt-oss": ("tiny-gpt-oss", {"num_experts": 4}),
    "tiny-deepseek-v3": ("tiny-deepseek-v3", {}),
    "tiny-deepseek-v2": ("tiny-deepseek-v2", {}),
    "tiny-deepseek-v3.2": ("tiny-deepseek-v3.2", {}),
    "tiny-kimi-k2": ("tiny-kimi-k2", {}),
    "tiny-glm4-moe": ("tiny-glm4-moe", {}),
    "tiny-glm-5": ("tiny-glm-5", {}),
    "tiny-minimax-m2": ("tiny-minimax-m2", {}),
    "tiny-llama4": ("tiny-llama4", {}),
    "tiny-gemma4-moe": ("tiny-gemma4", GEMMA4_MOE),
    "tiny-qwen3-next": ("tiny-qwen3-next", {}),
    "tiny-qwen3.5-moe": ("tiny-qwen3-next", {"family": "qwen3_5_moe", "gated_delta": {"fused_projections": False}}),
    "tiny-granite-hybrid-moe": ("tiny-granite-hybrid-moe", {}),
    "tiny-nemotron-3-nano": ("tiny-nemotron-h", NEMOTRON3_MOE),
    "tiny-kimi-linear": ("tiny-kimi-linear", {}),
    # dense
    "tiny-gemma4": ("tiny-gemma4", {}),
    "tiny-olmo3": ("tiny-olmo3", {}),
    "tiny-olmo2": ("tiny-olmo3", {"family": "olmo2", "attention": {"pattern": ["global"], "sliding_window": None}}),
    "tiny-phi3": ("tiny", {"family": "phi3", "rotary_dim": 8}),
    "tiny-smollm3": ("tiny-smollm3", {}),
    "tiny-qwen3.5": (
        "tiny-qwen3-next",
        {
            "family": "qwen3_5",
            "gated_delta": {"fused_projections": False},
            "moe": None,  # the preset's section (flat keys read into sections as a preset loads)
        },
    ),
    "tiny-granite-hybrid": ("tiny-granite-hybrid", {}),
    "tiny-nemotron-h": ("tiny-nemotron-h", {}),
    "tiny-falcon-h1": ("tiny-falcon-h1", {}),
}
# Every other registered family: its own tiny preset, configs/models/tiny-<family>.yaml (Llama's
# is `tiny`, Ling 3's `tiny-ling-3`), as the sweep runs it by name; a family with none is an
# error here, not a row left out.
OWN_PRESET = {"llama": "tiny", "bailing_hybrid": "tiny-ling-3"}


def _add_own_presets() -> None:
    covered = {model_config(name).family for name in CASES}
    for family in family_names():
        if family not in covered:
            name = OWN_PRESET.get(family, "tiny-" + family.replace("_", "-"))
            CASES[name] = (name, {})


def model_config(name: str, **extra) -> ModelConfig:
    preset, overrides = CASES[name]
    tree = dict(resolve_model_preset({"model": preset}, preset)["model"])
    tree.pop("compute", None)
    for key, value in {**overrides, **extra}.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            tree[key] = {**tree[key], **value}
        elif value is None:
            tree.pop(key, None)
        else:
            tree[key] = value
    return ModelConfig.model_validate(tree)


_add_own_presets()


# --------------------------------------------------------------------------- expert parallelism

ROWS, SEQ = 8, 12


def ep_batch(vocab: int) -> dict:
    """Tokens below `vocab`: the LM head's rows where it has fewer than the embedding (Apertus
    1.5), so that every target is one the head predicts."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (ROWS, SEQ))
    segments = np.ones((ROWS, SEQ), np.int32)
    segments[3, 7:] = 0  # a right-padded row: out of the loss and the router's statistics
    return {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(SEQ), (ROWS, SEQ)),
        "segment_ids": segments,
        "targets": np.roll(tokens, -1, 1),
        "loss_mask": segments.astype(np.float32),
    }


def host_params(cfg: ModelConfig, compute: ComputeConfig) -> dict:
    """The model's own initialisation with the routers scaled x20, so that routing is decided by
    margins far above float32 rounding (at init scale some tokens' top-k is nearly a tie)."""
    params = jax.device_get(init_params(cfg, compute, make_mesh(MeshConfig(data=1), jax.devices()[:1]), 0))

    def scale(path, x):
        return x * 20 if "w_router" in jax.tree_util.keystr(path) else x

    return jax.tree_util.tree_map_with_path(scale, params)


def two_steps(cfg, compute, params_host, batch, mesh, lr: float = 0.05):
    """[(loss, balance, grad_norm, grads)] of two steps (SGD between them) on `mesh`."""
    step = jax.jit(jax.value_and_grad(lm_loss_fn(graphdef_of(cfg, compute)), has_aux=True))
    shardings = param_shardings(cfg, compute, mesh)[1]
    params = jax.device_put(params_host, shardings)
    sharded = {k: global_array(v, batch_sharding(mesh)) for k, v in batch.items()}
    denominator = float(np.sum(batch["loss_mask"]))
    out = []
    with use_mesh(mesh):
        compiled = step.lower(params, sharded, denominator).compile()
        all_to_all = "all-to-all" in compiled.as_text()
        for _ in range(2):
            (loss, aux), grads = compiled(params, sharded, denominator)
            norm = float(jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))))
            out.append((float(loss), float(aux.get("moe_balance_loss", np.nan)), norm, jax.device_get(grads)))
            # back to the parameters' layout (with a tensor axis some gradients come out in another)
            params = jax.device_put(jax.tree.map(lambda p, g: p - lr * g, params, grads), shardings)
    return out, all_to_all


def compare(base, other) -> list[dict]:
    """Per step, the relative differences of `other` to `base`: loss, balance loss, gradient
    norm, and the largest of every gradient's max |difference| over its max |entry| (floored at
    1e-3 of the largest entry of all gradients: a gradient that is analytically zero, such as
    the last Gemma 4 layer's layer_scale under the final norm, is all rounding), with its name."""
    out = []
    for (l0, b0, n0, g0), (l1, b1, n1, g1) in zip(base, other, strict=True):
        leaves = jax.tree_util.tree_leaves_with_path(g0)
        top_all = max(float(np.abs(np.asarray(a)).max()) for _, a in leaves)
        worst, worst_name, bitwise = 0.0, "", l0 == l1
        for (path, a), b in zip(leaves, jax.tree.leaves(g1), strict=True):
            a, b = np.asarray(a), np.asarray(b)
            bitwise &= bool(np.array_equal(a, b))
            rel = float(np.abs(a - b).max()) / max(float(np.abs(a).max()), 1e-3 * top_all)
            if rel > worst:
                worst, worst_name = rel, jax.tree_util.keystr(path)
        out.append(
            {
                "loss_rel": abs(l1 - l0) / abs(l0),
                "balance_rel": 0.0 if math.isnan(b0) else abs(b1 - b0) / abs(b0),
                "grad_norm_rel": abs(n1 - n0) / n0,
                "grad_rel": worst,
                "worst_gradient": worst_name,
                "bitwise": bool(bitwise),
            }
        )
    return out


# Relative; float32 sums in another order (tests/test_moe.py's gradient tolerance). The second
# step starts from parameters the first step's rounding already moved apart, so it gets 10x.
EP_TOLERANCE = (1e-5, 1e-4)


def run_ep(name: str, dispatch: str) -> dict:
    cfg = model_config(name)
    compute = ComputeConfig(dtype="float32", moe_dispatch=dispatch, moe_capacity_factor=float(cfg.moe.num_experts))
    params = host_params(cfg, compute)
    batch = ep_batch(cfg.head.vocab_size or cfg.vocab_size)
    base, _ = two_steps(cfg, compute, params, batch, make_mesh(MeshConfig(data=8)))
    record = {
        "num_experts": cfg.moe.num_experts,
        "experts_per_token": cfg.moe.experts_per_token,
        "loss": [s[0] for s in base],
        "grad_norm": [s[2] for s in base],
    }
    meshes = {"fsdp=2 (control, no expert axis)": MeshConfig(data=4, fsdp=2)}
    meshes.update({f"expert={n}": MeshConfig(data=8 // n, expert=n) for n in (2, 4)})
    for label, mesh_config in meshes.items():
        if cfg.moe.num_experts % mesh_config.expert:
            record[label] = "not run: the experts do not split evenly"
            continue
        start = time.perf_counter()
        steps, all_to_all = two_steps(cfg, compute, params, batch, make_mesh(mesh_config))
        per_step = compare(base, steps)
        worst = [max(d["loss_rel"], d["balance_rel"], d["grad_norm_rel"], d["grad_rel"]) for d in per_step]
        record[label] = {
            "steps": per_step,
            "all_to_all": all_to_all,
            "passed": bool(all(w <= t for w, t in zip(worst, EP_TOLERANCE)) and np.isfinite(base[0][0])),
            "seconds": round(time.perf_counter() - start, 1),
        }
    return record


# --------------------------------------------------------------------------- GRPO

GRPO_VOCAB = 16


def grpo_task(name: str, out: Path) -> Path:
    """tests/test_grpo.py's copy task (bench/copy_task.py) over a checkpoint of the family's
    tiny preset, initialised by the model's own initialiser (jitted)."""
    # the copy task's 16 tokens, the LM head's too (a head narrower than the embedding, Apertus
    # 1.5's, would not predict them all)
    cfg = model_config(name, vocab_size=GRPO_VOCAB, max_seq_len=16, head={"vocab_size": None})
    params = jax.device_get(init_params(cfg, ComputeConfig(), make_mesh(MeshConfig(data=1), jax.devices()[:1]), 0))
    return write_copy_task(out, cfg, params)


def grpo_config(task: Path, out: Path, **overrides) -> GRPOConfig:
    tree = {
        "checkpoint": {
            "init_from": str(task / "checkpoint"),
            "directory": str(out / "checkpoint"),
            "async_save": False,
        },
        "data": {"path": str(task / "prompts.jsonl")},
        "rewards": [{"function": "exact_match", "kwargs": {"pattern": r"^(\d)"}}],
        "optimizer": {"learning_rate": 2e-2},
        "max_prompt_length": 2,
        "max_completion_length": 2,
        "progress": False,
        "metrics_dir": str(out),
    }
    return load_config(tree=tree, overrides=[f"{k}={v}" for k, v in overrides.items()], schema=GRPOConfig)


def grpo_metrics(out: Path) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    skip = ("_seconds", "tokens_per_second", "tflops_per_device", "mfu")
    return [{k: v for k, v in r.items() if isinstance(v, float) and not k.endswith(skip)} for r in records]


# Left out of the data / expert comparison: rollout_corr/rollout_is_std is sqrt(E[x^2] - E[x]^2)
# in float32 (engine/posttrain/rollout_correction.py), so for ratios within 2e-7 of 1 it is the
# square root of rounding, up to ~3e-4 on either mesh (measured on tiny-deepseek-v3's data run).
NOISE = {"rollout_corr/rollout_is_std"}


def run_grpo_case(name: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        task = grpo_task(name, Path(tmp) / "task")
        meshes = {"data": {"mesh.data": 8}}
        if model_config(name).moe.num_experts:
            meshes["expert"] = {"mesh.data": 4, "mesh.expert": 2}
        runs = {}
        for mesh_name, mesh in meshes.items():
            out = Path(tmp) / mesh_name
            start = time.perf_counter()
            overrides = {"steps": 2, "prompts_per_step": 2, "num_generations": 4, **mesh}
            result = run_grpo(grpo_config(task, out, **overrides))
            runs[mesh_name] = grpo_metrics(out)
            runs[mesh_name + "_seconds"] = round(time.perf_counter() - start, 1)
            runs[mesh_name + "_steps"] = result["steps"]
        record = {
            "steps": runs["data_steps"],
            "loss": [r["loss"] for r in runs["data"]],
            "grad_norm": [r["grad_norm"] for r in runs["data"]],
            "reward": [r["reward"] for r in runs["data"]],
            "finite": all(math.isfinite(v) for r in runs["data"] for v in r.values()),
        }
        if "expert" in runs:  # relative where a metric is not ~0, else absolute (rounding-noise metrics)
            rel, absolute = {}, {}
            for a, b in zip(runs["data"], runs["expert"], strict=True):
                for key in a.keys() - NOISE:
                    if abs(a[key]) >= 1e-3:
                        rel[key] = max(rel.get(key, 0.0), abs(b[key] - a[key]) / abs(a[key]))
                    else:
                        absolute[key] = max(absolute.get(key, 0.0), abs(b[key] - a[key]))
            worst_rel, worst_abs = max(rel, key=rel.get), max(absolute, key=absolute.get, default=None)
            record["expert=2"] = {
                "max_rel": rel[worst_rel],
                "max_rel_metric": worst_rel,
                "max_abs_of_small": absolute.get(worst_abs, 0.0),
                "max_abs_metric": worst_abs,
            }
        ep = record.get("expert=2", {"max_rel": 0.0, "max_abs_of_small": 0.0})
        record["passed"] = (
            record["finite"] and record["steps"] == 2 and ep["max_rel"] <= 1e-4 and ep["max_abs_of_small"] <= 1e-5
        )
        return record


# --------------------------------------------------------------------------- LoRA and the plan

LORA = LoraConfig(rank=2, alpha=4.0, target_modules="all-linear")


def run_lora_plan(name: str, plan: bool = True) -> dict:
    """LoRA: the projections `all-linear` adapts in the family (or the sentence refusing it),
    and three steps of the adapter alone on one CPU device (float32, the EP batch), each of
    L2 length 0.1 down its gradient (plain SGD at one learning rate overshoots some families
    and moves others below float32's resolution of the loss): every adapter's B gets a
    gradient (B starts at zero, so a B without one is an adapter the forward does not read),
    the loss finite and lower after the steps. Plan: the training step (with that adapter
    where the family takes one) compiled for a v5e-8 slice by libtpu, as `trainflow plan`
    compiles it; `plan=False` leaves it out (the record's plan is kept)."""
    cfg = model_config(name)
    record: dict = {}
    try:
        targets = LORA.targets(cfg)
    except ValueError as refusal:
        record["lora"] = {"refused": str(refusal)}
        targets = None
    if targets:
        compute = ComputeConfig(dtype="float32")
        params = init_params(cfg, compute, make_mesh(MeshConfig(data=1), jax.devices()[:1]), 0, lora=LORA)
        adapter, base = split_adapter(jax.device_get(params))
        loss_fn = lm_loss_fn(graphdef_of(cfg, compute, LORA))
        batch = {k: jnp.asarray(v) for k, v in ep_batch(cfg.head.vocab_size or cfg.vocab_size).items()}
        denominator = float(np.sum(batch["loss_mask"]))
        # the frozen base an argument, as the trainer passes it (not constants folded in)
        step = jax.jit(jax.value_and_grad(lambda a, b: loss_fn(join(a, b), batch, denominator)[0]))
        base = jax.tree.map(jnp.asarray, base)
        losses, unread = [], []
        for i in range(3):
            loss, grads = step(adapter, base)
            losses.append(float(loss))
            if i == 0:
                named = [(jax.tree_util.keystr(p), g) for p, g in jax.tree_util.tree_leaves_with_path(grads)]
                unread = [key for key, g in named if "_lora_b" in key and not jnp.any(g)]
            length = 0.1 / jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
            adapter = jax.tree.map(lambda a, g, s=length: a - s * g, adapter, grads)
        losses.append(float(step(adapter, base)[0]))
        record["lora"] = {
            "targets": list(targets),
            "adapter_params": int(sum(np.size(a) for a in jax.tree.leaves(adapter))),
            "loss": losses,
            "b_without_gradient": unread,
            "passed": bool(np.all(np.isfinite(losses)) and losses[-1] < losses[0] and not unread),
        }
    if not plan:
        return record
    tree = {"model": cfg.model_dump(mode="json"), "data": {"seq_len": 32, "batch_size": 8}, "steps": 1}
    if targets:
        tree["lora"] = LORA.model_dump(mode="json")
    start = time.perf_counter()
    compiled = plan_step(load_config(tree=tree, schema=TrainConfig), get_target("v5e-8"))
    record["plan"] = {
        "target": "v5e-8",
        "how": compiled.how,
        "fits": bool(compiled.fits),
        "with_lora": bool(targets),
        "seconds": round(time.perf_counter() - start, 1),
    }
    record["passed"] = compiled.how == "compiled" and compiled.fits and record["lora"].get("passed", True)
    return record


# --------------------------------------------------------------------------- main


def table(results: dict) -> str:
    """One line per family: each EP mesh's worst relative difference over the two steps
    (- where not run), GRPO's outcome, LoRA's (refused: the family takes no adapter) and the
    v5e-8 plan's."""

    def ep_cell(record) -> str:
        if not isinstance(record, dict):
            return "-"
        worst = max(max(d["loss_rel"], d["balance_rel"], d["grad_norm_rel"], d["grad_rel"]) for d in record["steps"])
        return f"{worst:.1e}{'' if record['passed'] else ' FAIL'}"

    def grpo_cell(record) -> str:
        if record is None:
            return "-"
        if "error" in record:
            return "error"
        outcome = "ok" if record["passed"] else "FAIL"
        return f"{outcome} {record['expert=2']['max_rel']:.1e}" if "expert=2" in record else outcome

    def lora_cell(record) -> str:
        if record is None:
            return "-"
        if "error" in record:
            return "error"
        lora = record["lora"]
        if "error" in lora:
            return "error"
        return "refused" if "refused" in lora else ("ok" if lora["passed"] else "FAIL")

    def plan_cell(record) -> str:
        if record is None or "error" in record:
            return "-" if record is None else "error"
        return "ok" if record["plan"]["how"] == "compiled" and record["plan"]["fits"] else "FAIL"

    head = ["family", *[f"{d} {m}" for d in ("dropless", "capacity") for m in ("fsdp=2", "e=2", "e=4")], "grpo (e=2)"]
    head += ["lora", "plan v5e-8"]
    widths = [24] + [15] * (len(head) - 1)
    lines = ["  ".join(f"{h:>{w}}" for h, w in zip(head, widths, strict=True))]
    for name in CASES:
        ep = results["ep"].get(name, {})
        cells = [name]
        for dispatch in ("dropless", "capacity"):
            records = ep.get(dispatch, {})
            if "error" in records:
                cells += ["error"] * 3
                continue
            labels = ("fsdp=2 (control, no expert axis)", "expert=2", "expert=4")
            cells += [ep_cell(records.get(label)) for label in labels]
        cells.append(grpo_cell(results["grpo"].get(name)))
        cells += [lora_cell(results.get("lora_plan", {}).get(name)), plan_cell(results.get("lora_plan", {}).get(name))]
        lines.append("  ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["ep", "grpo", "lora_plan", "lora", "both", "all"], default="all")
    parser.add_argument("--families", nargs="*", default=list(CASES))
    parser.add_argument("--dispatch", nargs="*", default=["dropless", "capacity"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results.setdefault("ep", {})
    results.setdefault("grpo", {})
    results.setdefault("lora_plan", {})
    results["ep_tolerance"] = {"step 1": EP_TOLERANCE[0], "step 2": EP_TOLERANCE[1]}
    results["devices"] = f"{jax.device_count()} simulated {jax.devices()[0].platform} devices, jax {jax.__version__}"
    for name in args.families:
        if args.part in ("ep", "both", "all") and model_config(name).moe.num_experts:
            for dispatch in args.dispatch:
                try:
                    record = run_ep(name, dispatch)
                except Exception as error:  # noqa: BLE001 - a sweep records the failure and goes on
                    traceback.print_exc()
                    record = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
                results["ep"].setdefault(name, {})[dispatch] = record
                shown = {k: v for k, v in record.items() if k.startswith(("expert=", "fsdp", "error"))}
                print(name, dispatch, json.dumps(shown))
                args.out.write_text(json.dumps(results, indent=1) + "\n")
        if args.part in ("grpo", "both", "all"):
            try:
                record = run_grpo_case(name)
            except Exception as error:  # noqa: BLE001
                traceback.print_exc()
                record = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}", "passed": False}
            results["grpo"][name] = record
            print(name, "grpo", json.dumps(record))
            args.out.write_text(json.dumps(results, indent=1) + "\n")
        if args.part == "lora" and "plan" in results["lora_plan"].get(name, {}):  # again, the plan kept
            try:
                lora = run_lora_plan(name, plan=False)
            except Exception as error:  # noqa: BLE001
                traceback.print_exc()
                lora = {"lora": {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}}
            record = {**results["lora_plan"][name], **lora}
            record["passed"] = bool(record["plan"]["how"] == "compiled" and record["plan"]["fits"])
            record["passed"] &= record["lora"].get("passed", True)
            results["lora_plan"][name] = record
            print(name, "lora", json.dumps(record))
            args.out.write_text(json.dumps(results, indent=1) + "\n")
        if args.part in ("lora_plan", "all"):
            try:
                record = run_lora_plan(name)
            except Exception as error:  # noqa: BLE001
                traceback.print_exc()
                record = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}", "passed": False}
            results["lora_plan"][name] = record
            print(name, "lora_plan", json.dumps(record))
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
