"""A model's parameters as pure pytrees: their shapes, shardings, initialisation, and the
functional forward pass.

Training, sampling and conversion hold params as nested dicts of arrays; the NNX module is
rebuilt around them (`apply_model`) inside jitted functions. Shardings come from the logical
axis names every parameter carries (engine/ops/partitioning.py).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from engine.models.config import ComputeConfig, LoraConfig, ModelConfig
from engine.models.lora import split_adapter
from engine.models.transformer import Transformer
from engine.ops.partitioning import check_divisible, logical_to_spec, use_mesh


def _path_name(path) -> str:
    return ".".join(str(getattr(p, "key", p)) for p in path)


def param_shardings(
    model_cfg: ModelConfig, compute: ComputeConfig, mesh: Mesh | AbstractMesh | None, lora: LoraConfig | None = None
):
    """(shapes, per-parameter NamedSharding from the logical names in the model's metadata).
    With `lora`, the tree holds the adapters too (engine/models/lora.py)."""
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, compute, rngs=nnx.Rngs(0), lora=lora))
    _, state = nnx.split(abstract)
    shapes = nnx.to_pure_dict(state)
    logical = nnx.to_pure_dict(nnx.get_partition_spec(state))
    if mesh is None:
        return shapes, None

    def to_sharding(path, shape, names):
        spec = logical_to_spec(names, mesh=mesh)
        check_divisible(_path_name(path), shape.shape, spec, mesh)
        return NamedSharding(mesh, spec)

    shardings = jax.tree_util.tree_map_with_path(
        to_sharding, shapes, logical, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    return shapes, shardings


def abstract_model_params(
    model_cfg: ModelConfig, compute: ComputeConfig, mesh: Mesh | None, lora: LoraConfig | None = None
):
    """ShapeDtypeStructs (with shardings on `mesh`) of the model's parameters (and adapters)."""
    shapes, shardings = param_shardings(model_cfg, compute, mesh, lora)
    if shardings is None:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), shapes)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def init_params(
    model_cfg: ModelConfig,
    compute: ComputeConfig,
    mesh: Mesh,
    seed: int,
    lora: LoraConfig | None = None,
    *,
    adapter_only: bool = False,
):
    """Initialise directly into the sharded layout (no full copy on one device). With
    `adapter_only`, just the adapters of `lora` (the base is never computed: XLA drops it)."""
    _, shardings = param_shardings(model_cfg, compute, mesh, lora)
    if adapter_only:
        shardings = split_adapter(shardings)[0]

    def init():
        params = nnx.to_pure_dict(nnx.split(Transformer(model_cfg, compute, rngs=nnx.Rngs(seed), lora=lora))[1])
        return split_adapter(params)[0] if adapter_only else params

    with use_mesh(mesh):
        return jax.jit(init, out_shardings=shardings)()


def graphdef_of(model_cfg: ModelConfig, compute: ComputeConfig, lora: LoraConfig | None = None):
    """The model's structure without its values: `apply_model` merges params into it."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, compute, rngs=nnx.Rngs(0), lora=lora)))[0]


def apply_model(graphdef, params, tokens, positions=None, segment_ids=None):
    """Logits of the model `graphdef` with `params` (a pure dict): the functional forward pass."""
    return nnx.merge(graphdef, params)(tokens, positions, segment_ids)


def apply_model_with_aux(graphdef, params, tokens, positions=None, segment_ids=None):
    """(logits, aux): aux holds a mixture of experts' router losses and expert loads
    (engine/models/moe.py: combine_stats), and is empty for a dense model."""
    return nnx.merge(graphdef, params).forward(tokens, positions, segment_ids)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), the PaLM accounting: the
    parameters' products, and each layer's sequence mixing as its spec counts it."""
    dense = cfg.num_params(include_embedding=False, active=True) + cfg.vocab_size * cfg.d_model  # + lm head
    mixers = [spec.mixer for spec in cfg.layer_specs() if spec.mixer is not None]
    attention = sum(mixer.mixing_macs(seq_len) for mixer in mixers)  # each mixer kind counts its own
    return 6 * dense + 6 * attention
