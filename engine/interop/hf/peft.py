"""LoRA adapters <-> PEFT's format: `adapter_config.json` + `adapter_model.safetensors`, as
`peft.PeftModel.from_pretrained` loads onto the exported base model.

PEFT names an adapted nn.Linear's two factors `<module>.lora_A.weight` (r, in_features) and
`<module>.lora_B.weight` (out_features, r) under `base_model.model.`; the engine's A is
(in..., r) and B (r, out...) beside the base weight (engine/models/lora.py), so each is a
reshape and a transpose. numpy only: pipeline validation reads adapter_config.json here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import ConfigError
from engine.interop.hf.mapping import fuse, tensor_table, unfuse
from engine.interop.hf.safetensors_io import SafetensorsFile, write_safetensors
from engine.models.config import LoraConfig, ModelConfig
from engine.models.families import get_family
from engine.models.lora_targets import adaptable_modules

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def _adapted_specs(cfg: ModelConfig, lora: LoraConfig):
    """(PEFT module name, TensorSpec of its base weight(s), the model's layers in its stack,
    or None for a weight of the model's own outside the layers: Gemma 4's per-layer-input
    projection) for every module `lora` adapts (engine/models/lora_targets.py)."""
    modules, _ = adaptable_modules(cfg)
    stacks = dict(cfg.layer_stacks())
    top, _ = tensor_table(cfg)
    for name in lora.targets(cfg):
        for spec in modules[name]:
            if spec in top:
                yield name, spec, None
            elif spec.stack in stacks:  # not the multi-token-prediction layers' (mtp_blocks)
                yield name, spec, stacks[spec.stack]


def _b_spec(spec):
    """The spec that lays the parts' B factors out as PEFT's one lora_B (out, r): as the fused
    weight's rows (or a Conv1D's columns) in order, the rank the input axis."""
    return dataclasses.replace(spec, in_dims=1, in_out=False)


def _modules(cfg: ModelConfig, spec, layers: list[int] | None):
    """(slot in the stack or None, PEFT's module name under base_model.model.) of each of
    `spec`'s modules."""
    family = get_family(cfg.family)
    if layers is None:
        yield None, PREFIX + family.module_name(spec.hf_name).removesuffix(".weight")
        return
    for i, layer in enumerate(layers):
        yield i, PREFIX + family.module_name(spec.hf_name.format(i=layer)).removesuffix(".weight")


def _layer(tree: dict, stack: str, path: tuple[str, ...], i: int | None, scan_layers: bool) -> Any:
    if i is None:  # the model's own weight
        return _at(tree, path)
    node = tree[stack] if scan_layers else tree[stack][i]
    for key in path:
        node = node[key]
    return node[i] if scan_layers else node


def adapter_to_peft(cfg: ModelConfig, lora: LoraConfig, adapter: dict, *, scan_layers: bool) -> dict[str, np.ndarray]:
    """PEFT's tensors (name -> C-contiguous array) of the engine's adapter tree: a fused
    module's one A is its first part's, its B the parts' B's laid out as the fused weight's rows."""
    out = {}
    for _, spec, layers in _adapted_specs(cfg, lora):
        *module, attr = spec.path
        for i, name in _modules(cfg, spec, layers):
            a = np.asarray(_layer(adapter, spec.stack, (*module, attr + "_lora_a"), i, scan_layers))
            bs = [
                np.asarray(_layer(adapter, spec.stack, (*part[:-1], part[-1] + "_lora_b"), i, scan_layers))
                for part in (spec.path, *spec.fused_with)
            ]
            out[name + ".lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, lora.rank).T)
            b_rows = [b.reshape(lora.rank, -1).T for b in bs]  # each (out, r)
            out[name + ".lora_B.weight"] = np.ascontiguousarray(
                fuse(_b_spec(spec), b_rows) if spec.fused_with else b_rows[0]
            )
    return out


def peft_config(lora: LoraConfig, cfg: ModelConfig, base_model: str | None = None) -> dict[str, Any]:
    """adapter_config.json of `lora` (the keys PEFT's LoraConfig reads; its defaults for the rest)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.targets(cfg)),
        "use_rslora": lora.use_rslora,
        "bias": "none",
        # a Conv1D base (GPT-2's) stores (in, out); the factors are the same either way
        "fan_in_fan_out": any(spec.in_out for _, spec, _ in _adapted_specs(cfg, lora)),
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_dora": False,
    }


def write_peft(
    out_dir: str | Path,
    cfg: ModelConfig,
    lora: LoraConfig,
    adapter: dict,
    *,
    scan_layers: bool,
    base_model: str | None = None,
) -> list[str]:
    """Write the PEFT adapter directory; returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = adapter_to_peft(cfg, lora, adapter, scan_layers=scan_layers)
    write_safetensors(out_dir / ADAPTER_WEIGHTS, list(tensors.items()), metadata={"format": "pt"})
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(peft_config(lora, cfg, base_model), indent=2) + "\n")
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]


