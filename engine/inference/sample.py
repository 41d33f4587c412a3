"""Batched sampling with a KV cache: one prefill, then a jitted decode loop.

`sample(...)` is pure and jit-able: left-padded prompts of mixed length in, generated
tokens and their log-probabilities out. Prompts are left-padded so that every row's next
token lands in the same cache slot (engine/models/kv_cache.py); positions count real tokens
only, so a row's numbers do not depend on how much padding it got.

Log-probabilities are those of the distribution sampled from, before top-k/top-p
truncation: log_softmax(logits / temperature) (TRL and vLLM report the same); greedy
decoding (temperature 0) reports log_softmax(logits). They equal the teacher-forced
log-probabilities of the same tokens, which is what GRPO's importance ratios need.

GRPO samples G completions per prompt: `sample` prefills each prompt once, its G rows
attend to that one prompt cache (KVCache.share), and the whole decode loop is one on-device while_loop
that stops as soon as every row has ended. `Sampler` jits `sample` once per length bucket
and setting on a mesh (params sharded as in training, rows over the data axes).
engine/inference/generate.py is the text-in, text-out command (`python -m
engine.inference.generate`, `trainflow generate`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from engine.config import ConfigError
from engine.contract import CHECKPOINT_DIR, TOKENIZER_DIR
from engine.data import urls
from engine.data.chat import render
from engine.models import router_replay
from engine.models.config import ComputeConfig, LoraConfig, ModelConfig
from engine.models.kv_cache import KVCache
from engine.models.params import abstract_model_params, graphdef_of
from engine.ops.partitioning import constrain, use_mesh
from engine.parallel.mesh import (
    batch_sharding,
    batch_shards,
    global_array,
    replicated,
    to_host,
)

NEG_INF = -jnp.inf
RolloutDtype = Literal["float32", "bfloat16"]
DRAW_BLOCK = 128  # vocabulary entries per block of the two-level inverse-CDF draw


# --------------------------------------------------------------------------- pure core


def filter_logits(logits_bv, top_k: int = 0, top_p: float = 1.0):
    """Set logits outside the top-k / the top-p nucleus to -inf (0 / 1.0 = no filter)."""
    if top_k and top_k < logits_bv.shape[-1]:
        kth_b1 = jax.lax.top_k(logits_bv, top_k)[0][:, -1:]
        logits_bv = jnp.where(logits_bv < kth_b1, NEG_INF, logits_bv)
    if top_p < 1.0:
        sorted_bv = jnp.sort(logits_bv, axis=-1)[:, ::-1]
        probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
        # Keep a token if the mass of the tokens ranked above it is below top_p (the first always).
        keep_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv < top_p
        threshold_b1 = jnp.min(jnp.where(keep_bv, sorted_bv, jnp.inf), axis=-1, keepdims=True)
        logits_bv = jnp.where(logits_bv < threshold_b1, NEG_INF, logits_bv)
    return logits_bv


# One decode step's token choice runs over the whole vocabulary for every row, as often as
# the LM head's matmul. Its passes over the (rows, vocab) logits are few and are reductions
# XLA:CPU hands to YNNPACK: each row's logits are cut into blocks of DRAW_BLOCK entries, and
# the per-block maxima and probability masses place a row's token in one block; only that
# block's entries are looked at again. No cumulative sum or arg-reduction runs over the whole
# vocabulary (on XLA:CPU those are several passes each: bench/profile_sample.py).


def vocab_blocks(logits_bv, block: int = DRAW_BLOCK):
    """(rows, blocks, block): the logits in blocks, the last padded with -inf."""
    rows, vocab = logits_bv.shape
    blocks = -(-vocab // block)
    if blocks * block != vocab:
        logits_bv = jnp.pad(logits_bv, ((0, 0), (0, blocks * block - vocab)), constant_values=NEG_INF)
    return logits_bv.reshape(rows, blocks, block)


def _first(flags_bn):
    """Index of each row's first true entry (the row's length if none)."""
    return jnp.min(jnp.where(flags_bn, jnp.arange(flags_bn.shape[-1]), flags_bn.shape[-1]), axis=-1)


def _last_positive(x_bn):
    """Index of each row's last entry > 0 (0 if none)."""
    return jnp.max(jnp.where(x_bn > 0, jnp.arange(x_bn.shape[-1]), 0), axis=-1)


