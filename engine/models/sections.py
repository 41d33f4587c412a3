"""The sections of a ModelConfig: one typed config per kind of layer part (attention, RoPE,
MLP, experts, latent attention, the residual block) and per model-wide part (embedding, head).

A section describes the model's layers of its kind: ModelConfig.layer_specs() turns the
sections and the layer layout (attention.pattern, rope.pattern, mixer_pattern, ffn_pattern,
moe.first_dense_layers, attention.kv_shared_layers) into one engine/models/specs.py spec per
layer, which is what the decoder builds and runs. The sections of the Gated DeltaNet, Mamba2 and
muP layers are GatedDeltaConfig, Mamba2Config and MuPMultipliers (config.py).

Every field had a flat name before the sections existed (`num_heads`, `router_scale`, ...):
engine/flat_keys.py maps them, so configs, presets and checkpoints written flat still read.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.config import Strict
from engine.models.rope_scaling import RopeScaling
from engine.models.specs import Activation

AttentionKind = Literal["global", "local", "chunked"]
"""How a layer's attention sees the keys: all earlier, a sliding window, or its chunk."""
_ALL_GLOBAL: list[AttentionKind] = ["global"]


class AttentionConfig(Strict):
    """The attention layers (grouped-query attention; with ModelConfig.mla set, the query and
    key-value heads of multi-head latent attention)."""

    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    """Grouped-query attention: each KV head serves num_heads / num_kv_heads query heads."""
    head_dim: int = Field(gt=0)
    """Independent of d_model / num_heads."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2)."""
    out_bias: bool = False
    """A bias on the attention output projection (GPT-OSS; with qkv_bias, attention_bias)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on queries and keys, before RoPE (Qwen3, Gemma 3)."""
    qk_norm_across_heads: bool = False
    """With qk_norm: one RMSNorm over all heads' dimensions of the projected queries (keys),
    scales (heads * head_dim), instead of one over head_dim shared by the heads (OLMo 2)."""
    qk_norm_per_head: bool = False
    """With qk_norm and norm kind layer: each head's queries (keys) get a LayerNorm over head_dim
    with a scale of their own and no bias (StableLM 2 12B's and Cohere's QK norms)."""
    qk_norm_after_rope: bool = False
    """With qk_norm: the norms apply to the rotated queries and keys, not before RoPE (Hunyuan
    dense's query_layernorm, key_layernorm)."""
    qk_l2_norm: bool = False
    """On RoPE layers, queries and keys are divided by their root mean square over head_dim
    (the norm's eps inside, no scale) after RoPE (Llama 4's use_qk_norm); NoPE layers have none."""
    pattern: list[AttentionKind] = Field(default_factory=lambda: _ALL_GLOBAL.copy(), min_length=1)
    """Layer i attends as pattern[i % len]; local = sliding window, chunked = within chunks of
    chunk_size positions (Llama 4: [chunked, chunked, chunked, global]). Mistral: [local];
    Gemma 2: [local, global]; Gemma 3: five local then one global."""
    sliding_window: int | None = Field(None, gt=0)
    """Local layers see this many most recent positions, the query's own included."""
    chunk_size: int | None = Field(None, gt=0)
    """Chunked layers attend within chunks of this many positions: query i sees key j iff
    j <= i and i // size == j // size, i and j positions in the document (Llama 4)."""
    query_pre_attn_scalar: float | None = Field(None, gt=0)
    """Attention scores are scaled by query_pre_attn_scalar**-0.5 (None: head_dim, as usual)."""
    scale: float | None = Field(None, gt=0)
    """Attention scores are multiplied by this (Granite's attention_multiplier); None: as
    query_pre_attn_scalar says."""
    softcap: float | None = Field(None, gt=0)
    """Attention scores become cap * tanh(scores / cap) before masking (Gemma 2)."""
    sinks: bool = False
    """A learned logit per query head that joins each softmax's denominator and no value
    (GPT-OSS): a head may attend to nothing."""
    output_gate: bool = False
    """Attention's output is multiplied by sigmoid(x . W_gate) per head and dimension before
    o_proj (Qwen3-Next): the query projection yields each head's query and gate side by side,
    wq_dnh of shape (d, heads, 2 head_dim)."""
    value_norm: bool = False
    """An RMSNorm without a scale on the values, over head_dim (Gemma 4)."""
    qkv_clip: float | None = Field(None, gt=0)
    """Queries, keys and values clamped to [-clip, clip] after their projections (OLMo 1, DBRX)."""
    temperature_floor: int | None = Field(None, gt=0)
    """NoPE layers multiply their queries by 1 + temperature_scale * log(1 + floor((p + 1) /
    temperature_floor)), p the query's position (Llama 4's attn_temperature_tuning with
    floor_scale, arXiv 2501.19399); None: no such scaling."""
    temperature_scale: float = Field(0.1, ge=0)
    """That scaling's strength (Llama 4's attn_scale)."""
    query_position_scale: float | None = Field(None, ge=0)
    """Every layer multiplies its rotated queries by 1 + query_position_scale * log(1 + floor(p /
    rope.scaling.original_max_position)), p the query's position (Ministral 3's
    llama_4_scaling_beta); None: no such scaling."""
    global_head_dim: int | None = Field(None, gt=0)
    """Head width of the global (non-sliding) layers (Gemma 4, whose global layers form a stack
    of their own, `global_blocks`); None: head_dim."""
    global_num_kv_heads: int | None = Field(None, gt=0)
    """Key/value heads of the global layers; None: num_kv_heads."""
    global_values_from_keys: bool = False
    """The global layers have no value projection: their values are the key projection,
    taken before the key norm and RoPE (Gemma 4's attention_k_eq_v)."""
    kv_shared_layers: int = Field(0, ge=0)
    """The last this many layers project no keys or values: each attends with those of the last
    earlier layer of its attention kind (Gemma 4's num_kv_shared_layers; config.Layer.kv_sharing)."""
    head_gate: bool = False
    """Each head's output times sigmoid(x . w), a learned scalar gate per head and token from the
    layer's input, before o_proj (LFM3's g_proj)."""
    head_gate_activation: Literal["sigmoid", "softplus"] = "sigmoid"
    """With head_gate: the gate's activation, sigmoid (LFM3) or softplus (Laguna's g_proj)."""
    value_dim: int | None = Field(None, gt=0)
    """The value heads' width where it differs from head_dim (at most it; MiMo-V2-Flash's
    v_head_dim, 128 under 192-wide queries and keys); None: head_dim."""
    value_scale: float = Field(1.0, gt=0)
    """The values are multiplied by this after their projection (MiMo-V2-Flash's attention_value_scale)."""
    local_sinks_only: bool = False
    """With sinks: only the sliding-window layers have them, the global layers (a stack of
    their own, `global_blocks`) none (MiMo-V2-Flash)."""
    experts: int = Field(0, ge=0)
    """A mixture of attention heads (JetMoE; engine/models/moa.py): each attention layer's query
    and output projections are this many experts, moe.experts_per_token of them per token, each
    num_kv_heads heads wide (num_heads = num_kv_heads * experts_per_token); 0: plain attention."""

    @property
    def has_global_shape(self) -> bool:
        """The global layers' attention differs in its parameters (Gemma 4): a stack of their own."""
        return bool(
            self.global_head_dim or self.global_num_kv_heads or self.global_values_from_keys or self.local_sinks_only
        )


