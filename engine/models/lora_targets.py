"""Which of a model's weights a LoRA adapter puts factors on, by PEFT's module names.

PEFT names an adapted module by the last part of its name in the transformers model
(`q_proj`, GPT-NeoX's `query_key_value`, GPT-2's `c_attn`, DeepSeek's `kv_a_proj_with_mqa`,
Mamba's `in_proj`), and the family's tensor table already knows each engine weight's HF name:
so a model's adaptable modules are the table's matmul weights (TensorSpec.in_dims set) that
the engine computes through an adapter-aware product (WEIGHTS below), named as the table
names them. One HF tensor that fuses several engine weights (query_key_value: q, k and v,
TensorSpec.fused_with) is one PEFT module with one A: its parts share the first part's A
(its "owner") and each has the rows of B that produce its own output.

A name is adaptable only if every module of that name is: an adapter by that name loads onto
all of them in PEFT, so adapting some would export an adapter that is not the one trained.
"""

from __future__ import annotations

from typing import Any

from engine.models.family_registry import get_family

ModelConfig = Any
"""engine.models.config.ModelConfig, which imports this module (LoraConfig.targets): not
imported here, also for annotations (tests/test_imports.py: no cycle, TYPE_CHECKING's included)."""

ATTENTION_WEIGHTS = {"wq_dnh": 1, "wk_dkh": 1, "wv_dkh": 1, "wo_nhd": 2}
MLP_WEIGHTS = {"w_gate_df": 1, "w_up_df": 1, "w_down_fd": 1}
PER_LAYER_INPUT_WEIGHTS = {"per_layer_gate_dp": 1, "per_layer_proj_pd": 1}
"""Gemma 4's per-layer inputs: each layer's gate and projection (the Block's)."""
MODEL_WEIGHTS = {"per_layer_proj_dx": 1}
"""The model's own adaptable projections, outside the layers (Gemma 4's per-layer-input projection)."""
MLA_WEIGHTS = {"wq_a_dq": 1, "wq_b_qnh": 1, "wq_dnh": 1, "wkv_a_dx": 1, "wkv_b_cny": 1, "wo_nwd": 2}
"""Latent attention's (engine/models/mla.py): q_a_proj, q_b_proj (or q_proj), kv_a_proj_with_mqa,
kv_b_proj, o_proj."""
MAMBA_WEIGHTS = {"w_in_dp": 1, "w_x_cq": 1, "w_dt_rc": 1, "w_out_cd": 1, "w_out_fd": 1}
"""Mamba's and Mamba-2's (engine/models/mamba1.py, mamba2.py): in_proj, x_proj, dt_proj, out_proj."""
SHORT_CONV_WEIGHTS = {"w_in_d3c": 1, "w_out_cd": 1}
"""LFM2's short convolution's (engine/models/short_conv.py): in_proj, out_proj."""
WEIGHTS = {
    **ATTENTION_WEIGHTS,
    **MLP_WEIGHTS,
    **PER_LAYER_INPUT_WEIGHTS,
    **MODEL_WEIGHTS,
    **MLA_WEIGHTS,
    **MAMBA_WEIGHTS,
    **SHORT_CONV_WEIGHTS,
}
"""Every engine weight a module can adapt -> its number of input axes. Order matters: a
weight's index seeds its dropout masks (engine/models/lora.py)."""
FOLDED = ("wkv_b_cny",)
"""Weights the layer reads as a matrix rather than as one product of its input (latent
attention's kv_b_proj, absorbed into the scores): their adapter is folded into the weight
each step, so no dropout reaches it."""

LLAMA_ORDER = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "per_layer_input_gate",
    "per_layer_projection",
    "per_layer_model_projection",
)
"""PEFT's Llama (and Gemma 4) names, listed first in this order; other names follow in the
order of the tensor table."""


def _last(name: str) -> str:
    return name.removesuffix(".weight").rsplit(".", 1)[-1]


def _matmuls(model: ModelConfig):
    """(PEFT name, TensorSpec) of every matmul weight of the model's layers and of its own
    (not the LM head, which PEFT's all-linear leaves out, nor a multi-token-prediction layer's,
    which transformers does not run). PEFT's name is the last part of the transformers
    module's (Family.module_name: EXAONE runs as Llama, so its c_fc_0 is gate_proj)."""
    family = get_family(model.family)
    top, per_layer = family.tensor_table(model)
    stacks = {name for name, _ in model.layer_stacks()}
    specs = [s for s in top if s.in_dims is not None and not s.export_only and s.path[-1] != "lm_head_dv"]
    specs += [s for s in per_layer if s.in_dims is not None and s.stack in stacks]
    for spec in specs:
        yield _last(family.module_name(spec.hf_name)), spec


def _why_not(model: ModelConfig, spec) -> str | None:
    """None if the engine adapts `spec`'s weight(s); else what stops it, as a phrase."""
    if spec.experts or (model.is_moe and spec.path[-1] in MLP_WEIGHTS):
        return "experts"
    if model.compressed_attention is not None and spec.path[-1] in MLA_WEIGHTS:
        return "layout"  # DeepSeek-V4's compressed attention (its wq_a, wq_b) takes no adapter
    if spec.last_axis_slice or spec.interleaved_with or spec.concatenated_with or spec.swap_last:
        return "layout"
    if any(path[-1] not in WEIGHTS for path in (spec.path, *spec.fused_with)):
        return "layout"
    return None


def adaptable_modules(model: ModelConfig) -> tuple[dict[str, list], dict[str, str]]:
    """({PEFT name: the table's specs of it} for every name the engine adapts in `model`,
    {name: why not ("experts", "layout" or "peft": Family.peft_refuses)} for
    the matmuls it does not)."""
    found: dict[str, list] = {}
    refused: dict[str, str] = {}
    peft_refuses = get_family(model.family).peft_refuses
    for name, spec in _matmuls(model):
        why = "peft" if name in peft_refuses else _why_not(model, spec)
        if why is not None:
            refused.setdefault(name, why)
        found.setdefault(name, []).append(spec)
    order = {name: i for i, name in enumerate(found)}
    last = len(LLAMA_ORDER)
    ranked = sorted(found, key=lambda n: (LLAMA_ORDER.index(n), 0) if n in LLAMA_ORDER else (last, order[n]))
    return {name: found[name] for name in ranked if name not in refused}, refused


def adapted_weights(model: ModelConfig, names: tuple[str, ...]) -> dict[str, str]:
    """{engine weight: the weight whose A it uses (itself, or its fused tensor's first part)}
    for the modules `names` (PEFT's) of `model`."""
    modules, _ = adaptable_modules(model)
    owners: dict[str, str] = {}
    for name in names:
        for spec in modules[name]:
            for path in (spec.path, *spec.fused_with):
                owners[path[-1]] = spec.path[-1]
    # a weight is adapted in every module that has it, or in none (one flag per module kind)
    for name, specs in modules.items():
        if name not in names:
            clash = [s.path[-1] for s in specs if s.path[-1] in owners]
            if clash:
                raise ValueError(
                    f"family '{model.family}': {name} shares its weights' kind with {', '.join(names)}, so LoRA "
                    f"adapts both or neither; add {name} to target_modules or leave the others out"
                )
    return owners
