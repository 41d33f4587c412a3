"""What a Hugging Face checkpoint means to the engine: config.json <-> ModelConfig per
family, and each engine parameter's tensor name and layout.

A family is a transformers class plus the ModelConfig fields all its models share
(FAMILIES); the rest of the config is read from config.json, in the keys published
checkpoints use or in transformers 5's (`rope_parameters`, `layer_types`). Weights only move
between HF's (out, in) matrices and the engine's named axes (TensorSpec.in_dims).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from engine.config import MODEL_RUN_FIELDS, ConfigError, ModelConfig, RopeScaling


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
    ours, theirs = cfg.model_dump(exclude=MODEL_RUN_FIELDS), again.model_dump(exclude=MODEL_RUN_FIELDS)
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