class RopeConfig(Strict):
    """Rotary position embedding of the attention layers (ModelConfig.positions rope)."""

    theta: float = Field(10000.0, gt=0)
    scaling: RopeScaling | None = None
    local_theta: float | None = Field(None, gt=0)
    """RoPE base of local layers, unscaled (Gemma 3). None: theta and scaling."""
    rotary_dim: int | None = Field(None, gt=0)
    """RoPE rotates only the first rotary_dim dimensions of each query/key head, its
    frequencies those of a rotary_dim-wide head (GLM-4.5's partial_rotary_factor: head_dim / 2);
    None: all of head_dim."""
    pattern: list[bool] | None = Field(None, min_length=1)
    """Layer i rotates queries and keys iff pattern[i % len]; None: every layer. SmolLM3: three
    RoPE layers then a NoPE one ([true, true, true, false])."""
    interleave: bool = False
    """RoPE rotates adjacent pairs (x0, x1), (x2, x3), ... instead of (first half, second half)
    pairs (DeepSeek-V3's MLA checkpoints; Llama 4's attention)."""
    local_rotary_dim: int | None = Field(None, gt=0)
    """The local (sliding-window) layers' rotary width where it differs from rotary_dim (Laguna:
    whole heads there, half on its global layers); None: rotary_dim."""
    mrope_section: list[int] | None = None
    """Qwen3.5's multimodal RoPE: how many rotary frequencies the time, height and width
    position axes each take (rope_parameters.mrope_section). Text positions are equal on the
    three axes, so the engine's RoPE is plain RoPE whatever it says; kept so that an export,
    and a multimodal one's vision positions, have it back. None: transformers' default
    [11, 11, 10]."""


