"""Run configuration: pydantic schemas, YAML loading, dotted overrides.

YAML supplies values, the models below are the schema. Unknown keys are errors that name
the key and the closest valid one; types and ranges are checked before anything compiles.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CONFIG_ROOT = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A user mistake in a config: the message names the file and key at fault."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class RopeScaling(Strict):
    """RoPE frequency scaling for long context."""

    kind: Literal["llama3", "linear"] = "llama3"
    """llama3: frequency-dependent (Llama 3.1+); linear: every frequency / factor (Gemma 3)."""
    factor: float = Field(8.0, gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    """llama3 only, as are the next two."""
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_position: int = Field(8192, gt=0)
    """Context length the base model was trained with."""


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3")


class ModelConfig(Strict):
    """A decoder-only transformer. Model families differ only in these fields."""

    family: Literal["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"] = "llama"
    """Architecture family: names the Hugging Face layout (engine/hf.py). The math is set by
    the fields below alone; their defaults describe Llama."""
    vocab_size: int = Field(gt=0)
    d_model: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    """Grouped-query attention: each KV head serves num_heads / num_kv_heads query heads."""
    head_dim: int = Field(gt=0)
    """Independent of d_model / num_heads."""
    mlp_dim: int = Field(gt=0)
    max_seq_len: int = Field(2048, gt=0)
    norm_eps: float = Field(1e-5, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    activation: Literal["silu", "gelu_tanh"] = "silu"
    """Gate of the gated MLP: silu = SwiGLU (Llama, Qwen, Mistral), gelu_tanh = GeGLU (Gemma)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on queries and keys, before RoPE (Qwen3, Gemma 3)."""
    norm_zero_centered: bool = False
    """RMSNorm multiplies by (1 + scale), the scale stored zero-centred (Gemma)."""
    scale_embeddings: bool = False
    """Multiply token embeddings by sqrt(d_model) (Gemma)."""
    post_norms: bool = False
    """Also normalise each sublayer's output before the residual add (Gemma 2/3)."""
    attention_pattern: list[Literal["global", "local"]] = Field(default_factory=lambda: ["global"], min_length=1)
    """Layer i attends as attention_pattern[i % len]; local = sliding window. Mistral: [local];
    Gemma 2: [local, global]; Gemma 3: five local then one global."""
    sliding_window: int | None = Field(None, gt=0)
    """Local layers see this many most recent positions, the query's own included."""
    rope_local_theta: float | None = Field(None, gt=0)
    """RoPE base of local layers, unscaled (Gemma 3). None: rope_theta and rope_scaling."""
    query_pre_attn_scalar: float | None = Field(None, gt=0)
    """Attention scores are scaled by query_pre_attn_scalar**-0.5 (None: head_dim, as usual)."""
    attn_logit_softcap: float | None = Field(None, gt=0)
    """Attention scores become cap * tanh(scores / cap) before masking (Gemma 2)."""
    final_logit_softcap: float | None = Field(None, gt=0)
    """Output logits become cap * tanh(logits / cap) (Gemma 2)."""
    init_std: float = Field(0.02, gt=0)
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of matmuls; norms, softmax and the loss stay in float32."""
    scan_layers: bool = True
    remat: Literal["none", "full", "save_dots", "save_qkv_proj"] = "none"
    """Which activations the backward pass recomputes (none = keep all)."""
    attention_block: int = Field(128, ge=0)
    """Query block of causal attention in training and prefill (engine/attention.py): blocks
    skip the masked upper triangle. 0 means one block (the whole sequence)."""

    @model_validator(mode="after")
    def _check_heads(self) -> "ModelConfig":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if "local" in self.attention_pattern and self.sliding_window is None:
            raise ValueError("attention_pattern has local layers, so sliding_window must be set")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        return self

    def layer_is_local(self) -> list[bool]:
        """Per layer: does it use sliding-window attention?"""
        pattern = self.attention_pattern
        return [pattern[i % len(pattern)] == "local" for i in range(self.num_layers)]

    def num_params(self, include_embedding: bool = True) -> int:
        attn = self.d_model * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        attn += self.head_dim * (self.num_heads + 2 * self.num_kv_heads) * self.qkv_bias
        attn += 2 * self.head_dim * self.qk_norm
        mlp = 3 * self.d_model * self.mlp_dim
        block = attn + mlp + (4 if self.post_norms else 2) * self.d_model
        n = self.num_layers * block + self.d_model
        if include_embedding:
            n += self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
        return n


class MeshConfig(Strict):
    """Device mesh sizes; -1 takes the remaining devices (at most one axis)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    @model_validator(mode="after")
    def _check(self) -> "MeshConfig":
        sizes = [self.data, self.fsdp, self.tensor]
        if any(s == 0 or s < -1 for s in sizes):
            raise ValueError("mesh sizes must be positive or -1")
        if sizes.count(-1) > 1:
            raise ValueError("at most one mesh axis may be -1")
        return self


