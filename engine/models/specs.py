"""A decoder layer as a typed spec: what its sequence mixer and its feed-forward are, how it
normalises and adds its sublayers to the residual stream.

A spec is data, frozen and hashable, and says everything its block needs: the decoder
(engine/models/transformer.py) builds and calls each layer from its spec and knows no model
family. Mixers and feed-forwards are discriminated unions on `kind`; each kind's module builds
it (transformer.MIXERS / FFNS) and its spec counts its parameters here, without JAX, so config
validation and `trainflow plan` stay cheap.

ModelConfig.layer_specs() is where a model's fields become these specs (engine/models/config.py);
it is the one place that interprets them. Shapes as in transformer.py: d the model width.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.models.rope_scaling import RopeScaling


class Spec(BaseModel):
    """A frozen, hashable piece of a layer's description (a static argument of the traced step)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=(), use_attribute_docstrings=True)


class NormSpec(Spec):
    """A normalisation over the model width (or a head's width)."""

    kind: Literal["rms", "layer"] = "rms"
    """rms: x / rms(x) (RMSNorm); layer: (x - mean) / std (LayerNorm)."""
    eps: float = 1e-5
    zero_centered: bool = False
    """The scale is stored zero-centred: x * (1 + scale) (Gemma; Nemotron's LayerNorm1P)."""
    scale: bool = True
    """A learned scale (OLMo 1's LayerNorm has none)."""
    bias: bool = False
    """A learned bias (layer only)."""

    def params(self, dim: int) -> int:
        return dim * (self.scale + self.bias)


class RotarySpec(Spec):
    """Rotary position embedding of a layer's queries and keys."""

    theta: float = 10000.0
    scaling: RopeScaling | None = None
    rotary_dim: int | None = None
    """Rotate only the first rotary_dim dimensions of each head; None: all of them."""
    interleave: bool = False
    """Rotate adjacent pairs (x0, x1), (x2, x3), ... instead of the two halves."""


class BlockIndexerSpec(Spec):
    """MiniMax-M3's block-sparse indexer (engine/models/block_sparse.py): per key/value group
    a query attends to the `topk_blocks` blocks of `block` keys its indexer head scores highest
    (a block's score its best key's) plus the `local_blocks` blocks ending at its own."""

    heads: int
    """One per key/value head."""
    head_dim: int
    block: int
    topk_blocks: int
    local_blocks: int = 1


class QSAIndexerSpec(Spec):
    """Qwen4-Exp's QSA indexer (engine/models/qsa.py): a query attends to the `budget // block`
    complete blocks of `block` keys its indexer scores highest (each block's keys averaged)
    plus the keys of its own incomplete block."""

    heads: int
    head_dim: int
    budget: int
    """Tokens selected from complete blocks (a multiple of `block`)."""
    block: int
    """Consecutive keys averaged into one block key (indexer_compress_ratio)."""