class BlockConfig(Strict):
    """How each layer wraps its mixer and feed-forward: norms and residual form."""

    pre_norms: bool = True
    """Normalise each sublayer's input (pre-norm). False with post_norms: only the outputs are
    normalised, x + norm(attn(x)) (OLMo 2)."""
    post_norms: bool = False
    """Also normalise each sublayer's output before the residual add (Gemma 2/3)."""
    residual: Literal["sequential", "parallel", "parallel_shared_norm"] = "sequential"
    """How a layer adds its sublayers (engine/models/specs.py: LayerSpec.residual)."""
    residual_multiplier: float | None = Field(None, gt=0)
    """Each sublayer's output is multiplied by this before the residual add (Granite)."""
    layer_scale: bool = False
    """A learned scalar per layer multiplying the residual stream after the layer (Gemma 4's
    layer_scalar)."""
    laurel_rank: int | None = Field(None, gt=0)
    """LAuReL beside each layer's attention, of this rank (Gemma 3n's laurel_rank;
    engine/models/laurel.py); None: none."""
    linear_pre_norms: bool = False
    """Layers whose mixer is not attention are pre-norm only, x + mixer(norm(x)), whatever
    pre_norms and post_norms say of the attention layers (OLMo Hybrid: post-norm attention
    layers, pre-norm Gated DeltaNet ones)."""
    shortcut_moe: bool = False
    """LongCat-Flash's pairs of layers: the expert layers (ffn_pattern moe) run a dense MLP and,
    on its input, the experts, whose output joins the stream at the end of the next layer, a
    dense one (LayerSpec.shortcut_moe, shortcut_close)."""


class MLPConfig(Strict):
    """The dense feed-forward layers (and the activation of the experts and per-layer inputs)."""

    dim: int = Field(gt=0)
    """The MLP's hidden width (intermediate_size)."""
    activation: Activation = "silu"
    """Gate of the gated MLP: silu = SwiGLU (Llama, Qwen, Mistral), gelu_tanh = GeGLU (Gemma);
    relu2 = relu(x)^2, the activation of Nemotron-H's MLP, which is not gated; gelu (exact) and
    relu those of GPT-era MLPs; xielu = xIELU with two learned scalars per layer
    (engine/models/xielu.py; Apertus's ungated dense MLP, the only place it is taken)."""
    gated: bool = True
    """The MLP is down(act(gate(x)) * up(x)); false: down(act(up(x))), no gate (Nemotron-H; its
    experts and shared expert too)."""
    bias: bool = False
    """Biases on the MLP's projections."""
    kv_shared_wide: bool = False
    """The KV-sharing layers' MLP (attention.kv_shared_layers) is 2 * dim wide (Gemma 4's
    use_double_wide_mlp)."""
    gate_sparsity: list[float] | None = None
    """Per layer, the Gaussian top-k sparsity of the MLP's gate (Gemma 3n's
    activation_sparsity_pattern; MLPSpec.gate_sparsity), one value per layer; None: all 0."""


