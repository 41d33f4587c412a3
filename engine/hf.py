"""Hugging Face checkpoints in and out: config.json <-> ModelConfig, safetensors <-> Orbax.

    convert_hf(hf_dir, out_dir)         a HF model directory -> out_dir/checkpoint/ (Orbax,
                                        step 0, params + meta) and out_dir/tokenizer/
    export_hf(checkpoint_dir, out_dir)  an Orbax checkpoint -> config.json,
                                        generation_config.json, model-0000i-of-0000n.safetensors
                                        + model.safetensors.index.json, tokenizer files

    python -m engine.hf convert HF_DIR OUT_DIR [--dtype float32|bfloat16]
    python -m engine.hf export CHECKPOINT_DIR OUT_DIR [--tokenizer DIR] [--max-shard-gb 5]

Families differ in a few config keys (FAMILIES, `model_config_from_hf`) and in which norm
tensor is which (`tensor_table`); the weights themselves only move between HF's
(out, in) matrices and the engine's named axes. Conversion streams: each tensor is read
from a memory-mapped file straight into its slot of the stacked (layers, ...) array, so the
peak is one model in memory. The checkpoint holds no mesh: restore it onto any mesh with
engine.checkpoint.load_params(dir, engine.train.abstract_model_params(cfg, mesh)).
"""

from __future__ import annotations

import argparse
import dataclasses
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

from engine.config import ConfigError, ModelConfig, RopeScaling
from engine.safetensors_io import SafetensorsFile, write_safetensors

FORMAT = "trainflow.checkpoint/1"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


@dataclasses.dataclass(frozen=True)
class Family:
    architecture: str
    """The transformers class (config.json `architectures[0]`)."""
    model_type: str
    fixed: dict[str, Any]
    """ModelConfig fields every model of the family has."""
    hf_defaults: dict[str, Any]
    """transformers' defaults for config.json keys a file may leave out."""


_GEMMA = {"norm_zero_centered": True, "scale_embeddings": True}
FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "llama", {}, {"max_position_embeddings": 2048, "tie_word_embeddings": False}),
    "mistral": Family("MistralForCausalLM", "mistral", {}, {"max_position_embeddings": 131072, "tie_word_embeddings": False}),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", {"qkv_bias": True}, {"max_position_embeddings": 32768, "tie_word_embeddings": False}),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", {"qk_norm": True}, {"max_position_embeddings": 32768, "tie_word_embeddings": False}),
    "gemma": Family("GemmaForCausalLM", "gemma", _GEMMA, {"max_position_embeddings": 8192, "tie_word_embeddings": True}),
    "gemma2": Family("Gemma2ForCausalLM", "gemma2", {**_GEMMA, "post_norms": True},
                     {"max_position_embeddings": 8192, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
                      "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "gemma3": Family("Gemma3ForCausalLM", "gemma3_text", {**_GEMMA, "post_norms": True, "qk_norm": True},
                     {"max_position_embeddings": 131072, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
                      "sliding_window": 4096, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}),
}
BY_MODEL_TYPE = {f.model_type: name for name, f in FAMILIES.items()}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
# Fields that describe a run rather than the architecture; left out of "can HF express it".
RUN_FIELDS = ("param_dtype", "dtype", "scan_layers", "remat", "init_std")


# --------------------------------------------------------------------------- config.json


def _rope_from_hf(params: dict, where: str) -> tuple[float, RopeScaling | None]:
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", 10000.0))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor is not supported")
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=params["factor"])
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3", factor=params["factor"], low_freq_factor=params["low_freq_factor"],
            high_freq_factor=params["high_freq_factor"],
            original_max_position=params["original_max_position_embeddings"],
        )
    raise ConfigError(f"{where}: RoPE type '{kind}' is not supported (supported: default, linear, llama3)")