class AttentionSpec(Spec):
    """Grouped-query attention (transformer.Attention). The fields marked `call` change how a
    layer attends, not its parameters: layers differing only in them share a stack."""

    kind: Literal["attention"] = "attention"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: Literal["none", "head", "across_heads", "per_head"] = "none"
    """A norm on queries and keys before RoPE: over each head's dims (scale per head_dim, Qwen3)
    or over all heads' dims at once (scale per (head, head_dim), OLMo 2); per_head: a LayerNorm
    over each head's dims with a scale of its own per head and no bias (StableLM 2, Cohere)."""
    norm: NormSpec = NormSpec()
    """The QK norms' (and value norm's) kind and epsilon."""
    values_from_keys: bool = False
    """No value projection: the values are the keys before their norm (Gemma 4's global layers)."""
    output_gate: bool = False
    """sigmoid(x . W_gate) per head and dimension on the output (Qwen3-Next); q_proj yields both."""
    sinks: bool = False
    """A learned logit per head in each softmax's denominator (GPT-OSS)."""
    head_gate: bool = False
    """Each head's output times sigmoid(x . w_n), a scalar per head from the layer's input (LFM3's g_proj)."""
    kv_sharing: Literal["store", "reuse"] | None = None
    """Gemma 4: `reuse` layers have no key/value projections and attend with the keys and
    values of their kind's `store` layer."""
    # call: how the layer attends
    rope: RotarySpec | None = RotarySpec()
    """None: no position signal but the causal mask (NoPE)."""
    window: int | None = None
    """Sliding window: a query sees this many most recent positions, its own included."""
    chunk: int | None = None
    """Chunked attention: a query sees the earlier keys of its own chunk (Llama 4)."""
    scale: float | None = None
    """Scores are multiplied by this; None: head_dim**-0.5."""
    softcap: float | None = None
    value_norm: bool = False
    """An RMSNorm without a scale on the values (Gemma 4)."""
    qk_l2_norm: bool = False
    """On RoPE layers, queries and keys divided by their RMS after RoPE, no scale (Llama 4)."""
    key_multiplier: float = 1.0
    """Keys are multiplied by this after their projection (Falcon-H1's muP)."""
    temperature_floor: int | None = None
    """NoPE layers scale queries by 1 + temperature_scale * log(1 + floor((p + 1) / floor)) (Llama 4)."""
    temperature_scale: float = 0.1
    qkv_clip: float | None = None
    """Queries, keys and values clamped to [-clip, clip] after their projections (OLMo 1, DBRX)."""
    alibi: bool = False
    """ALiBi (arXiv 2108.12409): scores get -slope_n * (i - j), a slope per head, instead of RoPE
    (BLOOM, MPT)."""
    qk_norm_after_rope: bool = False
    """qk_norm `head` applied to the rotated queries and keys instead (Hunyuan dense)."""
    query_position_scale: float | None = None
    """Queries, after RoPE, times 1 + query_position_scale * log(1 + floor(p /
    query_position_period)), p the query's position (Ministral 3's llama_4_scaling_beta)."""
    query_position_period: int = 1
    value_head_dim: int | None = None
    """The value heads' width where it differs from head_dim (MiMo-V2-Flash: 128 under 192)."""
    value_scale: float = 1.0
    """call: the values are multiplied by this after their projection (MiMo-V2-Flash)."""
    block_indexer: BlockIndexerSpec | None = None
    """Block-sparse attention chosen by an indexer of its own (MiniMax-M3's sparse layers)."""
    head_gate_activation: Literal["sigmoid", "softplus"] = "sigmoid"
    """call: head_gate's activation of x . w_n (Laguna's g_proj: softplus)."""
    qsa_indexer: QSAIndexerSpec | None = None
    """Sparse attention over the blocks a pooled-key indexer selects (Qwen4-Exp's QSA, qsa.py)."""

    def structure(self) -> AttentionSpec:
        """This spec with the call fields at their defaults: what its parameters depend on."""
        fields = self.model_dump(include=_ATTENTION_STRUCTURE)
        if self.kv_sharing == "store":  # a store layer has the usual projections
            fields["kv_sharing"] = None
        return AttentionSpec(**fields)

    @property
    def score_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim**-0.5

    def mixing_macs(self, seq_len: int) -> int:
        """Multiply-adds per token of mixing the sequence (QK^T and PV over every earlier
        position, causal-unaware as PaLM counts them); the projections are in params()."""
        macs = self.num_heads * (self.head_dim + (self.value_head_dim or self.head_dim)) * seq_len  # QK^T, PV
        if self.block_indexer is not None:  # its scores of every earlier key (the parallel form attends densely)
            macs += self.block_indexer.heads * self.block_indexer.head_dim * seq_len
        if self.qsa_indexer is not None:  # its scores of every block (the parallel form attends densely)
            macs += self.qsa_indexer.heads * self.qsa_indexer.head_dim * (seq_len // self.qsa_indexer.block)
        return macs

    def params(self, d: int) -> int:
        n, k, h = self.num_heads, self.num_kv_heads, self.head_dim
        per_head_norm = self.norm.params(h)
        if self.qk_norm == "per_head":  # a scale per head and dimension
            per_head_norm = h
        if self.kv_sharing == "reuse":  # the queries' projection and norm, and the output's
            norms = per_head_norm * (n if self.qk_norm == "per_head" else self.qk_norm != "none")
            return d * n * (h + (self.value_head_dim or h)) + norms
        v, w = 0 if self.values_from_keys else k, self.value_head_dim or h
        count = d * h * (n + k) + d * w * (n + v) + (h * (n + k) + w * v) * self.qkv_bias + d * n * h * self.output_gate
        if self.qk_norm == "head":
            count += 2 * per_head_norm
        elif self.qk_norm in ("across_heads", "per_head"):
            count += (n + k) * per_head_norm
        if self.block_indexer is not None:  # its query and key projections and their norms
            g, i = self.block_indexer.heads, self.block_indexer.head_dim
            count += d * i * (g + 1) + 2 * self.norm.params(i)
        if self.qsa_indexer is not None:  # its fused query-and-key projection and their norms
            g, i = self.qsa_indexer.heads, self.qsa_indexer.head_dim
            count += d * i * (g + 1) + 2 * self.norm.params(i)
        return count + n * self.sinks + d * self.out_bias + d * n * self.head_gate


_ATTENTION_STRUCTURE = {
    "kind",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "qkv_bias",
    "out_bias",
    "qk_norm",
    "norm",
    "values_from_keys",
    "output_gate",
    "sinks",
    "kv_sharing",
    "value_head_dim",
    "block_indexer",
    "head_gate",
    "qsa_indexer",
}


class IndexerSpec(Spec):
    """DeepSeek Sparse Attention's lightning indexer (engine/models/dsa.py)."""

    topk: int
    heads: int
    head_dim: int
    rope_interleave: bool = False
    shared: bool = False
    """No indexer of its own: the layer selects with the last earlier indexer's queries, head
    weights and keys, which the decoder carries from layer to layer beside the residual stream
    while any layer is shared (GLM-5's indexer_types "shared")."""
    rope_last: bool = False
    """RoPE on the last rope_head_dim dimensions of its queries and key, not the first (HY-V4)."""
    key_norm_eps: float = 1e-6
    """The key LayerNorm's epsilon (transformers' DeepSeek-V3.2 fixes 1e-6; HY-V4's is rms_norm_eps)."""


class MLASpec(Spec):
    """Multi-head latent attention (engine/models/mla.py; DeepSeek-V2/V3)."""

    kind: Literal["mla"] = "mla"
    num_heads: int
    head_dim: int
    """A query/key head's whole width, its last rope_head_dim dimensions rotary."""
    rope_head_dim: int
    value_head_dim: int
    kv_lora_rank: int
    q_lora_rank: int | None = None
    rope: RotarySpec | None = RotarySpec()
    """None: the rotary part is left unrotated (Kimi Linear's MLA)."""
    window: int | None = None
    indexer: IndexerSpec | None = None
    scale: float | None = None
    """Scores are multiplied by this; None: head_dim**-0.5 (see mla_score_scale)."""
    head_gate: bool = False
    """Each head's output times sigmoid(x . w_h), one scalar per head and token, before the
    output projection (Ling 3's g_proj)."""
    sinks: bool = False
    """A learned logit per head in each softmax's denominator (HY-V4)."""
    output_gate: bool = False
    """Each head's output times sigmoid(x . W_gate) per value dimension, before o_proj, from a
    projection of its own (HY-V4's gate_proj)."""
    lora_scale: bool = False
    """call: queries times sqrt(d / q_lora_rank), the normed latent times sqrt(d / kv_lora_rank)
    (LongCat-Flash's mla_scale_q_lora, mla_scale_kv_lora)."""
    key_norm_eps: float | None = None
    """An RMSNorm with this epsilon on the shared rotary key before RoPE (Dots3's
    k_rope_only_layernorm); None: none."""
    latent_norm_eps: float = 1e-6
    """The query and key-value latents' RMSNorm epsilon (DeepSeek's code leaves them at 1e-6
    whatever rms_norm_eps says; Dots3's read rms_norm_eps)."""

    @property
    def score_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim**-0.5

    def mixing_macs(self, seq_len: int) -> int:
        return 2 * self.num_heads * self.head_dim * seq_len

    def params(self, d: int) -> int:
        n, rank, r = self.num_heads, self.kv_lora_rank, self.rope_head_dim
        nope = self.head_dim - r
        if self.q_lora_rank:
            q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * self.head_dim
        else:
            q = d * n * self.head_dim
        kv = d * (rank + r) + rank + rank * n * (nope + self.value_head_dim)
        if self.indexer is not None and not self.indexer.shared:  # wq_b, wk, its key LayerNorm, weights_proj
            assert self.q_lora_rank is not None
            h, w = self.indexer.heads, self.indexer.head_dim
            q += self.q_lora_rank * h * w + d * w + 2 * w + d * h
        extras = n * self.sinks + d * n * self.value_head_dim * self.output_gate + d * n * self.head_gate
        extras += r * (self.key_norm_eps is not None)
        return q + kv + n * self.value_head_dim * d + extras


def mla_score_scale(head_dim: int, scaling: RopeScaling | None) -> float:
    """MLA's softmax scale: head_dim**-0.5, times YaRN's mscale(factor, mscale_all_dim) squared
    when the RoPE has one (DeepSeek-V3: the attention factor on cos and sin covers only the
    rotary part)."""
    scale = head_dim**-0.5
    if scaling is not None and scaling.kind == "yarn" and scaling.mscale_all_dim and scaling.factor > 1:
        mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
        scale *= mscale * mscale
    return scale


class GatedDeltaSpec(Spec):
    """A Gated DeltaNet mixer (engine/models/gated_delta_block.py; Qwen3-Next, Qwen3.5)."""

    kind: Literal["gated_delta"] = "gated_delta"
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    fused_projections: bool = False
    norm_eps: float = 1e-6
    beta_scale: float = 1.0
    """The write strength is beta_scale * sigmoid(b) (OLMo Hybrid: 2, negative eigenvalues)."""

    def mixing_macs(self, seq_len: int) -> int:
        """The chunked form's (64 positions a chunk): within its chunk QK^T and the weights
        times V, and the state read and updated, per value head."""
        chunk = min(64, seq_len)
        dk, dv = self.key_head_dim, self.value_head_dim
        return self.num_value_heads * (chunk * (dk + dv) + 2 * dk * dv)

    def params(self, d: int) -> int:
        keys, values = self.num_key_heads * self.key_head_dim, self.num_value_heads * self.value_head_dim
        channels = 2 * keys + values
        projections = d * (channels + values + 2 * self.num_value_heads) + values * d
        return projections + channels * self.conv_kernel + 2 * self.num_value_heads + self.value_head_dim


class KimiDeltaSpec(Spec):
    """Kimi Delta Attention (engine/models/kimi_delta_block.py): the delta rule with a decay per
    key channel; as many value heads as key heads, of the same width."""

    kind: Literal["kimi_delta"] = "kimi_delta"
    num_heads: int
    head_dim: int
    conv_kernel: int = 4
    norm_eps: float = 1e-6
    full_rank_gates: bool = False
    """The forget and output gates are each one (d, heads * head_dim) projection (Ling 3's f_proj,
    g_proj), not a low-rank pair through head_dim."""
    gate_lower_bound: float | None = None
    """The forget gate's log decay is this times sigmoid(exp(A_log) (f + dt_bias)) (Ling 3's safe
    gate, kda_lower_bound); None: -exp(A_log) softplus(f + dt_bias)."""

    def mixing_macs(self, seq_len: int) -> int:
        chunk = min(64, seq_len)
        return self.num_heads * (2 * chunk * self.head_dim + 2 * self.head_dim * self.head_dim)

    def params(self, d: int) -> int:
        # q, k, v, conv, two low-rank gates, dt_bias, A_log, b, norm, out
        h, k = self.num_heads, self.head_dim
        conv = 3 * h * k * self.conv_kernel
        gates = 2 * d * h * k if self.full_rank_gates else 2 * (d * k + k * h * k)
        return 4 * d * h * k + conv + gates + h * k + h + d * h + k


class Mamba2Spec(Spec):
    """A Mamba2 mixer (engine/models/mamba2.py; Nemotron-H, Granite 4, Falcon-H1)."""

    kind: Literal["mamba2"] = "mamba2"
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 256
    conv_bias: bool = True
    proj_bias: bool = False
    dt_limit: tuple[float, float] | None = None
    gated_norm: bool = True
    norm_before_gate: bool = False
    norm_eps: float = 1e-5
    """The gated norm's epsilon."""
    projection_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    """in_proj's output sections z, x, B, C, dt are multiplied by these (Falcon-H1's muP)."""

    def mixing_macs(self, seq_len: int) -> int:
        """SSD: C.B^T and its product with x within a chunk, the state read and written."""
        chunk = min(self.chunk_size, seq_len)
        per_head = chunk * (self.state_size + self.head_dim) + 2 * self.head_dim * self.state_size
        return 2 * self.num_heads * per_head

    def params(self, d: int) -> int:
        inner = self.num_heads * self.head_dim
        channels = inner + 2 * self.n_groups * self.state_size
        projected = inner + channels + self.num_heads
        n = d * projected + channels * self.conv_kernel + 3 * self.num_heads + inner * self.gated_norm
        n += inner * d
        return n + channels * self.conv_bias + (projected + d) * self.proj_bias


class Mamba1Spec(Spec):
    """A Mamba (Mamba1) selective-scan mixer (engine/models/mamba1.py; Mamba, Falcon-Mamba, Jamba):
    a state of state_size per inner channel, each with its own decay exp(dt A)."""

    kind: Literal["mamba1"] = "mamba1"
    inner: int
    """The SSM's width (transformers' intermediate_size: expand x hidden_size)."""
    state_size: int
    dt_rank: int
    """Width of dt's low-rank projection (x_proj's first columns, then dt_proj)."""
    conv_kernel: int = 4
    conv_bias: bool = True
    proj_bias: bool = False
    """Biases on in_proj and out_proj."""
    bcdt_norm: Literal["none", "weightless", "weighted"] = "none"
    """RMSNorms on dt's low-rank input, B and C: none (Mamba), without a scale (Falcon-Mamba),
    with learned scales (Jamba)."""
    bcdt_norm_eps: float = 1e-6
    chunk_size: int = 64
    """Tokens per chunk of the chunked associative scan (the results do not depend on it; not
    a ModelConfig field, since config.json has no such key)."""

    def mixing_macs(self, seq_len: int) -> int:
        """Per token and (channel, state) pair: the input dt B x, the decay times the state, C . state."""
        return 3 * self.inner * self.state_size

    def params(self, d: int) -> int:
        inner, n, rank = self.inner, self.state_size, self.dt_rank
        count = d * 2 * inner + inner * (rank + 2 * n) + rank * inner + inner + inner * n + inner + inner * d
        count += inner * self.conv_kernel + inner * self.conv_bias + (2 * inner + d) * self.proj_bias
        return count + (rank + 2 * n) * (self.bcdt_norm == "weighted")


class ParallelHybridSpec(Spec):
    """Attention and a Mamba2 mixer side by side on the same input (Falcon-H1,
    engine/models/parallel_hybrid.py), each output scaled, their sum the sublayer's."""

    kind: Literal["attention_mamba2"] = "attention_mamba2"
    attention: AttentionSpec
    mamba2: Mamba2Spec
    attention_in: float = 1.0
    """Each mixer reads the normed input times its _in multiplier and its output is multiplied
    by its _out one (Falcon-H1's muP)."""
    attention_out: float = 1.0
    ssm_in: float = 1.0
    ssm_out: float = 1.0

    def mixing_macs(self, seq_len: int) -> int:
        return self.attention.mixing_macs(seq_len) + self.mamba2.mixing_macs(seq_len)

    def params(self, d: int) -> int:
        return self.attention.params(d) + self.mamba2.params(d)


class MixtureOfAttentionSpec(Spec):
    """A mixture of attention heads (JetMoE, engine/models/moa.py): keys and values as grouped-
    query attention's, each token's queries and output projection from experts_per_token of
    num_experts expert pairs, chosen by a softmax top-k router, each giving num_kv_heads query
    heads; the outputs weighted by the router and summed, plus a bias. `attention` is the
    attention they run: num_kv_heads * experts_per_token heads, head n on KV head n // k."""

    kind: Literal["mixture_of_attention"] = "mixture_of_attention"
    attention: AttentionSpec
    num_experts: int
    experts_per_token: int

    def mixing_macs(self, seq_len: int) -> int:
        return self.attention.mixing_macs(seq_len)

    def params(self, d: int) -> int:
        width = self.attention.num_kv_heads * self.attention.head_dim
        return 2 * d * width + 2 * self.num_experts * d * width + d * self.num_experts + d


class ShortConvSpec(Spec):
    """A gated short convolution (engine/models/short_conv.py; LFM2): in_proj to B, C, x;
    C * conv(B * x), a depthwise causal convolution of conv_kernel taps; out_proj."""

    kind: Literal["short_conv"] = "short_conv"
    width: int
    """The convolution's channels (the model width)."""
    conv_kernel: int = 3
    bias: bool = False
    """Biases on in_proj, the convolution and out_proj (LFM2's conv_bias)."""

    def mixing_macs(self, seq_len: int) -> int:
        """The convolution's taps and the two gates, per token (independent of seq_len)."""
        return self.width * (self.conv_kernel + 2)

    def params(self, d: int) -> int:
        return 4 * d * self.width + self.width * self.conv_kernel + (3 * self.width + self.width + d) * self.bias


class RGLRUSpec(Spec):
    """Griffin's recurrent block (engine/models/rglru.py; RecurrentGemma): linear_y, linear_x,
    a depthwise causal convolution, the RG-LRU (block-diagonal gates, a block per head) and
    linear_out, each with a bias."""

    kind: Literal["rglru"] = "rglru"
    width: int
    """The recurrence's width (lru_width)."""
    num_heads: int
    """Blocks of the gates' block-diagonal weights (width / num_heads each)."""
    conv_kernel: int = 4

    def mixing_macs(self, seq_len: int) -> int:
        """The convolution's taps, the two gates' blocks and the recurrence, per token."""
        return self.width * (self.conv_kernel + 2 * self.width // self.num_heads + 2)

    def params(self, d: int) -> int:
        w, k = self.width, self.width // self.num_heads
        return 3 * d * w + 2 * w + d + w * self.conv_kernel + w + 2 * (w * k + w) + w


class LightningSpec(Spec):
    """Lightning attention (engine/models/lightning.py; MiniMax-Text-01): linear attention with a
    fixed decay per head, an RMSNorm over all heads and a sigmoid output gate."""

    kind: Literal["lightning"] = "lightning"
    num_heads: int
    head_dim: int
    chunk_size: int = 256
    """Positions per chunk of the training form (the results do not depend on it)."""
    norm_eps: float = 1e-6
    # call: how the layer decays
    slope_factor: float = 1.0
    """Each head's decay rate is 2^(-8 (h + 1) / heads) times this: transformers' 1 - i / (L - 1 +
    1e-5) + 1e-5 for layer i of L, so layers differing only in it share a stack."""

    def structure(self) -> LightningSpec:
        """This spec with slope_factor at its default: what its parameters depend on."""
        return self.model_copy(update={"slope_factor": 1.0})

    def mixing_macs(self, seq_len: int) -> int:
        """The chunked form's: within its chunk QK^T and the scores times V, and the state read
        and written, per head."""
        chunk = min(self.chunk_size, seq_len)
        return self.num_heads * (2 * chunk * self.head_dim + 2 * self.head_dim * self.head_dim)

    def params(self, d: int) -> int:
        inner = self.num_heads * self.head_dim
        return 5 * d * inner + inner


class CompressedAttentionSpec(Spec):
    """A DeepSeek-V4 attention layer (compressed_attention.py)."""

    kind: Literal["compressed_attention"] = "compressed_attention"
    num_heads: int
    head_dim: int
    rope_head_dim: int
    """The last rope_head_dim dimensions of each head (and of the indexer's) are rotary."""
    q_lora_rank: int
    out_groups: int
    """Heads form this many groups for the output's first, per-group projection (o_groups)."""
    out_rank: int
    """Each group's width after it (o_lora_rank)."""
    window: int
    """The sliding window: a query sees this many most recent positions, its own included."""
    compress_ratio: int = 0
    """Positions per compressed entry; 0: the sliding window alone."""
    sparse: bool = False
    """CSA: overlapping windows and the indexer's top-k (else HCA: side-by-side windows, all seen)."""
    index_topk: int = 0
    index_heads: int = 0
    index_head_dim: int = 0
    rope: RotarySpec = RotarySpec()
    """The sliding-window layers' RoPE (transformers' `main`)."""
    compress_rope: RotarySpec = RotarySpec()
    """The compressed layers' RoPE, of their queries, keys, entries and indexer (`compress`)."""
    norm_eps: float = 1e-6

    @property
    def overlap(self) -> int:
        """Projections per position of the compressor: 2 with CSA's overlapping windows."""
        return 2 if self.sparse else 1

    def params(self, d: int) -> int:
        n, h, q = self.num_heads, self.head_dim, self.q_lora_rank
        count = d * q + q + q * n * h + d * h + h + n * h * self.out_rank + self.out_groups * self.out_rank * d + n
        if self.compress_ratio:
            c = self.overlap * h
            count += 2 * d * c + self.compress_ratio * c + h
        if self.sparse:
            g, i = self.index_heads, self.index_head_dim
            count += 2 * d * 2 * i + self.compress_ratio * 2 * i + i + q * g * i + d * g
        return count

    def mixing_macs(self, seq_len: int) -> int:
        """Per token: QK^T and PV over the window and the entries seen (all, or index_topk),
        and the indexer's scores of every entry."""
        keys = min(self.window, seq_len)
        if self.compress_ratio:
            entries = seq_len // self.compress_ratio
            keys += min(entries, self.index_topk) if self.sparse else entries
        index = self.index_heads * self.index_head_dim * (seq_len // self.compress_ratio) if self.sparse else 0
        return 2 * self.num_heads * self.head_dim * keys + index

    def cache_shapes(self, batch: int, max_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """KVCache's (keys, values) shapes for it: the key per slot, and as values the
        compressor's and indexer's projections and gate logits per slot (their windows are
        pooled from them at every step)."""
        return (batch, 1, max_len, self.head_dim), (batch, 1, max_len, self.raw_width)

    @property
    def raw_width(self) -> int:
        """The compressor's and the indexer's projections and gate logits per position."""
        width = 2 * self.overlap * self.head_dim if self.compress_ratio else 0
        return width + (4 * self.index_head_dim if self.sparse else 0)


class HyperConnectionSpec(Spec):
    """The n-stream residual of a layer (LayerSpec.hyper)."""

    streams: int
    """n: parallel residual streams (DeepSeek-V4's hc_mult)."""
    iterations: int = 20
    """Sinkhorn-Knopp normalisations of the stream mix (hc_sinkhorn_iters)."""
    eps: float = 1e-6
    """The floor added to `pre`, `comb` and each normalisation's sum (hc_eps)."""
    norm_eps: float = 1e-6
    """The RMS norm of the streams the weights are computed from."""
    independent: bool = False
    """No stream mix (HY-V4's independent hyper-connections): x'_k = post_k y + x_k, with
    post = magnitude * sigmoid(.) + eps; only `pre` and `post` are learned (two scales)."""
    magnitude: float = 2.0
    """`post`'s scale: 2 in DeepSeek-V4 (hc_magnitude)."""

    def params(self, d: int) -> int:
        """One sublayer's connection: the projection, its biases and the three (two) scales."""
        n = self.streams
        mixes = 2 * n if self.independent else (2 + n) * n
        return mixes * n * d + mixes + (2 if self.independent else 3)


class LaurelSpec(Spec):
    """LAuReL, a learned low-rank augmented residual (Gemma 3n; engine/models/laurel.py): the
    layer's normed input x adds norm(x . L . R) beside the attention (LayerSpec.laurel)."""

    rank: int

    def params(self, d: int, norm: NormSpec) -> int:
        return 2 * d * self.rank + norm.params(d)


class AltUpSpec(Spec):
    """AltUp's n residual streams (Gemma 3n; engine/models/altup.py, LayerSpec.altup): the layer
    runs on a prediction of the active stream from all n and corrects every stream by its output."""

    streams: int
    """n (altup_num_inputs)."""
    active: int = 0
    """The stream the layer computes on (altup_active_idx)."""
    correct_scale: bool = True
    """The corrected active stream is scaled by a learned vector before the per-layer input gate
    reads it (altup_correct_scale)."""
    coef_clip: float | None = None
    """The prediction and correction coefficients are clipped to +-this (altup_coef_clip;
    transformers clips only while training, where published weights lie within it)."""
    norm_eps: float = 1e-6

    def params(self, d: int) -> int:
        """The router and its norm, the prediction and correction coefficients, the output scale."""
        n = self.streams
        return d * n + d + n * n * n + n * n + d


class Zamba2HybridSpec(Spec):
    """A Zamba2 hybrid layer (engine/models/zamba2.py): a shared attention + MLP block (one of
    `shared_blocks`, model-level parameters, block `block` here) reads the stream joined with
    the original embeddings (2 d wide), with this call's own low-rank adapters on its
    projections; its output, through this layer's linear, joins the stream at a Mamba2 layer's
    input: x + mamba2(norm(x + linear(shared(x, embeddings)))). Its params(d) counts this
    layer's own (Mamba2, norm, linear, adapters); shared_params(d) one shared block's."""

    kind: Literal["zamba2_hybrid"] = "zamba2_hybrid"
    attention: AttentionSpec
    """The shared block's attention (over the 2 d-wide input)."""
    mamba2: Mamba2Spec
    norm: NormSpec
    mlp_dim: int
    activation: Literal["gelu", "gelu_tanh", "silu"] = "gelu"
    adapter_rank: int
    attention_adapters: bool = False
    """Adapters on the shared attention's q, k, v (use_shared_attention_adapter); the MLP's
    gate and up projections always have them."""
    block: int = 0
    """Which shared block the layer calls."""

    def mixing_macs(self, seq_len: int) -> int:
        return self.attention.mixing_macs(seq_len) + self.mamba2.mixing_macs(seq_len)

    def params(self, d: int) -> int:
        width = self.attention.num_heads * self.attention.head_dim
        adapters = self.adapter_rank * (d + 2 * self.mlp_dim)
        if self.attention_adapters:
            kv = self.attention.num_kv_heads * self.attention.head_dim
            adapters += self.adapter_rank * (3 * 2 * d + width + 2 * kv)
        return self.mamba2.params(d) + self.norm.params(d) + d * d + adapters

    def shared_params(self, d: int) -> int:
        width = self.attention.num_heads * self.attention.head_dim
        kv = self.attention.num_kv_heads * self.attention.head_dim
        attention = 2 * d * (width + 2 * kv) + width * d
        return self.norm.params(2 * d) + attention + self.norm.params(d) + 3 * d * self.mlp_dim


MixerSpec = Annotated[
    AttentionSpec
    | MLASpec
    | GatedDeltaSpec
    | KimiDeltaSpec
    | Mamba2Spec
    | ParallelHybridSpec
    | MixtureOfAttentionSpec
    | Mamba1Spec
    | ShortConvSpec
    | RGLRUSpec
    | LightningSpec
    | CompressedAttentionSpec
    | Zamba2HybridSpec,
    Field(discriminator="kind"),
]
"""A layer's sequence mixer."""


Activation = Literal["silu", "gelu_tanh", "gelu", "relu", "relu2", "xielu"]
"""silu (SwiGLU's), gelu_tanh (GeGLU's; HF's gelu_new, gelu_pytorch_tanh), gelu (exact, erf),
relu, relu2 = relu(x)^2 (engine/models/common.py: ACTIVATIONS); xielu: xIELU with two learned
scalars (engine/models/xielu.py; an ungated dense MLP's only)."""


XIELU_BETA, XIELU_EPS = 0.5, -1e-6
"""xIELU's constants (transformers' XIELUActivation `beta` and `eps` buffers; engine/models/xielu.py)."""


class MLPSpec(Spec):
    """The MLP: down(act(gate(x)) * up(x)), or without a gate down(act(up(x)))."""

    kind: Literal["mlp"] = "mlp"
    dim: int
    activation: Activation = "silu"
    gated: bool = True
    bias: bool = False
    """Biases on its projections (GPT-2, GPT-NeoX, Phi, StarCoder2)."""
    gate_multiplier: float = 1.0
    """The gate's pre-activation is multiplied by this (Falcon-H1's muP)..."""
    down_multiplier: float = 1.0
    """... and the output by this."""
    swiglu_limit: float | None = None
    """The clamped SwiGLU of GPT-OSS's experts (moe.clamped_swiglu) with this limit (MiniMax-M3's
    dense MLPs and shared experts); None: activation(gate) * up."""
    swiglu_alpha: float = 1.702
    gate_sparsity: float = 0.0
    """Gemma 3n's activation sparsity (a `call` field): the gate's pre-activation less its
    mean + std * Phi^-1(gate_sparsity) over the hidden width, floored at 0 (a Gaussian top-k
    keeping about 1 - gate_sparsity of it); 0: the plain gate."""

    def structure(self) -> MLPSpec:
        """The spec less its call fields: what its parameters depend on."""
        return self.model_copy(update={"gate_sparsity": 0.0})

    def params(self, d: int) -> int:
        weights = (3 if self.gated else 2) * d * self.dim + 2 * (self.activation == "xielu")  # xIELU's two scalars
        return weights + ((2 if self.gated else 1) * self.dim + d) * self.bias


class MoESpec(Spec):
    """A mixture of experts (engine/models/moe.py): a router sends each token to k of
    num_experts MLPs of width expert_dim, plus optional shared experts every token uses."""

    kind: Literal["moe"] = "moe"
    num_experts: int
    experts_per_token: int
    expert_dim: int
    activation: Activation = "silu"
    gated: bool = True
    router_score: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"
    router_renormalize: bool = True
    router_bias: bool = False
    """A learned choosing bias (DeepSeek-V3's e_score_correction_bias; a buffer in transformers)."""
    router_logits_bias: bool = False
    router_groups: int = 1
    router_group_top: int = 1
    router_group_score: Literal["top2_sum", "max"] = "top2_sum"
    router_scale: float = 1.0
    router_scales_input: bool = False
    router_input_norm: bool = False
    router_expert_scale: bool = False
    router_norm_eps: float = 1e-6
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    num_shared_experts: int = 0
    shared_dim: int = 0
    """Width of the shared experts' one MLP (0 without shared experts)."""
    shared_expert_gate: bool = False
    shared_scale: float = 1.0
    """The shared experts' output is multiplied by this (Cohere 2 MoE's `average`: 0.5)."""
    beside: MLPSpec | None = None
    """A dense MLP beside the experts, each with its norms (Gemma 4's 26B-A4B)."""
    sparsemixer_eps: float | None = None
    """SparseMixer routing with this epsilon (PhiMoE; moe.sparsemixer); None: softmax top-k."""
    output_bias: bool = False
    """A learned bias added to the mixture's output (JetMoE)."""
    swiglu_shift: float = 1.0
    """The clamped SwiGLU's (swiglu_limit) up + shift: 1 GPT-OSS's, 0 DeepSeek-V4's (whose shared
    experts are clamped too)."""
    hash_vocab: int = 0
    """Hash routing (DeepSeek-V4's first layers): each token's experts are a fixed table's row
    for its id (transformers' tid2eid, a buffer: not counted), over a vocabulary of this many; 0: none."""
    clamp_shared: bool = True
    """With swiglu_limit: the shared experts take the clamped SwiGLU too (MiniMax-M3,
    DeepSeek-V4); False: the plain one (HY-V4)."""
    router_softcap: float | None = None
    """The router logits become cap * tanh(logits / cap) before scoring (Laguna); None: as they are."""
    zero_experts: int = 0
    """Zero-computation experts routed beside the num_experts (LongCat-Flash): the router scores
    num_experts + zero_experts, and a token's chosen zero experts add their weight times the
    token itself."""

    def params(self, d: int, active: bool = False) -> int:
        experts = self.experts_per_token if active else self.num_experts
        n = (3 if self.gated else 2) * d * (self.expert_dim * experts + self.shared_dim)
        n += d * self.shared_expert_gate + d * (self.num_experts + self.zero_experts)  # not router_bias: a buffer
        n += (2 * self.expert_dim + d) * experts * self.expert_bias + self.num_experts * self.router_logits_bias
        n += d * self.router_input_norm + self.num_experts * self.router_expert_scale
        if self.beside is not None:  # and its three norms
            n += self.beside.params(d) + 3 * d
        return n + d * self.output_bias


FFNSpec = Annotated[MLPSpec | MoESpec, Field(discriminator="kind")]
"""A layer's feed-forward."""


class GatedResidualSpec(Spec):
    """Qwen4-Exp's gated-residual hyper-connections (engine/models/gated_residual.py): n
    residual streams, each sublayer reading a per-channel gated mean of them (its own norm in
    place of the pre-norm) and adding its output to each with a gate of its own."""

    streams: int
    """n (hc_count)."""
    rank: int
    """The input mix's low rank (hc_lowrank)."""
    norm_eps: float = 1e-6

    def params(self, d: int, inject: bool = True) -> int:
        """The streams' norm, the low-rank mix (down, up) and the per-stream output gates."""
        n = self.streams
        return n * d + 2 * n * d * self.rank + n * d * n * inject


class NGramEmbeddingSpec(Spec):
    """Qwen4-Exp's hashed n-gram per-layer embedding (engine/models/ngram_embedding.py): the
    token's 2..order-grams hashed into tables of prime sizes, gating a value into every
    residual stream, plus a dilated causal convolution of it (LayerSpec.ngram_embedding)."""

    order: int
    """The longest n-gram (ngram_size); the convolution's dilation too."""
    heads_per_order: int
    """Independently hashed heads per n-gram order (heads_per_ngram)."""
    dim: int
    """The heads' embeddings concatenated (ple_embed_dim)."""
    conv_kernel: int
    primes: tuple[int, ...]
    """Each head's vocabulary, a prime, in order (2-gram heads first)."""
    rows: int
    """The table's rows: the primes' sum, padded to make_ngram_vocab_size_divisible_by."""
    multipliers: tuple[int, ...]
    """The hash's odd multiplier of each n-gram position (order of them)."""
    eos_token_id: int
    """The token that ends a document: n-grams do not reach across it (and it pads)."""
    norm_eps: float = 1e-6

    @property
    def heads(self) -> int:
        return (self.order - 1) * self.heads_per_order

    def params(self, d: int, streams: int) -> int:
        """The table, the key (per stream) and value projections, three norms, the convolution."""
        x = streams * d
        return self.rows * (self.dim // self.heads) + self.dim * (x + d) + 3 * x + x * self.conv_kernel


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact below 3.3e24 with these bases)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    if n in bases:
        return True
    if any(n % p == 0 for p in bases):
        return False
    r, m = 0, n - 1
    while m % 2 == 0:
        r, m = r + 1, m // 2
    for a in bases:
        x = pow(a, m, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def ngram_primes(base: int, first: int, count: int) -> tuple[int, ...]:
    """The primes at or above `base` numbered first .. first + count - 1 (from 0), as
    transformers' Qwen4-Exp sizes its n-gram heads (_find_nth_prime_after(base - 1, k + 1))."""
    primes: list[int] = []
    n = base - 1
    while len(primes) < first + count:
        n += 1
        if _is_prime(n):
            primes.append(n)
    return tuple(primes[first:])


def ngram_multipliers(vocab: int, order: int, index: int, seed: int) -> tuple[int, ...]:
    """The hash's odd 64-bit multipliers of n-gram embedding `index` (transformers'
    _build_layer_multipliers: SplitMix64 of the seed; every product with a token id is below 2**63)."""
    mask, gamma = (1 << 64) - 1, 0x9E3779B97F4A7C15
    half = max(1, ((1 << 63) - 1) // max(vocab, 1) // 2)
    out = []
    for k in range(order):
        z = (seed + 10007 * index + gamma * (k + 1)) & mask
        z = (z + gamma) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(2 * ((z ^ (z >> 31)) % half) + 1)
    return tuple(out)


class LayerSpec(Spec):
    """One decoder layer: x + mixer(norm(x)), then x + ffn(norm(x)), with the variations below."""

    stack: str
    """The params key of the stack of like layers it belongs to (ModelConfig.layer_stacks)."""
    mixer: MixerSpec | None
    """None: the layer is only its feed-forward (Nemotron-H's MLP layers)."""
    ffn: FFNSpec | None
    """None: the layer is only its mixer."""
    norm: NormSpec = NormSpec()
    pre_norms: bool = True
    """Normalise each sublayer's input."""
    post_norms: bool = False
    """Normalise each sublayer's output before the residual add (Gemma 2/3, OLMo 2)."""
    residual_multiplier: float | None = None
    """Each sublayer's output is multiplied by this before the add (Granite)."""
    layer_scale: bool = False
    """A learned scalar multiplying the stream after the layer (Gemma 4)."""
    per_layer_input_dim: int | None = None
    """Gemma 4's per-layer inputs: x + norm(proj(act(gate(x)) * e)) after the feed-forward."""
    per_layer_activation: Activation = "gelu_tanh"
    residual_scales: tuple[float, float, float, float] | None = None
    """(mixer alpha, mixer beta, ffn alpha, ffn beta): each sublayer sets the stream to alpha *
    norm(x) + beta * sublayer(norm(x)), the normed input its residual (MiniMax-Text-01's
    DeepNorm-style factors); None: x + sublayer(norm(x))."""
    hyper: HyperConnectionSpec | None = None
    """n residual streams mixed in and out of each sublayer (DeepSeek-V4, hyper_connection.py)."""
    laurel: LaurelSpec | None = None
    """Gemma 3n's LAuReL beside the attention (laurel.py)."""
    altup: AltUpSpec | None = None
    """Gemma 3n's AltUp streams (altup.py): the layer predicts, runs on and corrects n streams."""
    residual: Literal["sequential", "parallel", "parallel_shared_norm"] = "sequential"
    """sequential: x + mixer(norm(x)), then + ffn(norm(that)); parallel: x + mixer(norm1(x)) +
    ffn(norm2(x)) (GPT-NeoX, Falcon's new architecture); parallel_shared_norm: one norm for both,
    x + mixer(norm(x)) + ffn(norm(x)) (GPT-J, Phi, Cohere)."""
    shortcut_moe: MoESpec | None = None
    """LongCat-Flash's shortcut-connected experts: the layer also runs them on its MLP's input,
    and their output joins the stream at the end of the next layer (shortcut_close), carried
    beside it: the decoder's stream is then (b, t, 2 d), the stream and the carried output."""
    shortcut_close: bool = False
    """The layer adds the carried shortcut experts' output after its MLP (LongCat-Flash)."""
    gated_residual: GatedResidualSpec | None = None
    """Qwen4-Exp's n gated residual streams (gated_residual.py): each sublayer's connection
    replaces its pre-norm."""
    ngram_embedding: NGramEmbeddingSpec | None = None
    """Qwen4-Exp's hashed n-gram embedding added to the streams before the layer (ngram_embedding.py)."""

    @property
    def attention(self) -> AttentionSpec | None:
        """The layer's grouped-query attention (also the one beside a Mamba2 mixer), if any."""
        if isinstance(self.mixer, ParallelHybridSpec | MixtureOfAttentionSpec | Zamba2HybridSpec):
            return self.mixer.attention
        return self.mixer if isinstance(self.mixer, AttentionSpec) else None

    @property
    def local(self) -> bool:
        """Attends through a sliding window (Gemma 4's KV sharing pairs layers by this)."""
        return getattr(self.mixer, "window", None) is not None

    @property
    def kv_sharing(self) -> Literal["store", "reuse"] | None:
        return None if self.attention is None else self.attention.kv_sharing

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoESpec)

    def params(self, d: int, active: bool = False) -> int:
        norms = (self.pre_norms + self.post_norms) * self.norm.params(d)
        n = int(self.layer_scale)
        if self.mixer is not None:
            n += self.mixer.params(d) + norms
        if self.ffn is not None:
            n += self.ffn.params(d, active) if isinstance(self.ffn, MoESpec) else self.ffn.params(d)
            n += norms - self.pre_norms * self.norm.params(d) * (self.residual == "parallel_shared_norm")
        if self.per_layer_input_dim:  # gate, projection, norm
            n += d * (2 * self.per_layer_input_dim) + self.norm.params(d)
        if self.hyper is not None:  # the mixer's and the feed-forward's connections
            n += 2 * self.hyper.params(d)
        if self.laurel is not None:
            n += self.laurel.params(d, self.norm)
        if self.altup is not None:
            n += self.altup.params(d)
        if self.shortcut_moe is not None:
            n += self.shortcut_moe.params(d, active)
        if self.gated_residual is not None:  # the mixer's and the feed-forward's connections
            n += 2 * self.gated_residual.params(d)
        if self.ngram_embedding is not None:
            n += self.ngram_embedding.params(d, 1 if self.gated_residual is None else self.gated_residual.streams)
        return n


def with_layer_decays(specs: list[LayerSpec]) -> list[LayerSpec]:
    """The layers with each lightning mixer's slope_factor set from its depth, as transformers
    sets it: 1 - i / (L - 1 + 1e-5) + 1e-5 for layer i of L."""
    last = len(specs) - 1 + 1e-5
    out = []
    for i, spec in enumerate(specs):
        if isinstance(spec.mixer, LightningSpec):
            mixer = spec.mixer.model_copy(update={"slope_factor": 1 - i / last + 1e-5})
            spec = spec.model_copy(update={"mixer": mixer})
        out.append(spec)
    return out