def _block_of(logits_bnk, block_b):
    """(rows, block): block `block_b[r]` of each row r."""
    return jnp.take_along_axis(logits_bnk, block_b[:, None, None], axis=1)[:, 0]


def _argmax_in_blocks(logits_bnk, top_bn, top_b1):
    """The first of the rows' maximal entries: in the first block whose maximum is the row's."""
    block_b = _first(top_bn == top_b1)
    return block_b * logits_bnk.shape[-1] + _first(_block_of(logits_bnk, block_b) == top_b1)


def _draw_in_blocks(keys_b, logits_bnk, top_b1, cdf_bn, inverse_temperature=1.0):
    """The entry whose cumulative mass first reaches u * total (u uniform in (0, 1)): first
    the block, by the blocks' cumulative masses `cdf_bn` (of exp((logit - top) *
    inverse_temperature)), then the entry, by cumulative masses within that one block."""
    tiny = jnp.finfo(jnp.float32).tiny  # u > 0: an entry of probability 0 at the start is never reached
    u_b = jax.vmap(lambda key: jax.random.uniform(key, minval=tiny))(keys_b) * cdf_bn[:, -1]
    mass_bn = jnp.diff(cdf_bn, axis=-1, prepend=0.0)
    # Rounding may leave u past the last cumulative mass: the last block (entry) with mass then.
    block_b = jnp.minimum(jnp.sum(cdf_bn < u_b[:, None], axis=-1), _last_positive(mass_bn))
    at_block = functools.partial(jnp.take_along_axis, indices=block_b[:, None], axis=1)
    below_b = (at_block(cdf_bn) - at_block(mass_bn))[:, 0]  # the mass of the blocks before
    p_bk = jnp.exp((_block_of(logits_bnk, block_b) - top_b1) * inverse_temperature)
    # At least `tiny`: rounding can put below_b a hair above u, and a target <= 0 would take
    # the block's first entry even where top-k/top-p filtered it out (probability 0).
    target_b = jnp.maximum(u_b - below_b, tiny)
    entry_b = jnp.sum(jnp.cumsum(p_bk, axis=-1) < target_b[:, None], axis=-1)
    return block_b * logits_bnk.shape[-1] + jnp.minimum(entry_b, _last_positive(p_bk))


def _block_stats(logits_bnk, inverse_temperature=1.0):
    """(top_bn, top_b1, cdf_bn): each block's and each row's maximum logit, and the blocks'
    cumulative masses sum(exp((logit - top) * inverse_temperature)), whose last entry is the
    normaliser (a cumulative sum, not a sum: XLA would fold a sum of the block masses into a
    second pass over the vocabulary)."""
    top_bn = jnp.max(logits_bnk, axis=-1)
    top_b1 = jnp.max(top_bn, axis=-1, keepdims=True)
    mass_bn = jnp.sum(jnp.exp((logits_bnk - top_b1[:, :, None]) * inverse_temperature), axis=-1)
    return top_bn, top_b1, jnp.cumsum(mass_bn, axis=-1)


def first_argmax(logits_bv, block: int = DRAW_BLOCK):
    """argmax over the last axis (the first of equal maxima)."""
    logits_bnk = vocab_blocks(logits_bv, block)
    top_bn = jnp.max(logits_bnk, axis=-1)
    return _argmax_in_blocks(logits_bnk, top_bn, jnp.max(top_bn, axis=-1, keepdims=True))


def inverse_cdf_draw(keys_b, logits_bv, block: int = DRAW_BLOCK):
    """One token per row from softmax(logits): the first entry whose cumulative probability
    reaches a uniform draw. One random number per row, where jax.random.categorical
    (Gumbel-max) draws one per vocabulary entry: at 256 rows x 8192 that was about half of
    a decode step on CPU (bench/profile_sample.py). Entries at -inf are never drawn."""
    logits_bnk = vocab_blocks(logits_bv, block)
    _, top_b1, cdf_bn = _block_stats(logits_bnk)
    return _draw_in_blocks(keys_b, logits_bnk, top_b1, cdf_bn)


