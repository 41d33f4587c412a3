"""The KV cache of decoding: keys and values of every layer, written one step at a time."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from engine.models.config import ComputeConfig, ModelConfig
from engine.models.ngram_embedding import initial_state
from engine.models.specs import MLASpec
from engine.ops.attention import BF16_BITS, cache_values, stored
from engine.ops.partitioning import constrain, current_platform

INDEX_NAMES = ("act_batch", None, None)  # sparse attention's indexer keys (b, s, index_head_dim)
CACHE_NAMES = ("act_batch", "act_kv_heads", None, None)  # keys (b, kv_heads, head_dim, s); values (b, kv_heads, s, h)


DECODE_STATES: dict[str, Callable[[Any, ComputeConfig, int], Any]] = {}
"""Mixer kind -> its per-sequence decoding state at a sequence's start, of (its spec, compute,
batch), for the kinds that carry a state instead of keys and values; the kind's module
registers it (engine/models/gated_delta_block.py: the convolution window and the recurrent state)."""
KEYS_AND_STATE = {"attention_mamba2"}
"""Mixer kinds in DECODE_STATES that keep keys and values as well (Falcon-H1's parallel layers)."""


def ngram_state(spec, cfg: ModelConfig, batch: int):
    """A layer's hashed n-gram embedding's state at a sequence's start (ngram_embedding.py)."""
    streams = 1 if spec.gated_residual is None else spec.gated_residual.streams
    return initial_state(spec.ngram_embedding, streams, cfg.d_model, batch, jnp.float32)


def _names(shape: tuple[int, ...]) -> tuple:
    """CACHE_NAMES, but an MLA cache's single "head" is not split over the tensor axis."""
    return CACHE_NAMES if shape[1] > 1 else ("act_batch", None, None, None)


@struct.dataclass
class KVCache:
    """Keys and values of every layer, for decoding one step at a time (engine/inference/sample.py).

    Functional: a decode step returns a new cache. Rows are left-padded, so every row
    writes the same slots: a step of t tokens fills slots [end, end + t) of each layer.

    One array per layer, heads-major, keys (b, kv_heads, head_dim, s) and values (b,
    kv_heads, s, head_dim): attention's two products batch over (b, kv_heads) and contract
    head_dim (q . k) and the slots (p . v), so each (b, kv_head) is a plain row-major
    (contracted x free) matrix and attention reads the cache where it lies. A stacked
    (layers, b, s, kv_heads, head_dim) cache had XLA:CPU copy and transpose each layer's share
    every decode step; keys (s, head_dim)-major made q . k a transposed operand, which
    XLA:CPU multiplied at a fraction of the speed (bench/profile_sample.py).

    Multi-head latent attention (engine/models/mla.py) caches its compressed form instead: k
    holds each position's latent (b, 1, kv_lora_rank, s) and v its rotary key shared by the
    heads (b, 1, s, rope_head_dim), one "head" each.

    `update` returns both in the logical (b, s, heads, dim) order attention takes, or with
    `raw` as stored. On CPU a bfloat16 cache stores its values' bits (uint16,
    engine/ops/attention.py: BF16_BITS), so that a step's write is in place.

    A layer whose mixer carries a state instead (a kind in DECODE_STATES: Gated DeltaNet) has
    empty keys and values (no heads) and its state in `states` (None for the attention
    layers), one per row: expanding or sharing a prompt cache repeats it for each row.

    Group rollouts (GRPO's G completions per prompt) can keep the prompts' keys and values
    once per prompt (`share`): then `shared_k`/`shared_v` hold them (prompts, ...) in the
    same layouts, a prefix every row of a group of `group` consecutive rows attends to
    before its own slots, and k/v hold the rows' own (completion) slots only.
    """

    k: tuple[jax.Array, ...]  # per layer (b, kv_heads, head_dim, s)
    v: tuple[jax.Array, ...]  # per layer (b, kv_heads, s, head_dim)
    valid_bs: jax.Array  # (b, s) bool: the slot holds a real token (not padding, not empty)
    end: jax.Array  # () int32: first empty slot
    layer: int = struct.field(pytree_node=False, default=0)  # the layer being run; set by Transformer._decode_blocks
    shared_k: tuple[jax.Array, ...] = ()  # per layer (prompts, kv_heads, head_dim, p): the group's shared prefix
    shared_v: tuple[jax.Array, ...] = ()  # per layer (prompts, kv_heads, p, head_dim)
    shared_valid_ps: jax.Array | None = None  # (prompts, p) bool
    group: int = struct.field(pytree_node=False, default=1)  # rows per prompt sharing a prefix
    states: tuple = ()  # per layer: a stateful mixer's state (DECODE_STATES), None for attention; () if none
    index_k: tuple[jax.Array, ...] = ()  # per layer (b, s, index_head_dim): sparse attention's indexer keys (dsa.py)

    @classmethod
    def init(cls, cfg: ModelConfig, compute: ComputeConfig, batch: int, max_len: int) -> KVCache:
        dtype = jnp.float32
        if compute.dtype == "bfloat16":  # on CPU as its bits (engine/ops/attention.py: BF16_BITS)
            dtype = BF16_BITS if current_platform() == "cpu" else jnp.bfloat16
        k_shapes: list[tuple[int, ...]] = []
        v_shapes: list[tuple[int, ...]] = []
        states: list[Any] = []
        for spec in cfg.layer_specs():  # a layer's heads may have a shape of their own (Gemma 4's global ones)
            mixer = spec.mixer
            kind = None if mixer is None else mixer.kind
            states.append(DECODE_STATES[kind](mixer, compute, batch) if kind in DECODE_STATES else None)
            if spec.ngram_embedding is not None:  # Qwen4-Exp: the n-gram embedding's state beside the mixer's
                states[-1] = (ngram_state(spec, cfg, batch), states[-1])
            keys = kind in KEYS_AND_STATE  # Falcon-H1's parallel layers keep both
            reuses = spec.kv_sharing == "reuse"  # a Gemma 4 layer attending with another layer's keys and values
            if (states[-1] is not None and not keys) or mixer is None or reuses:  # no keys, values
                k_shapes.append((batch, 0, 0, max_len))
                v_shapes.append((batch, 0, max_len, 0))
                continue
            if hasattr(mixer, "cache_shapes"):  # a mixer that sizes its own (compressed_attention.py)
                k_shape, v_shape = mixer.cache_shapes(batch, max_len)
            elif isinstance(mixer, MLASpec):  # the latent and the shared rotary key (mla.py)
                k_shape, v_shape = (batch, 1, max_len, mixer.kv_lora_rank), (batch, 1, max_len, mixer.rope_head_dim)
            else:
                attention = spec.attention
                assert attention is not None, f"mixer kind {kind} keeps keys and values but is not attention"
                k_shape = v_shape = (batch, attention.num_kv_heads, max_len, attention.head_dim)
            k_shapes.append((*k_shape[:2], k_shape[3], k_shape[2]))  # keys slot-minor
            v_shapes.append(v_shape)
        k, v = (
            tuple(constrain(jnp.zeros(shape, dtype), _names(shape)) for shape in shapes)
            for shapes in (k_shapes, v_shapes)
        )
        layer_states = tuple(states) if any(state is not None for state in states) else ()
        index_k: tuple[jax.Array, ...] = ()
        if cfg.mla.index_topk is not None:  # DeepSeek Sparse Attention: the indexer's key per position
            shared = set(cfg.mla.index_shared_layers or [])  # (GLM-5's shared layers read an earlier layer's)
            shared |= {i for i, spec in enumerate(cfg.layer_specs()) if getattr(spec.mixer, "indexer", None) is None}
            index_k = tuple(
                constrain(jnp.zeros((batch, max_len, 0 if i in shared else cfg.mla.index_head_dim), dtype), INDEX_NAMES)
                for i in range(cfg.num_layers)
            )
        elif any(spec.attention is not None and spec.attention.block_indexer for spec in cfg.layer_specs()):
            widths = [  # MiniMax-M3's block-sparse layers: their indexer's key per position (block_sparse.py)
                spec.attention.block_indexer.head_dim if spec.attention and spec.attention.block_indexer else 0
                for spec in cfg.layer_specs()
            ]
            index_k = tuple(constrain(jnp.zeros((batch, max_len, i), dtype), INDEX_NAMES) for i in widths)
        elif any(spec.attention is not None and spec.attention.qsa_indexer for spec in cfg.layer_specs()):
            widths = [  # Qwen4-Exp's QSA layers: their indexer's raw key per position (qsa.py)
                spec.attention.qsa_indexer.head_dim if spec.attention and spec.attention.qsa_indexer else 0
                for spec in cfg.layer_specs()
            ]
            index_k = tuple(constrain(jnp.zeros((batch, max_len, i), dtype), INDEX_NAMES) for i in widths)
        return cls(
            k, v, jnp.zeros((batch, max_len), bool), jnp.zeros((), jnp.int32), states=layer_states, index_k=index_k
        )

    def expand(self, repeats: int, extra_slots: int) -> KVCache:
        """Each row `repeats` times (row r becomes rows r * repeats ... r * repeats + repeats - 1)
        with `extra_slots` empty slots appended: a prompt's cache, computed once, shared by the
        group of completions sampled from it (GRPO's G per prompt)."""
        k_slots, v_slots = ((0, 0), (0, 0), (0, 0), (0, extra_slots)), ((0, 0), (0, 0), (0, extra_slots), (0, 0))
        k, v = (
            tuple(constrain(jnp.pad(jnp.repeat(a, repeats, axis=0), slots), _names(a.shape)) for a in layers)
            for layers, slots in ((self.k, k_slots), (self.v, v_slots))
        )
        valid_bs = jnp.pad(jnp.repeat(self.valid_bs, repeats, axis=0), ((0, 0), (0, extra_slots)))
        index_k = tuple(  # sparse attention's indexer keys (dsa.py)
            constrain(jnp.pad(jnp.repeat(a, repeats, axis=0), ((0, 0), (0, extra_slots), (0, 0))), INDEX_NAMES)
            for a in self.index_k
        )
        return self.replace(k=k, v=v, valid_bs=valid_bs, states=self._repeat_states(repeats), index_k=index_k)

    def _repeat_states(self, repeats: int) -> tuple:
        """The stateful layers' states, each row `repeats` times (a state is per row, never shared)."""
        return jax.tree.map(lambda a: jnp.repeat(a, repeats, axis=0), self.states)

    def share(self, repeats: int, slots: int) -> KVCache:
        """This (prompt) cache as the prefix shared by groups of `repeats` rows (row r of the
        result belongs to prompt r // repeats), and `slots` empty slots of each row's own. The
        same attention as `expand(repeats, slots)`, without copying the prompt cache to every
        row: decode attention reads a prompt's keys once for its whole group
        (engine/ops/attention_reference.py). Attention layers only (not MLA), one prefix."""
        assert not self.shared_k, "the cache already has a shared prefix"
        batch = self.valid_bs.shape[0] * repeats
        k = tuple(constrain(jnp.zeros((batch, *a.shape[1:3], slots), a.dtype), _names(a.shape)) for a in self.k)
        v = tuple(
            constrain(jnp.zeros((batch, a.shape[1], slots, a.shape[3]), a.dtype), _names(a.shape)) for a in self.v
        )
        return KVCache(
            k,
            v,
            jnp.zeros((batch, slots), bool),
            jnp.zeros((), jnp.int32),
            shared_k=self.k,
            shared_v=self.v,
            shared_valid_ps=self.valid_bs,
            group=repeats,
            states=self._repeat_states(repeats),
        )

    @property
    def length(self) -> int:
        """Slots a row attends to: its own and a shared prefix's (every position is below it)."""
        return self.valid_bs.shape[1] + (0 if self.shared_valid_ps is None else self.shared_valid_ps.shape[1])

    def shared_prefix(self, *, window: int | None = None, raw: bool = False, chunk=None):
        """None, or this layer's shared prefix as (k_pkhs, v_pksh, mask_ps, group) for a
        step's one query (slot `end` of the rows' own slots, which follow the prefix's); `raw`:
        the keys and values as stored (maybe BF16_BITS), else as values. `chunk`: as update's."""
        if not self.shared_k:
            return None
        mask_ps = self.shared_valid_ps
        assert mask_ps is not None  # set with shared_k
        if window is not None:
            prefix = mask_ps.shape[1]
            distance_s = prefix + self.end - jnp.arange(prefix)
            mask_ps = mask_ps & (distance_s < window)[None]
        if chunk is not None:  # a group's rows share their query's position (prompt length + step)
            size, positions_bt = chunk
            key_positions_ps = jnp.cumsum(mask_ps.astype(jnp.int32), axis=1) - 1
            query_p = positions_bt[:: self.group, 0]
            mask_ps = mask_ps & (key_positions_ps // size == query_p[:, None] // size)
        k, v = self.shared_k[self.layer], self.shared_v[self.layer]
        return (k, v, mask_ps, self.group) if raw else (cache_values(k), cache_values(v), mask_ps, self.group)

    def update(self, k_btkh, v_btkh, *, window: int | None = None, raw: bool = False, chunk=None):
        """Write this layer's new keys/values; (k_bskh, v_bskh, mask_bts, cache) to attend with,
        or with `raw` (k_bkhs, v_bksh, mask_bts, cache): keys and values as stored, in the
        cache's layouts (for engine/ops/attention.py: decode_attention).

        Query i (slot end + i) sees slot j iff j <= end + i and the slot is valid; with a
        sliding `window` (a local layer) also end + i - j < window. Left padding keeps slot
        order equal to position order: this is the full forward pass's causal mask. `chunk`
        (size, the queries' positions (b, t)): chunked attention (Llama 4), the key's position
        (its valid slots before it, and a shared prefix's) in the query's chunk of `size`.
        """
        t = k_btkh.shape[1]
        k_bkhs = jax.lax.dynamic_update_slice(
            self.k[self.layer], stored(k_btkh.transpose(0, 2, 3, 1), self.k[0].dtype), (0, 0, 0, self.end)
        )
        v_bksh = jax.lax.dynamic_update_slice(
            self.v[self.layer], stored(v_btkh.swapaxes(1, 2), self.v[0].dtype), (0, 0, self.end, 0)
        )
        k_all = (*self.k[: self.layer], k_bkhs, *self.k[self.layer + 1 :])
        v_all = (*self.v[: self.layer], v_bksh, *self.v[self.layer + 1 :])
        mask_bts = self._mask(t, window, chunk)
        cache = self.replace(k=k_all, v=v_all)
        if raw:
            return k_bkhs, v_bksh, mask_bts, cache
        return cache_values(k_bkhs).transpose(0, 3, 1, 2), cache_values(v_bksh).swapaxes(1, 2), mask_bts, cache

    def read(self, t: int, *, window: int | None = None, raw: bool = False, chunk=None):
        """This layer's keys and values for a step of `t` queries as `update` returns them,
        without writing: a Gemma 4 layer attending with another's (Layer.kv_sharing reuse),
        `self.layer` that layer, which wrote the step's slots already."""
        k_bkhs, v_bksh, mask_bts = self.k[self.layer], self.v[self.layer], self._mask(t, window, chunk)
        if raw:
            return k_bkhs, v_bksh, mask_bts, self
        return cache_values(k_bkhs).transpose(0, 3, 1, 2), cache_values(v_bksh).swapaxes(1, 2), mask_bts, self

    def _mask(self, t: int, window: int | None, chunk):
        """(b, t, s): `update`'s mask of a step's `t` queries over the slots."""
        s = self.valid_bs.shape[1]
        distance_ts = self.end + jnp.arange(t)[:, None] - jnp.arange(s)[None, :]
        visible_ts = distance_ts >= 0
        if window is not None:
            visible_ts = visible_ts & (distance_ts < window)
        mask_bts = visible_ts[None] & self.valid_bs[:, None, :]
        if chunk is not None:
            size, positions_bt = chunk
            prefix_b = 0 if self.shared_valid_ps is None else jnp.repeat(jnp.sum(self.shared_valid_ps, 1), self.group)
            key_positions_bs = jnp.cumsum(self.valid_bs.astype(jnp.int32), axis=1) - 1 + jnp.reshape(prefix_b, (-1, 1))
            mask_bts = mask_bts & (key_positions_bs[:, None, :] // size == positions_bt[:, :, None] // size)
        return mask_bts

    def update_index(self, k_bti):
        """Write this layer's new indexer keys (sparse attention, engine/models/dsa.py) into
        slots [end, end + t); (all its keys (b, s, index_head_dim) as values, cache)."""
        k_bsi = jax.lax.dynamic_update_slice(
            self.index_k[self.layer], stored(k_bti, self.index_k[0].dtype), (0, self.end, 0)
        )
        index_k = (*self.index_k[: self.layer], k_bsi, *self.index_k[self.layer + 1 :])
        return cache_values(k_bsi), dataclasses.replace(self, index_k=index_k)
