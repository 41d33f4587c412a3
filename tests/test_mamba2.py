"""The Mamba2 mixer module (engine/models/mamba2.py) against transformers 5.25's three Mamba2
layers it stands for (Mamba2Mixer, Nemotron-H's NemotronHMamba2Mixer, Granite 4's
GraniteMoeHybridMambaLayer), float32, odd sizes (6 heads of 7 in 3 groups, state 5, width 14),
37 tokens in chunks of 8, one row right-padded; its decoding state against a full forward; and
packed rows (segment ids) against each document run alone, chunked form and per-token scan.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine.models.config import ComputeConfig
from engine.models.mamba2 import Mamba2
from engine.ops import ssd
from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer  # noqa: E402
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer  # noqa: E402
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer  # noqa: E402

B, T, CHUNK = 2, 37, 8
HEADS, HEAD_DIM, GROUPS, STATE, WIDTH, EPS = 6, 7, 3, 5, 14, 1e-5
DIMS = ssd.Mamba2Dims(HEADS, HEAD_DIM, STATE, n_groups=GROUPS, conv_kernel=4, norm_eps=EPS)


def torch_mixer(kind: str, bias: bool):
    t = transformers
    if kind == "mamba2":
        config = t.Mamba2Config(
            hidden_size=WIDTH,
            expand=3,
            num_heads=HEADS,
            head_dim=HEAD_DIM,
            n_groups=GROUPS,
            state_size=STATE,
            chunk_size=CHUNK,
            use_bias=bias,
            layer_norm_epsilon=EPS,
            num_hidden_layers=1,
        )
        return Mamba2Mixer(config, layer_idx=0)
    if kind == "nemotron_h":
        config = t.NemotronHConfig(
            hidden_size=WIDTH,
            mamba_num_heads=HEADS,
            mamba_head_dim=HEAD_DIM,
            n_groups=GROUPS,
            ssm_state_size=STATE,
            chunk_size=CHUNK,
            use_bias=bias,
            layer_norm_epsilon=EPS,
            layers_block_type=["linear_attention"],
        )
        return NemotronHMamba2Mixer(config, layer_idx=0)
    config = t.GraniteMoeHybridConfig(
        hidden_size=WIDTH,
        mamba_expand=3,
        mamba_n_heads=HEADS,
        mamba_d_head=HEAD_DIM,
        mamba_n_groups=GROUPS,
        mamba_d_state=STATE,
        mamba_chunk_size=CHUNK,
        mamba_proj_bias=bias,
        rms_norm_eps=EPS,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    return GraniteMoeHybridMambaLayer(config, layer_idx=0)


def randomized(module, seed: int):
    """Every weight drawn again (norm weights around 1; A_log, dt_bias in their usual ranges)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1.0 + 0.2 * noise if name.startswith("norm") else 0.3 * noise)
        module.A_log.copy_(torch.log(torch.linspace(1.0, 6.0, HEADS)))
        module.dt_bias.copy_(torch.linspace(-4.0, 0.5, HEADS))
    return module.eval()


def engine_mixer(module, bias: bool) -> Mamba2:
    """The engine module with `module`'s weights."""
    ours = Mamba2(DIMS, WIDTH, ComputeConfig(), rngs=nnx.Rngs(0), bias=bias, chunk_size=CHUNK)
    weights = {name: np.asarray(p.detach().numpy()) for name, p in module.named_parameters()}
    values = {
        "w_in_dp": weights["in_proj.weight"].T,
        "conv_c1k": weights["conv1d.weight"],
        "conv_bias_c": weights["conv1d.bias"],
        "dt_bias_h": weights["dt_bias"],
        "a_log_h": weights["A_log"],
        "d_h": weights["D"],
        "norm_f": weights["norm.weight"],
        "w_out_fd": weights["out_proj.weight"].T,
    }
    if bias:
        values |= {"b_in_p": weights["in_proj.bias"], "b_out_d": weights["out_proj.bias"]}
    for name, value in values.items():
        assert getattr(ours, name)[...].shape == value.shape, name
        getattr(ours, name)[...] = jnp.asarray(value)
    return ours