def choose_tokens(logits_bv, keys_b, temperature, *, top_k: int, top_p: float):
    """(token_b, logprob_b) of one sampling step, each row drawn with its own key; temperature
    0 (may be traced) is greedy. Logits are read three times (block maxima; exp; block
    masses), plus the filter's passes with top-k / top-p."""
    logits_bv = logits_bv.astype(jnp.float32)
    greedy = temperature == 0
    inverse_temperature = jnp.where(greedy, 1.0, 1.0 / jnp.where(greedy, 1.0, temperature))
    logits_bnk = vocab_blocks(logits_bv)
    top_bn, top_b1, cdf_bn = _block_stats(logits_bnk, inverse_temperature)

    def draw():
        if top_k or top_p < 1.0:
            return inverse_cdf_draw(keys_b, filter_logits(logits_bv * inverse_temperature, top_k, top_p))
        return _draw_in_blocks(keys_b, logits_bnk, top_b1, cdf_bn, inverse_temperature)

    token_b = jax.lax.cond(greedy, lambda: _argmax_in_blocks(logits_bnk, top_bn, top_b1), draw)
    # log softmax(logits / temperature) at the token: (logit - top) / temperature - log(normaliser)
    logit_b = jnp.take_along_axis(logits_bv, token_b[:, None], axis=-1)[:, 0]
    logprob_b = (logit_b - top_b1[:, 0]) * inverse_temperature - jnp.log(cdf_bn[:, -1])
    return token_b.astype(jnp.int32), logprob_b


def prompt_positions(prompt_mask_bp):
    """Positions of left-padded prompts: 0, 1, ... over the real tokens, 0 on padding."""
    mask = prompt_mask_bp.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0) * mask


def sample(
    graphdef,
    params,
    prompt_tokens_bp,
    prompt_mask_bp,
    rng,
    temperature=1.0,
    eos_ids=(),
    pad_id=0,
    new_tokens=None,
    *,
    max_new_tokens: int,
    num_generations: int = 1,
    top_k: int = 0,
    top_p: float = 1.0,
    record_experts: bool = False,
) -> dict[str, jax.Array]:
    """`num_generations` (G) completions of each prompt, up to `new_tokens` tokens each (all
    `max_new_tokens` by default); a row stops at its first EOS.

    prompt_tokens_bp: left-padded ids; prompt_mask_bp: 1 on real tokens (each row needs one).
    The prompts are prefilled once, at batch b, and each prompt's cache is shared by its G
    rows (row p * G + g is completion g of prompt p; an MLA model's cache is copied to
    them); the decode loop runs on device and ends when every row has stopped.
    Row r samples with the key fold_in(rng, r), so a row's draws
    do not depend on the other rows or on how the batch was padded.

    rng, temperature, eos_ids, pad_id and new_tokens are traced (one compilation serves
    them all); max_new_tokens (the width of the outputs), num_generations, top_k and top_p
    are static. Returns tokens_bn (pad_id after a row stopped), logprobs_bn (0 there),
    mask_bn (1 on generated tokens, the EOS included) and lengths_b, b * G rows each.
    Deterministic for a given rng. `record_experts` (a mixture of experts): also experts_bltk,
    each token's routed experts per layer (engine/models/router_replay.py), prompt then
    completion columns, zeros at dense layers.
    """
    model = nnx.merge(graphdef, params)
    prompts, prompt_len = prompt_tokens_bp.shape
    batch = prompts * num_generations
    new_tokens = max_new_tokens if new_tokens is None else new_tokens
    mask_bp = prompt_mask_bp.astype(jnp.int32)
    cache = KVCache.init(model.cfg, model.compute, prompts, prompt_len)
    moe_layers = router_replay.moe_layers(model.cfg) if record_experts else []
    with router_replay.recording(bool(moe_layers)) as prefill_routes:
        logits_btv, cache = model(prompt_tokens_bp, prompt_positions(mask_bp), mask_bp, cache=cache)
    # KVCache.share: attention's keys and values only (no indexer keys, no compressed entries)
    shareable = not model.cfg.is_mla and not cache.index_k and model.cfg.compressed_attention is None
    if num_generations > 1 and shareable:  # the group's rows attend to one copy of its prompt
        cache = cache.share(num_generations, max_new_tokens)
    else:
        cache = cache.expand(num_generations, max_new_tokens)
    logits_bv = constrain(jnp.repeat(logits_btv[:, -1], num_generations, axis=0), ("act_batch", "act_vocab"))
    position_b = jnp.repeat(jnp.sum(mask_bp, axis=1), num_generations)
    row_keys_b = jax.vmap(jax.random.fold_in, (None, 0))(rng, jnp.arange(batch))
    eos = jnp.asarray(eos_ids, jnp.int32).reshape(-1)
    choose = functools.partial(choose_tokens, temperature=temperature, top_k=top_k, top_p=top_p)

    def cond(state):
        i, done_b = state[0], state[1]
        return (i < new_tokens) & ~jnp.all(done_b)

    def body(state):
        i, done_b, logits_bv, cache, position_b, tokens_bn, logprobs_bn, mask_bn, *experts = state
        token_b, logprob_b = choose(logits_bv, jax.vmap(jax.random.fold_in, (0, None))(row_keys_b, i))
        live_b = ~done_b
        token_b = jnp.where(live_b, token_b, pad_id)
        tokens_bn = tokens_bn.at[:, i].set(token_b)
        logprobs_bn = logprobs_bn.at[:, i].set(jnp.where(live_b, logprob_b, 0.0))
        mask_bn = mask_bn.at[:, i].set(live_b)
        done_b = done_b | jnp.isin(token_b, eos)
        with router_replay.recording(bool(experts)) as routes:
            logits_btv, cache = model(
                token_b[:, None], position_b[:, None], jnp.ones((batch, 1), jnp.int32), cache=cache
            )
        if experts:  # the fed token's routes: completion column i
            step_bl1k = router_replay.model_layer_routes(routes, moe_layers, model.cfg.num_layers)
            experts = [jax.lax.dynamic_update_slice_in_dim(experts[0], step_bl1k, i, axis=2)]
        return i + 1, done_b, logits_btv[:, -1], cache, position_b + 1, tokens_bn, logprobs_bn, mask_bn, *experts

    state: tuple = (
        jnp.int32(0),
        jnp.zeros((batch,), bool),
        logits_bv,
        cache,
        position_b,
        jnp.full((batch, max_new_tokens), pad_id, jnp.int32),
        jnp.zeros((batch, max_new_tokens), jnp.float32),
        jnp.zeros((batch, max_new_tokens), bool),
    )
    if moe_layers:
        k = model.cfg.moe.experts_per_token
        state = (*state, jnp.zeros((batch, model.cfg.num_layers, max_new_tokens, k), jnp.int32))
    state = jax.lax.while_loop(cond, body, state)
    tokens_bn, logprobs_bn, mask_bn = state[5:8]
    out = {"tokens": tokens_bn, "logprobs": logprobs_bn, "mask": mask_bn, "lengths": jnp.sum(mask_bn, axis=1)}
    if moe_layers:
        prompt_blpk = router_replay.model_layer_routes(prefill_routes, moe_layers, model.cfg.num_layers)
        out["experts"] = jnp.concatenate([jnp.repeat(prompt_blpk, num_generations, axis=0), state[8]], axis=2)
    return out


