"""Hugging Face checkpoints in and out: config.json <-> ModelConfig, safetensors <-> Orbax.

    convert_hf(hf_dir, out_dir)         a HF model directory -> out_dir/checkpoint/ (Orbax,
                                        step 0, params + meta) and out_dir/tokenizer/
    export_hf(checkpoint_dir, out_dir)  an Orbax checkpoint -> config.json,
                                        generation_config.json, model-0000i-of-0000n.safetensors
                                        + model.safetensors.index.json, tokenizer files

    python -m engine.hf convert HF_DIR OUT_DIR [--dtype float32|bfloat16]
    python -m engine.hf export CHECKPOINT_DIR OUT_DIR [--tokenizer DIR] [--max-shard-gb 5]

What the files mean (families, config keys, tensor names and layouts) is engine/hf_mapping.py;
this module moves the bytes. Conversion streams: every header is checked first, then each
tensor is read straight into its slot of the stacked (layers, ...) arrays, so the peak is one
model in memory. The checkpoint holds no mesh: restore it onto any mesh with
engine.checkpoint.load_params(dir, engine.train.abstract_model_params(cfg, mesh)).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import ml_dtypes
import numpy as np

from engine.config import ConfigError, ModelConfig
from engine.hf_mapping import (  # noqa: F401  (re-exported: engine.hf is the public entry point)
    FAMILIES, Family, TensorSpec, copy_into, hf_shape, model_config_from_hf, model_config_to_hf, tensor_table,
    to_engine, to_hf,
)
from engine.safetensors_io import SafetensorsFile, write_safetensors

FORMAT = "trainflow.checkpoint/1"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def _engine_shapes(cfg: ModelConfig) -> dict:
    """Shapes of the params of `cfg` as a nested dict (the stacked, scanned layout)."""
    from engine.train import abstract_model_params  # local: keeps `import engine.hf` light

    return abstract_model_params(cfg.model_copy(update={"scan_layers": True}), mesh=None)


def _at(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _check_table_covers(cfg: ModelConfig, shapes: dict) -> None:
    top, per_layer = tensor_table(cfg)
    mapped = {s.path for s in top} | {("blocks", *s.path) for s in per_layer}
    import jax

    leaves = {tuple(str(getattr(k, "key", k)) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]}
    assert mapped == leaves, f"tensor_table and the model disagree: {sorted(mapped ^ leaves)}"


# --------------------------------------------------------------------------- convert


def _weight_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [hf_dir / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ConfigError(f"{index}: lists {f.name}, which is missing")
        return files
    single = hf_dir / "model.safetensors"
    if single.is_file():
        return [single]
    if list(hf_dir.glob("*.bin")):
        raise ConfigError(f"{hf_dir}: only PyTorch .bin weights; convert them to safetensors first")
    raise ConfigError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")


def _source_dtype(files: list[Path]) -> str:
    with SafetensorsFile(files[0]) as st:
        dtypes = {st.dtype(name) for name in st.names()}
    return "bfloat16" if dtypes == {np.dtype(ml_dtypes.bfloat16)} else "float32"


def source_fingerprint(hf_dir: str | Path) -> dict[str, Any]:
    """What a conversion depends on, cheaply: sha256 of the small JSON files, size and
    modification time of the weights and tokenizer files (hashing GBs would take minutes)."""
    hf_dir = Path(hf_dir)
    out: dict[str, Any] = {}
    for path in sorted(hf_dir.iterdir()):
        if path.suffix == ".json" and path.stat().st_size < 10**7:
            out[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.suffix == ".safetensors" or path.name in TOKENIZER_FILES:
            out[path.name] = [path.stat().st_size, path.stat().st_mtime_ns]
    return out


def convert_hf(hf_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None,
               log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Convert a HF model directory into out_dir/checkpoint (Orbax) + out_dir/tokenizer.

    `dtype` (float32 | bfloat16) of the stored params; None keeps the source's (bfloat16
    stays bfloat16, anything else becomes float32). Returns a summary (lineage included).
    """
    log = log or (lambda msg: None)
    start = time.perf_counter()
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    hf_config = json.loads(config_path.read_text())
    files = _weight_files(hf_dir)
    if dtype is not None and dtype not in NP_DTYPES:
        raise ConfigError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    dtype = dtype or _source_dtype(files)
    cfg = model_config_from_hf(hf_config, param_dtype=dtype, where=str(config_path))
    architecture = FAMILIES[cfg.family].architecture
    shapes = _engine_shapes(cfg)
    _check_table_covers(cfg, shapes)

    # HF name -> (spec, layer index or None, engine shape of one slot)
    top, per_layer = tensor_table(cfg)
    expected: dict[str, tuple[TensorSpec, int | None, tuple]] = {s.hf_name: (s, None, _at(shapes, s.path).shape) for s in top}
    for spec in per_layer:
        stacked = _at(shapes, ("blocks", *spec.path)).shape
        for i in range(cfg.num_layers):
            expected[spec.hf_name.format(i=i)] = (spec, i, stacked[1:])
    target = NP_DTYPES[dtype]
    params: dict = {}
    for spec in top:
        _set(params, spec.path, np.empty(_at(shapes, spec.path).shape, target))
    for spec in per_layer:
        _set(params, ("blocks", *spec.path), np.empty(_at(shapes, ("blocks", *spec.path)).shape, target))

    log(f"convert: {architecture}, {len(expected)} tensors to read")
    # Every header first: a mismatch fails in a second, not after reading gigabytes.
    jobs: list[tuple[Path, str, TensorSpec, int | None]] = []
    tied_head: Path | None = None
    for path in files:
        with SafetensorsFile(path) as st:
            for name in st.names():
                if name.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints saved
                    continue
                if name == "lm_head.weight" and cfg.tie_embeddings:
                    tied_head = path
                    continue
                if name not in expected:
                    raise ConfigError(
                        f"{path.name}: unexpected tensor '{name}' for {architecture} as config.json describes it "
                        f"({cfg.num_layers} layers); config and weights do not match"
                    )
                spec, layer, shape = expected[name]
                want = hf_shape(spec, shape)
                if st.shape(name) != want:
                    raise ConfigError(
                        f"{path.name}: tensor '{name}' has shape {list(st.shape(name))}, but config.json "
                        f"({architecture}) implies {list(want)}"
                    )
                st.dtype(name)  # raises for a dtype we cannot read
                jobs.append((path, name, spec, layer))
    seen = {name for _, name, _, _ in jobs}
    missing = [name for name in expected if name not in seen]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"{hf_dir}: tensor '{missing[0]}'{more} is missing for {architecture}")

    # Then the data, a few tensors at a time: numpy's copies release the GIL, so reading and
    # transposing overlap. Each tensor has its own slot; at most `workers` are in flight.
    handles = {path: SafetensorsFile(path) for path in files}

    def load(job) -> int:
        path, name, spec, layer = job
        raw = handles[path].get(name)
        copy_into(_at(params, spec.path) if layer is None else _at(params, ("blocks", *spec.path))[layer], spec, raw)
        return raw.nbytes

    try:
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            nbytes = sum(pool.map(load, jobs))
    finally:
        for handle in handles.values():
            handle.close()
    log(f"convert: read {len(jobs)} tensors from {len(files)} file(s)")
    if tied_head is not None:
        with SafetensorsFile(tied_head) as st:
            if not np.array_equal(st.get("lm_head.weight").astype(target), params["embed_vd"]):
                raise ConfigError(
                    f"{tied_head.name}: tie_word_embeddings is true but 'lm_head.weight' differs from "
                    f"'model.embed_tokens.weight'"
                )

    generation = hf_dir / "generation_config.json"
    meta = {
        "step": 0, "model": cfg.model_dump(mode="json"), "format": FORMAT,
        "hf": {
            "architecture": architecture,
            "token_ids": {k: hf_config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
            "generation_config": json.loads(generation.read_text()) if generation.is_file() else None,
        },
        "source": {"kind": "huggingface", "path": str(hf_dir.absolute()), "files": source_fingerprint(hf_dir)},
    }
    from engine.checkpoint import save_params

    checkpoint_dir = out_dir / "checkpoint"
    if checkpoint_dir.exists():
        shutil.rmtree(checkpoint_dir)  # a partial earlier attempt
    save_params(checkpoint_dir, 0, params, meta)
    del params
    tokenizer_files = _copy_tokenizer(hf_dir, out_dir / "tokenizer")
    seconds = time.perf_counter() - start
    log(f"convert: {architecture}, {cfg.num_params():,} params, {nbytes / 1e9:.3f} GB in {seconds:.1f}s")
    return {
        "architecture": architecture, "family": cfg.family, "num_params": cfg.num_params(),
        "source_bytes": nbytes, "seconds": seconds, "dtype": dtype, "checkpoint": str(checkpoint_dir),
        "tokenizer_files": tokenizer_files, "model": cfg.model_dump(mode="json"), "source": meta["source"],
    }


def _copy_tokenizer(src: Path, dst: Path) -> list[str]:
    names = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    if names:
        dst.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copy2(src / name, dst / name)
    return names


# --------------------------------------------------------------------------- export


def _plan_shards(names_bytes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in names_bytes:
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def export_hf(checkpoint_dir: str | Path, out_dir: str | Path, tokenizer_dir: str | Path | None = None, *,
              step: int | None = None, max_shard_bytes: int = 5 * 10**9,
              log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Write a checkpoint as a HF model directory that AutoModelForCausalLM loads.

    `tokenizer_dir` defaults to the `tokenizer/` beside the checkpoint directory (the
    artifact layout of convert and pretrain), if there is one.
    """
    from engine.checkpoint import load_params, read_meta

    log = log or (lambda msg: None)
    start = time.perf_counter()
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    step, meta = read_meta(checkpoint_dir, step)
    cfg = ModelConfig.model_validate(meta["model"])
    hf_meta = meta.get("hf") or {}
    token_ids = hf_meta.get("token_ids") or {}
    hf_config = model_config_to_hf(cfg, token_ids)
    cfg_scanned = cfg.model_copy(update={"scan_layers": True})
    _, params, step = load_params(checkpoint_dir, step=step)

    def leaf(spec: TensorSpec, layer: int | None) -> np.ndarray:
        if layer is None:
            return np.asarray(_at(params, spec.path))
        if cfg.scan_layers:
            return np.asarray(_at(params, ("blocks", *spec.path))[layer])
        return np.asarray(_at(params["blocks"][layer], spec.path))

    top, per_layer = tensor_table(cfg_scanned)
    order = [(top[0], None)] + [(s, i) for i in range(cfg.num_layers) for s in per_layer] + [(s, None) for s in top[1:]]
    entries = {}
    for spec, layer in order:
        array = leaf(spec, layer)
        entries[spec.hf_name.format(i=layer)] = (spec, layer, hf_shape(spec, array.shape), array.dtype)
    sizes = [(name, int(np.prod(e[2])) * e[3].itemsize) for name, e in entries.items()]
    shards = _plan_shards(sizes, max_shard_bytes)
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for k, names in enumerate(shards):
        filename = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"

        def tensors(names=names) -> Iterator[tuple[str, np.ndarray]]:
            for name in names:
                spec, layer, _, _ = entries[name]
                yield name, to_hf(spec, leaf(spec, layer))

        total += write_safetensors(out_dir / filename, tensors(), metadata={"format": "pt"},
                                   shapes={n: entries[n][2:] for n in names})
        weight_map.update({name: filename for name in names})
        log(f"export: wrote {filename}")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = hf_meta.get("generation_config") or {
        "_from_model_config": True, **{k: v for k, v in token_ids.items() if v is not None}}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer_dir is None and (checkpoint_dir.parent / "tokenizer").is_dir():
        tokenizer_dir = checkpoint_dir.parent / "tokenizer"
    tokenizer_files = _copy_tokenizer(Path(tokenizer_dir), out_dir) if tokenizer_dir else []
    seconds = time.perf_counter() - start
    return {
        "architecture": hf_config["architectures"][0], "family": cfg.family, "step": step, "bytes": total,
        "shards": len(shards), "seconds": seconds, "tokenizer_files": tokenizer_files,
        "source": {"checkpoint": str(checkpoint_dir.absolute()), "step": step},
    }


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.hf", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="a Hugging Face model directory -> an Orbax checkpoint")
    conv.add_argument("hf_dir")
    conv.add_argument("out_dir")
    conv.add_argument("--dtype", choices=sorted(NP_DTYPES), default=None)
    exp = sub.add_parser("export", help="an Orbax checkpoint directory -> a Hugging Face model directory")
    exp.add_argument("checkpoint_dir")
    exp.add_argument("out_dir")
    exp.add_argument("--tokenizer", default=None, help="tokenizer directory (default: ../tokenizer)")
    exp.add_argument("--step", type=int, default=None)
    exp.add_argument("--max-shard-gb", type=float, default=5.0)
    args = parser.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        if args.command == "convert":
            result = convert_hf(args.hf_dir, args.out_dir, dtype=args.dtype, log=log)
        else:
            result = export_hf(args.checkpoint_dir, args.out_dir, args.tokenizer, step=args.step,
                               max_shard_bytes=int(args.max_shard_gb * 1e9), log=log)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"result": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