class OptimizerConfig(Strict):
    """AdamW with decoupled weight decay and global-norm clipping."""

    learning_rate: float = Field(3e-4, gt=0)
    b1: float = Field(0.9, ge=0, lt=1)
    b2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    decay_norms_and_embeddings: bool = False
    """False: weight decay skips norm scales and embeddings (the usual choice)."""
    grad_clip_norm: float | None = Field(1.0, gt=0)


class ScheduleConfig(Strict):
    """Learning-rate schedule: linear warmup then cosine decay or warmup-stable-decay."""

    kind: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    decay_fraction: float = Field(0.2, gt=0, le=1)
    """WSD only: fraction of the steps spent in the final linear decay."""
    final_lr_fraction: float = Field(0.1, ge=0, le=1)


class DataConfig(Strict):
    """Token shards written by the tokenize stage (see engine/data.py)."""

    path: str | None = None
    """Dataset directory (holding meta.json); required for training."""
    seq_len: int = Field(128, gt=1)
    batch_size: int = Field(8, gt=0)
    """Global batch size in rows (per optimizer step, before accumulation splits it)."""
    shuffle: bool = True
    seed: int = 0
    packing: bool = True
    """Concatenate documents into full rows (segment-aware attention keeps them apart)."""
    eval_split: str = "validation"
    eval_batches: int = Field(4, ge=0)
    worker_buffer: int = Field(2, ge=0)
    """Rows prefetched by a background thread (0 = none)."""


class CheckpointConfig(Strict):
    directory: str | None = None
    """Where Orbax checkpoints go; required for training."""
    every_steps: int = Field(100, gt=0)
    keep: int = Field(3, gt=0)
    """How many recent checkpoints to keep."""
    async_save: bool = True
    init_from: str | None = None
    """Start from the params of this checkpoint directory (fresh optimizer), not from scratch."""


class RunFields(Strict):
    """What every training run has besides its model, optimizer and data (pretraining, SFT)."""

    mesh: MeshConfig = MeshConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    steps: int = Field(100, gt=0)
    grad_accum: int = Field(1, gt=0)
    """Micro-batches per optimizer step; data.batch_size must divide evenly."""
    seed: int = 0
    log_every: int = Field(10, gt=0)
    eval_every: int = Field(0, ge=0)
    """Steps between held-out evaluations (0 = only at the end)."""
    metrics_dir: str | None = None
    """JSONL + TensorBoard output (default: next to the checkpoints)."""
    progress: bool = True

    @model_validator(mode="after")
    def _check_accumulation(self):
        if self.data.batch_size % self.grad_accum:
            raise ValueError(
                f"data.batch_size ({self.data.batch_size}) must be divisible by grad_accum ({self.grad_accum})"
            )
        return self


class TrainConfig(RunFields):
    """Everything one pretraining run of the engine needs."""

    model: ModelConfig
    optimizer: OptimizerConfig = OptimizerConfig()
    data: DataConfig = DataConfig()
    z_loss: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _check_length(self) -> "TrainConfig":
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})"
            )
        return self


# ModelConfig fields that say how a run computes, not what the architecture is: a checkpoint
# restores under any values of these, and Hugging Face configs do not carry them.
MODEL_RUN_FIELDS = frozenset({"param_dtype", "dtype", "scan_layers", "remat", "init_std", "attention_block"})