def lora_config_from_peft(adapter_dir: str | Path) -> LoraConfig:
    """The LoraConfig of a PEFT adapter directory; a ConfigError naming the file and key for
    what the engine cannot run (DoRA, biases, modules other than its projections)."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        raw = json.loads(path.read_text())
    except OSError:
        raise ConfigError(f"{path}: not found (a PEFT adapter directory holds {ADAPTER_CONFIG})") from None
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{path}: peft_type '{raw.get('peft_type')}' is not supported (LORA)")
    for key, ok in (("use_dora", False), ("bias", "none")):
        if raw.get(key, ok) != ok:
            raise ConfigError(f"{path}: {key}={raw[key]!r} is not supported ({ok!r})")
    if raw.get("modules_to_save"):
        raise ConfigError(f"{path}: modules_to_save is not supported (only LoRA factors are imported)")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        targets = "all-linear" if targets == "all-linear" else [targets]
    if isinstance(targets, list):
        # PEFT may save all-linear's modules by their full names (gpt_neox.layers.0.attention.dense):
        # the engine adapts a name in every layer, and adapter_from_peft names any layer's tensor missing
        targets = sorted({str(t).rsplit(".", 1)[-1] for t in targets})
    if raw.get("rank_pattern") or raw.get("alpha_pattern"):
        raise ConfigError(f"{path}: per-module rank_pattern / alpha_pattern are not supported")
    try:
        return LoraConfig(
            rank=raw["r"],
            alpha=raw.get("lora_alpha", 8),
            dropout=raw.get("lora_dropout", 0.0),
            target_modules=targets,
            use_rslora=raw.get("use_rslora", False),
        )
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{path}: does not make a valid LoRA config: {e}") from None


def adapter_from_peft(
    adapter_dir: str | Path, cfg: ModelConfig, lora: LoraConfig, shapes: dict, *, scan_layers: bool
) -> dict:
    """The engine's adapter tree (numpy, shaped as `shapes`: the adapter half of the model's
    abstract params) from PEFT's tensors; a ConfigError naming a missing or misshapen tensor."""
    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ConfigError(f"{path}: not found (PEFT's {ADAPTER_WEIGHTS}; .bin adapters are not read)")
    with SafetensorsFile(path) as file:
        tensors = {name: file.get(name) for name in file.names()}
    out: dict[str, Any] = {}
    own: dict[str, Any] = {}  # the model's own weights' factors, outside the layer stacks

    def put(stack, module, key, i, value):
        if i is None:
            node = own
            for k in module:
                node = node.setdefault(k, {})
            node[key] = value
            return
        node = out.setdefault(stack, {} if scan_layers else [])
        if not scan_layers:
            while len(node) <= i:
                node.append({})
            node = node[i]
        for k in module:
            node = node.setdefault(k, {})
        if scan_layers:
            node.setdefault(key, []).append(value)
        else:
            node[key] = value

    used = set()
    for _, spec, layers in _adapted_specs(cfg, lora):
        parts = (spec.path, *spec.fused_with)
        for i, name in _modules(cfg, spec, layers):

            def shape_of(part, key, i=i, stack=spec.stack):
                if i is None or not scan_layers:
                    return _layer(shapes, stack, (*part[:-1], key), i, scan_layers).shape
                return _at(shapes, (stack, *part[:-1], key)).shape[1:]

            wanted = {
                "lora_A": [(spec.path, spec.path[-1] + "_lora_a")],
                "lora_B": [(part, part[-1] + "_lora_b") for part in parts],
            }
            for factor, keys in wanted.items():
                tensor_name = f"{name}.{factor}.weight"
                if tensor_name not in tensors:
                    raise ConfigError(f"{path}: no tensor '{tensor_name}'")
                value, part_shapes = tensors[tensor_name], [shape_of(part, key) for part, key in keys]
                if value.size != sum(int(np.prod(shape)) for shape in part_shapes):
                    fits = " + ".join(str(tuple(shape)) for shape in part_shapes)
                    raise ConfigError(
                        f"{path}: tensor '{tensor_name}' has shape {tuple(value.shape)}, "
                        f"which does not fit this base model's {fits} (rank {lora.rank})"
                    )
                # lora_A (r, in); lora_B (out, r), a fused module's rows its parts' in its layout
                pieces = unfuse(_b_spec(spec), value, part_shapes) if len(keys) > 1 else [value]
                for (part, key), piece, shape in zip(keys, pieces, part_shapes):
                    put(spec.stack, part[:-1], key, i, piece.T.reshape(shape))
                used.add(tensor_name)
    extra = sorted(set(tensors) - used)
    if extra:
        raise ConfigError(f"{path}: tensor '{extra[0]}' is not an adapter of this base model's targeted modules")
    if scan_layers:

        def stack(node):
            return {k: stack(v) if isinstance(v, dict) else np.stack(v) for k, v in node.items()}

        out = stack(out)
    return {**out, **own}


def _at(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree
