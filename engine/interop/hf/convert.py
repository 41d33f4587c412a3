"""A Hugging Face model directory -> an Orbax checkpoint the engine loads.

    convert_hf(hf_dir, out_dir)   out_dir/checkpoint/ (Orbax, step 0, params + meta) and
                                  out_dir/tokenizer/

What the files mean (families, config keys, tensor names and layouts) is engine/models/
families and mapping.py; this module moves the bytes. Conversion streams: every header is
checked first, then each tensor is read straight into its slot of the stacked (layers, ...)
arrays, so the peak is one model in memory. The checkpoint holds no mesh: restore it onto
any mesh with engine.train.checkpoint.load_params(dir, abstract_model_params(cfg, compute, mesh)).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from etils import epath

from engine.config import ConfigError
from engine.contract import CHECKPOINT_DIR, CHECKPOINT_FORMAT, TOKENIZER_DIR
from engine.data.urls import is_url
from engine.interop.hf.files import copy_tokenizer, source_fingerprint
from engine.interop.hf.mapping import (
    TensorSpec,
    check_table_covers,
    copy_part_into,
    deinterleave,
    fused_hf_shape,
    hf_shape,
    model_config_from_hf,
    multimodal_of,
    part_shape,
    parts,
    tensor_table,
    text_config_of,
    unfuse,
    unmerged_hf_shape,
)
from engine.interop.hf.peft import ADAPTER_CONFIG, adapter_from_peft, lora_config_from_peft
from engine.interop.hf.safetensors_io import SafetensorsFile
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.families import get_family
from engine.models.lora import split_adapter
from engine.models.params import abstract_model_params
from engine.train.bucket_paths import checkpoint_path
from engine.train.checkpoint import read_meta, save_params

NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}

# MXFP4 (OCP microscaling, as GPT-OSS publishes its experts; quantization_config quant_method
# "mxfp4"): a tensor `X` is stored as `X_blocks` (..., out, in / 32, 16) uint8, two 4-bit
# E2M1 codes per byte, low nibble first, and `X_scales` (..., out, in / 32) uint8, one E8M0
# power of two (bias 127) per block of 32. Dequantized, it is (..., in, out): the layout of X.
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
FP4_E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)


def mxfp4_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The dequantized (..., in, out) shape of MXFP4 blocks (..., out, in / 32, 16)."""
    *lead, out, groups, _ = blocks_shape
    return (*lead, groups * 32, out)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 (..., in, out) values of MXFP4 blocks (..., out, in / 32, 16) and scales
    (..., out, in / 32); exact (every value is a 4-bit code times a power of two)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # low nibble first
    values = FP4_E2M1[codes].reshape(*blocks.shape[:-1], 32)
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return np.swapaxes(values.reshape(*blocks.shape[:-2], -1), -1, -2)


def _at(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


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


def _has_tensors(files: list[Path], prefix: str) -> bool:
    """Does any weight file hold a tensor whose name starts with `prefix`?"""
    for path in files:
        with SafetensorsFile(path) as st:
            if any(name.startswith(prefix) for name in st.names()):
                return True
    return False


def _source_dtype(files: list[Path]) -> str:
    """bfloat16 when most of the first file's float bytes are bfloat16, else float32: a bf16
    checkpoint may keep a few small tensors in float32 (DeepSeek-V3's router weight and
    score bias, transformers' _keep_in_fp32_modules), which must not double the whole model."""
    nbytes: dict[np.dtype, int] = {}
    with SafetensorsFile(files[0]) as st:
        for name in st.names():
            dtype = st.dtype(name)
            if dtype.kind in "ui":  # quantized payloads (MXFP4 blocks and scales) say nothing of the dtype
                continue
            nbytes[dtype] = nbytes.get(dtype, 0) + int(np.prod(st.shape(name))) * dtype.itemsize
    return "bfloat16" if max(nbytes, key=nbytes.get, default=None) == np.dtype(ml_dtypes.bfloat16) else "float32"


def _mxfp4_scales(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], np.dtype]]:
    """Every `*_scales` tensor of the checkpoint: its file, shape and dtype. A sharded
    checkpoint may put a tensor's blocks and its scales in different files."""
    found = {}
    for path in files:
        with SafetensorsFile(path) as st:
            for name in st.names():
                if name.endswith(MXFP4_SCALES):
                    found[name] = (path, tuple(st.shape(name)), st.dtype(name))
    return found