class MoEConfig(Strict):
    """A mixture of experts (engine/models/moe.py): a layer's MLP becomes `num_experts` gated
    MLPs of width expert_dim, each token routed to `experts_per_token` of them. num_experts 0:
    a dense MLP in every layer, and the rest of this section unused."""

    num_experts: int = Field(0, ge=0)
    """Routed experts per layer; 0 = a dense MLP (mlp.dim) in every layer."""
    experts_per_token: int = Field(2, gt=0)
    """Top-k: the experts each token is sent to (Mixtral 2, Qwen3-MoE 8)."""
    expert_dim: int | None = Field(None, gt=0)
    """Width of each expert's MLP; None: mlp.dim (Mixtral). Qwen3-MoE: moe_intermediate_size."""
    router_score: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"
    """Per-expert routing scores from the router logits: softmax over experts (Mixtral, Qwen)
    or an independent sigmoid each (DeepSeek-V3)."""
    router_renormalize: bool = True
    """Rescale the k chosen scores to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob)."""
    router_bias: bool = False
    """A learned per-expert bias added to the scores to choose the experts but not to weight
    them (DeepSeek-V3's auxiliary-loss-free balancing)."""
    router_logits_bias: bool = False
    """A learned per-expert bias added to the router logits (a Linear's bias, GPT-OSS): it both
    chooses the experts and weights them, unlike router_bias."""
    router_groups: int = Field(1, gt=0)
    """Group-limited routing (DeepSeek-V3's n_group): the experts form this many equal groups,
    each scored as router_group_score says, and a token's k experts come from its
    router_group_top best groups. 1: no groups."""
    router_group_top: int = Field(1, gt=0)
    """The groups a token may be routed into (DeepSeek-V3's topk_group)."""
    router_group_score: Literal["top2_sum", "max"] = "top2_sum"
    """With router_groups: what scores a group, the sum of its two best (biased) scores
    (DeepSeek-V3's noaux_tc) or its best score (DeepSeek-V2's group_limited_greedy)."""
    router_scale: float = Field(1.0, gt=0)
    """The routed experts' weights are multiplied by this after any renormalisation
    (DeepSeek-V3's routed_scaling_factor)."""
    router_scales_input: bool = False
    """The routing weight multiplies each chosen expert's input instead of its output (Llama 4:
    expert(w * x), not w * expert(x); the two differ as the experts are not linear)."""
    router_input_norm: bool = False
    """The router reads RMSNorm(x) without a scale, times a learned scale (d_model) and
    d_model**-0.5 (Gemma 4)."""
    router_expert_scale: bool = False
    """A learned factor per expert on its routing weight, after renormalisation (Gemma 4)."""
    sparsemixer_eps: float | None = Field(None, gt=0)
    """SparseMixer routing (PhiMoE, arXiv 2409.12136) at inference, with this jitter epsilon:
    the k experts are the best, then the best of the rest, ..., each weighted by a softmax
    over the logits still in play within a relative 2 * eps of that expert's (engine/models/moe.py:
    sparsemixer); None: the usual softmax top-k."""
    expert_bias: bool = False
    """Biases on each expert's gate, up and down projections (GPT-OSS)."""
    swiglu_limit: float | None = Field(None, gt=0)
    """The experts' clamped SwiGLU (GPT-OSS): gate clamped above at the limit, up to [-limit,
    limit], out = (up + 1) * gate * sigmoid(swiglu_alpha * gate). None: activation(gate) * up."""
    swiglu_alpha: float = Field(1.702, gt=0)
    """Sigmoid gain of that clamped SwiGLU (swiglu_limit set only)."""
    swiglu_shift: float = 1.0
    """The clamped SwiGLU's up + shift (swiglu_limit set): 1 GPT-OSS's, 0 DeepSeek-V4's."""
    num_shared_experts: int = Field(0, ge=0)
    """Experts every token goes through, as one gated MLP of num_shared_experts * expert_dim
    added to the routed output (DeepSeek)."""
    shared_dim: int | None = Field(None, gt=0)
    """Width of the shared experts' one gated MLP; None: num_shared_experts * expert_dim
    (Granite 4's shared_mlp: shared_intermediate_size)."""
    shared_gate: bool = False
    """The shared experts' output is multiplied by sigmoid(x . w), a learned scalar gate per
    token (Qwen3-Next's shared_expert_gate)."""
    shared_scale: float = Field(1.0, gt=0)
    """With shared experts: their output is multiplied by this before it joins the routed one
    (Cohere 2 MoE's `average` combination, (routed + shared) / 2: 0.5, with router_scale 0.5)."""
    first_dense_layers: int = Field(0, ge=0)
    """The first this many layers have a dense MLP (mlp.dim) instead, and form a layer stack of
    their own, `dense_blocks` (DeepSeek-V3's first_k_dense_replace)."""
    beside_mlp: bool = False
    """Each expert layer also runs the dense MLP (mlp.dim) beside the experts, on its usual
    pre-norm; each output gets its own norm and their sum the layer's post-MLP norm. The
    experts read their own pre-norm of the residual, the router the residual itself (Gemma 4)."""
    output_bias: bool = False
    """A learned bias on the mixture's output (JetMoE)."""
    zero_experts: int = Field(0, ge=0)
    """Zero-computation experts beside the routed ones (LongCat-Flash's zero_expert_num): chosen
    like any expert, each adds its weight times the token itself."""
    clamp_dense: bool = True
    """With swiglu_limit: the shared experts and the dense MLP layers take the clamped SwiGLU
    too (MiniMax-M3, DeepSeek-V4); False: only the routed experts do (HY-V4)."""
    router_softcap: float | None = Field(None, gt=0)
    """The router logits become cap * tanh(logits / cap) before scoring (Laguna's
    moe_router_logit_softcapping); None: as they are."""
    hash_layers: int = Field(0, ge=0)
    """The first hash_layers layers' experts are hash-routed: a token's experts are a fixed
    table's row for its id (DeepSeek-V4, engine/models/hash_routing.py)."""


