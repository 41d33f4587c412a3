"""Where a training step's time must go on a TPU v5e, read off the compiled program (no chip).

    python -m bench.tpu_roofline --shapes qwen3-0.6b-2048 [--set loss_tiles=4 --set compute.remat=save_qkv_proj]

Compiles trainflow's step of a bench/tpu_v5e.py shape for a v5e-1 through libtpu on this host
(as `trainflow plan` does) and walks the optimized HLO: every operation the chip runs (each
fusion, copy, custom call at the top of the entry computation or of a loop body, times the
loop's trip count) gets a lower bound on its time, the larger of its FLOPs over the chip's
197 TFLOP/s and the bytes it reads and writes over its 819 GB/s. The sum is the step's
roofline: what a perfect schedule of this program would take. Matmul fusions (those with a
convolution or dot) and the rest are summed apart; the costliest memory-bound operations are
listed with the scope (op_name) they come from.

It is a model, not a measurement: Pallas kernels (splash attention, megablox) are custom calls
whose FLOPs XLA does not see, so they count their bytes alone; a fusion that reads a slice of
a stacked (layers, ...) buffer counts the slice; overlap of copies with compute is ignored.
Read it against bench/results/tpu-v5e.json's measured seconds. Appends to
bench/results/tpu-v5e-roofline.json.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import time
from pathlib import Path

from bench import REPO
from bench.tpu_v5e import commit

OUT = REPO / "bench" / "results" / "tpu-v5e-roofline.json"
PEAK_FLOPS, HBM_BYTES_PER_S = 197e12, 819e9  # TPU v5e data sheet: bf16 dense, HBM bandwidth
ITEM = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2}
ITEM |= {"s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
SHAPE = re.compile(r"\b(" + "|".join(ITEM) + r")\[([\d,]*)\]")
INSTRUCTION = re.compile(r"^(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
NOT_RUN = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "opt-barrier"}
NOT_RUN |= {"partition-id", "replica-id", "copy-done", "custom-call-done"}


def shape_bytes(text: str) -> int:
    return sum(ITEM[dt] * _prod(dims) for dt, dims in SHAPE.findall(text))


def _dims(text: str) -> list[int]:
    m = SHAPE.search(text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _prod(dims: str | list[int]) -> int:
    n = 1
    for d in dims.split(",") if isinstance(dims, str) else dims:
        if d != "":
            n *= int(d)
    return n


def computations(hlo: str) -> tuple[dict[str, list[tuple]], str]:
    """name -> its instructions (name, shape, opcode, the rest), and the entry's name."""
    comps: dict[str, list[tuple]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header:
            current = header.group(2)
            comps[current] = []
            entry = current if header.group(1) else entry
        elif line.rstrip() == "}":  # (an instruction's attributes may run over lines starting with "}}")
            current = None
        elif current and (m := INSTRUCTION.match(line.strip())):
            comps[current].append(m.groups())
    return comps, entry


def _operands(rest: str) -> list[str]:
    return re.findall(r"%([\w.\-]+)", rest.split("), ")[0])


def fused_flops(comps, name: str, shapes: dict | None = None) -> int:
    """The multiply-adds (x2) of the convolutions and dots inside a fused computation
    (`shapes`: its operands' where they are defined outside it)."""
    flops, shapes = 0, dict(shapes or {})
    for inst, shape, op, rest in comps.get(name, []):
        shapes[inst] = shape
        if op in ("convolution", "dot"):
            lhs = _dims(shapes.get(_operands(rest)[0], ""))
            k = 1
            if op == "dot" and (c := re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)):
                k = _prod([lhs[int(i)] for i in c.group(1).split(",") if i])
            if op == "convolution":
                flops += _convolution_flops(lhs, _dims(shapes.get(_operands(rest)[1], "")), _dims(shape), rest)
                continue
            flops += 2 * _prod(_dims(shape)) * k
        elif op == "fusion" and (called := re.search(r"calls=%([\w.\-]+)", rest)):
            flops += fused_flops(comps, called.group(1))
    return flops


