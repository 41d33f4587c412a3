"""What the GPT-era families share (GPT-NeoX, Phi, GPT-J, CodeGen, StableLM, StarCoder2,
Falcon, Cohere, Nemotron): their config.json's activation names, RoPE keys with a partial
rotary factor, and tensor-table pieces for LayerNorms and biased projections.

Their checkpoints name the decoder otherwise than Llama (`gpt_neox.layers.{i}.`,
`transformer.h.{i}.`), so each family writes its whole tensor table and config.json with
these helpers instead of the base class's Llama-shaped ones.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.families.base import TensorSpec, rope_from_hf, rope_parameters_to_hf

ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
    "relu2": "relu2",
    "silu": "silu",
}
"""config.json activation name -> ModelConfig.mlp.activation (HF's gelu_new, gelu_pytorch_tanh and
gelu_fast are one tanh approximation, written out three ways)."""


def require(hf: dict, keys: tuple[str, ...], where: str) -> None:
    for key in keys:
        if hf.get(key) is None:
            raise ConfigError(f"{where}: missing key '{key}'")


def refuse(hf: dict, where: str, **allowed: Any) -> None:
    """One sentence for a config.json key whose value names math the engine does not run:
    `allowed` maps each key to the value it must have (or be absent)."""
    for key, value in allowed.items():
        if hf.get(key) is not None and hf[key] != value:
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported (only {value!r})")


def activation(hf: dict, key: str, default: str, where: str) -> str:
    name = hf.get(key) or default
    if name not in ACTIVATIONS:
        raise ConfigError(f"{where}: {key} '{name}' is not supported ({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def partial_rope(hf: dict, head_dim: int, where: str, *, theta: float = 10000.0, factor: float = 1.0) -> dict:
    """rope_theta, rope_scaling and rotary_dim of a config.json whose RoPE may rotate only the
    first int(head_dim * partial_rotary_factor) dimensions of each head (transformers 5's
    rope_parameters, or the older rope_theta / rope_scaling / partial_rotary_factor);
    `theta` and `factor` the class defaults."""
    rope = dict(hf.get("rope_parameters") or {})
    if not rope:
        rope = {"rope_theta": hf.get("rope_theta") or theta, **(hf.get("rope_scaling") or {})}
    pct = rope.pop("partial_rotary_factor", None)
    if pct is None:
        pct = hf.get("partial_rotary_factor", factor)
    rope.setdefault("rope_theta", theta)
    rope_theta, scaling = rope_from_hf(rope, where)
    rotary = int(head_dim * float(pct))
    if rotary % 2 or rotary <= 0:
        raise ConfigError(f"{where}: partial_rotary_factor {pct} rotates {rotary} of {head_dim} dims (must be even)")
    return {"rope_theta": rope_theta, "rope_scaling": scaling, "rotary_dim": None if rotary == head_dim else rotary}


def partial_rope_to_hf(cfg, *, factor_key: bool = True) -> dict:
    """transformers 5's rope_parameters of cfg, with its partial_rotary_factor (`factor_key`)."""
    rope = rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling)
    if factor_key:
        rope["partial_rotary_factor"] = (cfg.rope.rotary_dim or cfg.attention.head_dim) / cfg.attention.head_dim
    return rope


def norm(path: str, hf_prefix: str, bias: bool, scale: bool = True) -> list[TensorSpec]:
    """A norm's scale (`weight`) and bias."""
    out = []
    if scale:
        out.append(TensorSpec((*path.split("/"), "scale"), hf_prefix + ".weight", None))
    if bias:
        out.append(TensorSpec((*path.split("/"), "bias"), hf_prefix + ".bias", None))
    return out


def attention(prefix: str, names: tuple[str, str, str, str], qkv_bias: bool, out_bias: bool) -> list[TensorSpec]:
    """Separate q, k, v and output projections under `prefix` (their module names), with biases."""
    q, k, v, o = names
    out = [
        TensorSpec(("attn", "wq_dnh"), f"{prefix}{q}.weight", 1),
        TensorSpec(("attn", "wk_dkh"), f"{prefix}{k}.weight", 1),
        TensorSpec(("attn", "wv_dkh"), f"{prefix}{v}.weight", 1),
    ]
    if qkv_bias:
        out += [
            TensorSpec(("attn", "bq_nh"), f"{prefix}{q}.bias", None, flatten=True),
            TensorSpec(("attn", "bk_kh"), f"{prefix}{k}.bias", None, flatten=True),
            TensorSpec(("attn", "bv_kh"), f"{prefix}{v}.bias", None, flatten=True),
        ]
    out.append(TensorSpec(("attn", "wo_nhd"), f"{prefix}{o}.weight", 2))
    if out_bias:
        out.append(TensorSpec(("attn", "bo_d"), f"{prefix}{o}.bias", None))
    return out


def fused_qkv(name: str, bias: bool, groups: int = 1, order: str = "qkv") -> list[TensorSpec]:
    """q, k and v in one projection `name` (its .weight and .bias), in `groups` groups each
    holding its share of the parts in `order` (TensorSpec.fused_groups)."""
    weights = {"q": ("attn", "wq_dnh"), "k": ("attn", "wk_dkh"), "v": ("attn", "wv_dkh")}
    biases = {"q": ("attn", "bq_nh"), "k": ("attn", "bk_kh"), "v": ("attn", "bv_kh")}
    first, rest = order[0], order[1:]
    out = [
        TensorSpec(weights[first], name + ".weight", 1, fused_with=tuple(weights[x] for x in rest), fused_groups=groups)
    ]
    if bias:
        out.append(
            TensorSpec(
                biases[first],
                name + ".bias",
                None,
                flatten=True,
                fused_with=tuple(biases[x] for x in rest),
                fused_groups=groups,
            )
        )
    return out


def plain_mlp(prefix: str, up: str, down: str, bias: bool) -> list[TensorSpec]:
    """A non-gated MLP, down(act(up(x))), its two projections' module names."""
    out = [TensorSpec(("mlp", "w_up_df"), f"{prefix}{up}.weight", 1)]
    if bias:
        out.append(TensorSpec(("mlp", "b_up_f"), f"{prefix}{up}.bias", None))
    out.append(TensorSpec(("mlp", "w_down_fd"), f"{prefix}{down}.weight", 1))
    if bias:
        out.append(TensorSpec(("mlp", "b_down_d"), f"{prefix}{down}.bias", None))
    return out
