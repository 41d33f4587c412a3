"""Layer by layer against the transformers modules: norm, MLP, attention, block.

Where a full-model mismatch would be hard to place, these say which layer is wrong. Each
engine module gets the transformers module's weights through its family's tensor table
(engine/models/families), the same path conversion takes.
"""

from __future__ import annotations

import importlib

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.interop.hf.mapping import model_config_from_hf, tensor_table, to_engine  # noqa: E402
from engine.models.common import Build, RMSNorm  # noqa: E402
from engine.models.transformer import MLP, Attention, Block  # noqa: E402

COMMON = dict(
    vocab_size=37,
    hidden_size=30,
    intermediate_size=26,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
WINDOW = 4
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON),
    "gemma": lambda: transformers.GemmaConfig(**COMMON),
    "gemma2": lambda: transformers.Gemma2Config(
        **COMMON, sliding_window=WINDOW, query_pre_attn_scalar=12, attn_logit_softcapping=1.5
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **COMMON, sliding_window=WINDOW, query_pre_attn_scalar=12, sliding_window_pattern=2
    ),
}


def modeling(family: str):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def setup(family: str):
    """(HF config with eager attention, engine ModelConfig, ComputeConfig (float32), the
    modeling module)."""
    hf_cfg = CONFIGS[family]()
    hf_cfg._attn_implementation = "eager"
    return hf_cfg, *model_config_from_hf(hf_cfg.to_dict()), modeling(family)


def randomise(module) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn_like(p) + (0.0 if p.ndim > 1 else 0.2))


def load_into(engine_module, hf_module, cfg, prefix: tuple[str, ...], hf_prefix: str) -> None:
    """Copy hf_module's tensors into engine_module (the part of a block under `prefix`)."""
    _, per_layer = tensor_table(cfg)
    hf_state = {k: v.detach().numpy() for k, v in hf_module.state_dict().items()}
    state = nnx.state(engine_module, nnx.Param)
    pure = nnx.to_pure_dict(state)
    loaded = 0
    for spec in per_layer:
        if spec.path[: len(prefix)] != prefix:
            continue
        node = pure
        *parents, leaf = spec.path[len(prefix) :]
        for key in parents:
            node = node[key]
        name = spec.hf_name.format(i=0).removeprefix("model.layers.0.").removeprefix(hf_prefix)
        node[leaf] = jnp.asarray(to_engine(spec, hf_state.pop(name), node[leaf].shape))
        loaded += 1
    assert not hf_state, f"tensors left over: {sorted(hf_state)}"
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(engine_module, state)


def additive_mask(t: int, window: int | None, padding_b_t: np.ndarray) -> torch.Tensor:
    """transformers' 4-D eager mask: 0 where allowed, the dtype's minimum elsewhere."""
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    allowed = allowed[None] & padding_b_t[:, None, :].astype(bool)
    return torch.tensor(np.where(allowed, 0.0, np.finfo(np.float32).min)[:, None], dtype=torch.float32)


def hf_rope(family, hf_cfg, x, positions, local: bool):
    mod = modeling(family)
    rotary = getattr(mod, f"{family.capitalize()}RotaryEmbedding")(hf_cfg)
    if family == "gemma3":
        return rotary(x, positions, "sliding_attention" if local else "full_attention")
    return rotary(x, positions)


def inputs(seed: int = 0, b: int = 2, t: int = 11, d: int = 30):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(b, t, d)).astype(np.float32)
    segments = np.ones((b, t), np.int32)
    segments[1, 8:] = 0  # right padding on row 1
    return x, segments


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_rms_norm(family):
    hf_cfg, cfg, _, mod = setup(family)
    ref = getattr(mod, f"{family.capitalize()}RMSNorm")(30, eps=cfg.norm.eps)
    randomise(ref)
    ours = RMSNorm(30, cfg.norm.eps, jnp.float32, zero_centered=cfg.norm.zero_centered, rngs=nnx.Rngs(0))
    ours.scale[...] = jnp.asarray(ref.weight.detach().numpy())
    x, _ = inputs()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(x))), ref(torch.tensor(x)).detach().numpy(), atol=1e-5)


def layer_of(cfg, local: bool):
    """The spec of the model's first local (global) layer."""
    return next(spec for spec in cfg.layer_specs() if spec.local == local)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_mlp(family):
    hf_cfg, cfg, compute, mod = setup(family)
    ref = getattr(mod, f"{family.capitalize()}MLP")(hf_cfg)
    randomise(ref)
    ours = MLP(cfg.layer_specs()[0].ffn, Build.of(cfg, compute), rngs=nnx.Rngs(0))
    load_into(ours, ref, cfg, ("mlp",), "mlp.")
    x, _ = inputs()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(x))), ref(torch.tensor(x)).detach().numpy(), atol=1e-5)


@pytest.mark.parametrize(
    "family,local",
    [("llama", False), ("qwen2", False), ("qwen3", False), ("gemma2", True), ("gemma2", False), ("gemma3", True)],
)
def test_attention(family, local):
    hf_cfg, cfg, compute, mod = setup(family)
    ref = getattr(mod, f"{family.capitalize()}Attention")(hf_cfg, layer_idx=0 if local else 1).eval()
    randomise(ref)
    spec = layer_of(cfg, local)
    ours = Attention(spec.mixer, Build.of(cfg, compute), rngs=nnx.Rngs(0))
    load_into(ours, ref, cfg, ("attn",), "self_attn.")
    x, segments = inputs()
    t = x.shape[1]
    positions = torch.arange(t)[None].expand(2, t)
    rope = hf_rope(family, hf_cfg, torch.tensor(x), positions, local)
    mask = additive_mask(t, WINDOW if local else None, segments)
    expected = ref(torch.tensor(x), position_embeddings=rope, attention_mask=mask)[0].detach().numpy()
    got = np.asarray(ours(jnp.asarray(x), jnp.asarray(positions.numpy()), jnp.asarray(segments), spec.mixer))
    valid = segments.astype(bool)
    np.testing.assert_allclose(got[valid], expected[valid], atol=1e-5)


@pytest.mark.parametrize("family,local", [("llama", False), ("gemma2", True), ("gemma3", True), ("gemma3", False)])
def test_block(family, local):
    hf_cfg, cfg, compute, mod = setup(family)
    ref = getattr(mod, f"{family.capitalize()}DecoderLayer")(hf_cfg, layer_idx=0 if local else 1).eval()
    randomise(ref)
    spec = layer_of(cfg, local)
    ours = Block(spec, Build.of(cfg, compute), rngs=nnx.Rngs(0))
    load_into(ours, ref, cfg, (), "")
    x, segments = inputs()
    t = x.shape[1]
    positions = torch.arange(t)[None].expand(2, t)
    rope = hf_rope(family, hf_cfg, torch.tensor(x), positions, local)
    mask = additive_mask(t, WINDOW if local else None, segments)
    out = ref(torch.tensor(x), position_embeddings=rope, attention_mask=mask, position_ids=positions)
    expected = (out[0] if isinstance(out, tuple) else out).detach().numpy()
    got = np.asarray(ours(jnp.asarray(x), jnp.asarray(positions.numpy()), jnp.asarray(segments), spec))
    valid = segments.astype(bool)
    np.testing.assert_allclose(got[valid], expected[valid], atol=2e-5)