class MLAShape(Strict):
    """The sizes of the sliding-window layers' latent attention where they differ from the
    others' (MLAConfig.local; Dots3's SWA layers: 64 heads over 1024-wide latents beside 128
    heads over 512)."""

    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    """A query/key head's whole width, its last rope_head_dim dimensions rotary."""
    rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)
    kv_lora_rank: int = Field(gt=0)
    q_lora_rank: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _check_rope(self) -> MLAShape:
        if self.rope_head_dim % 2 or self.rope_head_dim >= self.head_dim:
            raise ValueError(
                f"mla.local.rope_head_dim ({self.rope_head_dim}) must be even and less than head_dim ({self.head_dim})"
            )
        return self


class MLAConfig(Strict):
    """Multi-head latent attention (engine/models/mla.py; DeepSeek-V2/V3) when kv_lora_rank is
    set: keys and values are up-projected per head from one compressed latent per position,
    plus a rotary key shared by the heads. attention.head_dim is then a query/key head's whole
    width, its last rope_head_dim dimensions rotary. With index_topk, DeepSeek Sparse Attention
    (engine/models/dsa.py; DeepSeek-V3.2, GLM-5)."""

    kv_lora_rank: int | None = Field(None, gt=0)
    """Width of the compressed key-value latent; None: grouped-query attention."""
    q_lora_rank: int | None = Field(None, gt=0)
    """Width of the compressed query (with its RMSNorm); None: queries projected directly."""
    rope_head_dim: int = Field(64, gt=0)
    """The rotary part of each query/key head (qk_rope_head_dim)."""
    v_head_dim: int | None = Field(None, gt=0)
    """Width of each value head; None: attention.head_dim."""
    index_topk: int | None = Field(None, gt=0)
    """A lightning indexer: each query attends only to the index_topk earlier keys its indexer
    scores highest (every one while there are no more); None: dense attention."""
    index_heads: int = Field(64, gt=0)
    """The indexer's query heads (index_n_heads)."""
    index_head_dim: int = Field(128, gt=0)
    """Width of the indexer's query heads and its one key (index_head_dim), the first
    rope_head_dim of them rotary."""
    index_rope_interleave: bool = False
    """The indexer's RoPE rotates adjacent pairs (GLM-5), else halves (DeepSeek-V3.2)."""
    output_gate: bool = False
    """Each head's output times sigmoid(x . W_gate) per value dimension before o_proj, W_gate a
    projection of its own (HY-V4's gate_proj). Sinks: attention.sinks."""
    lora_scale: bool = False
    """Queries times sqrt(d_model / q_lora_rank), the normed latent times sqrt(d_model /
    kv_lora_rank) (LongCat-Flash)."""
    index_rope_last: bool = False
    """The indexer's RoPE rotates the last rope_head_dim dimensions of its queries and key, not
    the first (HY-V4)."""
    index_norm_eps: float | None = Field(None, gt=0)
    """The indexer's key LayerNorm epsilon; None: 1e-6, as DeepSeek-V3.2's (HY-V4's: rms_norm_eps)."""
    index_shared_layers: list[int] | None = None
    """Sparse-attention layers that run no indexer and attend to the keys the last earlier
    layer's indexer selected (GLM-5's indexer_types "shared"; transformers passes that layer's
    top-k indices on). Layer 0 runs its own. None: every layer selects for itself."""
    key_norm: bool = False
    """An RMSNorm (norm.eps) on the shared rotary key before RoPE (Dots3's k_rope_only_layernorm)."""
    local: MLAShape | None = None
    """The sliding-window (local) layers' sizes, in a stack of their own (`local_blocks`), where
    they differ from the others' (Dots3); such layers have no indexer and rotate at rope.local_theta.
    None: every layer has the sizes above."""
    latent_norm_eps: float | None = Field(None, gt=0)
    """The query and key-value latents' RMSNorm epsilon; None: 1e-6, DeepSeek's whatever
    norm.eps is (Dots3's: rms_norm_eps)."""
    nominal_head_dim: int | None = Field(None, gt=0)
    """config.json's head_dim where it is not the query/key width (Dots3's 256 over 192-wide
    heads, from which transformers derives only its rotary fraction, qk_rope_head_dim /
    head_dim, i.e. rope_head_dim again): kept so that an export has it back. None: none."""