def rollout_params(params, dtype: RolloutDtype, per_layer=None):
    """The copy of `params` a rollout samples with, made once per sampler call (before the
    prefill), never per decode step: every floating-point array in `dtype`, and, given
    `per_layer` (the param tree of the same model with scan_layers off, arrays or shapes),
    stacked layers sliced into that per-layer layout. Decoding runs the layers unrolled
    (Transformer._decode_blocks); from stacked params it would slice each layer's weights
    out of the stack at every decode step, copies XLA:CPU does not hoist out of the loop.
    A router's choosing bias stays float32, as the model keeps it: rounded, it would choose
    other experts than training does."""
    target = jnp.dtype(dtype)

    def cast(path, a):
        keep = str(getattr(path[-1], "key", path[-1])) == "b_router_e" or not jnp.issubdtype(a.dtype, jnp.floating)
        return a if keep else a.astype(target)

    params = jax.tree_util.tree_map_with_path(cast, params)

    def unstack(tree, layout):
        if not isinstance(layout, dict):
            return tree
        if layout and all(isinstance(k, int) for k in layout) and not any(isinstance(k, int) for k in tree):
            return {i: jax.tree.map(lambda a, i=i: a[i], tree) for i in layout}  # a list of layers <- a stack
        return {k: unstack(tree[k], v) for k, v in layout.items()}

    return params if per_layer is None else unstack(params, per_layer)


def length_bucket(length: int, buckets: Sequence[int] = ()) -> int:
    """The smallest of `buckets` that holds `length`; without buckets (or past the largest)
    the next power of two, at least 8. Shapes come in buckets so the sampler compiles once
    per bucket, not once per batch."""
    fitting = [b for b in buckets if b >= length]
    return min(fitting) if fitting else max(8, 1 << (length - 1).bit_length())