def _rope_to_hf(scaling: RopeScaling | None) -> dict | None:
    if scaling is None:
        return None
    if scaling.kind == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    return {"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position}


def _layer_types(hf: dict, family: str, num_layers: int, where: str) -> list[bool]:
    """Per layer: sliding-window attention? From `layer_types`, or each family's older keys."""
    types = hf.get("layer_types")
    if family in ("llama", "gemma"):  # no sliding-window attention in these
        return [False] * num_layers
    if family == "mistral":  # one window for all layers, or none
        return [hf.get("sliding_window") is not None] * num_layers
    if types is None:
        if family == "gemma2":
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
        elif family == "gemma3":
            period = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)]
        elif hf.get("use_sliding_window"):  # Qwen: the layers from max_window_layers on
            types = ["sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
                     for i in range(num_layers)]
        else:
            types = ["full_attention"] * num_layers
    if len(types) != num_layers:
        raise ConfigError(f"{where}: layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ConfigError(f"{where}: layer type '{unknown[0]}' is not supported (full_attention, sliding_attention)")
    return [t == "sliding_attention" for t in types]


def _shortest_period(flags: list[bool]) -> list[bool]:
    for period in range(1, len(flags) + 1):
        if all(flags[i] == flags[i % period] for i in range(len(flags))):
            return flags[:period]
    raise AssertionError("unreachable")


def model_config_from_hf(hf: dict, *, param_dtype: str = "float32", where: str = "config.json") -> ModelConfig:
    """The ModelConfig of a transformers config.json (legacy keys or transformers 5's)."""
    model_type = hf.get("model_type")
    architecture = (hf.get("architectures") or ["?"])[0]
    family = BY_MODEL_TYPE.get(model_type)
    if family is None or architecture not in ("?", FAMILIES[family].architecture):
        supported = ", ".join(f.architecture for f in FAMILIES.values())
        raise ConfigError(
            f"{where}: unsupported architecture '{architecture}' (model_type '{model_type}'); supported: {supported}"
        )
    fam = FAMILIES[family]
    what = f"{where} ({fam.architecture})"

    def get(key, default=None):
        value = hf.get(key)
        return fam.hf_defaults.get(key, default) if value is None else value

    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if hf.get(key) is None:
            raise ConfigError(f"{what}: missing key '{key}'")
    for key in ("attention_bias", "mlp_bias", "use_bidirectional_attention"):
        if hf.get(key) and family != "qwen2":
            raise ConfigError(f"{what}: {key}=true is not supported")
    activation_name = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if family == "gemma" and activation_name == "gelu":  # old Gemma configs; transformers reads tanh
        activation_name = "gelu_pytorch_tanh"
    if activation_name not in ACTIVATIONS:
        raise ConfigError(f"{what}: activation '{activation_name}' is not supported (silu, gelu_pytorch_tanh)")

    rope = hf.get("rope_parameters")
    if family == "gemma3":
        if rope and "full_attention" in rope:
            global_rope, local_rope = rope["full_attention"], rope.get("sliding_attention") or {}
        else:
            global_rope = {"rope_theta": get("rope_theta"), **(hf.get("rope_scaling") or {})}
            local_rope = {"rope_theta": get("rope_local_base_freq")}
        local_theta, local_scaling = _rope_from_hf({"rope_theta": 10_000.0, **local_rope}, what)
        if local_scaling is not None:
            raise ConfigError(f"{what}: RoPE scaling of sliding-window layers is not supported")
    else:
        global_rope = rope or {"rope_theta": get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
        local_theta = None
    rope_theta, rope_scaling = _rope_from_hf(global_rope, what)

    num_layers, num_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    is_local = _layer_types(hf, family, num_layers, what)
    window = get("sliding_window") if any(is_local) else None
    fields = dict(
        family=family, vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads, mlp_dim=hf["intermediate_size"],
        max_seq_len=get("max_position_embeddings"), norm_eps=get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta, rope_scaling=rope_scaling, rope_local_theta=local_theta,
        tie_embeddings=get("tie_word_embeddings"), activation=ACTIVATIONS[activation_name],
        attention_pattern=["local" if x else "global" for x in _shortest_period(is_local)],
        sliding_window=window, init_std=get("initializer_range", 0.02),
        param_dtype=param_dtype, dtype=param_dtype, **fam.fixed,
    )
    if family in ("gemma2", "gemma3"):
        fields.update(query_pre_attn_scalar=get("query_pre_attn_scalar"),
                      attn_logit_softcap=hf.get("attn_logit_softcapping", fam.hf_defaults.get("attn_logit_softcapping")),
                      final_logit_softcap=hf.get("final_logit_softcapping", fam.hf_defaults.get("final_logit_softcapping")))
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise ConfigError(f"{what}: does not make a valid model: {e}") from None


def model_config_to_hf(cfg: ModelConfig, token_ids: dict | None = None) -> dict:
    """config.json for `cfg`, in the keys published checkpoints use (read by transformers 4 and 5).

    Raises ConfigError naming the field when cfg's family cannot express it (e.g. QK-norm
    with family llama).
    """
    fam = FAMILIES[cfg.family]
    is_local = cfg.layer_is_local()
    hf: dict[str, Any] = {
        "architectures": [fam.architecture], "model_type": fam.model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_to_hf(cfg.rope_scaling), "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std, "attention_dropout": 0.0, "use_cache": True, "dtype": cfg.param_dtype,
    }
    activation = {v: k for k, v in ACTIVATIONS.items() if k != "gelu_new"}[cfg.activation]
    hf["hidden_activation" if cfg.family in ("gemma2", "gemma3") else "hidden_act"] = activation
    if cfg.family != "qwen2":
        hf["attention_bias"] = False
    if cfg.family == "mistral":
        hf["sliding_window"] = cfg.sliding_window if all(is_local) else None
    elif cfg.family not in ("llama", "gemma"):
        hf["layer_types"] = ["sliding_attention" if x else "full_attention" for x in is_local]
        hf["sliding_window"] = cfg.sliding_window
    if cfg.family in ("qwen2", "qwen3"):
        first_local = is_local.index(True) if any(is_local) else cfg.num_layers
        hf.update(use_sliding_window=any(is_local), max_window_layers=first_local)
    if cfg.family in ("gemma2", "gemma3"):
        scalar = cfg.query_pre_attn_scalar
        hf.update(query_pre_attn_scalar=int(scalar) if scalar and scalar.is_integer() else scalar,  # an int field
                  attn_logit_softcapping=cfg.attn_logit_softcap,
                  final_logit_softcapping=cfg.final_logit_softcap)
    if cfg.family == "gemma3":
        hf["rope_local_base_freq"] = cfg.rope_local_theta or cfg.rope_theta
    hf.update({k: v for k, v in (token_ids or {}).items() if v is not None})
    again = model_config_from_hf(hf, param_dtype=cfg.param_dtype, where=f"family '{cfg.family}'")
    ours, theirs = cfg.model_dump(exclude=set(RUN_FIELDS)), again.model_dump(exclude=set(RUN_FIELDS))
    for key in ours:
        if ours[key] != theirs[key]:
            raise ConfigError(
                f"model.{key}={ours[key]!r} cannot be expressed as a Hugging Face {fam.architecture} "
                f"(family '{cfg.family}' implies {theirs[key]!r}); choose the family that has it"
            )
    return hf


# --------------------------------------------------------------------------- tensor names


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One engine parameter and its Hugging Face tensor."""

    path: tuple[str, ...]
    """Key path in the engine's params (under `blocks` for per-layer tensors)."""
    hf_name: str
    """HF name; `{i}` stands for the layer index."""
    in_dims: int | None
    """A matmul: the engine array's first `in_dims` axes are HF's input (second) axis, the
    rest its output axis. None: same values, HF shape flattened when `flatten`."""
    flatten: bool = False


def tensor_table(cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(top-level tensors, per-layer tensors) of `cfg`, in the order HF files list them."""
    top = [TensorSpec(("embed_vd",), "model.embed_tokens.weight", None)]
    layer = "model.layers.{i}."
    per_layer = [
        TensorSpec(("attn_norm", "scale"), layer + "input_layernorm.weight", None),
        TensorSpec(("attn", "wq_dnh"), layer + "self_attn.q_proj.weight", 1),
        TensorSpec(("attn", "wk_dkh"), layer + "self_attn.k_proj.weight", 1),
        TensorSpec(("attn", "wv_dkh"), layer + "self_attn.v_proj.weight", 1),
        TensorSpec(("attn", "wo_nhd"), layer + "self_attn.o_proj.weight", 2),
    ]
    if cfg.qkv_bias:
        per_layer += [TensorSpec(("attn", f"b{x}_{'nh' if x == 'q' else 'kh'}"), layer + f"self_attn.{x}_proj.bias",
                                 None, flatten=True) for x in "qkv"]
    if cfg.qk_norm:
        per_layer += [TensorSpec(("attn", f"{x}_norm", "scale"), layer + f"self_attn.{x}_norm.weight", None) for x in "qk"]
    if cfg.post_norms:  # Gemma 2/3: post_attention_layernorm is the attention output's norm
        per_layer += [
            TensorSpec(("post_attn_norm", "scale"), layer + "post_attention_layernorm.weight", None),
            TensorSpec(("mlp_norm", "scale"), layer + "pre_feedforward_layernorm.weight", None),
            TensorSpec(("post_mlp_norm", "scale"), layer + "post_feedforward_layernorm.weight", None),
        ]
    else:
        per_layer.append(TensorSpec(("mlp_norm", "scale"), layer + "post_attention_layernorm.weight", None))
    per_layer += [
        TensorSpec(("mlp", "w_gate_df"), layer + "mlp.gate_proj.weight", 1),
        TensorSpec(("mlp", "w_up_df"), layer + "mlp.up_proj.weight", 1),
        TensorSpec(("mlp", "w_down_fd"), layer + "mlp.down_proj.weight", 1),
    ]
    top.append(TensorSpec(("final_norm", "scale"), "model.norm.weight", None))
    if not cfg.tie_embeddings:
        top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
    return top, per_layer


def hf_shape(spec: TensorSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    if spec.in_dims is not None:
        return (int(np.prod(shape[spec.in_dims:])), int(np.prod(shape[: spec.in_dims])))
    return (int(np.prod(shape)),) if spec.flatten else tuple(shape)


def to_engine(spec: TensorSpec, hf_array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The engine's view of a HF tensor (the reference; conversion uses `copy_into`)."""
    return (hf_array.T if spec.in_dims is not None else hf_array).reshape(shape)


def _transpose_into(dst_2d: np.ndarray, src_2d: np.ndarray, block: int = 16) -> None:
    """dst = src.T, copied as raw bits in blocks of rows: numpy's plain strided transpose
    is ~10x slower, and slower still on ml_dtypes' bfloat16."""
    bits = np.dtype(f"u{src_2d.dtype.itemsize}")
    src, dst = src_2d.view(bits), dst_2d.view(bits)
    for i in range(0, src.shape[0], block):
        dst[:, i:i + block] = src[i:i + block].T


def copy_into(slot: np.ndarray, spec: TensorSpec, hf_array: np.ndarray) -> None:
    """slot[...] = to_engine(spec, hf_array) cast to slot's dtype; `slot` is C-contiguous."""
    if hf_array.dtype != slot.dtype:
        hf_array = hf_array.astype(slot.dtype)  # a contiguous cast first: far faster than a strided one
    if spec.in_dims is None:
        slot.reshape(-1)[...] = hf_array.reshape(-1)
    else:
        _transpose_into(slot.reshape(hf_array.shape[::-1]), hf_array)


def to_hf(spec: TensorSpec, array: np.ndarray) -> np.ndarray:
    """A new C-contiguous array in HF's layout."""
    shape = hf_shape(spec, array.shape)
    if spec.in_dims is None:
        return np.ascontiguousarray(array.reshape(shape))
    out = np.empty(shape, array.dtype)
    _transpose_into(out, array.reshape(shape[::-1]))
    return out


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
