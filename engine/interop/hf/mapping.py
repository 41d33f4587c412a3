"""What a Hugging Face checkpoint means to the engine, generically: config.json <->
(ModelConfig, ComputeConfig), and each tensor's layout.

What differs per family (config keys, fixed fields, tensor names) is that family's module in
engine/models/families; this module builds and checks the configs and moves arrays between
HF's (out, in) matrices and the engine's named axes (TensorSpec.in_dims). numpy only, no
JAX: pipeline validation reads config.json through here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pydantic

from engine import flat_keys
from engine.config import ConfigError
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.families import TensorSpec, family_names, family_of_model_type, get_family

# --------------------------------------------------------------------------- config.json

TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def multimodal_of(hf: dict):
    """(the text family, its families/base.py Multimodal) when config.json `hf` describes a
    multimodal ...ForConditionalGeneration checkpoint whose text decoder a family reads
    (Llama 4's model_type llama4); None for any other config."""
    for name in family_names():
        family = get_family(name)
        if family.multimodal is not None and hf.get("model_type") == family.multimodal.model_type:
            text_model_type = (hf.get(family.multimodal.text_config) or {}).get("model_type")
            if family.multimodal.text_model_type in (None, text_model_type):
                return family, family.multimodal
    return None


def text_config_of(hf: dict) -> dict:
    """config.json as its text decoder's: a multimodal checkpoint's `text_config` (its keys
    over the top level's token ids), named as the text family; any other config as it is."""
    found = multimodal_of(hf)
    if found is None:
        return hf
    family, multimodal = found
    text = hf.get(multimodal.text_config)
    if text is None:  # the text config's keys at the top level, beside the towers' (Dots3 Note's published config)
        text = {key: value for key, value in hf.items() if key not in ("vision_config", "audio_config")}
    inherited = {key: hf[key] for key in TOKEN_ID_KEYS if hf.get(key) is not None}
    return {**inherited, **text, "architectures": [family.architecture], "model_type": family.model_type}


def model_config_from_hf(
    hf: dict, *, param_dtype: str = "float32", where: str = "config.json"
) -> tuple[ModelConfig, ComputeConfig]:
    """(architecture, compute settings) of a transformers config.json (legacy keys or
    transformers 5's); the params are stored, and computed with, in `param_dtype`. A
    multimodal checkpoint's config is read as its text decoder's (text_config_of)."""
    hf = text_config_of(hf)
    model_type = hf.get("model_type")
    architecture = (hf.get("architectures") or ["?"])[0]
    family = family_of_model_type(model_type)
    if family is None or architecture not in ("?", family.architecture, *family.also_architectures):
        supported = ", ".join(get_family(name).architecture for name in family_names())
        raise ConfigError(
            f"{where}: unsupported architecture '{architecture}' (model_type '{model_type}'); supported: {supported}"
        )
    what = f"{where} ({family.architecture})"
    fields = family.config_from_hf(hf, what)
    try:
        return ModelConfig(**fields), ComputeConfig(param_dtype=param_dtype, dtype=param_dtype)
    except ValueError as e:
        # One sentence: pydantic's first error (its message, with the field when it is a type error).
        errors = e.errors() if isinstance(e, pydantic.ValidationError) else []
        reason = str(e)
        if errors:
            first = errors[0]
            message = first["msg"].removeprefix("Value error, ")
            field = ".".join(str(part) for part in first.get("loc", ()))
            reason = f"{field}: {message}" if field and first.get("type") != "value_error" else message
        raise ConfigError(f"{what}: does not make a valid model: {reason}") from None


def model_config_to_hf(
    cfg: ModelConfig, token_ids: dict | None = None, *, param_dtype: str = "float32"
) -> dict[str, Any]:
    """config.json for `cfg` as transformers 5 writes it, plus the older keys transformers 4
    reads. `token_ids` (bos/eos/pad_token_id) are written as given, null when unknown, so
    transformers does not fill in its class defaults, which may not be this tokenizer's.

    Raises ConfigError naming the field when cfg's family cannot express it (e.g. QK-norm
    with family llama): the config must read back as exactly `cfg`.
    """
    family = get_family(cfg.family)
    hf = {**family.config_to_hf(cfg), "dtype": param_dtype}
    # a tokenizer's ids win; without one, what the family wrote (Qwen4-Exp's n-grams end at its eos)
    hf.update({key: (token_ids or {}).get(key) if token_ids is not None else hf.get(key) for key in TOKEN_ID_KEYS})
    hf.update({key: value for key, value in family.required_token_ids.items() if hf[key] is None})
    again, _ = model_config_from_hf(hf, where=f"family '{cfg.family}'")
    # by the flat keys (engine/flat_keys.py), so the message names the one field
    ours, theirs = flat_keys.unfold(cfg.model_dump()), flat_keys.unfold(again.model_dump())
    for key in ours:
        if ours[key] != theirs.get(key) and not _same_layers(ours[key], theirs.get(key), key, cfg.num_layers):
            raise ConfigError(
                f"model.{key}={ours[key]!r} cannot be expressed as a Hugging Face {family.architecture} "
                f"(family '{cfg.family}' implies {theirs[key]!r}); choose the family that has it"
            )
    return hf


def _same_layers(ours: Any, theirs: Any, key: str, num_layers: int) -> bool:
    """Two values of a per-layer `*_pattern` field (a period repeated over the layers) that give
    every layer the same kind: [mamba2, attention, mamba2, mamba2] over 4 layers is
    [mamba2, attention, mamba2], the period config.json reads back as."""
    if not key.endswith("_pattern") or not isinstance(ours, list) or not isinstance(theirs, list):
        return False
    return all(ours[i % len(ours)] == theirs[i % len(theirs)] for i in range(num_layers))


# --------------------------------------------------------------------------- tensor names


def tensor_table(cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(top-level tensors, per-layer tensors) of `cfg`, in the order HF files list them."""
    return get_family(cfg.family).tensor_table(cfg)


def _leaf_paths(tree: dict, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    paths: set[tuple[str, ...]] = set()
    for key, value in tree.items():
        path = (*prefix, str(key))
        paths |= _leaf_paths(value, path) if isinstance(value, dict) else {path}
    return paths


def parts(spec: TensorSpec) -> tuple[tuple[str, ...], ...]:
    """The engine params one HF tensor holds: `path`, and those interleaved or fused with it."""
    return (spec.path, *spec.interleaved_with, *spec.fused_with, *spec.concatenated_with)


def check_table_covers(cfg: ModelConfig, shapes: dict) -> None:
    """Assert that the tensor table names every parameter in `shapes` (the stacked layout
    of engine.models.params.abstract_model_params) and nothing else."""
    top, per_layer = tensor_table(cfg)
    mapped = {path for s in top for path in parts(s)}
    mapped |= {(s.stack, *path) for s in per_layer for path in parts(s)}
    leaves = _leaf_paths(shapes)
    assert mapped == leaves, f"tensor_table and the model disagree: {sorted(mapped ^ leaves)}"


# --------------------------------------------------------------------------- layouts


def hf_shape(spec: TensorSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of an engine array of `shape`."""
    if spec.merged_rows:  # DBRX's experts: the first two axes of the unmerged shape as one
        unmerged = unmerged_hf_shape(spec, shape)
        return (unmerged[0] * unmerged[1], *unmerged[2:])
    return unmerged_hf_shape(spec, shape)


def unmerged_hf_shape(spec: TensorSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    """hf_shape before TensorSpec.merged_rows merges its first two axes."""
    if spec.swap_last:
        shape = (*shape[:-2], shape[-1], shape[-2])
        if spec.concatenated_with:  # the parts one after another along HF's second-last axis
            return (*shape[:-2], shape[-2] * (1 + len(spec.concatenated_with)), shape[-1])
        return tuple(shape)
    if spec.interleaved_with or spec.concatenated_with:
        return (*shape[:-1], shape[-1] * (1 + len(spec.interleaved_with) + len(spec.concatenated_with)))
    if spec.in_dims is not None:
        if spec.in_out:  # Conv1D: (in, out)
            return (int(np.prod(shape[: spec.in_dims])), int(np.prod(shape[spec.in_dims :])))
        return (int(np.prod(shape[spec.in_dims :])), int(np.prod(shape[: spec.in_dims])))
    return (int(np.prod(shape)),) if spec.flatten else tuple(shape)


def part_shape(spec: TensorSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the part of an engine array of `shape` that spec's HF tensor holds
    (TensorSpec.last_axis_slice; else the whole)."""
    if spec.last_axis_slice is None:
        return tuple(shape)
    start, stop = spec.last_axis_slice
    axis = spec.slice_axis % len(shape)
    return (*shape[:axis], stop - start, *shape[axis + 1 :])


def part_of(spec: TensorSpec, array: np.ndarray) -> np.ndarray:
    """The view of an engine array that spec's HF tensor holds (TensorSpec.last_axis_slice)."""
    if spec.last_axis_slice is None:
        return array
    return np.moveaxis(np.moveaxis(array, spec.slice_axis, -1)[..., slice(*spec.last_axis_slice)], -1, spec.slice_axis)


def fused_hf_shape(spec: TensorSpec, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The HF shape of the tensor that fuses engine arrays of `shapes` (TensorSpec.fused_with)."""
    each = [hf_shape(spec, shape) for shape in shapes]
    if spec.in_out:  # Conv1D: the parts along the output (second) axis
        return (each[0][0], sum(h[1] for h in each))
    return (sum(h[0] for h in each), *each[0][1:])


def unfuse(spec: TensorSpec, hf_array: np.ndarray, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """A fused HF tensor's row blocks, one per engine array of `shapes` (views; in groups,
    TensorSpec.fused_groups, each part's rows gathered from every group; Conv1D's,
    TensorSpec.in_out, column blocks)."""
    if spec.in_out:
        return np.split(hf_array, np.cumsum([hf_shape(spec, shape)[1] for shape in shapes])[:-1], axis=1)
    rows, groups = [hf_shape(spec, shape)[0] for shape in shapes], spec.fused_groups
    if groups == 1:
        return np.split(hf_array, np.cumsum(rows)[:-1], axis=0)
    assert all(r % groups == 0 for r in rows), f"{spec.hf_name}: rows {rows} are not in {groups} groups"
    grouped = hf_array.reshape(groups, -1, *hf_array.shape[1:])
    pieces = np.split(grouped, np.cumsum([r // groups for r in rows])[:-1], axis=1)
    return [piece.reshape(-1, *hf_array.shape[1:]) for piece in pieces]


def fuse(spec: TensorSpec, hf_arrays: list[np.ndarray]) -> np.ndarray:
    """The fused HF tensor of the parts' HF arrays (unfuse's inverse): one after another along
    the first axis (in groups, TensorSpec.fused_groups), or Conv1D's (TensorSpec.in_out) second."""
    if spec.in_out:
        return np.concatenate(hf_arrays, axis=1)
    groups = spec.fused_groups
    if groups == 1:
        return np.concatenate(hf_arrays)
    grouped = [a.reshape(groups, -1, *a.shape[1:]) for a in hf_arrays]
    return np.concatenate(grouped, axis=1).reshape(-1, *hf_arrays[0].shape[1:])


def to_engine(spec: TensorSpec, hf_array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The engine's view of a HF tensor (the reference; conversion uses `copy_into`)."""
    return (hf_array.T if spec.in_dims is not None and not spec.in_out else hf_array).reshape(shape)


def _transpose_into(dst_2d: np.ndarray, src_2d: np.ndarray, block: int = 16) -> None:
    """dst = src.T, copied as raw bits in blocks of rows: numpy's plain strided transpose
    is ~10x slower, and slower still on ml_dtypes' bfloat16."""
    bits = np.dtype(f"u{src_2d.dtype.itemsize}")
    src, dst = src_2d.view(bits), dst_2d.view(bits)
    for i in range(0, src.shape[0], block):
        dst[:, i : i + block] = src[i : i + block].T


def interleave(arrays: list[np.ndarray]) -> np.ndarray:
    """One array whose last axis alternates the arrays' columns (TensorSpec.interleaved_with)."""
    return np.stack(arrays, axis=-1).reshape(*arrays[0].shape[:-1], -1)


def deinterleave(hf_array: np.ndarray, part: int, parts: int) -> np.ndarray:
    """The part-th of `parts` arrays interleaved along the last axis (a strided view)."""
    return hf_array[..., part::parts]


def copy_into(slot: np.ndarray, spec: TensorSpec, hf_array: np.ndarray) -> None:
    """slot[...] = to_engine(spec, hf_array) cast to slot's dtype; `slot` is C-contiguous."""
    if hf_array.dtype != slot.dtype:
        hf_array = hf_array.astype(slot.dtype)  # a contiguous cast first: far faster than a strided one
    if spec.in_dims is None or spec.in_out:
        slot.reshape(-1)[...] = hf_array.reshape(-1)
    else:
        _transpose_into(slot.reshape(hf_array.shape[::-1]), hf_array)


def copy_part_into(slot: np.ndarray, spec: TensorSpec, hf_array: np.ndarray) -> None:
    """copy_into for a spec of part of `slot` (TensorSpec.last_axis_slice): through a
    C-contiguous array of the part's shape, which copy_into needs."""
    if spec.last_axis_slice is None:
        copy_into(slot, spec, hf_array)
        return
    piece = np.empty(part_shape(spec, slot.shape), slot.dtype)
    copy_into(piece, spec, hf_array)
    part_of(spec, slot)[...] = piece


def to_hf(spec: TensorSpec, array: np.ndarray) -> np.ndarray:
    """A new C-contiguous array in HF's layout."""
    shape = hf_shape(spec, array.shape)
    if spec.in_dims is None or spec.in_out:
        return np.ascontiguousarray(array.reshape(shape))
    out = np.empty(shape, array.dtype)
    _transpose_into(out, array.reshape(shape[::-1]))
    return out


# --------------------------------------------------------------------------- sequence classification
# A reward model is transformers' <Family>ForSequenceClassification: its family's decoder
# (`model.*`) and a `score` Linear (d_model -> num_labels, no bias). Its config.json is the
# causal model's plus num_labels (id2label); engine/interop/hf/sequence_classification.py.

SEQUENCE_CLASSIFICATION = "ForSequenceClassification"
_SEQUENCE_CLASSIFICATION_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextForSequenceClassification"}  # text-only Gemma 3


def sequence_classification_architecture(family: str) -> str:
    """The transformers *ForSequenceClassification class of a family (LlamaForSequenceClassification)."""
    causal = get_family(family).architecture
    return _SEQUENCE_CLASSIFICATION_CLASSES.get(causal, causal.replace("ForCausalLM", SEQUENCE_CLASSIFICATION))


def is_sequence_classification(hf: dict) -> bool:
    """Whether a config.json describes a *ForSequenceClassification model."""
    return str((hf.get("architectures") or ["?"])[0]).endswith(SEQUENCE_CLASSIFICATION)


def causal_view(hf: dict) -> dict:
    """A *ForSequenceClassification config.json as its family's causal model's (the same
    decoder keys), for model_config_from_hf; the labels are the caller's to read."""
    family = family_of_model_type(hf.get("model_type"))
    if family is None or (hf.get("architectures") or ["?"])[0] != sequence_classification_architecture(family.name):
        return hf  # model_config_from_hf names what it cannot read
    return {**hf, "architectures": [family.architecture]}
