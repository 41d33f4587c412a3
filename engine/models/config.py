"""What a model is (ModelConfig: the architecture) and how a run computes with it
(ComputeConfig: dtypes, layer scan, rematerialisation, attention and matmul implementations).

The two are apart so that a checkpoint records exactly its architecture: a run may restore it
under other compute settings (bfloat16 matmuls over float32 weights, remat, another block
size; only the layer layout, scan_layers, must match), and a different architecture is refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, NamedTuple

from pydantic import Field, field_validator, model_validator

from engine import flat_keys
from engine.config import Strict
from engine.models.family_registry import family_names, get_family
from engine.models.lora_targets import FOLDED, LLAMA_ORDER, adaptable_modules, adapted_weights
from engine.models.rope_scaling import RopeScaling as RopeScaling  # re-exported: configs import it from here
from engine.models.sections import (
    AttentionConfig,
    BlockConfig,
    EmbeddingConfig,
    HeadConfig,
    MLAConfig,
    MLPConfig,
    MoEConfig,
    RopeConfig,
)
from engine.models.specs import (
    AltUpSpec,
    AttentionSpec,
    BlockIndexerSpec,
    CompressedAttentionSpec,
    GatedDeltaSpec,
    GatedResidualSpec,
    HyperConnectionSpec,
    IndexerSpec,
    KimiDeltaSpec,
    LaurelSpec,
    LayerSpec,
    LightningSpec,
    Mamba1Spec,
    Mamba2Spec,
    MixtureOfAttentionSpec,
    MLASpec,
    MLPSpec,
    MoESpec,
    NGramEmbeddingSpec,
    NormSpec,
    ParallelHybridSpec,
    QSAIndexerSpec,
    RGLRUSpec,
    RotarySpec,
    ShortConvSpec,
    Zamba2HybridSpec,
    mla_score_scale,
    ngram_multipliers,
    ngram_primes,
    with_layer_decays,
)
from engine.ops.attention_names import DecodeImpl, Impl


class Layer(NamedTuple):
    """One decoder layer as data (ModelConfig.layer_pattern): its sequence mixer and
    feed-forward, and the static flags its call takes. Layers whose parameters have the same
    structure form one stack (`stack`), stacked and scanned together whatever their flags."""

    stack: str
    """The params key of its stack: `blocks`, or `dense_blocks` for the dense-MLP layers of
    a mixture of experts (DeepSeek-V3's first layers, Qwen3-MoE's mlp_only_layers)."""
    mixer: Literal[
        "attention",
        "mla",
        "gated_delta",
        "kimi_delta",
        "mamba2",
        "attention_mamba2",
        "mamba1",
        "block_sparse",
        "short_conv",
        "rglru",
        "lightning",
        "compressed_attention",
        "none",
        "zamba2_hybrid",
        "qsa",
    ]
    """The sequence mixer, a kind in transformer.MIXERS: grouped-query attention
    (transformer.Attention), multi-head latent attention (mla.py), or a Gated DeltaNet
    linear-attention layer (gated_delta_block.py), which decodes with a recurrent state;
    attention_mamba2: attention and a Mamba2 mixer side by side (Falcon-H1, parallel_hybrid.py);
    kimi_delta: Kimi Delta Attention, the delta rule with a decay per key channel (kimi_delta_block.py);
    block_sparse: attention over the key blocks an indexer selects (MiniMax-M3, block_sparse.py)."""
    ffn: Literal["mlp", "moe", "none"]
    """The gated MLP or a mixture of experts (moe.py), or none (a layer that is only its mixer;
    Nemotron-H's, whose MLP layers have mixer "none" in turn)."""
    local: bool
    """Sliding-window attention (else global)."""
    rope: bool
    """RoPE on queries and keys (else NoPE: no position signal but the causal mask)."""
    head_dim: int | None = None
    """This layer's query/key/value head width; None: ModelConfig.attention.head_dim (Gemma 4's global
    layers: global_head_dim, in a stack of their own)."""
    kv_heads: int | None = None
    """This layer's key/value heads; None: ModelConfig.attention.num_kv_heads."""
    values_from_keys: bool = False
    """No value projection: the values are the key projection (Gemma 4's attention_k_eq_v)."""
    chunked: bool = False
    """Chunked attention: a query sees the earlier keys of its own chunk of
    ModelConfig.attention.chunk_size positions (Llama 4's chunked_attention layers)."""
    kv_sharing: Literal["store", "reuse"] | None = None
    """Gemma 4's KV sharing (ModelConfig.attention.kv_shared_layers): `reuse`, the layer has no key and
    value projections and attends with the keys and values of the `store` layer of its kind
    (local or global), the last earlier one, in a stack of its own (`kv_shared_blocks`)."""
    mlp_dim: int | None = None
    """This layer's MLP width; None: ModelConfig.mlp.dim (Gemma 4 E2B's reuse layers: twice it)."""
    compressed: str | None = None
    """A compressed_attention layer's kind (CompressedAttentionConfig.layer_types)."""
    hashed: bool = False
    """Its experts hash-routed (ModelConfig.moe.hash_layers)."""
    index_shared: bool = False
    """Sparse attention without an indexer of its own: the layer attends to the keys the last
    earlier layer's indexer selected (ModelConfig.mla.index_shared_layers), in a stack of its
    own (`index_shared_...`)."""
    shared_call: int | None = None
    """A Zamba2 hybrid layer's place among them (its adapters' index; its shared block is this
    modulo Zamba2Config.shared_blocks), in a stack of its own (`zamba2_hybrid_{n}_blocks`)."""
    ngram: int | None = None
    """A layer with a hashed n-gram embedding: its place among them (its table's size and hash
    are its own), in a stack of its own (`ngram_{n}_...`; ModelConfig.ngram_embedding)."""


class GatedDeltaConfig(Strict):
    """The sizes of a Gated DeltaNet mixer (engine/models/gated_delta_block.py; Qwen3-Next's
    and Qwen3.5's linear_* config.json keys)."""

    num_key_heads: int = Field(gt=0)
    num_value_heads: int = Field(gt=0)
    """A multiple of num_key_heads: each key head serves a group of value heads."""
    key_head_dim: int = Field(gt=0)
    value_head_dim: int = Field(gt=0)
    conv_kernel: int = Field(4, gt=1)
    """Taps of the short causal convolution over q, k and v."""
    fused_projections: bool = False
    """Qwen3-Next's layout: q, k, v, z in one projection and b, a in another, grouped per key
    head (in_proj_qkvz, in_proj_ba); else Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a."""
    beta_scale: float = Field(1.0, gt=0)
    """The write strength is this times sigmoid(b): 2.0 lets the state's eigenvalues go negative
    (OLMo Hybrid's linear_allow_neg_eigval)."""
    norm_eps: float | None = Field(None, gt=0)
    """The gated output norm's epsilon; None: the model's norm epsilon (OLMo Hybrid's is 1e-5)."""
    full_rank_gates: bool = False
    """Kimi delta attention: its forget and output gates one full-rank projection each (Ling 3)."""
    gate_lower_bound: float | None = Field(None, lt=0)
    """Kimi delta attention: the bounded forget gate's lower bound (Ling 3's kda_lower_bound)."""

    @model_validator(mode="after")
    def _check_groups(self) -> GatedDeltaConfig:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"num_value_heads ({self.num_value_heads}) must be a multiple of num_key_heads ({self.num_key_heads})"
            )
        return self


class Mamba2Config(Strict):
    """The sizes of a Mamba2 mixer (engine/models/mamba2.py; Nemotron-H's and Granite 4's
    mamba_* config.json keys)."""

    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    state_size: int = Field(gt=0)
    """N, each head's state is (head_dim, state_size)."""
    n_groups: int = Field(1, gt=0)
    """Groups of heads sharing B and C (and a group of the gated norm)."""
    conv_kernel: int = Field(4, gt=1)
    chunk_size: int = Field(256, gt=0)
    """Tokens per chunk of the SSD chunked scan (the results do not depend on it)."""
    conv_bias: bool = True
    proj_bias: bool = False
    """Biases on in_proj and out_proj."""
    dt_limit: tuple[float, float] | None = None
    """dt clamped to [low, high] after the softplus (time_step_limit); None: no clamp."""
    gated_norm: bool = True
    """The scan's output goes through the gated RMSNorm (weight norm_f); false: y * silu(z),
    no norm and no weight (Falcon-H1's mamba_rms_norm false)."""
    norm_before_gate: bool = False
    """With gated_norm: weight * norm(y) * silu(z) (Falcon-H1's mamba_norm_before_gate); else
    Mamba2's weight * norm(y * silu(z))."""

    @model_validator(mode="after")
    def _check_groups(self) -> Mamba2Config:
        if self.num_heads % self.n_groups:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of n_groups ({self.n_groups})")
        return self


class Mamba1Config(Strict):
    """The sizes of a Mamba1 selective-scan mixer (engine/models/mamba1.py; Mamba's, Falcon-Mamba's
    and Jamba's config.json keys)."""

    inner: int = Field(gt=0)
    """The SSM's width (intermediate_size = expand x hidden_size)."""
    state_size: int = Field(gt=0)
    dt_rank: int = Field(gt=0)
    conv_kernel: int = Field(4, gt=1)
    conv_bias: bool = True
    proj_bias: bool = False
    bcdt_norm: Literal["none", "weightless", "weighted"] = "none"
    """RMSNorms on dt's low-rank input, B and C: none (Mamba), scale-less (Falcon-Mamba), learned (Jamba)."""
    bcdt_norm_eps: float = Field(1e-6, gt=0)