class EmbeddingConfig(Strict):
    """The token (and position) embeddings, before the first layer."""

    scale: bool = False
    """Multiply token embeddings by sqrt(d_model) (Gemma)."""
    multiplier: float | None = Field(None, gt=0)
    """Token embeddings are multiplied by this (Granite); None: not scaled (but see scale)."""
    norm: bool = False
    """A norm on the token embeddings before the first layer (BLOOM's word_embeddings_layernorm)."""
    position_offset: int = Field(0, ge=0)
    """Learned positions (ModelConfig.positions learned): the embedding of position p is row
    p + offset (OPT's 2)."""
    per_layer_input_dim: int | None = Field(None, gt=0)
    """Per-layer embeddings: after its MLP each layer adds norm(proj(act(gate(x)) * e)) to the
    stream, e its per_layer_input_dim-wide share of a second embedding of the token (num_layers
    shares per token) plus a projection of the first (Gemma 4's hidden_size_per_layer_input).
    None: none."""
    per_layer_vocab_size: int | None = Field(None, gt=0)
    """Rows of the per-layer embedding where fewer than vocab_size (Gemma 3n's
    vocab_size_per_layer_input): tokens past it read row 0. None: vocab_size."""


class HeadConfig(Strict):
    """The final norm and the LM head."""

    bias: bool = False
    """A bias on the LM head (GPT-J, Phi)."""
    softcap: float | None = Field(None, gt=0)
    """Output logits become cap * tanh(logits / cap) (Gemma 2)."""
    divisor: float | None = Field(None, gt=0)
    """Output logits are divided by this (Granite's logits_scaling)."""
    multiplier: float | None = Field(None, gt=0)
    """Output logits are multiplied by this (Cohere's logit_scale); None: not scaled."""
    vocab_size: int | None = Field(None, gt=0)
    """Rows of the LM head (the logits' width) where fewer than the model's vocab_size: the
    embedding rows past it are tokens the model reads but never predicts (Apertus 1.5's image
    and audio tokens, whose head rows its checkpoints prune). None: vocab_size."""
    norm_eps: float | None = Field(None, gt=0)
    """The final norm's epsilon, where it differs from the layers' norm.eps (JetMoE's layer norms
    keep 1e-6, its final one reads rms_norm_eps); None: norm.eps."""
