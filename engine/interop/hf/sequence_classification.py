"""A reward model <-> transformers' <Family>ForSequenceClassification (num_labels 1).

    export_reward_model(checkpoint_dir, out_dir)   config.json (architectures
        [LlamaForSequenceClassification], one label, pad_token_id), model.safetensors (or
        shards + index): the decoder's tensors named as the causal export names them
        (`model.*`, no lm_head) plus `score.weight` (1, d_model), the head; the tokenizer files.
        AutoModelForSequenceClassification.from_pretrained(out_dir) loads it and its scores
        are the engine's (tests/test_reward_model.py).
    convert_reward_model(hf_dir, out_dir)          back: out_dir/checkpoint (a reward-model
        checkpoint, step 0, params + meta) and out_dir/tokenizer.

transformers pools at the rightmost token that is not `pad_token_id`; the engine reads the
reward at each sequence's last token. The two agree when the pad id never ends a sequence:
the export writes the tokenizer's pad token, and only without one falls back to eos (then a
sequence ending in eos is scored one token earlier by transformers, as TRL's reward models
with pad = eos are; the export says so). A sequence-classification model has no LM head: an
untied decoder converted back gets a zero `lm_head_dv` (the reward never reads it).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from engine.config import ConfigError
from engine.contract import CHECKPOINT_DIR, CHECKPOINT_FORMAT, TOKENIZER_DIR
from engine.interop.hf.files import (
    check_export_dir,
    copy_tokenizer,
    remove_stale_weights,
    source_fingerprint,
    tokenizer_beside,
    tokenizer_token_ids,
)
from engine.interop.hf.mapping import (
    causal_view,
    copy_into,
    copy_part_into,
    deinterleave,
    fuse,
    fused_hf_shape,
    hf_shape,
    interleave,
    is_sequence_classification,
    model_config_from_hf,
    model_config_to_hf,
    part_of,
    part_shape,
    parts,
    sequence_classification_architecture,
    tensor_table,
    to_hf,
    unfuse,
)
from engine.interop.hf.safetensors_io import SafetensorsFile, write_safetensors
from engine.models.params import abstract_model_params
from engine.train.bucket_paths import checkpoint_path
from engine.train.checkpoint import adapter_base, read_meta, save_params
from engine.train.reward_checkpoint import HEAD, REWARD_MODEL_FORMAT, load_reward_params

SCORE = "score.weight"
LM_HEAD = "lm_head.weight"


def _at(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _slots(cfg, shapes: dict) -> dict[str, tuple[Any, tuple]]:
    """HF name -> (TensorSpec, index) of every decoder tensor but the LM head, in file order:
    index () for a top-level tensor, (layer,) or (layer, expert) within its stack."""
    top, per_layer = tensor_table(cfg)
    out: dict[str, tuple[Any, tuple]] = {top[0].hf_name: (top[0], ())}
    for stack, layers in cfg.layer_stacks():
        for i, layer in enumerate(layers):
            for spec in per_layer:
                if spec.stack != stack:
                    continue
                if spec.experts:
                    experts = _at(shapes, (stack, *spec.path)).shape[1]
                    out.update({spec.hf_name.format(i=layer, j=j): (spec, (i, j)) for j in range(experts)})
                else:
                    out[spec.hf_name.format(i=layer)] = (spec, (i,))
    out.update({s.hf_name: (s, ()) for s in top[1:] if s.hf_name != LM_HEAD})
    return out


def _slot(params: dict, spec, index: tuple, path: tuple[str, ...]):
    return _at(params, path) if not index else _at(params, (spec.stack, *path))[index]


def _token_ids(checkpoint_dir: Path, meta: dict, tokenizer_dir: Path | None, log) -> dict:
    """bos/eos/pad ids for config.json: the tokenizer's, else what the checkpoint's HF source said."""
    if meta.get("lora"):
        meta = read_meta(adapter_base(checkpoint_dir, meta))[1]
    ids = dict((meta.get("hf") or {}).get("token_ids") or {})
    if tokenizer_dir is not None:
        ours = tokenizer_token_ids(tokenizer_dir)
        ids.update(
            ours, pad_token_id=ours["pad_token_id"] if ours["pad_token_id"] is not None else ids.get("pad_token_id")
        )
    if ids.get("pad_token_id") is None and ids.get("eos_token_id") is None:
        raise ConfigError(
            f"{checkpoint_dir}: no tokenizer beside it and no token ids in its meta; give the "
            "tokenizer (transformers finds each sequence's last token by pad_token_id)"
        )
    if ids.get("pad_token_id") is None:
        ids["pad_token_id"] = ids["eos_token_id"]
        log(
            "export: the tokenizer has no pad token; pad_token_id is eos, so transformers scores a sequence that "
            "ends in eos at the token before it (it pools at the last token that is not pad_token_id)"
        )
    return ids


def export_reward_model(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    *,
    step: int | None = None,
    max_shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Write a reward-model checkpoint as the transformers *ForSequenceClassification of its
    family (a LoRA one with its adapter folded in)."""
    log = log or (lambda msg: None)
    start = time.perf_counter()
    checkpoint_dir, out_dir = checkpoint_path(checkpoint_dir), Path(out_dir)
    check_export_dir(out_dir, overwrite)
    cfg, compute, params, step, meta = load_reward_params(checkpoint_dir, step)
    if tokenizer_dir is None:
        tokenizer_dir = tokenizer_beside(checkpoint_dir)
    hf_config = model_config_to_hf(
        cfg,
        _token_ids(checkpoint_dir, meta, Path(tokenizer_dir) if tokenizer_dir else None, log),
        param_dtype=compute.param_dtype,
    )
    architecture = sequence_classification_architecture(cfg.family)
    hf_config.update(architectures=[architecture], id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})

    def tensor(spec, index) -> np.ndarray:
        if spec.interleaved_with:  # several engine arrays in one HF tensor
            return interleave(
                [np.asarray(_slot(params, spec, index, path)) for path in (spec.path, *spec.interleaved_with)]
            )
        if spec.fused_with:  # several engine arrays one after another (Phi-3's qkv_proj)
            return fuse(spec, [to_hf(spec, np.asarray(_slot(params, spec, index, p))) for p in parts(spec)])
        return to_hf(spec, part_of(spec, np.asarray(_slot(params, spec, index, spec.path))))

    slots = _slots(cfg, params)
    entries = {}
    for name, (spec, index) in slots.items():
        array = np.asarray(_slot(params, spec, index, spec.path))
        shape = hf_shape(spec, part_shape(spec, array.shape))
        if spec.fused_with:
            shape = fused_hf_shape(spec, [np.shape(_slot(params, spec, index, p)) for p in parts(spec)])
        entries[name] = (shape, array.dtype)
    entries[SCORE] = ((1, cfg.d_model), params[HEAD].dtype)
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in entries.items():
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards, size = [*shards, []], 0
        shards[-1].append(name)
        size += nbytes
    removed = remove_stale_weights(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for k, names in enumerate(shards):
        filename = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        arrays = ((n, params[HEAD][None, :] if n == SCORE else tensor(*slots[n])) for n in names)
        total += write_safetensors(
            out_dir / filename, arrays, metadata={"format": "pt"}, shapes={n: entries[n] for n in names}
        )
        weight_map.update({n: filename for n in names})
    if len(shards) > 1:
        shard_index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(shard_index, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    tokenizer_files = copy_tokenizer(Path(tokenizer_dir), out_dir) if tokenizer_dir else []
    log(f"export: {architecture}, {total / 1e6:.2f} MB in {len(shards)} file(s) to {out_dir}")
    return {
        "architecture": architecture,
        "family": cfg.family,
        "step": step,
        "bytes": total,
        "shards": len(shards),
        "seconds": time.perf_counter() - start,
        "tokenizer_files": tokenizer_files,
        "removed_weights": removed,
        "pad_token_id": hf_config["pad_token_id"],
        "source": {"checkpoint": str(checkpoint_dir), "step": step},
    }


def _weight_files(hf_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        return {name: hf_dir / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = hf_dir / "model.safetensors"
    if not single.is_file():
        raise ConfigError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
    with SafetensorsFile(single) as st:
        return {name: single for name in st.names()}


def convert_reward_model(
    hf_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """A transformers *ForSequenceClassification directory with one label -> out_dir/checkpoint
    (a reward model: the decoder's params and `score_d`) + out_dir/tokenizer."""
    log = log or (lambda msg: None)
    start = time.perf_counter()
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    hf = json.loads((hf_dir / "config.json").read_text())
    where = str(hf_dir / "config.json")
    if not is_sequence_classification(hf):
        raise ConfigError(f"{where}: not a *ForSequenceClassification model")
    labels = len(hf["id2label"]) if hf.get("id2label") else int(hf.get("num_labels", 2))
    if labels != 1:
        raise ConfigError(f"{where}: has {labels} labels; a reward model scores with one (num_labels 1)")
    files = _weight_files(hf_dir)
    if SCORE not in files:
        raise ConfigError(f"{hf_dir}: no '{SCORE}' tensor (the head)")
    with SafetensorsFile(files[SCORE]) as st:
        source_dtype = "bfloat16" if st.dtype(SCORE) == np.dtype(ml_dtypes.bfloat16) else "float32"
    dtype = dtype or source_dtype
    cfg, compute = model_config_from_hf(causal_view(hf), param_dtype=dtype, where=where)
    target = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    shapes = abstract_model_params(cfg, compute, mesh=None)
    params = _empty_like(shapes, target)
    slots = _slots(cfg, shapes)
    unexpected = sorted(set(files) - set(slots) - {SCORE, LM_HEAD})
    missing = [name for name in slots if name not in files]
    if unexpected or missing:
        name = (unexpected or missing)[0]
        raise ConfigError(
            f"{hf_dir}: tensor '{name}' is {'unexpected' if unexpected else 'missing'} for "
            f"{hf['architectures'][0]} as config.json describes it ({cfg.num_layers} layers)"
        )
    handles = {path: SafetensorsFile(path) for path in set(files.values())}
    nbytes = 0
    try:
        for name, (spec, index) in slots.items():
            st = handles[files[name]]
            slot = _slot(params, spec, index, spec.path)
            fused = [_slot(params, spec, index, p).shape for p in parts(spec)] if spec.fused_with else None
            want = fused_hf_shape(spec, fused) if fused else hf_shape(spec, part_shape(spec, slot.shape))
            if tuple(st.shape(name)) != tuple(want):
                raise ConfigError(
                    f"{files[name].name}: tensor '{name}' has shape {list(st.shape(name))}, but "
                    f"config.json implies {list(want)}"
                )
            raw = st.get(name)
            nbytes += raw.nbytes
            if fused:
                for path, piece in zip(parts(spec), unfuse(spec, raw, fused), strict=True):
                    copy_into(_slot(params, spec, index, path), spec, piece)
                continue
            paths = (spec.path, *spec.interleaved_with)
            for part, path in enumerate(paths):
                copy_part_into(
                    _slot(params, spec, index, path),
                    spec,
                    deinterleave(raw, part, len(paths)) if len(paths) > 1 else raw,
                )
        score = handles[files[SCORE]].get(SCORE)
    finally:
        for handle in handles.values():
            handle.close()
    if score.shape != (1, cfg.d_model):
        raise ConfigError(f"{files[SCORE].name}: '{SCORE}' has shape {list(score.shape)}, not [1, {cfg.d_model}]")
    params[HEAD] = score[0].astype(target)
    meta = {
        "step": 0,
        "model": cfg.model_dump(mode="json"),
        "compute": compute.model_dump(mode="json"),
        "format": CHECKPOINT_FORMAT,
        "stage": "convert",
        "hf": {
            "architecture": hf["architectures"][0],
            "token_ids": {k: hf.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        },
        "source": {"kind": "huggingface", "path": str(hf_dir.absolute()), "files": source_fingerprint(hf_dir)},
        "reward_model": {"format": REWARD_MODEL_FORMAT, "head": HEAD, "pooling": "last_token"},
    }
    checkpoint_dir = out_dir / CHECKPOINT_DIR
    if checkpoint_dir.exists():
        shutil.rmtree(checkpoint_dir)  # a partial earlier attempt
    save_params(checkpoint_dir, 0, params, meta)
    tokenizer_files = copy_tokenizer(hf_dir, out_dir / TOKENIZER_DIR)
    log(f"convert: {hf['architectures'][0]} -> a reward model, {cfg.num_params():,} params")
    return {
        "architecture": hf["architectures"][0],
        "family": cfg.family,
        "num_params": cfg.num_params(),
        "source_bytes": nbytes + score.nbytes,
        "dtype": dtype,
        "seconds": time.perf_counter() - start,
        "checkpoint": str(checkpoint_dir),
        "tokenizer_files": tokenizer_files,
        "model": cfg.model_dump(mode="json"),
        "compute": compute.model_dump(mode="json"),
        "source": meta["source"],
    }


def _empty_like(shapes: dict, dtype: np.dtype) -> dict:
    """Host arrays of `shapes` in `dtype`: zeros, so a tensor no file fills (the LM head) is 0."""
    return {k: _empty_like(v, dtype) if isinstance(v, dict) else np.zeros(v.shape, dtype) for k, v in shapes.items()}
