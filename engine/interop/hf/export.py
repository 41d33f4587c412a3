"""An Orbax checkpoint -> a Hugging Face model directory that AutoModelForCausalLM loads,
named as transformers names it: config.json, generation_config.json, model.safetensors (or,
past `max_shard_bytes`, model-0000i-of-0000n.safetensors + model.safetensors.index.json),
and the tokenizer files.

The target must be empty unless `overwrite`: weights of an earlier model left beside the
new ones could be what transformers loads. With `overwrite`, those (files.WEIGHT_FILES) are
deleted first; other files are replaced or left as they are.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import ConfigError
from engine.interop.hf.files import (
    check_export_dir,
    copy_tokenizer,
    export_token_ids,
    remove_stale_weights,
    tokenizer_beside,
)
from engine.interop.hf.mapping import (
    TensorSpec,
    fuse,
    fused_hf_shape,
    hf_shape,
    interleave,
    model_config_to_hf,
    multimodal_of,
    part_of,
    tensor_table,
    to_hf,
)
from engine.interop.hf.peft import ADAPTER_WEIGHTS, write_peft
from engine.interop.hf.safetensors_io import SafetensorsFile, write_safetensors
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.families import family_of_model_type, get_family
from engine.train.bucket_paths import checkpoint_path
from engine.train.checkpoint import adapter_base, load_adapter, load_params, read_meta


def _at(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


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


def export_hf(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    *,
    step: int | None = None,
    max_shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
    merged: bool = False,
    log: Callable[[str], None] | None = None,
    multimodal_source: str | Path | None = None,
) -> dict[str, Any]:
    """Write a checkpoint as a HF model directory that AutoModelForCausalLM loads.

    `multimodal_source`: a multimodal ...ForConditionalGeneration directory of the family
    (the one converted, say): the decoder is written back into its layout, beside its other
    tensors (vision tower, projector) copied from there (to_multimodal_layout).

    `tokenizer_dir` defaults to the `tokenizer/` beside the checkpoint directory (the
    artifact layout of convert and pretrain), if there is one. A non-empty `out_dir` is a
    ConfigError unless `overwrite`, which deletes the weights there before writing.

    A LoRA adapter checkpoint is written in PEFT's format (export_peft), or with `merged`
    as the whole model with the adapter folded in.
    """
    log = log or (lambda msg: None)
    start = time.perf_counter()
    checkpoint_dir, out_dir = checkpoint_path(checkpoint_dir), Path(out_dir)
    check_export_dir(out_dir, overwrite)
    step, meta = read_meta(checkpoint_dir, step)
    if meta.get("lora") and not merged:
        return export_peft(checkpoint_dir, out_dir, tokenizer_dir, step=step, log=log)
    if meta.get("lora"):  # the base's Hugging Face token ids and generation config
        meta = {**meta, "hf": read_meta(adapter_base(checkpoint_dir, meta))[1].get("hf")}
    cfg, compute = ModelConfig.model_validate(meta["model"]), ComputeConfig.model_validate(meta["compute"])
    _, params, step = load_params(checkpoint_dir, step=step, as_numpy=True)  # host arrays, as saved
    if tokenizer_dir is None:
        tokenizer_dir = tokenizer_beside(checkpoint_dir)
    hf_meta = meta.get("hf") or {}
    hf_meta = {**hf_meta, "token_ids": export_token_ids(meta.get("hf"), tokenizer_dir)}
    if multimodal_source is not None:  # refused before anything is written
        multimodal_layout_of(multimodal_source, cfg.family)
    written = write_hf_model(params, cfg, compute, out_dir, hf_meta, max_shard_bytes=max_shard_bytes, log=log)
    if multimodal_source is not None:
        written["config"] = to_multimodal_layout(out_dir, multimodal_source, max_shard_bytes=max_shard_bytes, log=log)
    tokenizer_files = copy_tokenizer(Path(tokenizer_dir), out_dir) if tokenizer_dir else []
    seconds = time.perf_counter() - start
    return {
        "architecture": written["config"]["architectures"][0],
        "family": cfg.family,
        "step": step,
        "bytes": written["bytes"],
        "shards": written["shards"],
        "seconds": seconds,
        "tokenizer_files": tokenizer_files,
        "removed_weights": written["removed_weights"],
        "source": {"checkpoint": str(checkpoint_dir), "step": step},
    }


def _transformers_floats(value):
    """`value` with each non-finite float as transformers 5 writes it into config.json,
    {"__float__": "Infinity"} (Mamba2's time_step_limit), not JSON's invalid bare Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": str(value).replace("inf", "Infinity").replace("nan", "NaN")}
    if isinstance(value, dict):
        return {key: _transformers_floats(v) for key, v in value.items()}
    if isinstance(value, list | tuple):
        return [_transformers_floats(v) for v in value]
    return value


def write_hf_model(
    params: dict,
    cfg: ModelConfig,
    compute: ComputeConfig,
    out_dir: str | Path,
    hf_meta: dict | None = None,
    *,
    max_shard_bytes: int = 5 * 10**9,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Host `params` (the engine's tree, as saved) as config.json, generation_config.json and
    safetensors in `out_dir`, replacing the weights there; {config (config.json's), bytes,
    shards, removed_weights}.
    `hf_meta`: a checkpoint's `hf` meta (the Hugging Face token ids and generation config).
    export_hf writes a checkpoint with it; a rollout server's weights are written by it from
    memory (engine/posttrain/vllm_rollout.py)."""
    log = log or (lambda msg: None)
    out_dir = Path(out_dir)
    hf_meta = hf_meta or {}
    token_ids = hf_meta.get("token_ids") or {}
    hf_config = model_config_to_hf(cfg, token_ids, param_dtype=compute.param_dtype)
    entries = hf_tensors(params, cfg, compute)
    sizes = [(name, int(np.prod(shape)) * dtype.itemsize) for name, (shape, dtype, _) in entries.items()]
    shards = _plan_shards(sizes, max_shard_bytes)
    removed = remove_stale_weights(out_dir)
    if removed:
        log(f"export: removed the earlier weights {', '.join(removed)} from {out_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for k, names in enumerate(shards):
        filename = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"

        def tensors(names=names) -> Iterator[tuple[str, np.ndarray]]:
            for name in names:
                yield name, entries[name][2]()

        total += write_safetensors(
            out_dir / filename, tensors(), metadata={"format": "pt"}, shapes={n: entries[n][:2] for n in names}
        )
        weight_map.update({name: filename for name in names})
        log(f"export: wrote {filename}")
    if len(shards) > 1:
        shard_index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(shard_index, indent=2) + "\n")
    for filename, text in hf_config_files(hf_config, hf_meta).items():
        (out_dir / filename).write_text(text)
    return {"config": hf_config, "bytes": total, "shards": len(shards), "removed_weights": removed}


def hf_config_files(hf_config: dict, hf_meta: dict) -> dict[str, str]:
    """config.json and generation_config.json's text, as transformers writes them."""
    token_ids = hf_meta.get("token_ids") or {}
    generation = hf_meta.get("generation_config") or {
        "_from_model_config": True,
        **{k: v for k, v in token_ids.items() if v is not None},
    }
    return {
        "config.json": json.dumps(_transformers_floats(hf_config), indent=2, sort_keys=True) + "\n",
        "generation_config.json": json.dumps(generation, indent=2) + "\n",
    }


def hf_tensors(
    params: dict, cfg: ModelConfig, compute: ComputeConfig
) -> dict[str, tuple[tuple[int, ...], np.dtype, Callable[[], np.ndarray]]]:
    """The Hugging Face tensors of host `params` in the export's order: name -> (shape, dtype,
    a function that builds the array). Nothing is transposed or copied until it is called, so
    a writer holds one HF-layout copy at a time (write_hf_model; the bucket weight sync,
    engine/interop/weight_sync.py, builds only the shards it writes)."""

    def leaf(spec: TensorSpec, index: tuple, path: tuple[str, ...] | None = None) -> np.ndarray:
        """The array at `index`: () top-level, (layer,), or (layer, expert) of an expert tensor."""
        if path is None:  # spec's own array: the part of it that spec's HF tensor holds
            return part_of(spec, leaf(spec, index, spec.path))
        if not index:
            return np.asarray(_at(params, path))
        if compute.scan_layers:
            return np.asarray(_at(params, (spec.stack, *path))[index])
        return np.asarray(_at(params[spec.stack][index[0]], path)[index[1:]])

    def hf_tensor(spec: TensorSpec, index: tuple) -> np.ndarray:
        if spec.swap_last:  # Gemma 4's experts: HF's last two axes are the engine's swapped
            parts = [leaf(spec, index, path) for path in (spec.path, *spec.concatenated_with)]
            swapped = np.ascontiguousarray(np.concatenate(parts, axis=-1).swapaxes(-1, -2))
            return swapped.reshape(-1, *swapped.shape[2:]) if spec.merged_rows else swapped  # DBRX's (E * f, d)
        if spec.interleaved_with:  # several engine arrays in one HF tensor
            return interleave([leaf(spec, index, path) for path in (spec.path, *spec.interleaved_with)])
        if spec.concatenated_with:  # one after another along the last axis (Llama 4's gate_up_proj)
            return np.concatenate([leaf(spec, index, path) for path in (spec.path, *spec.concatenated_with)], axis=-1)
        if spec.fused_with:  # several engine arrays one after another (Phi-3's qkv_proj)
            return fuse(spec, [to_hf(spec, leaf(spec, index, path)) for path in (spec.path, *spec.fused_with)])
        return to_hf(spec, leaf(spec, index))

    top, per_layer = tensor_table(cfg)
    order: list[tuple[TensorSpec, tuple[int, ...]]] = [(top[0], ())]
    layers_of = dict(cfg.layer_stacks() + cfg.mtp_stacks())  # and the MTP layer after the last
    slot = {layer: (stack, i) for stack, layers in layers_of.items() for i, layer in enumerate(layers)}
    for layer in range(cfg.num_layers + cfg.mtp_layers):  # in the model's order; index: the layer within its stack
        stack, i = slot[layer]
        for s in per_layer:
            if s.stack == stack:
                # one HF tensor per expert (or per head: StableLM 2's QK norms), the array's axis after the layer's
                order += [(s, (i, j)) for j in range(len(leaf(s, (i,))))] if s.experts else [(s, (i,))]
    order += [(s, ()) for s in top[1:]]
    entries: dict[str, tuple[tuple[int, ...], np.dtype, Callable[[], np.ndarray]]] = {}
    for spec, index in order:
        array = leaf(spec, index)
        layer = layers_of[spec.stack][index[0]] if index else 0
        name = spec.hf_name.format(i=layer, j=index[-1], k=layer - cfg.num_layers) if index else spec.hf_name
        shape = hf_shape(spec, array.shape)
        if spec.fused_with:
            shape = fused_hf_shape(spec, [leaf(spec, index, p).shape for p in (spec.path, *spec.fused_with)])
        entries[name] = (shape, array.dtype, functools.partial(hf_tensor, spec, index))
    dtype = leaf(top[0], ()).dtype  # constant buffers (Family.constant_tensors), in the parameters' dtype
    for name, value in get_family(cfg.family).constant_tensors(cfg).items():  # a scalar or an array
        integers = isinstance(value, np.ndarray) and value.dtype.kind in "iu"  # (Qwen4-Exp's int64 buffers)
        kept = value.dtype if isinstance(value, np.ndarray) and integers else dtype
        entries[name] = (np.shape(value), kept, functools.partial(np.asarray, value, kept))
    return entries


def _weights(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return [model_dir / name for name in dict.fromkeys(json.loads(index.read_text())["weight_map"].values())]
    return [model_dir / "model.safetensors"]


def multimodal_layout_of(source_dir: str | Path, family: str):
    """(config.json, families/base.py Multimodal) of `source_dir`, a multimodal checkpoint of
    the family `family`; a ConfigError naming the file otherwise."""
    source = Path(source_dir) / "config.json"
    if not source.is_file():
        raise ConfigError(f"{source_dir}: no config.json (not a Hugging Face model directory)")
    source_config = json.loads(source.read_text())
    found = multimodal_of(source_config)
    if found is None or found[0].name != family:
        raise ConfigError(
            f"{source}: is not a multimodal checkpoint of family '{family}' (model_type "
            f"{source_config.get('model_type')!r}); export without multimodal_source for the text model"
        )
    return source_config, found[1]


def to_multimodal_layout(
    out_dir: str | Path,
    source_dir: str | Path,
    *,
    max_shard_bytes: int = 5 * 10**9,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Rewrite the text model written in `out_dir` as the multimodal checkpoint `source_dir`
    is (families/base.py Multimodal): the decoder's tensors under the checkpoint's prefixes,
    the source's other tensors (vision tower, projector) copied beside them, config.json the
    source's with this model as its text config. Returns the new config.json."""
    log = log or (lambda msg: None)
    out_dir, source_dir = Path(out_dir), Path(source_dir)
    text_config = json.loads((out_dir / "config.json").read_text())
    family = family_of_model_type(text_config.get("model_type"))
    source_config, multimodal = multimodal_layout_of(source_dir, family.name if family else "?")
    to_source = {text: mm for text, mm in multimodal.prefixes}

    def source_name(name: str) -> str:
        text = next(p for p in to_source if name.startswith(p))
        return to_source[text] + name[len(text) :]

    written = _weights(out_dir)
    entries: dict[str, tuple[Path, str, tuple, Any]] = {}  # new name -> (file, its name there, shape, dtype)
    for path in written:
        with SafetensorsFile(path) as st:
            for name in st.names():
                entries[source_name(name)] = (path, name, tuple(st.shape(name)), st.dtype(name))
    kept = 0
    for path in _weights(source_dir):
        with SafetensorsFile(path) as st:
            for name in st.names():
                if multimodal.text_name(name) is None:  # the vision tower, the projector
                    entries[name] = (path, name, tuple(st.shape(name)), st.dtype(name))
                    kept += 1
                elif multimodal.text_name(name) == "lm_head.weight" and name not in entries:
                    # A text config that ties the head inside a multimodal one that does not
                    # (Qwen3.5's small models): the source holds the head, so the export does,
                    # the trained embedding (conversion checks the two are equal).
                    entries[name] = entries[source_name("model.embed_tokens.weight")]
    staging = out_dir / ".multimodal"
    staging.mkdir(exist_ok=True)
    sizes = [(name, int(np.prod(e[2])) * np.dtype(e[3]).itemsize) for name, e in entries.items()]
    shards = _plan_shards(sizes, max_shard_bytes)
    weight_map, total = {}, 0
    for k, names in enumerate(shards):
        filename = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"

        def tensors(names=names) -> Iterator[tuple[str, np.ndarray]]:
            for name in names:
                path, stored, _, _ = entries[name]
                with SafetensorsFile(path) as st:
                    yield name, st.get(stored)

        total += write_safetensors(
            staging / filename, tensors(), metadata={"format": "pt"}, shapes={n: entries[n][2:] for n in names}
        )
        weight_map.update({name: filename for name in names})
    for path in written:
        path.unlink()
    (out_dir / "model.safetensors.index.json").unlink(missing_ok=True)
    for path in sorted(staging.iterdir()):
        path.rename(out_dir / path.name)
    staging.rmdir()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    text = {key: value for key, value in text_config.items() if key != "architectures"}
    config = {**source_config, multimodal.text_config: text, "architectures": [multimodal.architecture]}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    log(f"export: the decoder in {multimodal.architecture}'s layout, with {kept} tensors of {source_dir} beside it")
    return config


def export_peft(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    *,
    step: int | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """An adapter checkpoint as PEFT's adapter directory (adapter_config.json +
    adapter_model.safetensors, and the tokenizer files), which
    `peft.PeftModel.from_pretrained(base, out_dir)` loads onto the base exported by export_hf.
    base_model_name_or_path names the Hugging Face directory the base was converted from,
    where it was one."""
    log = log or (lambda msg: None)
    start = time.perf_counter()
    checkpoint_dir, out_dir = checkpoint_path(checkpoint_dir), Path(out_dir)
    cfg, lora, adapter, step, base = load_adapter(checkpoint_dir, step)
    _, meta = read_meta(checkpoint_dir, step)
    compute = ComputeConfig.model_validate(meta["compute"])
    source = read_meta(base)[1].get("source") or {}
    files = write_peft(
        out_dir,
        cfg,
        lora,
        adapter,
        scan_layers=compute.scan_layers,
        base_model=source.get("path") if source.get("kind") == "huggingface" else None,
    )
    if tokenizer_dir is None:
        tokenizer_dir = tokenizer_beside(checkpoint_dir)
    tokenizer_files = copy_tokenizer(Path(tokenizer_dir), out_dir) if tokenizer_dir else []
    nbytes = (out_dir / ADAPTER_WEIGHTS).stat().st_size
    log(f"export: wrote a rank-{lora.rank} PEFT adapter ({nbytes / 1e6:.2f} MB) to {out_dir}")
    return {
        "architecture": "peft-lora",
        "family": cfg.family,
        "step": step,
        "bytes": nbytes,
        "shards": 1,
        "seconds": time.perf_counter() - start,
        "files": files,
        "tokenizer_files": tokenizer_files,
        "base_checkpoint": str(base),
        "source": {"checkpoint": str(checkpoint_dir), "step": step},
    }