def padded_batch(seed: int):
    x = np.random.default_rng(seed).normal(size=(B, T, WIDTH)).astype(np.float32)
    segments = np.ones((B, T), np.int32)
    segments[1, T - 6 :] = 0  # the second row right-padded
    return x, segments


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.mark.parametrize(("kind", "bias"), [("mamba2", True), ("nemotron_h", False), ("granitemoehybrid", True)])
def test_the_module_matches_transformers_mixer(kind, bias):
    module = randomized(torch_mixer(kind, bias), seed=len(kind))
    ours = engine_mixer(module, bias)
    x, segments = padded_batch(seed=3)
    with torch.no_grad():
        expected = module(torch.from_numpy(x), attention_mask=torch.from_numpy(segments)).numpy()
    out, _ = jax.jit(lambda x, s: ours.mix(x, s))(x, segments)
    valid = segments.astype(bool)
    assert np.abs(expected[valid]).max() > 0.1
    assert max_diff(out[valid], expected[valid]) <= 1e-5, kind


@pytest.fixture(scope="module")
def nemotron_mixer():
    return engine_mixer(randomized(torch_mixer("nemotron_h", False), seed=5), bias=False)


def test_a_prompt_then_decoded_tokens_leave_the_full_forwards_state(nemotron_mixer):
    """The state after a prompt (left-padded in one row, as the sampler pads) and N tokens
    decoded one at a time equals the state after one forward over the same tokens."""
    ours = nemotron_mixer
    x = np.random.default_rng(4).normal(size=(B, T, WIDTH)).astype(np.float32)
    segments = np.ones((B, T), np.int32)
    segments[1, :3] = 0
    prompt = 29
    full_out, full_state = jax.jit(lambda x, s: ours.mix(x, s))(x, segments)
    out, state = jax.jit(lambda x, s: ours.mix(x, s))(x[:, :prompt], segments[:, :prompt])
    step = jax.jit(lambda x_b1d, s, state: ours.mix(x_b1d, s, state))
    outputs = [out]
    for t in range(prompt, T):
        out, state = step(x[:, t : t + 1], segments[:, t : t + 1], state)
        outputs.append(out)
    assert max_diff(np.concatenate(outputs, axis=1)[segments.astype(bool)], full_out[segments.astype(bool)]) <= 1e-5
    assert max_diff(state.conv_bkc, full_state.conv_bkc) <= 1e-6
    assert max_diff(state.ssm_bhpn, full_state.ssm_bhpn) <= 1e-5
    assert np.abs(state.ssm_bhpn).max() > 0.1


@pytest.mark.parametrize("form", ["chunked", "scan"])
def test_packed_documents_each_start_afresh(form):
    """A packed row (documents 1, 2, 3, then padding, boundaries inside and at chunks' edges)
    gives each document the outputs it has alone in a row: no state or convolution input
    crosses a boundary."""
    rng = np.random.default_rng(6)
    params = {
        "w_in": rng.normal(size=(WIDTH, DIMS.inner + DIMS.conv_channels + HEADS)).astype(np.float32) * 0.3,
        "conv_kc": rng.normal(size=(4, DIMS.conv_channels)).astype(np.float32) * 0.3,
        "conv_bias": rng.normal(size=(DIMS.conv_channels,)).astype(np.float32) * 0.3,
        "dt_bias": np.linspace(-4.0, 0.5, HEADS).astype(np.float32),
        "a_log": np.log(np.linspace(1.0, 6.0, HEADS)).astype(np.float32),
        "d": rng.normal(size=(HEADS,)).astype(np.float32),
        "norm": np.ones(DIMS.inner, np.float32),
        "w_out": rng.normal(size=(DIMS.inner, WIDTH)).astype(np.float32) * 0.3,
    }
    bounds = [(0, 11), (11, 16), (16, 33)]  # 16 ends a chunk of 8
    x = rng.normal(size=(1, T, WIDTH)).astype(np.float32)
    segments = np.zeros((1, T), np.int32)
    for doc, (lo, hi) in enumerate(bounds, start=1):
        segments[0, lo:hi] = doc

    def mixer(x, segments):
        projected = jnp.asarray(x * (segments != 0)[..., None]) @ params["w_in"]
        y, _ = ssd.mamba2_inner(
            params, projected, DIMS, mask_bt=segments != 0, form=form, chunk_size=CHUNK, segment_ids_bt=segments
        )
        return y

    packed = jax.jit(mixer)(x, segments)
    for lo, hi in bounds:
        alone = mixer(x[:, lo:hi], np.ones((1, hi - lo), np.int32))
        assert max_diff(packed[:, lo:hi], alone) <= 1e-5, (lo, hi)
    # without the ids the later documents do read the earlier ones
    mixed = mixer(x, (segments != 0).astype(np.int32))
    assert max_diff(mixed[:, 11:16], mixer(x[:, 11:16], np.ones((1, 5), np.int32))) > 1e-3