def _check_mxfp4(st: SafetensorsFile, path: Path, scales_at: dict, blocks: str, name: str, want) -> None:
    """MXFP4 blocks of tensor `name` and their scales (in any file): uint8, with the shapes
    that dequantize to `want`."""
    scales = name + MXFP4_SCALES
    if scales not in scales_at:
        raise ConfigError(f"{path.name}: MXFP4 tensor '{blocks}' has no '{scales}' in the checkpoint")
    _, s_shape, s_dtype = scales_at[scales]
    b_shape = tuple(st.shape(blocks))
    if st.dtype(blocks) != np.uint8 or s_dtype != np.uint8:
        raise ConfigError(
            f"{path.name}: MXFP4 tensors '{blocks}' and '{scales}' must be uint8, got {st.dtype(blocks)} and {s_dtype}"
        )
    if len(b_shape) < 3 or b_shape[-1] != 16 or s_shape != b_shape[:-1] or mxfp4_shape(b_shape) != tuple(want):
        raise ConfigError(
            f"{path.name}: MXFP4 tensor '{blocks}' {list(b_shape)} with scales {list(s_shape)} does "
            f"not dequantize to the shape config.json implies for '{name}', {list(want)}"
        )


def _resplit(jobs: list, split: dict[tuple, list], architecture: str) -> list:
    """`jobs` with the TensorSpec.any_split parts that a checkpoint stores at other bounds than
    the table's read at theirs: each array's parts in the table's order, where together they
    fill the sliced axis as the table's do."""
    bounds: dict[str, TensorSpec] = {}
    for parts_of in split.values():
        parts_of.sort(key=lambda part: part[1].last_axis_slice[0])
        axis = parts_of[0][1].slice_axis
        table = [part[3][axis] if axis >= 0 else part[3][-1] for part in parts_of]
        stored = [part[2][axis] if axis >= 0 else part[2][-1] for part in parts_of]
        names = ", ".join(part[0] for part in parts_of)
        if len(parts_of) != len({p[1].last_axis_slice for p in parts_of}) or sum(stored) != sum(table):
            raise ConfigError(
                f"{names}: together {sum(stored)} along axis {axis}, "
                f"but config.json ({architecture}) implies {sum(table)}"
            )
        start = parts_of[0][1].last_axis_slice[0]
        for (name, spec, _, _), size in zip(parts_of, stored, strict=True):
            bounds[name] = dataclasses.replace(spec, last_axis_slice=(start, start + size))
            start += size
    return [(path, name, bounds.get(name, spec), index, blocks) for path, name, spec, index, blocks in jobs]


