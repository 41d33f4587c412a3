"""The frozen base of QLoRA held quantized (qwix): int8 or NF4 projection weights.

`lora.base_dtype: int8 | nf4` stores every dense projection of attention and the MLP (and
Gemma 4's per-layer-input projections; engine/models/lora.py: WEIGHTS) as a qwix QArray, as
bitsandbytes' QLoRA holds every nn.Linear but the head, and the rest of the base (embeddings,
norms, the LM head, routers and experts) in bfloat16:

    int8  absmax per output channel (and per layer)                     ~1 byte per weight
    nf4   NormalFloat4 (QLoRA, arXiv 2305.14314) in blocks of 64 along the last
          input axis (the whole axis where 64 does not divide it), absmax per block  ~0.5 byte

and each product dequantizes its weight to the compute dtype where it is read (one layer at
a time inside the layer scan), then multiplies as usual: the path every platform has.
No fused low-bit matmul kernel is used yet, so a QLoRA step spends the dequantization's
time and gains memory only; `describe_path` says so in the run's log.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import qwix
from jax.sharding import NamedSharding, PartitionSpec

from engine.models.lora_targets import WEIGHTS

QUANTIZED_DTYPES = ("int8", "nf4")
NF4_BLOCK = 64
_RANK = {
    "wq_dnh": 3, "wk_dkh": 3, "wv_dkh": 3, "wo_nhd": 3, "w_gate_df": 2, "w_up_df": 2, "w_down_fd": 2,
    "per_layer_gate_dp": 2, "per_layer_proj_pd": 2, "per_layer_proj_dx": 2,  # Gemma 4's per-layer inputs
}  # fmt: skip
"""Each quantized projection's own rank (the attention's, the MLP's and Gemma 4's per-layer
inputs'); more leading axes are stacked layers."""
_QUANTIZED_NAMES = frozenset(_RANK)
_N_IN = {attr: WEIGHTS[attr] for attr in _RANK}


def _axes(shape: tuple[int, ...], attr: str, base_dtype: str) -> dict:
    """qwix's channelwise and tiled axes for a weight (leading axes beyond its own are stacked layers)."""
    n_in, lead = _N_IN[attr], len(shape) - _RANK[attr]
    inputs = tuple(range(lead, lead + n_in))
    channelwise = tuple(i for i in range(len(shape)) if i not in inputs)
    if base_dtype == "int8":
        return {"qtype": jnp.int8, "channelwise_axes": channelwise}
    last = inputs[-1]
    block = NF4_BLOCK if shape[last] % NF4_BLOCK == 0 else shape[last]
    return {"qtype": "nf4", "channelwise_axes": channelwise + inputs[:-1], "tiled_axes": {last: block}}


def quantizable(path) -> str | None:
    """The projection name at `path` (a param tree key path) if QLoRA quantizes it."""
    name = str(getattr(path[-1], "key", path[-1]))
    return name if name in _QUANTIZED_NAMES else None


def quantize_leaf(value, attr: str, base_dtype: str):
    return qwix.quantize(value, **_axes(tuple(value.shape), attr, base_dtype))


def quantized_abstract(abstract: dict, base_dtype: str) -> dict:
    """The ShapeDtypeStructs (with shardings) of `abstract` (the base's) once quantized: each
    projection a QArray of its quantized values (sharded as the weight) and scales (sharded
    as the weight on the axes they keep whole, replicated on the others); the other floating
    leaves in bfloat16 (QLoRA's storage of what it does not quantize)."""

    def one(path, a):
        attr = quantizable(path)
        if attr is None:  # embeddings, norms, the head: bfloat16, as QLoRA keeps them
            floating = jnp.issubdtype(a.dtype, jnp.floating)
            return jax.ShapeDtypeStruct(a.shape, jnp.bfloat16 if floating else a.dtype, sharding=a.sharding)
        q = jax.eval_shape(lambda x: quantize_leaf(x, attr, base_dtype), jax.ShapeDtypeStruct(a.shape, a.dtype))
        spec = tuple(a.sharding.spec) + (None,) * (len(a.shape) - len(a.sharding.spec)) if a.sharding else None

        def placed(s):
            if spec is None:
                return jax.ShapeDtypeStruct(s.shape, s.dtype)
            kept = PartitionSpec(*(axis if s.shape[i] == a.shape[i] else None for i, axis in enumerate(spec)))
            return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(a.sharding.mesh, kept))

        return jax.tree.map(placed, q)

    return jax.tree_util.tree_map_with_path(one, abstract)


def describe_path(base_dtype: str, platform: str) -> str:
    return (
        f"lora.base_dtype {base_dtype}: the base's projections are stored as qwix {base_dtype} and "
        f"dequantized to the compute dtype per layer for each product (no fused {base_dtype} matmul kernel "
        f"on {platform}): the base takes {'~1/4' if base_dtype == 'int8' else '~1/8'} of float32's memory; "
        "the step is not faster for it"
    )