def left_pad(
    sequences: Sequence[Sequence[int]], pad_id: int = 0, length: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens_bp, mask_bp) with each sequence right-aligned; longer ones keep their last tokens."""
    length = length or max(len(s) for s in sequences)
    tokens = np.full((len(sequences), length), pad_id, np.int32)
    mask = np.zeros((len(sequences), length), np.int32)
    for row, seq in enumerate(sequences):
        seq = list(seq)[-length:]
        if not seq:
            raise ConfigError(f"prompt {row} is empty: a prompt needs at least one token")
        tokens[row, length - len(seq) :] = seq
        mask[row, length - len(seq) :] = 1
    return tokens, mask


# --------------------------------------------------------------------------- jitted, sharded


@dataclass
class SampleOutput:
    tokens: np.ndarray  # (b, n) int32
    logprobs: np.ndarray  # (b, n) float32
    mask: np.ndarray  # (b, n) bool
    lengths: np.ndarray  # (b,)
    experts: np.ndarray | None = None
    """(b, layers, p + n, k) int32: each prompt and completion token's routed experts per layer
    (Sampler's record_experts; router_replay.py), or None."""


class Sampler:
    """`sample` compiled for one model on one mesh; rows are sharded over (data, fsdp).

    Prompt lengths and max_new_tokens are rounded up to `length_bucket`s (left padding and
    unused output columns, both invisible in the results), so batches of other lengths in
    the same buckets reuse the compiled program.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        compute: ComputeConfig | None = None,
        mesh=None,
        param_shardings=None,
        length_buckets: Sequence[int] = (),
        dtype: RolloutDtype | None = None,
        lora: LoraConfig | None = None,
        record_experts: bool = False,
    ):
        """`lora`: the params hold a LoRA adapter beside the base (engine/models/lora.py), and
        every step computes base + adapter unmerged. `record_experts`: a mixture of experts'
        outputs carry each token's routed experts (SampleOutput.experts), for router replay."""
        self.model_cfg = model_cfg
        self.record_experts = record_experts and model_cfg.is_moe
        compute = (compute or ComputeConfig()).model_copy(update={"remat": "none"})  # no backward pass here
        self.dtype = dtype or compute.dtype
        if dtype is not None:  # the rollout copy: params and products in `dtype`, cast once per call
            compute = compute.model_copy(update={"param_dtype": dtype, "dtype": dtype})
        self.compute = compute
        # Decoding unrolls the layers: the sampler's model takes them per layer (rollout_params).
        unrolled = compute.model_copy(update={"scan_layers": False})
        self.graphdef = graphdef_of(self.model_cfg, unrolled, lora)
        self._per_layer = abstract_model_params(self.model_cfg, unrolled, None, lora) if compute.scan_layers else None
        self.mesh, self.param_shardings = mesh, param_shardings
        self.length_buckets = tuple(sorted(length_buckets))
        self._compiled: dict[tuple, Any] = {}

    def _bucket(self, length: int) -> int:
        """length_bucket(length), but no longer than the model's max_seq_len (unless length is)."""
        return min(length_bucket(length, self.length_buckets), max(length, self.model_cfg.max_seq_len))

    def _function(self, settings: tuple):
        if settings not in self._compiled:

            def fn(params, tokens, mask, key_data, *rest):
                params = rollout_params(params, self.compute.param_dtype, self._per_layer)
                return sample(
                    self.graphdef,
                    params,
                    tokens,
                    mask,
                    jax.random.wrap_key_data(key_data),
                    *rest,
                    **dict(settings),
                    record_experts=self.record_experts,
                )

            if self.mesh is None:
                self._compiled[settings] = jax.jit(fn)
            else:
                rows = batch_sharding(self.mesh)
                outputs = {"tokens": rows, "logprobs": rows, "mask": rows, "lengths": batch_sharding(self.mesh, 1)}
                if self.record_experts:
                    outputs["experts"] = batch_sharding(self.mesh, 4)
                scalar = replicated(self.mesh)
                self._compiled[settings] = jax.jit(
                    fn,
                    in_shardings=(self.param_shardings, rows, rows, scalar, scalar, scalar, scalar, scalar),
                    out_shardings=outputs,
                )
        return self._compiled[settings]

    def __call__(
        self,
        params,
        prompt_tokens_bp,
        prompt_mask_bp,
        *,
        seed: int | jax.Array = 0,
        max_new_tokens: int,
        num_generations: int = 1,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_ids: Sequence[int] = (),
        pad_id: int = 0,
        rows: Sequence[int] | None = None,
    ) -> SampleOutput:
        """Completions of left-padded prompts: `num_generations` rows per prompt (prompt p's
        are rows p * G ... p * G + G - 1), `max_new_tokens` columns. `rows`: the prompts whose
        completions the caller reads (None: all). This sampler computes every prompt anyway
        (the batch keeps its shape and so its compiled program, and no prompt's draws depend
        on another's); a server-backed one (engine/posttrain/vllm_rollout.py) asks for these alone."""
        prompt_tokens_bp, prompt_mask_bp = np.asarray(prompt_tokens_bp), np.asarray(prompt_mask_bp)
        prompts, prompt_len = prompt_tokens_bp.shape
        shards = 1 if self.mesh is None else batch_shards(self.mesh)
        extra_rows = -prompts % shards  # dummy prompts (copies of the last) so the rows divide over the mesh
        extra_columns = self._bucket(prompt_len) - prompt_len  # more left padding
        tokens_bp = np.pad(prompt_tokens_bp, ((0, 0), (extra_columns, 0)), constant_values=pad_id)
        mask_bp = np.pad(prompt_mask_bp, ((0, 0), (extra_columns, 0)))
        tokens_bp, mask_bp = (np.concatenate([a, np.repeat(a[-1:], extra_rows, 0)]) for a in (tokens_bp, mask_bp))
        rng = jax.random.key(seed) if isinstance(seed, int) else seed
        settings = (
            ("max_new_tokens", self._bucket(max_new_tokens)),
            ("num_generations", int(num_generations)),
            ("top_k", int(top_k)),
            ("top_p", float(top_p)),
        )
        args = (
            tokens_bp,
            mask_bp,
            jax.random.key_data(rng),
            np.float32(temperature),
            np.asarray(list(eos_ids) or [-1], np.int32),
            np.int32(pad_id),
            np.int32(max_new_tokens),
        )
        if self.mesh is not None:  # global arrays, so any process layout works (every process holds all rows)
            by_row, scalar = batch_sharding(self.mesh), replicated(self.mesh)
            args = tuple(global_array(a, by_row if i < 2 else scalar) for i, a in enumerate(args))
        with use_mesh(self.mesh):
            out = self._function(settings)(params, *args)
        keep = prompts * num_generations
        experts = out.pop("experts", None)
        if experts is not None:  # the prompt's own columns, then the completion's first max_new_tokens
            bucket = tokens_bp.shape[1]
            experts = to_host(experts)[:keep, :, extra_columns : bucket + max_new_tokens]
        return SampleOutput(
            **{k: to_host(v)[:keep, :max_new_tokens] if v.ndim == 2 else to_host(v)[:keep] for k, v in out.items()},
            experts=experts,
        )


# --------------------------------------------------------------------------- text in, text out


def encode_prompts(bundle, prompts: Sequence[str | list[dict]]) -> list[list[int]]:
    """Text prompts framed as in pretraining (the tokenizer's bos); message lists rendered
    with the chat template and its generation prompt."""
    ids = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids.append(bundle.tokenizer.encode(prompt, add_special_tokens=True).ids)
        else:
            text = render(bundle, prompt, add_generation_prompt=True)
            ids.append(bundle.tokenizer.encode(text, add_special_tokens=False).ids)
    return ids


def decode_completions(bundle, output: SampleOutput, skip_special_tokens: bool = True) -> list[str]:
    return [
        bundle.tokenizer.decode(row[mask].tolist(), skip_special_tokens=skip_special_tokens)
        for row, mask in zip(output.tokens, output.mask)
    ]


def checkpoint_in(path: str | Path) -> str:
    """The checkpoint directory a user names: `path` itself, or the checkpoint/ of the artifact
    at `path`; either a local path or a bucket URL (kept as the URL: Path would fold s3:// into s3:/)."""
    inner = urls.join(path, CHECKPOINT_DIR)
    return inner if (urls.exists(inner) if urls.is_url(path) else Path(inner).is_dir()) else str(path)


def tokenizer_dir_for(checkpoint_dir: str | Path) -> Path | None:
    """A checkpoint artifact keeps its tokenizer next to the checkpoint: <artifact>/tokenizer/
    (for a checkpoint at a bucket URL, this host's cached copy of the tokenizer there)."""
    return urls.existing_folder(urls.join(urls.parent(checkpoint_dir), TOKENIZER_DIR))