def convert_hf(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    log: Callable[[str], None] | None = None,
    checkpoint: str | None = None,
) -> dict[str, Any]:
    """Convert a HF model directory into out_dir/checkpoint (Orbax; or the directory or bucket
    URL `checkpoint`) + out_dir/tokenizer.

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
    cfg, compute = model_config_from_hf(hf_config, param_dtype=dtype, where=str(config_path))
    family = get_family(cfg.family)
    held = 0  # the multi-token-prediction modules the weights hold (transformers saves none)
    while held < 8 and (cfg.mtp_layers or family.mtp_in_weights) and _has_tensors(files, family.mtp_prefix(cfg, held)):
        held += 1
    if held < cfg.mtp_layers or (family.mtp_in_weights and held != cfg.mtp_layers):
        if held < cfg.mtp_layers:  # config.json names modules the weights do not hold: the model without them
            log(f"convert: config.json names {cfg.mtp_layers} multi-token-prediction modules, the weights hold {held}")
        cfg = type(cfg).model_validate({**cfg.model_dump(), **family.mtp_fields(cfg, held)})
    architecture = get_family(cfg.family).architecture
    # A multimodal checkpoint (Llama4ForConditionalGeneration): its text decoder, under the
    # family's names (families/base.py Multimodal); the vision tower and projector are skipped.
    multimodal = (multimodal_of(hf_config) or (None, None))[1]
    text_config = text_config_of(hf_config)
    shapes = abstract_model_params(cfg, compute, mesh=None)  # the stacked layout: scan_layers
    check_table_covers(cfg, shapes)

    # HF name -> (spec, index into the stacked array: () top-level, (layer,) or (layer, expert),
    # engine shape of one slot)
    top, per_layer = tensor_table(cfg)
    expected: dict[str, tuple[TensorSpec, tuple, tuple]] = {
        s.hf_name: (s, (), part_shape(s, _at(shapes, s.path).shape)) for s in top if not s.export_only
    }
    stacks = dict(cfg.layer_stacks() + cfg.mtp_stacks())  # the model's layers, its MTP layer's index
    for spec in per_layer:  # index: the layer within its stack; {i}: the model's layer
        stacked = _at(shapes, (spec.stack, *spec.path)).shape
        for i, layer in enumerate(stacks[spec.stack]):
            if spec.experts:
                for j in range(stacked[1]):
                    name = spec.hf_name.format(i=layer, j=j, k=layer - cfg.num_layers)
                    expected[name] = (spec, (i, j), part_shape(spec, stacked[2:]))
            else:
                name = spec.hf_name.format(i=layer, k=layer - cfg.num_layers)  # {k}: a module's depth
                expected[name] = (spec, (i,), part_shape(spec, stacked[1:]))
    target = NP_DTYPES[dtype]
    params: dict = {}
    for spec in top:
        for path in parts(spec):
            _set(params, path, np.empty(_at(shapes, path).shape, target))
    for spec in per_layer:
        for path in parts(spec):
            _set(params, (spec.stack, *path), np.empty(_at(shapes, (spec.stack, *path)).shape, target))

    def slots(spec: TensorSpec, index: tuple) -> list[np.ndarray]:
        """The engine arrays (views of `params`) one HF tensor fills."""
        return [_at(params, p) if not index else _at(params, (spec.stack, *p))[index] for p in parts(spec)]

    if multimodal is not None:
        log(f"convert: {multimodal.architecture}: reading its text decoder as {architecture}")
    log(f"convert: {architecture}, {len(expected)} tensors to read")
    # Every header first: a mismatch fails in a second, not after reading gigabytes.
    # (file, HF name, spec, index, the MXFP4 blocks' name or None)
    jobs: list[tuple[Path, str, TensorSpec, tuple, str | None]] = []
    tied_head: Path | None = None
    source_names: dict[str, str] = {}  # a multimodal checkpoint's name of each text-model name
    skipped: list[str] = []  # its tensors outside the text decoder
    ignored: list[str] = []  # tensors of modules the engine does not run (Family.ignored_tensor)
    mxfp4 = (hf_config.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    scales_at = _mxfp4_scales(files) if mxfp4 else {}
    split: dict[tuple, list] = {}  # TensorSpec.any_split parts stored at other bounds
    for path in files:
        with SafetensorsFile(path) as st:
            for stored in st.names():
                if multimodal is not None:
                    text_name = multimodal.text_name(stored)
                    if text_name is None:
                        skipped.append(stored)
                        continue
                    source_names[text_name] = stored
                    stored = text_name
                own_name = get_family(cfg.family).checkpoint_name(stored)
                if own_name != stored:  # a base model's names (GPT-2's published `h.0.`, no `transformer.`)
                    source_names[own_name] = stored
                    stored = own_name
                name, blocks = stored, None
                if mxfp4 and stored.endswith(MXFP4_SCALES) and stored[: -len(MXFP4_SCALES)] in expected:
                    continue  # read with its blocks
                if mxfp4 and stored.endswith(MXFP4_BLOCKS) and stored[: -len(MXFP4_BLOCKS)] in expected:
                    name, blocks = stored[: -len(MXFP4_BLOCKS)], stored
                if name.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints saved
                    continue
                if get_family(cfg.family).ignored_tensor(name, cfg):
                    ignored.append(name)
                    continue
                if name == "lm_head.weight" and cfg.tie_embeddings:
                    tied_head = path
                    continue
                if name not in expected:
                    raise ConfigError(
                        f"{path.name}: unexpected tensor '{name}' for {architecture} as config.json describes it "
                        f"({cfg.num_layers} layers); config and weights do not match"
                    )
                spec, index, shape = expected[name]
                fused = [slot.shape for slot in slots(spec, index)] if spec.fused_with else None
                want = fused_hf_shape(spec, fused) if fused else hf_shape(spec, shape)
                if blocks is not None:
                    _check_mxfp4(st, path, scales_at, blocks, name, want)
                elif spec.any_split:  # checked with its other parts (_resplit)
                    split.setdefault((spec.stack, spec.path, index), []).append(
                        (name, spec, st.shape(source_names.get(name, name)), want)
                    )
                elif st.shape(source_names.get(name, name)) != want:
                    raise ConfigError(
                        f"{path.name}: tensor '{source_names.get(name, name)}' has shape "
                        f"{list(st.shape(source_names.get(name, name)))}, but config.json ({architecture}) "
                        f"implies {list(want)}"
                    )
                else:
                    st.dtype(source_names.get(name, name))  # raises for a dtype we cannot read
                jobs.append((path, name, spec, index, blocks))
    jobs = _resplit(jobs, split, architecture)
    seen = {name for _, name, _, _, _ in jobs}
    missing = [name for name in expected if name not in seen]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"{hf_dir}: tensor '{missing[0]}'{more} is missing for {architecture}")

    # Then the data, a few tensors at a time: numpy's copies release the GIL, so reading and
    # transposing overlap. Each tensor has its own slot; at most `workers` are in flight.
    handles = {path: SafetensorsFile(path) for path in files}

    def load(job) -> int:
        path, name, spec, index, blocks = job
        if blocks is None:
            raw = handles[path].get(source_names.get(name, name))
        else:
            scales = name + MXFP4_SCALES
            raw = dequantize_mxfp4(handles[path].get(blocks), handles[scales_at[scales][0]].get(scales))
        targets = slots(spec, index)  # one array, or those HF interleaves or fuses in this tensor
        if spec.merged_rows:  # DBRX's experts (E * f, d): the expert axis apart again
            raw = raw.reshape(unmerged_hf_shape(spec, targets[0].shape))
        if spec.swap_last:  # Gemma 4's experts: HF's last two axes are the engine's swapped
            raw = raw.swapaxes(-1, -2)
        if spec.fused_with:
            pieces = unfuse(spec, raw, [slot.shape for slot in targets])
        elif spec.concatenated_with:  # Llama 4's gate_up_proj: the parts one after another on the last axis
            pieces = np.split(raw, len(targets), axis=-1)
        else:
            pieces = [
                deinterleave(raw, part, len(targets)) if len(targets) > 1 else raw for part in range(len(targets))
            ]
        for slot, piece in zip(targets, pieces, strict=True):
            copy_part_into(slot, spec, np.ascontiguousarray(piece) if spec.fused_with else piece)
        return raw.nbytes

    try:
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            nbytes = sum(pool.map(load, jobs))
    finally:
        for handle in handles.values():
            handle.close()
    log(f"convert: read {len(jobs)} tensors from {len(files)} file(s)")
    if ignored:
        layers = {".".join(n.split(".")[:3]) if n.startswith("model.layers.") else n.split(".")[0] for n in ignored}
        modules = sorted(layers)
        log(f"convert: skipped {len(ignored)} tensors of modules the engine does not run: {', '.join(modules)}")
    if skipped and multimodal is not None:
        roots = {prefix.split(".")[0] for _, prefix in multimodal.prefixes}  # under them: a level deeper
        outside = sorted({".".join(n.split(".")[: 1 + (n.split(".")[0] in roots)]) + "." for n in skipped})
        log(
            f"convert: skipped {len(skipped)} tensors of {multimodal.architecture} outside the text decoder "
            f"(the vision tower, projector and any audio tower: {', '.join(outside)}); the checkpoint is the text "
            f"model {architecture}"
        )
    if tied_head is not None:
        with SafetensorsFile(tied_head) as st:
            head = source_names.get("lm_head.weight", "lm_head.weight")
            if not np.array_equal(st.get(head).astype(target), params["embed_vd"]):
                raise ConfigError(
                    f"{tied_head.name}: tie_word_embeddings is true but 'lm_head.weight' differs from "
                    f"'model.embed_tokens.weight'"
                )

    generation = hf_dir / "generation_config.json"
    meta = {
        "step": 0,
        "model": cfg.model_dump(mode="json"),
        "compute": compute.model_dump(mode="json"),
        "format": CHECKPOINT_FORMAT,
        "hf": {
            "architecture": architecture,
            "token_ids": {k: text_config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
            "generation_config": json.loads(generation.read_text()) if generation.is_file() else None,
        },
        "source": {"kind": "huggingface", "path": str(hf_dir.absolute()), "files": source_fingerprint(hf_dir)},
    }
    checkpoint_dir = checkpoint_path(checkpoint or out_dir / CHECKPOINT_DIR)
    if checkpoint_dir.exists():  # a partial earlier attempt
        epath.Path(checkpoint_dir).rmtree() if is_url(checkpoint_dir) else shutil.rmtree(checkpoint_dir)
    save_params(checkpoint_dir, 0, params, meta)
    params.clear()  # the host copy is on disk now: free it before the tokenizer copy
    tokenizer_files = copy_tokenizer(hf_dir, out_dir / TOKENIZER_DIR)
    seconds = time.perf_counter() - start
    log(f"convert: {architecture}, {cfg.num_params():,} params, {nbytes / 1e9:.3f} GB in {seconds:.1f}s")
    return {
        "architecture": architecture,
        "family": cfg.family,
        "num_params": cfg.num_params(),
        "source_bytes": nbytes,
        "seconds": seconds,
        "dtype": dtype,
        "checkpoint": str(checkpoint_dir),
        "tokenizer_files": tokenizer_files,
        "skipped_tensors": len(skipped),
        "model": cfg.model_dump(mode="json"),
        "compute": compute.model_dump(mode="json"),
        "source": meta["source"],
    }


def convert_peft(
    adapter_dir: str | Path, out_dir: str | Path, base_checkpoint: str | Path, *, log=None
) -> dict[str, Any]:
    """A PEFT LoRA adapter directory -> an adapter checkpoint on the engine's base
    `base_checkpoint` (<out_dir>/checkpoint, params the adapter alone, meta `lora` naming the
    base), which every stage that takes a checkpoint reads as the base with the adapter folded
    in. An adapter whose tensors do not fit the base (another architecture or size) is a
    ConfigError naming both shapes; nothing is written then."""
    log = log or (lambda msg: None)
    # The base: an absolute path, or its bucket URL (a bucket store's checkpoint), kept a URL.
    adapter_dir, out_dir, base_checkpoint = Path(adapter_dir), Path(out_dir), checkpoint_path(base_checkpoint)
    lora = lora_config_from_peft(adapter_dir)
    _, meta = read_meta(base_checkpoint)
    if meta.get("lora"):
        raise ConfigError(f"{base_checkpoint}: is itself an adapter; convert a PEFT adapter onto a full checkpoint")
    cfg = ModelConfig.model_validate(meta["model"])
    compute = ComputeConfig.model_validate(meta["compute"])
    try:
        lora.targets(cfg)
    except ValueError as e:
        raise ConfigError(f"{adapter_dir / ADAPTER_CONFIG}: {e}") from None
    shapes = split_adapter(abstract_model_params(cfg, compute, None, lora))[0]
    adapter = adapter_from_peft(adapter_dir, cfg, lora, shapes, scan_layers=compute.scan_layers)
    checkpoint = out_dir / "checkpoint"
    out_meta = {
        "step": 0,
        "model": cfg.model_dump(mode="json"),
        "compute": compute.model_dump(mode="json"),
        "format": meta.get("format"),
        "stage": "convert",
        "lora": {
            **lora.model_dump(mode="json"),
            "base_checkpoint": str(base_checkpoint),
            "base_relative": None
            if is_url(base_checkpoint)
            else os.path.relpath(base_checkpoint, checkpoint.absolute()),
        },
        "source": {"kind": "peft", "path": str(adapter_dir.absolute())},
    }
    save_params(checkpoint, 0, adapter, out_meta)
    log(f"convert: a rank-{lora.rank} PEFT adapter on {', '.join(lora.targets(cfg))} of {base_checkpoint}")
    return {
        "architecture": "peft-lora",
        "family": cfg.family,
        "rank": lora.rank,
        "targets": list(lora.targets(cfg)),
        "base_checkpoint": str(base_checkpoint),
    }
