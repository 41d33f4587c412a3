"""Dropless expert parallelism: the tokens travel to the devices that hold their experts.

Used by engine/models/moe.py for `moe_dispatch: dropless` when the mesh's `expert` axis has
more than one device. Without it, XLA would partition the grouped matmul by gathering every
expert's weights onto every device; here each device keeps the experts its `expert` shard
holds (E / S of them) and the assignments move instead, MegaBlocks / MaxText style:

1. each device sorts its own (token, expert) assignments by expert, so the rows for expert
   shard s are contiguous, and packs them into a (S, n * k, d) send buffer;
2. an all-to-all over `expert` exchanges the buffers: device s receives, from each peer, the
   rows routed to its experts (with their local expert ids);
3. one grouped matmul per projection (engine/ops/grouped.py) over the local experts, with the
   expert MLP width split over `tensor` (the down projection's partial sums are summed over
   it);
4. the reverse all-to-all returns each row to the device it came from, where the k outputs of
   a token are weighted and summed.

Without an expert axis but with the tokens split over the batch or context axes (an
fsdp-only mesh), the same shard_map runs without the exchange: each device sorts its own
assignments and runs them through every expert (the weights gathered, as FSDP gathers any
layer's). Left to GSPMD, the sort by expert of the whole batch's assignments was not split:
every device sorted and computed all of them (DeepSeek-V4-Flash on a v5p-256 with
`fsdp: 128`: (128 x 4,096 x 6, 4,096) bf16 buffers of 24 GiB each).

Nothing is dropped: a send buffer has room for all n * k of a device's assignments to every
peer, the worst case, since the collectives here (XLA:CPU included) move fixed shapes. On
GPU and TPU `jax.lax.ragged_all_to_all` would move only the filled rows; XLA:CPU does not
implement it, so the padded exchange is the one path, and the one tested.

Shapes in names as in moe.py, plus s the expert shards, r = n * k the rows of one buffer.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from engine.ops.grouped import grouped_mlp
from engine.ops.partitioning import TOKEN_AXES


def expert_shards(mesh: Mesh | None) -> int:
    """How many devices the `expert` axis of `mesh` has (1 without a mesh or the axis)."""
    return 1 if mesh is None or "expert" not in mesh.axis_names else mesh.shape["expert"]


def applies(mesh: Mesh | None, tokens: int) -> bool:
    """Whether the dropless dispatch of `tokens` tokens runs here, each device on its own
    tokens: the tokens split over more than one device of the batch and context axes (an
    expert axis among them, or not), evenly (a decode step of fewer rows than devices does
    not, and takes the gathered path)."""
    if mesh is None:
        return False
    split = math.prod(mesh.shape[a] for a in TOKEN_AXES if a in mesh.axis_names)
    return split > 1 and tokens % split == 0


def expert_parallel_dropless(
    x_nd, experts_nk, weights_nk, w_gate_edf, w_up_edf, w_down_efd, glu, mesh: Mesh, biases=None
):
    """sum_k weight * expert_k(x) with the experts sharded over `mesh`'s `expert` axis (if it
    has more than one device) and the tokens over its batch and context axes; the same numbers
    as moe.dropless_experts (tests/test_moe.py)."""
    shards = expert_shards(mesh)
    num_experts = w_gate_edf.shape[0]
    assert num_experts % shards == 0, "check_divisible refuses such a mesh before any step"
    local_experts = num_experts // shards
    tensor = "tensor" if "tensor" in mesh.axis_names and mesh.shape["tensor"] > 1 else None
    rows = tuple(a for a in TOKEN_AXES if a in mesh.axis_names)  # (b, t) flattened: rows, then positions

    def local(x_nd, experts_nk, weights_nk, w_gate_edf, w_up_edf, w_down_efd, *biases):
        n, k = experts_nk.shape
        r = n * k
        with jax.named_scope("dispatch"):
            flat = experts_nk.reshape(-1)  # assignment i is token i // k
            order = jnp.argsort(flat, stable=True)
            if shards == 1:  # every expert here: no exchange
                groups = jnp.bincount(flat, length=local_experts).astype(jnp.int32)
                x_md = x_nd[order // k]
            else:
                expert_r = flat[order]
                shard_r = expert_r // local_experts  # where each sorted assignment goes
                sent_s = jnp.bincount(shard_r, length=shards)
                slot_r = jnp.arange(r) - (jnp.cumsum(sent_s) - sent_s)[shard_r]  # its row in that shard's buffer
                send_srd = jnp.zeros((shards, r, x_nd.shape[-1]), x_nd.dtype).at[shard_r, slot_r].set(x_nd[order // k])
                # Empty rows carry expert id `local_experts`: past every group, so no matmul touches them.
                send_sr = (
                    jnp.full((shards, r), local_experts, jnp.int32).at[shard_r, slot_r].set(expert_r % local_experts)
                )
                recv_srd = jax.lax.all_to_all(send_srd, "expert", 0, 0, tiled=True)
                recv_sr = jax.lax.all_to_all(send_sr, "expert", 0, 0, tiled=True)
                # Grouped by local expert: every peer's rows for expert 0, then expert 1, ...
                local_m = recv_sr.reshape(-1)
                by_expert = jnp.argsort(local_m, stable=True)
                groups = jnp.bincount(local_m, length=local_experts).astype(jnp.int32)
                x_md = recv_srd.reshape(-1, x_nd.shape[-1])[by_expert]
        with jax.named_scope("experts"):
            # Each tensor shard holds a slice of the MLP width: the down projection's partial
            # sums are summed over it. The empty rows (past the groups) come out unused.
            y_md = grouped_mlp(
                x_md,
                groups,
                w_gate_edf,
                w_up_edf,
                w_down_efd,
                glu,
                biases or None,
                (lambda y: jax.lax.psum(y, tensor)) if tensor else None,
            )
        with jax.named_scope("combine"):
            if shards == 1:
                y_sorted = y_md
            else:
                y_srd = y_md[jnp.argsort(by_expert)].reshape(shards, r, -1)
                back_srd = jax.lax.all_to_all(y_srd, "expert", 0, 0, tiled=True)
                y_sorted = back_srd[shard_r, slot_r]  # (r, d) in the sorted order
            y_nkd = y_sorted[jnp.argsort(order)].reshape(n, k, -1)
            return jnp.einsum("nkd,nk->nd", y_nkd, weights_nk.astype(y_nkd.dtype))

    token = P(rows or None, None)
    f_in, f_out = P("expert", None, tensor), P("expert", tensor, None)
    bias_specs = () if biases is None else (P("expert", tensor), P("expert", tensor), P("expert", None))
    fn = jax.shard_map(
        local, mesh=mesh, in_specs=(token, token, token, f_in, f_in, f_out, *bias_specs), out_specs=token
    )
    return fn(x_nd, experts_nk, weights_nk, w_gate_edf, w_up_edf, w_down_efd, *(biases or ()))