# Fields that cannot change a run's result; excluded from artifact fingerprints.
NON_SEMANTIC_FIELDS = ("log_every", "progress", "metrics_dir", "checkpoint.async_save")


# --------------------------------------------------------------------------- loading


def _closest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(valid))}"


def _model_at(schema: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that owns the field at `loc` (for suggestions)."""
    current: Any = schema
    for part in loc:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        annotation = field.annotation
        for candidate in getattr(annotation, "__args__", (annotation,)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                current = candidate
                break
        else:
            current = annotation
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def format_validation_error(err: ValidationError, schema: type[BaseModel], source: str) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden":
            owner = _model_at(schema, loc[:-1])
            valid = list(owner.model_fields) if owner else []
            lines.append(f"{source}: unknown key '{key}'{_closest(str(loc[-1]), valid)}")
        elif e["type"] == "missing":
            lines.append(f"{source}: missing required key '{key}'")
        else:
            value = e.get("input")
            shown = "" if isinstance(value, dict) else f" (got {value!r})"
            lines.append(f"{source}: key '{key}': {e['msg']}{shown}")
    return "\n".join(lines)


def parse_value(text: str) -> Any:
    """An override value as YAML would read it: `3`, `1e-3`, `true`, `null`, `[1,2]`, `abc`."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(tree: dict, overrides: list[str] | dict[str, Any], source: str = "override") -> dict:
    """Apply `a.b.c=value` overrides to a nested dict (in place; returns it)."""
    items = overrides.items() if isinstance(overrides, dict) else []
    if not isinstance(overrides, dict):
        parsed = []
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"{source}: '{item}' is not of the form key=value")
            key, value = item.split("=", 1)
            parsed.append((key.strip(), parse_value(value)))
        items = parsed
    for key, value in items:
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"{source}: '{key}': '{part}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return tree


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def resolve_model_preset(tree: dict, source: str) -> dict:
    """`model: llama3-1b` or `model: {preset: llama3-1b, num_layers: 2}` -> a full model dict."""
    model = tree.get("model")
    if isinstance(model, str):
        model = {"preset": model}
    if isinstance(model, dict) and "preset" in model:
        model = dict(model)
        name = model.pop("preset")
        preset_path = CONFIG_ROOT / "models" / f"{name}.yaml"
        if not preset_path.is_file():
            names = sorted(p.stem for p in (CONFIG_ROOT / "models").glob("*.yaml"))
            match = difflib.get_close_matches(str(name), names, n=1)
            hint = f"; did you mean '{match[0]}'?" if match else f"; available: {', '.join(names)}"
            raise ConfigError(f"{source}: unknown model preset '{name}'{hint}")
        base = load_yaml(preset_path)
        base.update(model)
        tree["model"] = base
    return tree


def validate(schema: type[BaseModel], tree: dict, source: str) -> Any:
    try:
        return schema.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, schema, source)) from None


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | dict | None = None,
    tree: dict | None = None,
    schema: type[BaseModel] = TrainConfig,
) -> Any:
    """Load a run config from YAML (or a dict), apply overrides, resolve presets, validate."""
    source = str(path) if path else "config"
    data = load_yaml(path) if path else dict(tree or {})
    if isinstance(data.get("model"), str):  # so `model.num_layers=2` can refine a preset
        data["model"] = {"preset": data["model"]}
    if overrides:
        apply_overrides(data, overrides)
    if schema is TrainConfig or "model" in getattr(schema, "model_fields", {}):
        resolve_model_preset(data, source)
    return validate(schema, data, source)


def to_yaml(cfg: BaseModel) -> str:
    """The config as YAML, model and data sections first (the order a reader looks for them)."""
    tree = cfg.model_dump(mode="json")
    first = [key for key in ("model", "tokenizer", "data", "optimizer") if key in tree]
    tree = {**{key: tree[key] for key in first}, **{k: v for k, v in tree.items() if k not in first}}
    return yaml.safe_dump(tree, sort_keys=False)
