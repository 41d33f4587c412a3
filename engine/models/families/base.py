"""What a model family is: a transformers class, the ModelConfig fields all its models share,
its config.json keys both ways, and its tensor table; plus the registry of families.

A family module (llama.py, qwen.py, ...) subclasses `Family`, overrides the few hooks where
it differs from Llama (which the base class describes), and registers itself:

    @register_family
    class Qwen3(Family):
        name, architecture, model_type = "qwen3", "Qwen3ForCausalLM", "qwen3"
        fixed = {"qk_norm": True}
        ...

Families speak plain dicts of ModelConfig fields; engine/interop/hf/mapping.py builds the
ModelConfig and moves the weights. The registry is engine/models/family_registry.py, below
ModelConfig (which validates `family` against it), so a family may import ModelConfig. config.json is read in the keys
published checkpoints use or in transformers 5's (`rope_parameters`, `layer_types`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

from engine.config import ConfigError
from engine.models import family_registry
from engine.models.config import ModelConfig

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "xielu": "xielu"}
"""config.json activation name -> ModelConfig.mlp.activation."""
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
LAYER = "model.layers.{i}."
EXPERT = "experts.{j}."


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
    experts: bool = False
    """One HF tensor per expert (`{j}` in hf_name stands for the expert index): the engine's
    per-layer array has an expert axis first, and in_dims/flatten describe one expert's slice.
    Also one per head of a per-head norm's scale (StableLM 2's q_layernorm.norms.{j})."""
    interleaved_with: tuple[tuple[str, ...], ...] = ()
    """More engine params stored interleaved with `path` in HF's one tensor, along its last
    axis (GPT-OSS's gate_up_proj: gate at even columns, up at odd): of the n arrays, the
    i-th is HF's [..., i::n]. Same shapes; in_dims must be None."""
    fused_with: tuple[tuple[str, ...], ...] = ()
    """More engine params stored after `path` in HF's one tensor, concatenated along its first
    (output) axis, each laid out as in_dims says (Phi-3's qkv_proj: q, k, v; gate_up_proj:
    gate, up). Their shapes may differ."""
    fused_groups: int = 1
    """With fused_with: HF's rows are this many equal groups, one after another, each holding
    its share of every part in order (GPT-NeoX's query_key_value, (heads, 3, head_dim): groups
    = heads; Falcon's, each KV group's queries, key and value: groups = KV heads). 1: the parts
    whole, one after another."""
    concatenated_with: tuple[tuple[str, ...], ...] = ()
    """More engine params stored after `path` in HF's one tensor, concatenated along its last
    axis (Llama 4's experts' gate_up_proj (E, d, 2f): gate then up, `chunk(2, -1)`). Same
    shapes; in_dims must be None."""
    stack: str = "blocks"
    """The layer stack a per-layer tensor belongs to (ModelConfig.layer_stacks): `blocks`, or
    the `dense_blocks` of a mixture of experts' dense layers (DeepSeek-V3's first layers,
    Qwen3-MoE's mlp_only_layers); `{i}` is always the model's layer index."""
    export_only: bool = False
    """A copy of another tensor that export writes and conversion skips (a multi-token-
    prediction layer's embed_tokens and shared_head.head: transformers' MtpModel uses the main
    model's, as the engine does)."""
    in_out: bool = False
    """A matmul stored (in, out), HF's Conv1D (GPT-2, GPT-BigCode): the engine array's first
    in_dims axes are HF's FIRST axis, the rest its second, in order (a plain reshape, no
    transpose); fused_with parts follow one another along that second (output) axis."""
    swap_last: bool = False
    """in_dims None: HF's tensor is the engine's (or its concatenation's) with the last two
    axes swapped (Gemma 4's stacked experts: gate_up_proj (E, 2f, d), down_proj (E, d, f))."""
    last_axis_slice: tuple[int, int] | None = None
    """HF's tensor holds only [..., start:stop] of the engine array's last axis, other specs of
    the same path the rest (AFMoE's q_proj and gate_proj: the engine's one query-and-gate
    projection wq_dnh, (d, heads, 2 head_dim)); in_dims describes that part."""
    slice_axis: int = -1
    """The engine array's axis last_axis_slice slices (0: OLMo Hybrid's q_conv1d, k_conv1d and
    v_conv1d, the engine's one convolution's channels (c, 1, K) in three)."""
    any_split: bool = False
    """With last_axis_slice: conversion also reads the parts split at other bounds, in the
    table's order, where together they fill the axis (transformers saves OLMo Hybrid's
    convolution as three equal chunks whatever the q, k, v widths); export writes these bounds."""
    merged_rows: bool = False
    """in_dims None: HF's tensor is the engine's (after swap_last) with its first two axes
    merged into one (DBRX's stacked experts, (E * f, d): w1 and v1 the engine's (E, d, f)
    swapped, w2 its (E, f, d))."""


@dataclasses.dataclass(frozen=True)
class Multimodal:
    """The multimodal `...ForConditionalGeneration` checkpoints a text family is published in
    (Llama 4, Gemma 3/4): config.json holds the family's config under `text_config`, and the
    text decoder's tensors sit under other prefixes beside a vision tower and a projector.
    Conversion reads the decoder and skips the rest (engine/interop/hf/convert.py); export
    writes the text-only model (the family's `architecture`)."""

    architecture: str
    """The multimodal class (config.json `architectures[0]`): Llama4ForConditionalGeneration."""
    model_type: str
    """Its config.json `model_type` (llama4), not the text family's own (llama4_text)."""
    prefixes: tuple[tuple[str, str], ...]
    """(the text model's name prefix, the multimodal checkpoint's) pairs: Llama 4's
    ("model.", "language_model.model."), ("lm_head.", "language_model.lm_head."); Gemma 3's
    ("model.", "model.language_model."), ("lm_head.", "lm_head."). A tensor under none of the
    checkpoint's prefixes is not the decoder's (vision tower, projector): skipped."""
    text_config: str = "text_config"
    """The config.json key of the text decoder's config."""
    text_model_type: str | None = None
    """The model_type its text config must have for this family to read it: Mistral3ForConditionalGeneration
    wraps Mistral decoders (Mistral Small 3.1) and Ministral 3 ones. None: any."""

    def text_name(self, name: str) -> str | None:
        """The text model's name of a multimodal checkpoint's tensor; None for one outside
        the text decoder."""
        for text, multimodal in self.prefixes:
            if name.startswith(multimodal):
                return text + name[len(multimodal) :]
        return None


# --------------------------------------------------------------------------- shared helpers


def rope_from_hf(params: dict, where: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling as a RopeScaling dict) of a HF RoPE dict (`rope_parameters`,
    or `rope_theta` merged with the older `rope_scaling`)."""
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", 10000.0))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor is not supported")
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, {"kind": "linear", "factor": params["factor"]}
    if kind == "dynamic":  # the original context: transformers' max_position_embeddings (Family.rope_from_hf)
        original = params.get("original_max_position_embeddings") or params.get("max_position_embeddings")
        if params.get("factor") is None or original is None:
            raise ConfigError(f"{where}: RoPE type 'dynamic' needs factor and max_position_embeddings")
        return theta, {"kind": "dynamic", "factor": params["factor"], "original_max_position": original}
    if kind == "llama3":
        return theta, {
            "kind": "llama3",
            "factor": params["factor"],
            "low_freq_factor": params["low_freq_factor"],
            "high_freq_factor": params["high_freq_factor"],
            "original_max_position": params["original_max_position_embeddings"],
        }
    if kind == "yarn":
        if params.get("factor") is None or params.get("original_max_position_embeddings") is None:
            raise ConfigError(f"{where}: RoPE type 'yarn' needs factor and original_max_position_embeddings")
        scaling = {
            "kind": "yarn",
            "factor": params["factor"],
            "original_max_position": params["original_max_position_embeddings"],
            "beta_fast": params.get("beta_fast") or 32.0,
            "beta_slow": params.get("beta_slow") or 1.0,
            "attention_factor": params.get("attention_factor"),
            "mscale": params.get("mscale"),
            "mscale_all_dim": params.get("mscale_all_dim"),
            "truncate": params.get("truncate", True),
        }
        return theta, scaling
    raise ConfigError(
        f"{where}: RoPE type '{kind}' is not supported (supported: default, linear, llama3, yarn, dynamic)"
    )


def rope_to_hf(scaling) -> dict | None:
    """config.json's `rope_scaling` (transformers 4) of a ModelConfig.rope.scaling (a RopeScaling or None)."""
    if scaling is None:
        return None
    if scaling.kind == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    if scaling.kind == "dynamic":  # its original context is config.json's max_position_embeddings
        return {"rope_type": "dynamic", "factor": scaling.factor}
    if scaling.kind == "longrope":  # the family leaves out what transformers derives (phi3.py)
        longrope = {
            "rope_type": "longrope",
            "short_factor": list(scaling.short_factor),
            "long_factor": list(scaling.long_factor),
            "original_max_position_embeddings": scaling.original_max_position,
            "factor": scaling.factor,
            "attention_factor": scaling.attention_factor,
        }
        return {k: v for k, v in longrope.items() if v is not None}
    if scaling.kind == "yarn":
        # Only what differs from transformers' defaults, as published configs write it.
        optional = {
            "beta_fast": scaling.beta_fast if scaling.beta_fast != 32 else None,
            "beta_slow": scaling.beta_slow if scaling.beta_slow != 1 else None,
            "attention_factor": scaling.attention_factor,
            "mscale": scaling.mscale,
            "mscale_all_dim": scaling.mscale_all_dim,
            "truncate": None if scaling.truncate else False,
        }
        return {
            "rope_type": "yarn",
            "factor": scaling.factor,
            "original_max_position_embeddings": scaling.original_max_position,
            **{k: v for k, v in optional.items() if v is not None},
        }
    return {
        "rope_type": "llama3",
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position,
    }


def rope_parameters_to_hf(theta: float, scaling) -> dict:
    """transformers 5's `rope_parameters`: the RoPE type, base and scaling in one dict."""
    return {**(rope_to_hf(scaling) or {"rope_type": "default"}), "rope_theta": theta}


def parse_layer_types(types: list[str], num_layers: int, where: str) -> list[bool]:
    """Per layer: sliding-window attention? From HF's `layer_types` strings."""
    if len(types) != num_layers:
        raise ConfigError(f"{where}: layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ConfigError(f"{where}: layer type '{unknown[0]}' is not supported (full_attention, sliding_attention)")
    return [t == "sliding_attention" for t in types]


def layer_types_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """transformers 5's per-layer keys, for the families that read them."""
    types = ["sliding_attention" if x else "full_attention" for x in cfg.layer_is_local()]
    return {"layer_types": types, "sliding_window": cfg.attention.sliding_window}


def _shortest_period(flags: list[bool]) -> list[bool]:
    """The shortest prefix that repeats to `flags` (ModelConfig.attention.pattern)."""
    for period in range(1, len(flags) + 1):
        if all(flags[i] == flags[i % period] for i in range(len(flags))):
            return flags[:period]
    raise AssertionError("unreachable")


def qk_norm_tensors(flatten: bool = False) -> list[TensorSpec]:
    """RMSNorm over head_dim on queries and keys (Qwen3, Gemma 3); `flatten`: over all heads'
    dims, HF's (heads * head_dim,) scale the engine's (heads, head_dim) (OLMo 2)."""
    return [
        TensorSpec(("attn", f"{x}_norm", "scale"), LAYER + f"self_attn.{x}_norm.weight", None, flatten=flatten)
        for x in "qk"
    ]


def gated_mlp_tensors(prefix: str = "mlp.") -> list[TensorSpec]:
    """Llama's gated MLP: gate_proj, up_proj, down_proj (also a mixture of experts' dense layers)."""
    return [
        TensorSpec(("mlp", "w_gate_df"), LAYER + prefix + "gate_proj.weight", 1),
        TensorSpec(("mlp", "w_up_df"), LAYER + prefix + "up_proj.weight", 1),
        TensorSpec(("mlp", "w_down_fd"), LAYER + prefix + "down_proj.weight", 1),
    ]


def shortest_period(flags: list) -> list:
    """The shortest prefix that repeats to `flags` (a ModelConfig *_pattern)."""
    return _shortest_period(flags)


def mtp_tensors(cfg: ModelConfig, per_layer: list[TensorSpec]) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(top-level, per-layer) tensors of the multi-token-prediction layer (ModelConfig.mtp_layers)
    as DeepSeek-V3 and GLM-4.5 publish it, `model.layers.{num_layers}.`: its norms and eh_proj,
    a layer named as the last layer's stack's (`per_layer`'s specs of it, in the `mtp_blocks`
    stack), and copies of the embedding and LM head that export writes and conversion skips."""
    if not cfg.mtp_layers:
        return [], []
    head = ("embed_vd",) if cfg.tie_embeddings else ("lm_head_dv",)
    top = []
    for k, name in enumerate(cfg.mtp_head_names()):
        mtp = f"model.layers.{cfg.num_layers + k}."
        top += [
            *mtp_head_tensors(name, mtp, post_norm="shared_head.norm"),
            TensorSpec(("embed_vd",), mtp + "embed_tokens.weight", None, export_only=True),
            TensorSpec(head, mtp + "shared_head.head.weight", None if cfg.tie_embeddings else 1, export_only=True),
        ]
    last = cfg.layer_pattern()[-1].stack
    return top, [dataclasses.replace(spec, stack="mtp_blocks") for spec in per_layer if spec.stack == last]


def mtp_head_tensors(
    name: str,
    prefix: str,
    norms: tuple[str, str] = ("enorm", "hnorm"),
    eh_proj: str = "eh_proj",
    post_norm: str | None = "final_layernorm",
) -> list[TensorSpec]:
    """Multi-token-prediction module `name`'s own tensors under `prefix` (its checkpoint's
    module, e.g. `model.mtp.layers.0.`): the embedding's and hidden state's norms (`norms`),
    their joint projection and, unless `post_norm` is None, the norm before the LM head."""
    specs = [
        TensorSpec((name, "enorm", "scale"), prefix + norms[0] + ".weight", None),
        TensorSpec((name, "hnorm", "scale"), prefix + norms[1] + ".weight", None),
        TensorSpec((name, "w_eh_xd"), prefix + eh_proj + ".weight", 1),
    ]
    if post_norm is not None:
        specs.append(TensorSpec((name, "post_norm", "scale"), prefix + post_norm + ".weight", None))
    return specs


def mtp_copy(name: str, cfg: ModelConfig) -> bool:
    """A tensor of the checkpoint's layer after the last that conversion skips: all of it
    without mtp_layers (a module the engine would not keep), else the embedding and LM head
    copies (the engine's are the main model's)."""
    for k in range(max(cfg.mtp_layers, 1)):
        prefix = f"model.layers.{cfg.num_layers + k}."
        if name.startswith(prefix):
            return not cfg.mtp_layers or name[len(prefix) :] in ("embed_tokens.weight", "shared_head.head.weight")
    return False


# --------------------------------------------------------------------------- the base class


class Family:
    """A Llama-shaped Hugging Face family. Subclasses set the class attributes and override
    the hooks where their config.json or tensors differ."""

    name: ClassVar[str]
    """ModelConfig.family."""
    architecture: ClassVar[str]
    """The transformers class (config.json `architectures[0]`)."""
    model_type: ClassVar[str]
    """config.json `model_type`."""
    also_architectures: ClassVar[tuple[str, ...]] = ()
    """Other config.json `architectures[0]` read as this family: transformers 5 runs some
    published classes as Llama and saves them as LlamaForCausalLM (InternLM3, EXAONE 3)."""
    fixed: ClassVar[dict[str, Any]] = {}
    """ModelConfig fields every model of the family has."""
    hf_defaults: ClassVar[dict[str, Any]] = {}
    """transformers' defaults for config.json keys a file may leave out."""
    activation_key: ClassVar[str] = "hidden_act"
    """The config.json key export writes the activation under."""
    unsupported_flags: ClassVar[tuple[str, ...]] = ("attention_bias", "mlp_bias", "use_bidirectional_attention")
    """config.json keys that must not be true: the engine has no such layers."""
    hf_constants: ClassVar[dict[str, Any]] = {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    """config.json keys the transformers class writes whose value is the same for every model
    the engine runs (flags of layers it does not have). Only keys the class defines."""
    moe: ClassVar[bool | None] = False
    """A mixture of experts: its models have num_experts > 0 (engine/models/moe.py); None:
    dense and expert models both (Gemma 4)."""
    peft_refuses: ClassVar[dict[str, str]] = {}
    """Module names LoRA cannot put an adapter on as PEFT would on the family's transformers
    model -> why (PEFT refuses Mamba's out_proj; transformers' Mamba reads dt_proj.weight
    directly; Sarvam's checkpoints fuse a query_key_value that transformers splits):
    LoraConfig.targets refuses them. The modules LoRA adapts are otherwise read from the
    tensor table (engine/models/lora_targets.py)."""
    required_token_ids: ClassVar[dict[str, int]] = {}
    """Token ids the transformers class refuses as null (CwmConfig's bos_token_id must be an int):
    config.json gets this value where the tokenizer's is unknown."""
    multimodal: ClassVar[Multimodal | None] = None
    """The multimodal checkpoints whose text decoder is this family's model (Llama 4's
    Llama4ForConditionalGeneration): convert reads them, skipping the vision tower."""

    # ----------------------------------------------------------------- config.json -> fields

    def hf_value(self, hf: dict, key: str, default: Any = None) -> Any:
        """hf[key], or transformers' default for it when the file leaves it out (or null)."""
        value = hf.get(key)
        return self.hf_defaults.get(key, default) if value is None else value

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        """ModelConfig fields (a plain dict) of config.json `hf`; `where` prefixes errors."""
        for key in REQUIRED_KEYS:
            if hf.get(key) is None:
                raise ConfigError(f"{where}: missing key '{key}'")
        for key in self.unsupported_flags:
            if hf.get(key):
                raise ConfigError(f"{where}: {key}=true is not supported")
        activation = self.activation_from_hf(hf)
        if activation not in ACTIVATIONS:
            raise ConfigError(f"{where}: activation '{activation}' is not supported (silu, gelu_pytorch_tanh)")
        rope = self.rope_from_hf(hf, where)
        num_layers, num_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
        is_local = parse_layer_types(self.layer_types(hf, num_layers), num_layers, where)
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": hf["hidden_size"],
            "num_layers": num_layers,
            "num_heads": num_heads,
            "num_kv_heads": hf.get("num_key_value_heads") or num_heads,
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // num_heads,
            "mlp_dim": hf["intermediate_size"],
            "max_seq_len": self.hf_value(hf, "max_position_embeddings"),
            "norm_eps": self.hf_value(hf, "rms_norm_eps", 1e-6),
            **rope,
            "tie_embeddings": self.hf_value(hf, "tie_word_embeddings"),
            "activation": ACTIVATIONS[activation],
            "attention_pattern": ["local" if x else "global" for x in _shortest_period(is_local)],
            "sliding_window": self.hf_value(hf, "sliding_window") if any(is_local) else None,
            "init_std": self.hf_value(hf, "initializer_range", 0.02),
            **self.fixed,
            **self.extra_fields_from_hf(hf),
        }

    def activation_from_hf(self, hf: dict) -> str:
        """config.json's activation name (transformers 5 renamed some keys)."""
        return hf.get("hidden_activation") or hf.get("hidden_act") or "silu"

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        """HF's per-layer attention kinds (full_attention / sliding_attention). Llama: all full."""
        return ["full_attention"] * num_layers

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        """The RoPE fields: rope_theta and rope_scaling (and rope_local_theta for Gemma 3)."""
        rope = hf.get("rope_parameters") or {
            "rope_theta": self.hf_value(hf, "rope_theta", 10000.0),
            **(hf.get("rope_scaling") or {}),
        }
        # dynamic NTK's original context is transformers' max_position_embeddings
        theta, scaling = rope_from_hf(
            {"max_position_embeddings": self.hf_value(hf, "max_position_embeddings"), **rope}, where
        )
        return {"rope_theta": theta, "rope_scaling": scaling}

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        """ModelConfig fields only this family reads from config.json."""
        return {}

    # ----------------------------------------------------------------- ModelConfig -> config.json

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        """config.json of `cfg`: every key transformers 5 writes for the class (tests/
        test_hf_parity.py compares), plus the older keys transformers 4 reads (`rope_theta`,
        `rope_scaling`). Fields the family cannot express are caught by the caller's round trip."""
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.mlp.dim,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.attention.num_heads,
            "num_key_value_heads": cfg.attention.num_kv_heads,
            "head_dim": cfg.attention.head_dim,
            "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm.eps,
            "rope_parameters": rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling),
            "rope_theta": cfg.rope.theta,
            "rope_scaling": rope_to_hf(cfg.rope.scaling),
            "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.init_std,
            "attention_dropout": 0.0,
            "use_cache": True,
            self.activation_key: self.activation_to_hf(cfg),
            **self.hf_constants,
        }
        hf.update(self.extra_hf_keys(cfg))
        return hf

    def activation_to_hf(self, cfg: ModelConfig) -> str:
        """config.json's activation name of ModelConfig.mlp.activation."""
        return {v: k for k, v in ACTIVATIONS.items() if k != "gelu_new"}[cfg.mlp.activation]

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        """config.json keys only this family writes."""
        return {}

    # ----------------------------------------------------------------- tensors

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """(top-level tensors, per-layer tensors) of `cfg`, in the order HF files list them:
        each layer stack's (ModelConfig.layer_stacks), its feed-forward the stack's kind."""
        top = [TensorSpec(("embed_vd",), "model.embed_tokens.weight", None)]
        layers, per_layer = cfg.layer_pattern(), []
        for stack, indices in cfg.layer_stacks():
            moe = layers[indices[0]].ffn == "moe"
            specs = [
                *self.mixer_tensors(cfg, layers[indices[0]]),
                *self.mlp_norm_tensors(),
                *(self.mlp_tensors(cfg) if moe or not cfg.is_moe else self.dense_mlp_tensors(cfg)),
            ]
            per_layer += [dataclasses.replace(spec, stack=stack) for spec in specs]
        top.append(TensorSpec(("final_norm", "scale"), "model.norm.weight", None))
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        mtp_top, mtp_layer = self.mtp_tensor_table(cfg, per_layer)
        return top + mtp_top, per_layer + mtp_layer

    def mtp_tensor_table(self, cfg: ModelConfig, per_layer: list[TensorSpec]) -> tuple[list, list]:
        """(top-level, per-layer) tensors of the multi-token-prediction modules, `per_layer` the
        model's: DeepSeek-V3's layout (mtp_tensors)."""
        return mtp_tensors(cfg, per_layer)

    def mixer_tensors(self, cfg: ModelConfig, layer) -> list[TensorSpec]:
        """The input norm and sequence mixer of a stack of `layer`'s kind (a config.Layer):
        attention_tensors and extra_attention_tensors; a family with another mixer kind
        (ModelConfig.mixer_pattern: Qwen3-Next's Gated DeltaNet) names that kind's tensors."""
        return [*self.attention_tensors(cfg), *self.extra_attention_tensors()]

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        """The input norm and the q, k, v, o projections (Phi-3: one fused qkv_proj)."""
        return [
            TensorSpec(("attn_norm", "scale"), LAYER + "input_layernorm.weight", None),
            TensorSpec(("attn", "wq_dnh"), LAYER + "self_attn.q_proj.weight", 1),
            TensorSpec(("attn", "wk_dkh"), LAYER + "self_attn.k_proj.weight", 1),
            TensorSpec(("attn", "wv_dkh"), LAYER + "self_attn.v_proj.weight", 1),
            TensorSpec(("attn", "wo_nhd"), LAYER + "self_attn.o_proj.weight", 2),
        ]

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        """The MLP's tensors: Llama's gated MLP (a mixture of experts' families: router and experts)."""
        return gated_mlp_tensors()

    def dense_mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        """A mixture of experts' dense layers' MLP (ModelConfig.ffn_pattern): Llama's names."""
        return gated_mlp_tensors()

    def extra_attention_tensors(self) -> list[TensorSpec]:
        """Attention tensors after o_proj: biases (Qwen2), QK-norm scales (Qwen3, Gemma 3)."""
        return []

    def module_name(self, hf_name: str) -> str:
        """The torch module path of a checkpoint tensor's name, which PEFT names adapters by:
        the same, unless transformers renames the model on saving (Nemotron-H's `backbone.`)."""
        return hf_name

    def checkpoint_name(self, stored: str) -> str:
        """The tensor table's name of a checkpoint tensor stored as `stored`: the same, unless the
        family's checkpoints were saved from its base model, without its prefix (GPT-2's)."""
        return stored

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        """A checkpoint tensor conversion skips: one of a module the engine does not run
        (DeepSeek-V3's multi-token-prediction layer)."""
        return False

    mtp_in_weights: ClassVar[bool] = False
    """config.json does not say how many multi-token-prediction modules a checkpoint holds
    (MiMo-V2-Flash's): conversion counts them in its weights (mtp_prefix)."""

    def mtp_prefix(self, cfg: ModelConfig, depth: int) -> str:
        """The checkpoint's name prefix of multi-token-prediction module `depth` (from 0), by
        which conversion finds the modules the weights hold: DeepSeek-V3's layers after the last."""
        return f"model.layers.{cfg.num_layers + depth}."

    def mtp_fields(self, cfg: ModelConfig, modules: int) -> dict[str, Any]:
        """The ModelConfig fields of `cfg` with `modules` multi-token-prediction modules (the
        number a checkpoint's weights hold)."""
        return {"mtp_layers": modules}

    def mlp_norm_tensors(self) -> list[TensorSpec]:
        """The norms between attention and MLP: Llama's post_attention_layernorm is the MLP's
        input norm."""
        return [TensorSpec(("mlp_norm", "scale"), LAYER + "post_attention_layernorm.weight", None)]

    def constant_tensors(self, cfg: ModelConfig) -> dict[str, float]:
        """Checkpoint tensors that hold constants, not parameters (buffers transformers saves
        and loads, such as Apertus's xIELU `beta`): HF name -> value. Export writes them as
        0-d arrays of the parameters' dtype; conversion skips them (ignored_tensor)."""
        return {}


# --------------------------------------------------------------------------- the registry

# The registry itself is engine/models/family_registry.py (below ModelConfig, which validates
# `family` against it); these are its functions, typed for Family.
register_family: Callable[[type[Family]], type[Family]] = family_registry.register_family
family_names = family_registry.family_names
get_family: Callable[[str], Family] = family_registry.get_family
family_of_model_type: Callable[[str | None], Family | None] = family_registry.family_of_model_type