class CompressedAttentionConfig(Strict):
    """DeepSeek-V4's attention layers (engine/models/compressed_attention.py; its config.json's
    layer_types, compress_rates, o_groups, index_* keys)."""

    layer_types: list[Literal["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]]
    """Per layer: the sliding window alone, or beside CSA's (sparse, overlapping) or HCA's entries."""
    csa_ratio: int = Field(4, gt=0)
    """Positions per compressed entry of the compressed_sparse_attention layers."""
    hca_ratio: int = Field(128, gt=0)
    """... and of the heavily_compressed_attention layers."""
    window: int = Field(128, gt=0)
    q_lora_rank: int = Field(gt=0)
    rope_head_dim: int = Field(gt=0)
    out_groups: int = Field(gt=0)
    out_rank: int = Field(gt=0)
    index_topk: int = Field(gt=0)
    index_heads: int = Field(gt=0)
    index_head_dim: int = Field(gt=0)
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: RopeScaling | None = None
    """The compressed layers' RoPE scaling (YaRN for the published models); the sliding ones have none."""


class HyperConnectionConfig(Strict):
    """DeepSeek-V4's residual streams (engine/models/hyper_connection.py; hc_* keys)."""

    streams: int = Field(4, gt=0)
    iterations: int = Field(20, gt=0)
    eps: float = Field(1e-6, gt=0)
    independent: bool = False
    """No stream mix, `post` = magnitude * sigmoid(.) + eps (HY-V4's independent hyper-connections)."""
    magnitude: float = Field(2.0, gt=0)
    """`post`'s scale (hc_magnitude)."""


class AltUpConfig(Strict):
    """Gemma 3n's AltUp residual streams (engine/models/altup.py; its altup_* config.json keys)."""

    streams: int = Field(4, gt=1)
    """Parallel residual streams (altup_num_inputs)."""
    active: int = Field(0, ge=0)
    """The stream each layer computes on (altup_active_idx)."""
    correct_scale: bool = True
    """Scale the corrected active stream before the per-layer input gate (altup_correct_scale)."""
    coef_clip: float | None = Field(120.0, gt=0)
    """Clip the prediction and correction coefficients to +-this (altup_coef_clip)."""

    @model_validator(mode="after")
    def _check_active(self) -> AltUpConfig:
        if self.active >= self.streams:
            raise ValueError(f"altup.active ({self.active}) must be below altup.streams ({self.streams})")
        return self


class Zamba2Config(Strict):
    """Zamba2's shared blocks (engine/models/zamba2.py; mixer_pattern zamba2_hybrid): the
    attention + MLP blocks the hybrid layers call in turn, each call with adapters of its own."""

    shared_blocks: int = Field(1, gt=0)
    """Distinct shared blocks, called in turn by the hybrid layers (num_mem_blocks)."""
    adapter_rank: int = Field(128, gt=0)
    """Rank of each call's adapters (adapter_rank)."""
    attention_adapters: bool = False
    """Adapters on the shared attention's q, k and v too (use_shared_attention_adapter); the
    MLP's gate and up projections always have them."""
    rope: bool = False
    """RoPE in the shared attention (use_mem_rope)."""


class MuPMultipliers(Strict):
    """Falcon-H1's muP multipliers (its config.json's *_multiplier(s) keys; 1.0 is none):
    fixed scalars on activations, not parameters, so its weights stay as trained."""

    lm_head: float = 1.0
    """Logits are multiplied by this (lm_head_multiplier)."""
    key: float = 1.0
    """Keys are multiplied by this after their projection, before RoPE (key_multiplier)."""
    attention_in: float = 1.0
    """The attention reads the normed input times this (attention_in_multiplier)..."""
    attention_out: float = 1.0
    """... and its output is multiplied by this (attention_out_multiplier)."""
    ssm_in: float = 1.0
    """The Mamba2 mixer reads the normed input times this (ssm_in_multiplier)..."""
    ssm_out: float = 1.0
    """... and its output is multiplied by this (ssm_out_multiplier)."""
    ssm_projections: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    """in_proj's output sections z, x, B, C, dt are multiplied by these (ssm_multipliers,
    transformers' mup_vector)."""
    mlp_gate: float = 1.0
    """The MLP's gate projection is multiplied by this before the activation..."""
    mlp_down: float = 1.0
    """... and its output by this (mlp_multipliers)."""


class BlockIndexerConfig(Strict):
    """MiniMax-M3's block-sparse attention layers (mixer_pattern `block_sparse`; engine/models/
    block_sparse.py): the model's attention, each key/value group's queries attending only to
    the key blocks an indexer of its own selects (its index_* config.json keys)."""

    heads: int = Field(gt=0)
    """The indexer's query heads: one per key/value head (num_kv_heads)."""
    head_dim: int = Field(gt=0)
    """Its queries' and keys' width, at least the attention's rotary width."""
    block: int = Field(gt=0)
    """Keys per block."""
    topk_blocks: int = Field(gt=0)
    """The best-scored blocks a query attends to."""
    local_blocks: int = Field(1, ge=0)
    """The blocks ending at the query's own, always attended to."""


class QSAIndexerConfig(Strict):
    """Qwen4-Exp's QSA layers (mixer_pattern `qsa`; engine/models/qsa.py): the model's
    attention, each query attending only to the blocks of keys a pooled-key indexer selects
    and to its own incomplete block (its indexer_* config.json keys)."""

    heads: int = Field(gt=0)
    """The indexer's query heads (indexer_n_heads; one key head)."""
    head_dim: int = Field(gt=0)
    """Its queries' and keys' width, at least the attention's rotary width."""
    budget: int = Field(gt=0)
    """Tokens selected from complete blocks (indexer_budget), a multiple of `block`."""
    block: int = Field(gt=0)
    """Consecutive keys averaged into one block key (indexer_compress_ratio)."""


class GatedResidualConfig(Strict):
    """Qwen4-Exp's gated-residual hyper-connections (engine/models/gated_residual.py; hc_* keys)."""

    streams: int = Field(4, gt=1)
    """Residual streams (hc_count)."""
    rank: int = Field(gt=0)
    """The input mix's low rank (hc_lowrank)."""


class NGramEmbeddingConfig(Strict):
    """Qwen4-Exp's hashed n-gram per-layer embeddings (engine/models/ngram_embedding.py; its
    ple_* and ngram_* config.json keys)."""

    layers: list[int] = Field(min_length=1)
    """The layers with one (from 0; ple_layer_ids counts from 1): linear-attention layers."""
    dim: int = Field(gt=0)
    """The heads' embeddings concatenated (ple_embed_dim), a multiple of the heads."""
    order: int = Field(3, ge=2)
    """The longest n-gram (ngram_size)."""
    heads_per_order: int = Field(8, gt=0)
    vocab_base: int = Field(20_000_000, gt=1)
    """Each head's vocabulary is the next unused prime from this on (ngram_vocab_size_base)."""
    vocab_multiple: int = Field(128, gt=0)
    """The table's rows padded to a multiple of this (make_ngram_vocab_size_divisible_by)."""
    conv_kernel: int = Field(4, gt=0)
    """Taps of the dilated causal convolution (ple_conv_kernel_size)."""
    seed: int = 1234
    """Seeds the hash multipliers."""
    eos_token_id: int = Field(ge=0)
    """The token ending a document: n-grams do not reach across it."""
    checkpoint_shards: int = Field(512, gt=0)
    """A checkpoint stores each table in this many pieces (split_ngram_parts)."""

    @model_validator(mode="after")
    def _check_heads(self) -> NGramEmbeddingConfig:
        if self.dim % ((self.order - 1) * self.heads_per_order):
            raise ValueError("ngram_embedding.dim must be a multiple of (order - 1) * heads_per_order")
        return self


class ShortConvConfig(Strict):
    """The gated short convolution layers (engine/models/short_conv.py; LFM2's conv_* keys)."""

    conv_kernel: int = Field(3, gt=1)
    """Taps of the depthwise causal convolution (LFM2's conv_L_cache)."""
    bias: bool = False
    """Biases on in_proj, the convolution and out_proj (LFM2's conv_bias)."""


class RGLRUConfig(Strict):
    """Griffin's recurrent blocks (engine/models/rglru.py; RecurrentGemma's lru_width, conv1d_width)."""

    width: int = Field(gt=0)
    """The recurrence's width (lru_width)."""
    num_heads: int = Field(gt=0)
    """Blocks of its gates' block-diagonal weights; a divisor of width."""
    conv_kernel: int = Field(4, gt=1)


class LightningConfig(Strict):
    """Lightning attention layers (engine/models/lightning.py; MiniMax-Text-01's linear_attention)."""

    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    chunk_size: int = Field(256, gt=0)
    """Positions per chunk of the training form (block_size; the results do not depend on it)."""


class NormedResidualConfig(Strict):
    """MiniMax-Text-01's residual: each sublayer sets the stream to alpha * norm(x) + beta *
    sublayer(norm(x)), with factors per sublayer kind (its config.json *_alpha_factor, *_beta_factor)."""

    attention_alpha: float = 1.0
    attention_beta: float = 1.0
    lightning_alpha: float = 1.0
    lightning_beta: float = 1.0
    mlp_alpha: float = 1.0
    mlp_beta: float = 1.0


class MtpLayerConfig(Strict):
    """The multi-token-prediction modules' layer where it is not of the last layer's kind
    (ModelConfig.mtp_layer_kind)."""

    local: bool = True
    """A sliding-window layer: MiMo-V2-Flash's (the sliding layers' heads and sinks),
    DeepSeek-V4's sliding_attention one (no compressor); False: a global layer."""
    ffn: Literal["moe", "mlp"] = "moe"
    """Its feed-forward: the experts (scored, never hash-routed), or the dense layers' MLP
    (MiMo-V2-Flash's, intermediate_size wide)."""
    mixer: Literal["block_sparse"] | None = None
    """Its sequence mixer where not the window's layers': MiniMax-M3's block_sparse (vLLM's
    MTP block is a sparse-attention layer whatever the last layer is); None: theirs."""
    at_hidden_position: bool = False
    """Module k's layer runs at position i + k, its hidden state's (vLLM's drafter, whose
    MiniMax-M3 block-sparse selection counts positions), not at i + k + 1, its embedded
    token's (transformers' MtpModel; the same under RoPE alone)."""
    hidden_first: bool = False
    """The projection reads [hnorm(hidden), enorm(embedding)] (SGLang's MiniMax-M2 module),
    not the embedding's first."""
    shared_final_norm: bool = False
    """The modules' output norm is the main model's final norm (SGLang's MiniMax-M2 module:
    model.norm), not one of their own."""


_LAYER_SPECS: dict[str, tuple[LayerSpec, ...]] = {}
"""ModelConfig.layer_specs' results by the config's JSON (a config is rebuilt from its fields
everywhere; its specs are asked for at every trace)."""


class ModelConfig(Strict):
    """The architecture of a decoder-only transformer: what a checkpoint's parameters mean.

    Saved with every checkpoint and compared when one is loaded; model families differ only
    in these fields. How a run computes with it is ComputeConfig."""

    family: str = "llama"
    """Architecture family, one registered in engine/models/families (llama, qwen3, gemma3,
    deepseek_v3, ...): names the Hugging Face layout. The math is set by the fields below alone."""
    vocab_size: int = Field(gt=0)
    d_model: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    max_seq_len: int = Field(2048, gt=0)
    init_std: float = Field(0.02, gt=0)
    tie_embeddings: bool = False
    positions: Literal["rope", "learned", "alibi"] = "rope"
    """The position signal: RoPE in the attention layers (rope.pattern says which), a learned
    absolute embedding added to the token's (GPT-2, OPT), or ALiBi's linear biases on the scores
    (BLOOM, MPT)."""
    embedding: EmbeddingConfig = EmbeddingConfig()
    """The token embeddings' scaling and norm, learned positions' offset, per-layer inputs."""
    attention: AttentionConfig
    """The attention layers: heads, biases, QK norms, windows, scaling; which layers slide."""
    rope: RopeConfig = RopeConfig()
    """RoPE's base, scaling, rotary width; which layers rotate."""
    mla: MLAConfig = MLAConfig()
    """Multi-head latent attention instead of grouped-query attention, when its kv_lora_rank is set."""
    mlp: MLPConfig
    """The dense MLP layers (and the experts' activation)."""
    moe: MoEConfig = MoEConfig()
    """A mixture of experts, when its num_experts is above 0."""
    norm: NormSpec = NormSpec()
    """Every norm of the layers (and the final norm, but for head.norm_eps)."""
    block: BlockConfig = BlockConfig()
    """How a layer adds its sublayers: pre/post norms, sequential or parallel, multipliers."""
    head: HeadConfig = HeadConfig()
    """The LM head's bias, softcap and scaling, and the final norm's epsilon."""
    mixer_pattern: (
        list[
            Literal[
                "attention",
                "gated_delta",
                "kimi_delta",
                "mamba2",
                "attention_mamba2",
                "mamba1",
                "block_sparse",
                "short_conv",
                "rglru",
                "lightning",
                "compressed_attention",
                "none",
                "zamba2_hybrid",
                "qsa",
            ]
        ]
        | None
    ) = Field(None, min_length=1)
    """Layer i's sequence mixer is mixer_pattern[i % len] (attention: the model's attention,
    MLA where mla.kv_lora_rank is set); None: attention in every layer. Each other kind's layers
    form stacks of their own (`gated_delta_blocks`). Qwen3-Next: three gated_delta then one
    attention; attention_mamba2: attention and Mamba2 side by side (Falcon-H1); none: a layer
    that is only its feed-forward."""
    ffn_pattern: list[Literal["mlp", "moe", "none"]] | None = Field(None, min_length=1)
    """With experts: layer i (past moe.first_dense_layers) has experts iff ffn_pattern[i % len]
    is moe, else a dense MLP (mlp.dim) in the `dense_blocks` stack; None: experts in every layer.
    Qwen3-MoE's decoder_sparse_step 2: [mlp, moe]; its mlp_only_layers: one entry per layer.
    none: the layer has no feed-forward, only its mixer (Nemotron-H's Mamba2 and attention
    layers), and the layers of each mixer kind without one form a stack of their own
    (`mamba2_only_blocks`, `attention_only_blocks`), as do those with no mixer (`mlp_only_blocks`)."""
    gated_delta: GatedDeltaConfig | None = None
    """The Gated DeltaNet (or Kimi delta) layers' sizes (mixer_pattern has gated_delta / kimi_delta)."""
    mamba2: Mamba2Config | None = None
    """The Mamba2 layers' sizes (mixer_pattern has mamba2)."""
    mamba1: Mamba1Config | None = None
    """The Mamba1 layers' sizes (mixer_pattern has mamba1; Mamba, Falcon-Mamba, Jamba)."""
    block_indexer: BlockIndexerConfig | None = None
    """The block-sparse attention layers' indexer (mixer_pattern has block_sparse; MiniMax-M3)."""
    short_conv: ShortConvConfig | None = None
    """The gated short convolution layers' settings (mixer_pattern short_conv: LFM2)."""
    rglru: RGLRUConfig | None = None
    """The RG-LRU recurrent blocks' sizes (mixer_pattern rglru: RecurrentGemma)."""
    lightning: LightningConfig | None = None
    """The lightning attention layers' sizes (mixer_pattern lightning: MiniMax-Text-01)."""
    normed_residual: NormedResidualConfig | None = None
    """MiniMax-Text-01's residual form (LayerSpec.residual_scales); None: x + sublayer(norm(x))."""
    compressed_attention: CompressedAttentionConfig | None = None
    """DeepSeek-V4's attention layers (mixer_pattern compressed_attention)."""
    hyper_connections: HyperConnectionConfig | None = None
    """DeepSeek-V4's n residual streams in every layer (hyper_connection.py); None: one stream."""
    mup: MuPMultipliers | None = None
    """Falcon-H1's multipliers on the attention, Mamba2, MLP and LM head activations; None: none."""
    mtp_layers: int = Field(0, ge=0, le=8)
    """Multi-token-prediction modules after the last layer (DeepSeek-V3's and GLM-4.5's
    num_nextn_predict_layers; DeepSeek-V4's one, MiMo-V2-Flash's three): the first joins the
    main model's final hidden state at i with the embedding of token i + 1 and runs one more
    layer (the last layer's kind, or mtp_layer_kind's), whose output the LM head reads as a
    prediction of token i + 2; module k does so with module k - 1's output and token i + k + 1
    for token i + k + 2 (engine/models/mtp.py; the `mtp_blocks` stack). Converted, kept and
    exported; trained only under ComputeConfig.mtp_loss."""
    mtp_layer_kind: MtpLayerConfig | None = None
    """The multi-token-prediction layer's own kind (MiMo-V2-Flash: a sliding-window layer with
    a dense MLP; DeepSeek-V4: a sliding_attention layer); None: the last layer's, with experts."""
    altup: AltUpConfig | None = None
    """Gemma 3n's AltUp: n residual streams each layer predicts from and corrects (altup.py); None: one stream."""
    zamba2: Zamba2Config | None = None
    """Zamba2's shared blocks (mixer_pattern zamba2_hybrid, zamba2.py); None: none."""
    qsa: QSAIndexerConfig | None = None
    """The QSA layers' indexer (mixer_pattern has qsa; Qwen4-Exp, qsa.py)."""
    gated_residual: GatedResidualConfig | None = None
    """Qwen4-Exp's n gated residual streams in every layer (gated_residual.py); None: one stream."""
    ngram_embedding: NGramEmbeddingConfig | None = None
    """Qwen4-Exp's hashed n-gram embeddings of some layers (ngram_embedding.py); None: none."""

    FLAT_KEYS: ClassVar[tuple[str, ...]] = tuple(flat_keys.FLAT)
    """The sections' fields by their flat names, which configs may still use (`num_heads: 8`)."""

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> ModelConfig:
        """A copy with `update`; flat keys in it (`{"kv_lora_rank": None}`) are read as a config's
        are, into their sections, and the result validated (pydantic's copy would set an unknown
        attribute and leave the section as it was)."""
        if update and any(key in flat_keys.FLAT for key in update):
            return type(self).model_validate({**self.model_dump(), **update})
        return super().model_copy(update=update, deep=deep)

    @model_validator(mode="before")
    @classmethod
    def _flat_keys(cls, data: Any) -> Any:
        """Configs written with flat keys (`num_heads: 8`): their sections' fields (flat_keys.py)."""
        return flat_keys.fold(data)

    @model_validator(mode="after")
    def _check_query_scaling(self) -> ModelConfig:
        if (
            self.attention.experts
            and self.attention.num_heads != self.attention.num_kv_heads * self.moe.experts_per_token
        ):
            raise ValueError(
                "attention_experts needs num_heads = num_kv_heads * experts_per_token (each expert's heads)"
            )
        if self.attention.query_position_scale is not None and self.rope.scaling is None:
            raise ValueError("query_position_scale needs rope_scaling (its original_max_position is the period)")
        if self.attention.qk_norm_after_rope and (
            not self.attention.qk_norm or self.attention.qk_norm_across_heads or self.rope.interleave
        ):
            raise ValueError(
                "qk_norm_after_rope needs qk_norm over head_dim (not qk_norm_across_heads) and half-split "
                "RoPE (rope_interleave false: the rotation reorders head_dim, the norm's scales would not)"
            )
        return self

    @field_validator("family")
    @classmethod
    def _known_family(cls, name: str) -> str:
        get_family(name)  # raises a ValueError naming the closest registered family
        return name

    @model_validator(mode="after")
    def _check_experts(self) -> ModelConfig:
        moe_family = get_family(self.family).moe
        if moe_family and not self.is_moe:
            raise ValueError(f"family '{self.family}' is a mixture of experts, so num_experts must be set")
        if self.is_moe and moe_family is False:  # None: a family of dense and expert models (Gemma 4)
            moe = ", ".join(name for name in family_names() if get_family(name).moe)
            raise ValueError(
                f"family '{self.family}' has no experts (num_experts must be 0); mixture-of-experts families: {moe}"
            )
        return self

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.attention.num_heads % self.attention.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.attention.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.attention.num_kv_heads})"
            )
        if "local" in self.attention.pattern and self.attention.sliding_window is None:
            raise ValueError("attention_pattern has local layers, so sliding_window must be set")
        if ("chunked" in self.attention.pattern) != (self.attention.chunk_size is not None):
            raise ValueError("attention_chunk_size is set exactly when attention_pattern has chunked layers")
        if self.mla.kv_lora_rank is None and self.positions == "rope" and self.attention.head_dim % 2:
            raise ValueError(f"head_dim ({self.attention.head_dim}) must be even for RoPE")
        if self.moe.num_experts and self.moe.experts_per_token > self.moe.num_experts:
            raise ValueError(
                f"experts_per_token ({self.moe.experts_per_token}) exceeds num_experts ({self.moe.num_experts})"
            )
        expert_only = [
            name for name in ("router_logits_bias", "expert_bias", "swiglu_limit") if getattr(self.moe, name)
        ]
        if expert_only and not self.is_moe:
            raise ValueError(f"{expert_only[0]} is a setting of the experts, so num_experts must be set")
        return self

    @model_validator(mode="after")
    def _check_deepseek(self) -> ModelConfig:
        gemma4_moe = [n for n in ("beside_mlp", "router_input_norm", "router_expert_scale") if getattr(self.moe, n)]
        if gemma4_moe and not self.is_moe:
            raise ValueError(f"{gemma4_moe[0]} is a setting of the experts, so num_experts must be set")
        if self.moe.beside_mlp and not (self.block.pre_norms and self.block.post_norms):
            raise ValueError("moe_beside_mlp needs pre_norms and post_norms (each branch has its norms)")
        if self.moe.first_dense_layers and not self.is_moe:
            raise ValueError("first_dense_layers needs num_experts (the layers after them have experts)")
        if "moe" in (self.ffn_pattern or []) and not self.is_moe:
            raise ValueError("ffn_pattern needs num_experts (it says which layers have experts)")
        if self.mtp_layers and not self.is_moe:
            raise ValueError("mtp_layers (DeepSeek-V3's and GLM-4.5's multi-token prediction) needs num_experts")
        if self.attention.qk_norm_across_heads and not self.attention.qk_norm:
            raise ValueError("qk_norm_across_heads needs qk_norm")
        if not self.block.pre_norms and not self.block.post_norms:
            raise ValueError("pre_norms false needs post_norms (a block normalises its input or its output)")
        mla_rope = self.rope.pattern not in (None, [False])  # [False]: MLA without RoPE (Kimi Linear)
        if self.is_mla and (self.attention.qk_norm_across_heads or mla_rope or self.rope.rotary_dim):
            raise ValueError(
                "qk_norm_across_heads, rope_pattern and rotary_dim are settings of grouped-query attention, not MLA"
            )
        if self.attention.has_global_shape and (self.is_mla or "global" not in self.attention.pattern):
            raise ValueError(
                "global_head_dim, global_num_kv_heads and global_values_from_keys need global layers "
                "of grouped-query attention (attention_pattern with 'global')"
            )
        if (self.attention.global_head_dim or 0) % 2 or (self.rope.rotary_dim or 0) > (
            self.attention.global_head_dim or self.attention.head_dim
        ):
            raise ValueError(f"global_head_dim ({self.attention.global_head_dim}) must be even and at least rotary_dim")
        if self.attention.num_heads % (self.attention.global_num_kv_heads or self.attention.num_kv_heads):
            raise ValueError(
                f"num_heads ({self.attention.num_heads}) must be a multiple of "
                f"global_num_kv_heads ({self.attention.global_num_kv_heads})"
            )
        if self.rope.rotary_dim is not None and (
            self.rope.rotary_dim % 2 or self.rope.rotary_dim > self.attention.head_dim
        ):
            raise ValueError(
                f"rotary_dim ({self.rope.rotary_dim}) must be even and at most head_dim ({self.attention.head_dim})"
            )
        if self.moe.router_groups > 1:
            if self.moe.num_experts % self.moe.router_groups or self.moe.num_experts // self.moe.router_groups < 2:
                raise ValueError(
                    f"num_experts ({self.moe.num_experts}) must be router_groups ({self.moe.router_groups}) "
                    f"groups of at least 2 experts"
                )
            if self.moe.router_group_top > self.moe.router_groups:
                raise ValueError(
                    f"router_group_top ({self.moe.router_group_top}) exceeds router_groups ({self.moe.router_groups})"
                )
            if self.moe.experts_per_token > self.moe.router_group_top * (
                self.moe.num_experts // self.moe.router_groups
            ):
                raise ValueError(
                    f"experts_per_token ({self.moe.experts_per_token}; config.json num_experts_per_tok) exceeds the "
                    f"experts of router_group_top ({self.moe.router_group_top}; topk_group) groups"
                )
        if self.mla.index_topk is not None and (
            self.mla.q_lora_rank is None or self.mla.index_head_dim < self.mla.rope_head_dim
        ):
            raise ValueError(
                "index_topk (sparse attention) needs kv_lora_rank and q_lora_rank (its indexer reads the "
                f"compressed query) and index_head_dim ({self.mla.index_head_dim}) >= "
                f"rope_head_dim ({self.mla.rope_head_dim})"
            )
        if self.mla.kv_lora_rank is None:
            if self.mla.q_lora_rank is not None or self.mla.v_head_dim is not None:
                raise ValueError("q_lora_rank and v_head_dim need kv_lora_rank (multi-head latent attention)")
            return self
        if self.attention.num_kv_heads != self.attention.num_heads:
            raise ValueError(
                f"multi-head latent attention has num_kv_heads = num_heads ({self.attention.num_heads}), "
                f"got {self.attention.num_kv_heads}"
            )
        if self.mla.rope_head_dim % 2 or self.mla.rope_head_dim >= self.attention.head_dim:
            raise ValueError(
                f"rope_head_dim ({self.mla.rope_head_dim}) must be even and less than head_dim "
                f"({self.attention.head_dim}), the whole query/key head"
            )
        if self.mla.local is not None and (self.mla.local.q_lora_rank is None) != (self.mla.q_lora_rank is None):
            raise ValueError("mla.local.q_lora_rank must be set exactly when q_lora_rank is")
        return self

    @model_validator(mode="after")
    def _check_mixers(self) -> ModelConfig:
        if bool({"gated_delta", "kimi_delta"} & set(self.mixer_pattern or [])) != (self.gated_delta is not None):
            raise ValueError("gated_delta (the sizes) is set exactly when mixer_pattern has gated_delta layers")
        gd = self.gated_delta
        if "kimi_delta" in (self.mixer_pattern or []) and gd is not None:
            if (gd.num_key_heads, gd.key_head_dim) != (gd.num_value_heads, gd.value_head_dim):
                raise ValueError("kimi_delta layers have as many value heads as key heads, of the same width")
        if bool({"mamba2", "attention_mamba2", "zamba2_hybrid"} & set(self.mixer_pattern or [])) != (
            self.mamba2 is not None
        ):
            raise ValueError("mamba2 (the sizes) is set exactly when mixer_pattern has mamba2 layers")
        for kind in ("rglru", "lightning"):  # (short_conv's settings have defaults)
            if (kind in (self.mixer_pattern or [])) != (getattr(self, kind) is not None):
                raise ValueError(f"{kind} (the sizes) is set exactly when mixer_pattern has {kind} layers")
        if any(layer.mixer == layer.ffn == "none" for layer in self.layer_pattern()):
            raise ValueError("mixer_pattern and ffn_pattern leave a layer with neither a mixer nor a feed-forward")
        if self.moe.shared_gate and not self.moe.num_shared_experts:
            raise ValueError("shared_expert_gate needs num_shared_experts")
        if self.moe.shared_dim and not self.moe.num_shared_experts:
            raise ValueError("shared_expert_mlp_dim needs num_shared_experts")
        if "attention_mamba2" in (self.mixer_pattern or []) and self.is_mla:
            raise ValueError("attention_mamba2 layers (Falcon-H1) have grouped-query attention, not MLA")
        if self.attention.output_gate and self.is_mla:
            raise ValueError("attention_output_gate is a setting of grouped-query attention, not MLA")
        return self

    @model_validator(mode="after")
    def _check_gpt_era(self) -> ModelConfig:
        if self.norm.kind == "rms" and self.norm.bias:
            raise ValueError("norm_bias needs norm_kind layer (an RMSNorm has no bias)")
        if self.norm.kind == "layer" and self.attention.qk_norm_across_heads:
            raise ValueError("qk_norm_across_heads is an RMSNorm over all heads; norm_kind layer has none")
        if self.block.residual != "sequential" and (self.block.post_norms or not self.block.pre_norms):
            raise ValueError(
                f"residual {self.block.residual} adds pre-normed sublayers: pre_norms true, post_norms false"
            )
        if self.attention.qk_norm_per_head and not (self.attention.qk_norm and self.norm.kind == "layer"):
            raise ValueError("qk_norm_per_head (a LayerNorm per head) needs qk_norm and norm_kind layer")
        if self.embedding.position_offset and self.positions != "learned":
            raise ValueError("position_offset is the row offset of learned position embeddings (positions: learned)")
        return self

    @model_validator(mode="after")
    def _check_gate_sparsity(self) -> ModelConfig:
        sparsity = self.mlp.gate_sparsity
        if sparsity is not None and (len(sparsity) != self.num_layers or not all(0 <= s < 1 for s in sparsity)):
            raise ValueError(f"activation_sparsity needs one value in [0, 1) per layer ({self.num_layers})")
        return self

    @model_validator(mode="after")
    def _check_kv_sharing(self) -> ModelConfig:
        if not self.attention.kv_shared_layers:
            if self.mlp.kv_shared_wide:
                raise ValueError("kv_shared_wide_mlp needs kv_shared_layers")
            return self
        if (
            self.is_mla
            or self.mixer_pattern
            or self.attention.qkv_bias
            or self.attention.qk_norm_across_heads
            or self.is_moe
        ):
            raise ValueError("kv_shared_layers is a setting of dense grouped-query attention models (Gemma 4)")
        first, local = self.num_layers - self.attention.kv_shared_layers, self.layer_is_local()
        if first <= 0 or set(local[first:]) - set(local[:first]):
            raise ValueError(
                f"kv_shared_layers ({self.attention.kv_shared_layers}): each sharing layer needs an earlier layer "
                "of its attention kind (local or global) that is not sharing"
            )
        return self

    @model_validator(mode="after")
    def _check_index_sharing(self) -> ModelConfig:
        shared = self.mla.index_shared_layers
        if shared is None:
            return self
        if self.mla.index_topk is None or self.mixer_pattern or self.mtp_layers:
            raise ValueError("index_shared_layers needs sparse attention (index_topk) in every layer and no mtp_layers")
        if sorted(set(shared)) != shared or not all(0 < i < self.num_layers for i in shared):
            raise ValueError(
                f"index_shared_layers {shared} must be distinct, increasing layer indices from 1 to "
                f"{self.num_layers - 1} (layer 0 has no earlier selection to reuse)"
            )
        return self

    @model_validator(mode="after")
    def _check_output_vocab(self) -> ModelConfig:
        if self.head.vocab_size is not None and (self.head.vocab_size > self.vocab_size or self.tie_embeddings):
            raise ValueError("output_vocab_size must be at most vocab_size, with untied embeddings (its own LM head)")
        return self

    @model_validator(mode="after")
    def _check_attention_variants(self) -> ModelConfig:
        a = self.attention
        if a.value_dim is not None and (self.is_mla or a.value_dim > a.head_dim):
            raise ValueError("attention_value_dim is grouped-query attention's, at most head_dim (MLA: v_head_dim)")
        if a.local_sinks_only and not a.sinks:
            raise ValueError("local_sinks_only needs attention_sinks")
        if ("block_sparse" in (self.mixer_pattern or [])) != (self.block_indexer is not None):
            raise ValueError("block_indexer (the sizes) is set exactly when mixer_pattern has block_sparse layers")
        indexer = self.block_indexer
        if indexer is not None and (indexer.heads != a.num_kv_heads or self.is_mla):
            raise ValueError("block_sparse layers are grouped-query attention with an indexer head per KV head")
        if indexer is not None and indexer.local_blocks > indexer.topk_blocks:  # they are among the top k
            raise ValueError("block_indexer.local_blocks must be at most topk_blocks")
        if indexer is not None and indexer.head_dim < (self.rope.rotary_dim or a.head_dim):
            raise ValueError(f"block_indexer.head_dim ({indexer.head_dim}) must be at least the rotary width")
        if ("qsa" in (self.mixer_pattern or [])) != (self.qsa is not None):
            raise ValueError("qsa (the indexer's sizes) is set exactly when mixer_pattern has qsa layers")
        if self.qsa is not None and (self.qsa.budget % self.qsa.block or self.is_mla):
            raise ValueError("qsa layers are grouped-query attention whose qsa.budget is a multiple of qsa.block")
        if self.qsa is not None and self.qsa.head_dim < (self.rope.rotary_dim or a.head_dim):
            raise ValueError(f"qsa.head_dim ({self.qsa.head_dim}) must be at least the rotary width")
        ngram = self.ngram_embedding
        if ngram is not None and (self.gated_residual is None or self.vocab_size > 1 << 32):
            raise ValueError("ngram_embedding needs gated_residual streams and a vocabulary below 2**32")
        if ngram is not None and not all(0 <= i < self.num_layers for i in ngram.layers):
            raise ValueError(f"ngram_embedding.layers {ngram.layers} must be layers below {self.num_layers}")
        if ngram is not None and ngram_primes(ngram.vocab_base, 0, 1)[0] * 2 > 1 << 28:
            raise ValueError("ngram_embedding.vocab_base must be below 2**27 (the hash's modulus in 32 bits)")
        return self

    @model_validator(mode="after")
    def _check_zamba2(self) -> ModelConfig:
        if ("zamba2_hybrid" in (self.mixer_pattern or [])) != (self.zamba2 is not None):
            raise ValueError("zamba2 (the shared blocks) is set exactly when mixer_pattern has zamba2_hybrid layers")
        return self

    @model_validator(mode="after")
    def _check_mamba1(self) -> ModelConfig:
        if ("mamba1" in (self.mixer_pattern or [])) != (self.mamba1 is not None):
            raise ValueError("mamba1 (the sizes) is set exactly when mixer_pattern has mamba1 layers")
        return self

    @model_validator(mode="after")
    def _check_xielu(self) -> ModelConfig:
        if self.mlp.activation == "xielu" and (self.mlp.gated or self.is_moe or self.embedding.per_layer_input_dim):
            raise ValueError("activation xielu (Apertus) is taken by a dense MLP without a gate only (mlp_gated false)")
        return self

    @property
    def is_mla(self) -> bool:
        return self.mla.kv_lora_rank is not None

    @property
    def value_head_dim(self) -> int:
        """Width of a value head (MLA's v_head_dim, else head_dim)."""
        return self.mla.v_head_dim or self.attention.head_dim

    def layer_pattern(self) -> list[Layer]:
        """Every layer as data, in order: the decoder is this list (transformer.py runs it)."""
        mixer: Literal["attention", "mla"] = "mla" if self.is_mla else "attention"
        ffn_pattern = self.ffn_pattern or ["moe"]
        rope_pattern = self.rope.pattern or [True]
        layers = []
        mixer_pattern = self.mixer_pattern or ["attention"]
        for i, local in enumerate(self.layer_is_local()):
            moe = self.is_moe and i >= self.moe.first_dense_layers and ffn_pattern[i % len(ffn_pattern)] == "moe"
            stack = "dense_blocks" if self.is_moe and not moe else "blocks"
            kind = mixer_pattern[i % len(mixer_pattern)]
            if kind == "compressed_attention":  # DeepSeek-V4: a stack per attention kind and routing
                assert self.compressed_attention is not None
                compressed, hashed = self.compressed_attention.layer_types[i], i < self.moe.hash_layers
                name = f"{compressed}_{'hash_' if hashed else ''}blocks"
                layers.append(Layer(name, kind, "moe", False, True, compressed=compressed, hashed=hashed))
                continue
            if kind == "zamba2_hybrid":  # Zamba2: each its own stack (its adapters' names are its call's)
                call = sum(mixer_pattern[j % len(mixer_pattern)] == kind for j in range(i))
                layers.append(Layer(f"zamba2_hybrid_{call}_blocks", kind, "none", False, False, shared_call=call))
                continue
            if "none" in (kind, ffn_pattern[i % len(ffn_pattern)]):  # a layer that is its mixer or its MLP
                ffn: Literal["mlp", "moe", "none"] = (
                    "none" if ffn_pattern[i % len(ffn_pattern)] == "none" else "moe" if moe else "mlp"
                )
                attention = kind == "attention"
                only = ffn if kind == "none" else "attention" if attention else kind
                rope = attention and rope_pattern[i % len(rope_pattern)]
                stack = f"{only}_only_blocks"
                layers.append(Layer(stack, mixer if attention else kind, ffn, attention and local, rope))
                continue
            if kind != "attention":  # another mixer kind: stacks of its own, no window, no RoPE but Falcon-H1's
                rope = kind == "attention_mamba2" and rope_pattern[i % len(rope_pattern)]
                layers.append(Layer(f"{kind}_{stack}", kind, "moe" if moe else "mlp", False, rope))
                continue
            shape: dict[str, Any] = {}  # Layer's per-layer fields with values other than their defaults
            if not local and self.attention.has_global_shape:  # Gemma 4: global heads of their own shape
                stack = "global_" + stack
                shape = dict(
                    head_dim=self.attention.global_head_dim,
                    kv_heads=self.attention.global_num_kv_heads,
                    values_from_keys=self.attention.global_values_from_keys,
                )
            if local and self.is_mla and self.mla.local is not None:  # Dots3: local MLA of its own sizes
                stack = "local_" + stack
            rope = rope_pattern[i % len(rope_pattern)]
            if self.attention.pattern[i % len(self.attention.pattern)] == "chunked":
                shape["chunked"] = True
            layers.append(Layer(stack, mixer, "moe" if moe else "mlp", local, rope, **shape))
        return self._ngram_layers(self._share_index(self._share_kv(layers)))

    def _ngram_layers(self, layers: list[Layer]) -> list[Layer]:
        """ngram_embedding.layers: each in a stack of its own (its table's size is its own)."""
        for k, i in enumerate(self.ngram_embedding.layers if self.ngram_embedding else []):
            layers[i] = layers[i]._replace(stack=f"ngram_{k}_" + layers[i].stack, ngram=k)
        return layers

    def _ngram_spec(self, layer: Layer) -> NGramEmbeddingSpec | None:
        e = self.ngram_embedding
        if e is None or layer.ngram is None:
            return None
        heads = (e.order - 1) * e.heads_per_order
        primes = ngram_primes(e.vocab_base, layer.ngram * heads, heads)
        return NGramEmbeddingSpec(
            order=e.order,
            heads_per_order=e.heads_per_order,
            dim=e.dim,
            conv_kernel=e.conv_kernel,
            primes=primes,
            rows=-(-sum(primes) // e.vocab_multiple) * e.vocab_multiple,
            multipliers=ngram_multipliers(self.vocab_size, e.order, layer.ngram, e.seed),
            eos_token_id=e.eos_token_id,
            norm_eps=self.norm.eps,
        )

    def _share_index(self, layers: list[Layer]) -> list[Layer]:
        """index_shared_layers: those layers without an indexer, in stacks of their own."""
        for i in self.mla.index_shared_layers or []:
            layers[i] = layers[i]._replace(stack="index_shared_" + layers[i].stack, index_shared=True)
        return layers

    def layer_specs(self) -> list[LayerSpec]:
        """Every layer as its typed spec (engine/models/specs.py), in order: what the decoder
        builds and runs. The one place this config's fields become layers."""
        key = self.model_dump_json()
        if key not in _LAYER_SPECS:
            if len(_LAYER_SPECS) >= 64:
                _LAYER_SPECS.pop(next(iter(_LAYER_SPECS)))
            _LAYER_SPECS[key] = tuple(
                with_layer_decays(self._sparse_gates([self._layer_spec(layer) for layer in self.layer_pattern()]))
            )
        return list(_LAYER_SPECS[key])

    def _norm_spec(self) -> NormSpec:
        return self.norm

    def _layer_spec(self, layer: Layer) -> LayerSpec:
        ffn: MLPSpec | MoESpec | None = None
        if layer.ffn == "mlp":
            ffn = self._mlp_spec(layer.mlp_dim or self.mlp.dim)
        elif layer.ffn == "moe":
            ffn = self._moe_spec()
            if layer.hashed:
                ffn = ffn.model_copy(update={"hash_vocab": self.vocab_size})
        hc = self.hyper_connections
        shortcut = self.block.shortcut_moe and layer.ffn == "moe"  # LongCat-Flash: the experts beside
        if shortcut:
            ffn = self._mlp_spec(layer.mlp_dim or self.mlp.dim)
        return LayerSpec(
            stack=layer.stack,
            mixer=self._mixer_spec(layer),
            ffn=ffn,
            norm=self._norm_spec(),
            pre_norms=self.gated_residual is None  # (Qwen4-Exp: the connections norm their streams)
            and (self.block.pre_norms or (self.block.linear_pre_norms and layer.mixer != "attention"))
            and layer.mixer != "zamba2_hybrid",  # (Zamba2's hybrid layer norms inside, zamba2.py)
            post_norms=self.block.post_norms and not (self.block.linear_pre_norms and layer.mixer != "attention"),
            residual_multiplier=self.block.residual_multiplier,
            layer_scale=self.block.layer_scale,
            per_layer_input_dim=self.embedding.per_layer_input_dim,
            per_layer_activation=self.mlp.activation,
            residual=self.block.residual,
            residual_scales=self._residual_scales(layer),
            hyper=None if hc is None else HyperConnectionSpec(**hc.model_dump(), norm_eps=self.norm.eps),
            laurel=None if self.block.laurel_rank is None else LaurelSpec(rank=self.block.laurel_rank),
            altup=None if self.altup is None else AltUpSpec(**self.altup.model_dump(), norm_eps=self.norm.eps),
            shortcut_moe=self._moe_spec() if shortcut else None,
            shortcut_close=self.block.shortcut_moe and layer.ffn == "mlp",
            gated_residual=self._gated_residual_spec(),
            ngram_embedding=self._ngram_spec(layer),
        )

    def _gated_residual_spec(self) -> GatedResidualSpec | None:
        gr = self.gated_residual
        return None if gr is None else GatedResidualSpec(streams=gr.streams, rank=gr.rank, norm_eps=self.norm.eps)

    def _sparse_gates(self, specs: list[LayerSpec]) -> list[LayerSpec]:
        """mlp.gate_sparsity: each layer's MLP with its sparsity (Gemma 3n's first layers)."""
        for i, sparsity in enumerate(self.mlp.gate_sparsity or []):
            ffn = specs[i].ffn
            if sparsity and isinstance(ffn, MLPSpec):
                specs[i] = specs[i].model_copy(update={"ffn": ffn.model_copy(update={"gate_sparsity": sparsity})})
        return specs

    def _residual_scales(self, layer: Layer) -> tuple[float, float, float, float] | None:
        """MiniMax's (mixer alpha, beta, ffn alpha, beta) for the layer's mixer kind."""
        r = self.normed_residual
        if r is None:
            return None
        lightning = layer.mixer == "lightning"
        mixer = (r.lightning_alpha, r.lightning_beta) if lightning else (r.attention_alpha, r.attention_beta)
        return (*mixer, r.mlp_alpha, r.mlp_beta)

    def _mlp_spec(self, dim: int) -> MLPSpec:
        mup = self.mup
        return MLPSpec(
            dim=dim,
            activation=self.mlp.activation,
            gated=self.mlp.gated,
            gate_multiplier=1.0 if mup is None else mup.mlp_gate,
            down_multiplier=1.0 if mup is None else mup.mlp_down,
            bias=self.mlp.bias,
            swiglu_limit=self.moe.swiglu_limit if self.moe.clamp_dense else None,
            swiglu_alpha=self.moe.swiglu_alpha,
        )

    def _moe_spec(self) -> MoESpec:
        return MoESpec(
            num_experts=self.moe.num_experts,
            experts_per_token=self.moe.experts_per_token,
            expert_dim=self.moe_mlp_dim,
            activation=self.mlp.activation,
            gated=self.mlp.gated,
            router_score=self.moe.router_score,
            router_renormalize=self.moe.router_renormalize,
            router_bias=self.moe.router_bias,
            router_logits_bias=self.moe.router_logits_bias,
            router_groups=self.moe.router_groups,
            router_group_top=self.moe.router_group_top,
            router_group_score=self.moe.router_group_score,
            router_scale=self.moe.router_scale,
            router_scales_input=self.moe.router_scales_input,
            router_input_norm=self.moe.router_input_norm,
            router_expert_scale=self.moe.router_expert_scale,
            router_norm_eps=self.norm.eps,
            router_softcap=self.moe.router_softcap,
            clamp_shared=self.moe.clamp_dense,
            zero_experts=self.moe.zero_experts,
            expert_bias=self.moe.expert_bias,
            swiglu_limit=self.moe.swiglu_limit,
            swiglu_alpha=self.moe.swiglu_alpha,
            swiglu_shift=self.moe.swiglu_shift,
            num_shared_experts=self.moe.num_shared_experts,
            shared_dim=self.shared_mlp_dim,
            shared_expert_gate=self.moe.shared_gate,
            shared_scale=self.moe.shared_scale,
            output_bias=self.moe.output_bias,
            beside=self._mlp_spec(self.mlp.dim) if self.moe.beside_mlp else None,
            sparsemixer_eps=self.moe.sparsemixer_eps,
        )

    def _rotary(self, local: bool) -> RotarySpec:
        if local and self.rope.local_theta is not None:  # local layers: their own base, unscaled (Gemma 3)
            return RotarySpec(
                theta=self.rope.local_theta,
                rotary_dim=self.rope.local_rotary_dim or self.rope.rotary_dim,
                interleave=self.rope.interleave,
            )
        return RotarySpec(
            theta=self.rope.theta,
            scaling=self.rope.scaling,
            rotary_dim=self.rope.rotary_dim,
            interleave=self.rope.interleave,
        )

    def _attention_spec(self, layer: Layer) -> AttentionSpec:
        h = layer.head_dim or self.attention.head_dim
        qk_norm: Literal["none", "head", "across_heads", "per_head"] = "none"
        if self.attention.qk_norm:
            qk_norm = (
                "across_heads"
                if self.attention.qk_norm_across_heads
                else "per_head"
                if self.attention.qk_norm_per_head
                else "head"
            )
        return AttentionSpec(
            num_heads=self.attention.num_heads,
            num_kv_heads=layer.kv_heads or self.attention.num_kv_heads,
            head_dim=h,
            qkv_bias=self.attention.qkv_bias,
            out_bias=self.attention.out_bias,
            qk_norm=qk_norm,
            norm=self._norm_spec(),
            values_from_keys=layer.values_from_keys,
            output_gate=self.attention.output_gate,
            sinks=self.attention.sinks and (layer.local or not self.attention.local_sinks_only),
            head_gate=self.attention.head_gate,
            head_gate_activation=self.attention.head_gate_activation,
            kv_sharing=layer.kv_sharing,
            rope=self._rotary(layer.local) if layer.rope and self.positions == "rope" else None,
            window=self.attention.sliding_window if layer.local else None,
            chunk=self.attention.chunk_size if layer.chunked else None,
            scale=self.attention.scale or (self.attention.query_pre_attn_scalar or h) ** -0.5,
            softcap=self.attention.softcap,
            value_norm=self.attention.value_norm,
            qk_l2_norm=self.attention.qk_l2_norm,
            key_multiplier=1.0 if self.mup is None else self.mup.key,
            temperature_floor=self.attention.temperature_floor,
            temperature_scale=self.attention.temperature_scale,
            qkv_clip=self.attention.qkv_clip,
            alibi=self.positions == "alibi",
            qk_norm_after_rope=self.attention.qk_norm_after_rope,
            query_position_scale=self.attention.query_position_scale,
            query_position_period=(
                self.rope.scaling.original_max_position
                if self.attention.query_position_scale is not None and self.rope.scaling
                else 1
            ),
            value_head_dim=self.attention.value_dim,
            value_scale=self.attention.value_scale,
        )

    def _mixer_spec(self, layer: Layer):
        """The layer's sequence mixer spec (None for a layer without one)."""
        if layer.mixer == "none":
            return None
        if layer.mixer == "attention" and self.attention.experts:  # JetMoE's mixture of attention heads
            return MixtureOfAttentionSpec(
                attention=self._attention_spec(layer),
                num_experts=self.attention.experts,
                experts_per_token=self.moe.experts_per_token,
            )
        if layer.mixer == "attention":
            return self._attention_spec(layer)
        if layer.mixer == "block_sparse":  # MiniMax-M3: attention with a block indexer (block_sparse.py)
            assert self.block_indexer is not None  # _check_attention_variants
            attention = self._attention_spec(layer._replace(mixer="attention", rope=self.positions == "rope"))
            return attention.model_copy(update={"block_indexer": BlockIndexerSpec(**self.block_indexer.model_dump())})
        if layer.mixer == "qsa":  # Qwen4-Exp: attention with a pooled-block indexer (qsa.py)
            assert self.qsa is not None  # _check_attention_variants
            attention = self._attention_spec(layer._replace(mixer="attention", rope=self.positions == "rope"))
            return attention.model_copy(update={"qsa_indexer": QSAIndexerSpec(**self.qsa.model_dump())})
        if layer.mixer == "mla":
            assert self.mla.kv_lora_rank is not None
            indexer = None
            shape = self.mla.local if layer.local else None  # Dots3's local layers: their sizes, no indexer
            if self.mla.index_topk is not None and shape is None:
                indexer = IndexerSpec(
                    topk=self.mla.index_topk,
                    heads=self.mla.index_heads,
                    head_dim=self.mla.index_head_dim,
                    rope_interleave=self.mla.index_rope_interleave,
                    shared=layer.index_shared,
                    rope_last=self.mla.index_rope_last,
                    key_norm_eps=self.mla.index_norm_eps or 1e-6,
                )
            rotary = RotarySpec(theta=self.rope.theta, scaling=self.rope.scaling, interleave=self.rope.interleave)
            if layer.local and self.rope.local_theta is not None:  # local layers: their own base, unscaled
                rotary = RotarySpec(theta=self.rope.local_theta, interleave=self.rope.interleave)
            spec = MLASpec(
                num_heads=self.attention.num_heads,
                head_dim=self.attention.head_dim,
                rope_head_dim=self.mla.rope_head_dim,
                value_head_dim=self.value_head_dim,
                kv_lora_rank=self.mla.kv_lora_rank,
                q_lora_rank=self.mla.q_lora_rank,
                rope=rotary if layer.rope else None,
                window=self.attention.sliding_window if layer.local else None,
                indexer=indexer,
                scale=mla_score_scale(self.attention.head_dim, self.rope.scaling),
                head_gate=self.attention.head_gate,
                sinks=self.attention.sinks,
                output_gate=self.mla.output_gate,
                lora_scale=self.mla.lora_scale,
                key_norm_eps=self.norm.eps if self.mla.key_norm else None,
                latent_norm_eps=self.mla.latent_norm_eps or 1e-6,
            )
            if shape is None:
                return spec
            return spec.model_copy(
                update=dict(
                    num_heads=shape.num_heads,
                    head_dim=shape.head_dim,
                    rope_head_dim=shape.rope_head_dim,
                    value_head_dim=shape.v_head_dim,
                    kv_lora_rank=shape.kv_lora_rank,
                    q_lora_rank=shape.q_lora_rank,
                    scale=shape.head_dim**-0.5,
                )
            )
        if layer.mixer == "compressed_attention":
            ca = self.compressed_attention
            assert ca is not None and layer.compressed is not None
            ratio = {"sliding_attention": 0, "compressed_sparse_attention": ca.csa_ratio}.get(
                layer.compressed, ca.hca_ratio
            )
            return CompressedAttentionSpec(
                num_heads=self.attention.num_heads,
                head_dim=self.attention.head_dim,
                rope_head_dim=ca.rope_head_dim,
                q_lora_rank=ca.q_lora_rank,
                out_groups=ca.out_groups,
                out_rank=ca.out_rank,
                window=ca.window,
                compress_ratio=ratio,
                sparse=layer.compressed == "compressed_sparse_attention",
                index_topk=ca.index_topk,
                index_heads=ca.index_heads,
                index_head_dim=ca.index_head_dim,
                rope=RotarySpec(theta=self.rope.theta),
                compress_rope=RotarySpec(theta=ca.compress_rope_theta, scaling=ca.compress_rope_scaling),
                norm_eps=self.norm.eps,
            )
        if layer.mixer == "lightning":
            assert self.lightning is not None  # _check_mixers
            return LightningSpec(**self.lightning.model_dump())  # slope_factor: layer_specs, by depth
        if layer.mixer == "rglru":
            assert self.rglru is not None  # _check_mixers
            return RGLRUSpec(**self.rglru.model_dump())
        if layer.mixer == "short_conv":
            return ShortConvSpec(width=self.d_model, **(self.short_conv or ShortConvConfig()).model_dump())
        if layer.mixer in ("gated_delta", "kimi_delta"):
            gd = self.gated_delta
            assert gd is not None  # _check_mixers
            if layer.mixer == "kimi_delta":
                return KimiDeltaSpec(
                    num_heads=gd.num_key_heads,
                    head_dim=gd.key_head_dim,
                    conv_kernel=gd.conv_kernel,
                    norm_eps=self.norm.eps,
                    full_rank_gates=gd.full_rank_gates,
                    gate_lower_bound=gd.gate_lower_bound,
                )
            kda = {"norm_eps", "full_rank_gates", "gate_lower_bound"}
            return GatedDeltaSpec(**gd.model_dump(exclude=kda), norm_eps=gd.norm_eps or self.norm.eps)
        if layer.mixer == "mamba1":
            assert self.mamba1 is not None  # _check_mamba1
            return Mamba1Spec(**self.mamba1.model_dump())
        m = self.mamba2
        assert m is not None  # _check_mixers
        mup = self.mup
        mamba2 = Mamba2Spec(
            **m.model_dump(),
            norm_eps=self.norm.eps,
            projection_multipliers=(1.0,) * 5 if mup is None else mup.ssm_projections,
        )
        if layer.mixer == "mamba2":
            return mamba2
        if layer.mixer == "zamba2_hybrid":  # Zamba2: a shared block's call, then Mamba2 (zamba2.py)
            return self._zamba2_spec(layer, mamba2)
        assert layer.mixer == "attention_mamba2"
        return ParallelHybridSpec(
            attention=self._attention_spec(layer._replace(mixer="attention")),
            mamba2=mamba2,
            attention_in=1.0 if mup is None else mup.attention_in,
            attention_out=1.0 if mup is None else mup.attention_out,
            ssm_in=1.0 if mup is None else mup.ssm_in,
            ssm_out=1.0 if mup is None else mup.ssm_out,
        )

    def _zamba2_spec(self, layer: Layer, mamba2: Mamba2Spec) -> Zamba2HybridSpec:
        z = self.zamba2
        assert z is not None and layer.shared_call is not None  # _check_zamba2
        return Zamba2HybridSpec(
            attention=self._attention_spec(layer._replace(mixer="attention", rope=z.rope)),
            mamba2=mamba2,
            norm=self._norm_spec(),
            mlp_dim=self.mlp.dim,
            activation=self.mlp.activation,
            adapter_rank=z.adapter_rank,
            attention_adapters=z.attention_adapters,
            block=layer.shared_call % z.shared_blocks,
        )

    def _share_kv(self, layers: list[Layer]) -> list[Layer]:
        """Gemma 4's KV sharing (kv_shared_layers): the last layers `reuse` the keys and values
        of the last earlier layer of their kind, which `store`s them (transformers' kv_sharing_modes)."""
        first = self.num_layers - self.attention.kv_shared_layers
        if not self.attention.kv_shared_layers or first <= 0:
            return layers
        wide = 2 * self.mlp.dim if self.mlp.kv_shared_wide else None
        for i in range(first, self.num_layers):
            layers[i] = layers[i]._replace(stack="kv_shared_" + layers[i].stack, kv_sharing="reuse", mlp_dim=wide)
        for local in {layer.local for layer in layers[:first]}:
            last = max(i for i in range(first) if layers[i].local == local)
            layers[last] = layers[last]._replace(kv_sharing="store")
        return layers

    def mtp_layer(self) -> Layer:
        """The kind of the multi-token-prediction modules' layer, in `mtp_blocks`: the last
        layer's, with its experts (transformers' MtpModel builds it with first_k_dense_replace
        0), or the model's last layer of mtp_layer_kind's window with its feed-forward."""
        pattern = self.layer_pattern()
        kind = self.mtp_layer_kind
        if kind is None:
            return pattern[-1]._replace(stack="mtp_blocks", ffn="moe" if self.is_moe else pattern[-1].ffn)
        if pattern[-1].compressed is not None:  # DeepSeek-V4: its sliding_attention layer, scored routing
            compressed = "sliding_attention" if kind.local else pattern[-1].compressed
            return pattern[-1]._replace(stack="mtp_blocks", ffn=kind.ffn, compressed=compressed, hashed=False)
        like = next((layer for layer in reversed(pattern) if layer.local == kind.local), pattern[-1])
        if kind.mixer is not None:  # MiniMax-M3: the last layer of that mixer
            like = next((layer for layer in reversed(pattern) if layer.mixer == kind.mixer), like)
            like = like._replace(mixer=kind.mixer)
        return like._replace(stack="mtp_blocks", ffn=kind.ffn, local=kind.local, mlp_dim=None)

    def mtp_layer_spec(self) -> LayerSpec:
        """The multi-token-prediction module's layer as a spec (mtp_layer's kind)."""
        return self._layer_spec(self.mtp_layer())

    def mtp_head_names(self) -> list[str]:
        """The params key of each multi-token-prediction module's own parameters (mtp.MTPHead),
        in order: `mtp`, `mtp_1`, ..."""
        return ["mtp"] + [f"mtp_{k}" for k in range(1, self.mtp_layers)]

    def mtp_stacks(self) -> list[tuple[str, tuple[int, ...]]]:
        """(params key, HF layer indices) of the multi-token-prediction layers: layer_stacks'
        form for the tensor table (model.layers.{num_layers}. ...); empty without them."""
        if not self.mtp_layers:
            return []
        return [("mtp_blocks", tuple(range(self.num_layers, self.num_layers + self.mtp_layers)))]

    def layer_stacks(self) -> list[tuple[str, tuple[int, ...]]]:
        """(params key, the model's layers in it, in order) of each stack of like layers, in the
        order of their first layer: `blocks` alone, or with experts also the dense layers'
        `dense_blocks` (DeepSeek-V3's first layers, or interleaved: Qwen3-MoE's)."""
        stacks: dict[str, list[int]] = {}
        for i, layer in enumerate(self.layer_pattern()):
            stacks.setdefault(layer.stack, []).append(i)
        return [(name, tuple(indices)) for name, indices in stacks.items()]

    @property
    def is_moe(self) -> bool:
        return self.moe.num_experts > 0

    @property
    def moe_mlp_dim(self) -> int:
        """Width of one expert's MLP."""
        return self.moe.expert_dim or self.mlp.dim

    @property
    def shared_mlp_dim(self) -> int:
        """Width of the shared experts' gated MLP (0 without shared experts)."""
        return self.moe.shared_dim or self.moe_mlp_dim * self.moe.num_shared_experts

    def layer_is_local(self) -> list[bool]:
        """Per layer: does it use sliding-window attention?"""
        pattern = self.attention.pattern
        return [pattern[i % len(pattern)] == "local" for i in range(self.num_layers)]

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        """Parameters; `active`: only those one token computes with (its k experts of each
        layer). Each layer's spec counts its own (engine/models/specs.py)."""
        d, specs = self.d_model, self.layer_specs()
        norm = specs[0].norm.params(d)
        n = sum(spec.params(d, active) for spec in specs) + norm  # the layers and the final norm
        if (gated := self._gated_residual_spec()) is not None:  # Qwen4-Exp: the streams' final mix, no final norm
            n += gated.params(d, inject=False) - norm
        n += norm * self.embedding.norm + self.vocab_size * self.head.bias
        if include_embedding:
            n += (self.vocab_size + (0 if self.tie_embeddings else self.head.vocab_size or self.vocab_size)) * d
            n += (self.max_seq_len + self.embedding.position_offset) * d * (self.positions == "learned")
        if self.embedding.per_layer_input_dim:  # the model's projection and norm, and the per-layer embedding
            width = self.num_layers * self.embedding.per_layer_input_dim
            rows = self.embedding.per_layer_vocab_size or self.vocab_size
            n += d * width + self.embedding.per_layer_input_dim + rows * width * include_embedding
        if self.mtp_layers:  # a layer like the last (experts), its two input norms, the (2d, d) projection, a norm
            mtp = self.mtp_layer_spec()
            n += self.mtp_layers * (mtp.params(d, active) + 2 * d * d + 3 * d)
            if self.mtp_layer_kind is not None and self.mtp_layer_kind.shared_final_norm:  # the model's
                n -= self.mtp_layers * norm
            if self.hyper_connections:  # DeepSeek-V4: each module's own final mix of the streams
                streams = self.hyper_connections.streams
                n += self.mtp_layers * (streams * streams * d + streams + 1)
        if self.hyper_connections:  # the streams' final mix (hyper_connection.HyperHead)
            streams = self.hyper_connections.streams
            n += streams * streams * d + streams + 1
        if self.altup:  # the streams' projections in and out (altup.AltUpStreams)
            n += 2 * (self.altup.streams - 1) * d * d
        if self.zamba2:  # Zamba2's shared blocks, counted once (each layer's spec counts its own)
            hybrid = next(spec.mixer for spec in specs if isinstance(spec.mixer, Zamba2HybridSpec))
            n += self.zamba2.shared_blocks * hybrid.shared_params(d)
        return n


class ComputeConfig(Strict):
    """How a run computes with a model: none of it changes what the parameters mean.

    `scan_layers` alone changes their layout (stacked or per layer), so a checkpoint restores
    under the value it was saved with; everything else may differ from the checkpoint's."""

    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Storage dtype of the parameters (and so of the optimizer's moments, unless the run's
    optimizer.moment_dtype sets theirs)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of matmuls; norms, softmax and the loss stay in float32."""
    scan_layers: bool = True
    scan_unroll: Literal["auto"] | int = "auto"
    """Layers per iteration of the layer scan (jax.lax.scan's `unroll`; the parameters keep
    their stacked layout either way). auto = the whole stack for bfloat16 compute on CPU,
    where XLA:CPU runs the unrolled step ~8% faster for ~0.1 GB more memory; else 1, one
    compiled layer however deep the model (the fastest compile; in float32 on CPU unrolling
    gained nothing measurable and took 0.5 GB more at the benchmark shape,
    docs/benchmarks.md). Ignored without scan_layers."""
    remat: Literal["none", "full", "save_dots", "save_qkv_proj"] = "none"
    """Which activations the backward pass recomputes (none = keep all)."""

    attention_impl: Impl = "auto"
    """Attention in training and prefill (engine/ops/attention.py; the names are
    engine/ops/attention_names.py's): auto picks by platform (cpu: cpu_kernel, the C++ kernel
    engine/ops/cpu_kernels/train_attention.cc, on one device of a CPU with AVX-512, where it
    is faster, else blocked; gpu cudnn; tpu splash) and falls back to blocked, with a
    warning, where that kernel cannot take the model (cudnn: softcap, float32, head_dim,
    attention sinks; splash: seq_len % 128; cpu_kernel: softcap, sinks, head_dim % 16, a
    kernel that cannot be built); a named one that cannot is an error. reference: the plain
    masked softmax (tests)."""
    decode_attention_impl: DecodeImpl = "auto"
    """Attention of a decode step (one query per row against the KV cache; engine/ops/attention.py):
    cpu_kernel = the C++ kernel engine/ops/cpu_kernels/decode_attention.cc, compiled on first
    use; reference = XLA's lowering of the masked softmax; auto = cpu_kernel on a single CPU
    device where a C++ compiler builds it (else reference, with a warning), reference elsewhere."""
    attention_block: int = Field(128, ge=0)
    """Query block of `blocked` attention: blocks skip the masked upper triangle (and, on local
    layers, the keys left of the window). 0 means one block (the whole sequence)."""
    matmul_backward: Literal["auto", "cpu", "autodiff"] = "auto"
    """Backward pass of the model's matmuls (engine/ops/dense.py): cpu = hand-written, ordered for
    XLA:CPU; autodiff = JAX's, which accelerator compilers lay out themselves; auto = cpu when
    compiling for CPU, else autodiff. The same numbers either way, up to summation order."""
    moe_dispatch: Literal["dropless", "capacity"] = "dropless"
    """How tokens reach their experts (engine/models/moe.py): dropless = sorted by expert and
    one grouped matmul (jax.lax.ragged_dot), no token dropped; capacity = fixed (expert,
    capacity) buffers, GShard-style, which shard over the `expert` mesh axis and drop the
    assignments past an expert's capacity."""
    moe_capacity_factor: float = Field(1.25, gt=0)
    """capacity only: each expert takes ceil(factor * seq_len * k / num_experts) assignments
    of each sequence."""
    moe_balance_loss: float = Field(0.01, ge=0)
    """Weight in the training loss of the router's load-balancing loss (Switch Transformer's
    E * sum_e f_e * P_e, which is k when balanced; transformers' router_aux_loss_coef)."""
    moe_router_z_loss: float = Field(0.001, ge=0)
    """Weight of the router z-loss, the mean squared log-normaliser of the router logits (ST-MoE)."""
    weight_grad_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype in which the dense layers' weight gradients are produced, and so reduced over the
    devices that split the batch (engine/ops/dense.py): float32, or bfloat16 as MaxText's are
    (half the bytes of the gradient all-reduce/reduce-scatter per step; docs/benchmarks.md).
    Only a bfloat16 `dtype` has anything to round; the parameters' update stays in param_dtype."""
    mtp_loss: float = Field(0.0, ge=0)
    """Weight in the training loss of the multi-token-prediction loss (a model with
    mtp_layers; DeepSeek-V3 trained with 0.3, then 0.1; MaxText's mtp_loss_scaling_factor):
    the mean over its modules of each one's mean cross entropy (module k predicting token
    i + k + 2; engine/models/mtp.py). 0: the modules are not run (and get no gradient)."""
    matmul_precision: Literal["default", "fp8", "int8"] = "default"
    """Recipe of the layers' trainable matmuls (engine/ops/low_precision.py, qwix): default =
    in `dtype`; fp8 = e4m3 operands and e5m2 gradients, int8 = int8 forward and backward
    (quantization-aware training), both with current absmax scaling per channel. The LM head,
    the MoE router and experts and attention's QK/PV products stay in `dtype`."""
    indexer_loss: Literal["none", "warmup", "sparse"] = "none"
    """How a sparse-attention model (ModelConfig.mla.index_topk) trains its lightning indexer
    (engine/models/dsa.py; DeepSeek-V3.2's recipe, arXiv 2512.02556): none = not at all (the
    selection is applied, the indexer gets no gradient); warmup = dense warm-up: attention
    stays dense, only the indexer's weights change (engine/train/optimizer.py freezes the
    rest), by the KL from the main attention's head-summed distribution over every visible
    key to the indexer's softmax; sparse = each query attends to its top-k keys, every
    weight trains on the LM loss and the indexer on the same KL over the selected keys,
    its inputs detached so neither loss reaches the other's weights."""
    indexer_loss_weight: float = Field(1.0, gt=0)
    """Weight of that KL (its mean over layers and query tokens) in the training loss
    (MaxText's indexer_loss_scaling_factor)."""
    pipeline_microbatches: int = Field(0, ge=0)
    """With a `pipeline` mesh axis of S stages (MeshConfig.pipeline): the micro-batches each
    step's rows are split into for the GPipe schedule (engine/ops/pipeline.py; bubble
    (S - 1) / (M + S - 1)). 0: S. Without a pipeline axis it does nothing."""
    indexer_ties: Literal["first", "torch_cpu"] = "first"
    """Which keys a sparse-attention model's indexer (engine/models/dsa.py) selects among those
    whose score ties with its k-th (they tie at exactly 0 where every indexer head's ReLU is 0,
    as few heads make common): first = the earliest (XLA's top_k); torch_cpu = those
    torch.topk takes on CPU, as transformers' indexer does there (libstdc++'s selection order,
    engine/ops/torch_cpu_topk.py; partly sequential, so slower): for parity checks with it."""

    @field_validator("scan_unroll", mode="before")
    @classmethod
    def _layers_per_iteration(cls, value):
        if value == "auto" or (type(value) is int and value >= 1):  # not True: a bool is an int
            return value
        raise ValueError("'auto' or a number of layers >= 1")


LORA_TARGETS = LLAMA_ORDER
"""PEFT's Llama and Gemma 4 module names; a family's own names (GPT-NeoX's query_key_value,
DeepSeek's kv_b_proj, ...) come from its tensor table (engine/models/lora_targets.py)."""


class LoraConfig(Strict):
    """A low-rank adapter on the frozen base (LoRA, arXiv 2106.09685; PEFT's LoraConfig):
    each targeted projection computes x.W + scale * (x.A).B, A Kaiming-uniform and B zero at
    the start, so a fresh adapter changes nothing. Only A and B train."""

    rank: int = Field(8, gt=0)
    """r, the adapter's inner width (PEFT `r`)."""
    alpha: float = Field(8.0, gt=0)
    """The update is scaled by alpha / rank (alpha / sqrt(rank) with use_rslora); PEFT `lora_alpha`."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input in training steps (PEFT `lora_dropout`; inverted, as
    torch's); evaluation and sampling drop nothing. Masks are drawn per row from the run's
    seed and the step, so they do not depend on the mesh and a resumed run redraws them."""
    target_modules: list[str] | Literal["all-linear"] = Field(default_factory=lambda: ["q_proj", "v_proj"])
    """PEFT's module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; with
    Gemma 4's per-layer inputs per_layer_input_gate, per_layer_projection and
    per_layer_model_projection) or `all-linear` (every one of them the model has; never the LM
    head, as PEFT). The default is PEFT's for Llama-shaped models."""
    use_rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(rank) (arXiv 2312.03732)."""
    base_dtype: Literal["float32", "bfloat16", "int8", "nf4"] | None = None
    """How the frozen base is held during training: None keeps the checkpoint's parameter
    dtype; bfloat16 halves it; int8 and nf4 (QLoRA) store its attention and MLP projections
    quantized with qwix (engine/models/quantize.py). The adapter and its optimizer state
    stay in the run's compute.param_dtype."""

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, value):
        if value == "all-linear":
            return value
        if not value:
            raise ValueError("at least one module to adapt is needed")
        bad = [m for m in value if not m or not m.replace("_", "").isalnum()]
        if bad:
            raise ValueError(f"target module '{bad[0]}' is not a module name (PEFT's: q_proj, query_key_value, ...)")
        return sorted(set(value), key=lambda m: (LORA_TARGETS.index(m) if m in LORA_TARGETS else len(LORA_TARGETS), m))

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def targets(self, model: ModelConfig) -> tuple[str, ...]:
        """The modules (PEFT's names) this adapter puts weights on in `model`: those of
        target_modules the engine adapts there, in the order of `all-linear`'s; a ValueError
        naming one it cannot (a mixture of experts' experts, and its dense layers and shared
        experts with them; a projection stored in a layout LoRA does not adapt) or that the
        model does not have."""
        modules, refused = adaptable_modules(model)
        can = ", ".join(modules) or "none of its projections"
        if self.target_modules == "all-linear":
            wanted = tuple(modules)
        else:
            wanted = tuple(m for m in modules if m in self.target_modules)
            experts = [m for m in self.target_modules if refused.get(m) == "experts"]
            if experts:
                raise ValueError(
                    f"family '{model.family}' is a mixture of experts: LoRA on its experts ({', '.join(experts)}) "
                    f"is not supported; target {can}"
                )
            for m in self.target_modules:
                if refused.get(m) == "peft":
                    why = get_family(model.family).peft_refuses[m]
                    raise ValueError(
                        f"family '{model.family}' cannot adapt {m} as PEFT would ({why}); it can adapt: {can}"
                    )
                if m in refused:
                    raise ValueError(
                        f"family '{model.family}' stores {m} in a layout LoRA does not adapt (part of a tensor "
                        f"another projection shares, or one tensor per expert); it can adapt: {can}"
                    )
                if m not in modules:
                    raise ValueError(f"family '{model.family}' has no module {m} to adapt; it can adapt: {can}")
        if not wanted:
            raise ValueError(f"none of target_modules can be adapted in family '{model.family}'")
        if self.dropout and any(w in FOLDED for w in adapted_weights(model, wanted)):
            raise ValueError(
                f"lora.dropout must be 0 with kv_b_proj in family '{model.family}': its adapter is folded into "
                "the latent attention's absorbed weights, where no dropout applies"
            )
        return wanted

    def weights(self, model: ModelConfig) -> dict[str, str]:
        """{engine weight the adapter puts factors on: the weight whose A it uses} in `model`
        (engine/models/lora_targets.py)."""
        return adapted_weights(model, self.targets(model))