def _window(rest: str, key: str, n: int, default: int) -> list[int]:
    found = re.search(rf"\b{key}=([\d_x]+)", rest.split("window={", 1)[-1].split("}", 1)[0])
    return [int(v.split("_")[0]) for v in found.group(1).split("x")] if found else [default] * n


def _convolution_flops(lhs: list[int], rhs: list[int], out: list[int], rest: str) -> int:
    """2 x the multiply-adds of a convolution that land on input (not on its padding), as
    XLA's cost analysis counts them: XLA:TPU writes batched and per-head products as
    convolutions whose windows slide over padded axes."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", rest)
    if not (labels and lhs and rhs and out):
        return 0
    lhs_l, rhs_l, out_l = labels.groups()
    spatial = sorted(c for c in lhs_l if c.isdigit())
    n = len(spatial)
    pads = re.search(r"pad=([\d_x-]+)", rest.split("window={", 1)[-1].split("}", 1)[0]) if "window={" in rest else None
    pad_lo = [int(p.split("_")[0]) for p in pads.group(1).split("x")] if pads else [0] * n
    stride, lhs_dilate = _window(rest, "stride", n, 1), _window(rest, "lhs_dilate", n, 1)
    rhs_dilate = _window(rest, "rhs_dilate", n, 1)
    pairs = 1
    for i, d in enumerate(spatial):
        size, window, positions = lhs[lhs_l.index(d)], rhs[rhs_l.index(d)], out[out_l.index(d)]
        valid = 0
        for o in range(positions):
            for k in range(window):
                x = o * stride[i] + k * rhs_dilate[i] - pad_lo[i]
                valid += x >= 0 and x % lhs_dilate[i] == 0 and x // lhs_dilate[i] < size
        pairs *= valid
    return 2 * out[out_l.index("b")] * rhs[rhs_l.index("o")] * rhs[rhs_l.index("i")] * pairs


def roofline(hlo: str, top: int = 12) -> dict:
    comps, entry = computations(hlo)
    ops = []

    def walk(name: str, times: int, trips: int) -> None:
        shapes = {}
        for inst, shape, op, rest in comps[name]:
            shapes[inst] = shape
            if op == "while":
                body = re.search(r"body=%([\w.\-]+)", rest).group(1)
                cond = re.search(r"condition=%([\w.\-]+)", rest).group(1)
                bound = [int(m[1]) for *_, o, r in comps[cond] if o == "constant" and (m := re.match(r"(\d+)\)", r))]
                n = max(bound, default=1)
                walk(body, times * n, n)
                continue
            if op in ("call", "conditional"):
                for called in re.findall(r"(?:to_apply=|calls=|computations=\{)%([\w.\-]+)", rest):
                    walk(called, times, trips)
                continue
            if op in NOT_RUN:
                continue
            out, args = shape_bytes(shape), [shapes[a] for a in _operands(rest) if a in shapes]
            if op in ("slice-start", "slice", "dynamic-slice"):  # reads what it writes
                moved = 2 * out
            elif op == "slice-done":
                moved = 0
            else:
                # one layer's row of a stacked buffer updated in place
                stacked = trips > 1 and _dims(shape)[:1] == [trips] and shape in args
                moved = out // trips if stacked else out
                for arg in args:
                    size, dims = shape_bytes(arg), _dims(arg)
                    if trips > 1 and dims[:1] == [trips] and (size > 4 * out or (stacked and arg == shape)):
                        size //= trips  # a layer's slice of a stacked (layers, ...) buffer
                    moved += size
            called = re.search(r"calls=%([\w.\-]+)", rest) if op == "fusion" else None
            flops = fused_flops(comps, called.group(1)) if called else 0
            if op in ("convolution", "dot"):  # a product left unfused
                flops = fused_flops({"one": [(inst, shape, op, rest)]}, "one", shapes)
            where = re.search(r'op_name="([^"]*)"', rest)
            seconds = max(flops / PEAK_FLOPS, moved / HBM_BYTES_PER_S)
            ops.append((seconds * times, flops * times, moved * times, times, op, shape, where[1] if where else ""))

    walk(entry, 1, 1)
    matmul = [o for o in ops if o[1] > 0]
    other = [o for o in ops if o[1] == 0]
    kinds = collections.Counter()
    for o in other:
        kinds[o[4]] += o[0]
    return {
        "flops": sum(o[1] for o in ops),
        "bytes": sum(o[2] for o in ops),
        "matmul_seconds": sum(o[0] for o in matmul),
        "matmul_flops_seconds": sum(o[1] for o in matmul) / PEAK_FLOPS,
        "other_seconds": sum(o[0] for o in other),
        "other_seconds_by_op": {k: v for k, v in kinds.most_common()},
        "roofline_seconds": sum(o[0] for o in ops),
        "top_other": [
            {"ms": round(o[0] * 1e3, 2), "times": o[3], "op": o[4], "shape": _short(o[5]), "op_name": o[6][-110:]}
            for o in sorted(other, reverse=True)[:top]
        ],
    }


def _short(shape: str) -> str:
    return re.sub(r"\{[^}]*\}", "", shape)[:120]


def compile_step(name: str, settings: dict[str, str]):
    """The optimized HLO text of trainflow's step for SHAPES[name] on a v5e-1, with `settings`
    (dotted TrainConfig keys) over bench/tpu_v5e.py's config."""
    import jax
    import yaml

    from bench.tpu_v5e import SHAPES, trainflow_config
    from engine.config import load_config
    from engine.models.params import flops_per_token
    from engine.ops.partitioning import use_mesh
    from engine.train.config import TrainConfig
    from engine.train.plan import target_devices
    from engine.train.targets import get_target
    from engine.train.trainer import Trainer, lm_batch

    tree = trainflow_config(SHAPES[name], 1000).model_dump()
    for key, value in settings.items():
        *path, last = key.split(".")
        node = tree
        for part in path:
            node = node[part]
        node[last] = yaml.safe_load(value)
    cfg = load_config(tree=tree, schema=TrainConfig)
    trainer = Trainer(cfg, devices=target_devices(get_target("v5e-1")))
    batch = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding)
        for k, v in lm_batch(cfg.data.batch_size, cfg.data.seq_len).items()
    }
    with use_mesh(trainer.mesh):
        lowered = trainer.jitted_train_step().trace(trainer.abstract_params, trainer.abstract_opt_state, batch).lower()
    compiled = lowered.compile()
    memory = compiled.memory_analysis()
    tokens = cfg.data.batch_size * cfg.data.seq_len
    return compiled.as_text(), {
        "model_flops": flops_per_token(cfg.model, cfg.data.seq_len) * tokens,
        "argument_gib": memory.argument_size_in_bytes / 2**30,
        # The buffer assignment's heap peak (arguments, outputs and temporaries live at once):
        # what `trainflow plan` reads on a TPU; temp_size_in_bytes sums every temporary.
        "peak_gib": (getattr(memory, "peak_memory_in_bytes", 0) or 0) / 2**30,
        "temp_size_gib": memory.temp_size_in_bytes / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama3.2-1b-2048,qwen3-0.6b-2048")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE over the shape's TrainConfig")
    parser.add_argument("--hlo", type=Path, help="analyse this optimized HLO text instead of compiling")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    settings = dict(s.split("=", 1) for s in args.set)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiling for the TPU needs no chip here
    for name in args.shapes.split(","):
        started = time.perf_counter()
        hlo, meta = (args.hlo.read_text(), {}) if args.hlo else compile_step(name, settings)
        row = {"shape": name, "settings": settings, **meta, **roofline(hlo, args.top)}
        row["compile_seconds"] = time.perf_counter() - started
        row["date"] = datetime.date.today().isoformat()
        row["commit"] = commit()
        print(
            f"{name} {settings}: roofline {row['roofline_seconds']:.3f} s "
            f"(matmuls {row['matmul_seconds']:.3f}, the rest {row['other_seconds']:.3f})",
            flush=True,
        )
        if not args.hlo:  # read again: another run may have written meanwhile
            results = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
            results["runs"].append(row)
            args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
