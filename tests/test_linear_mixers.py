"""The linear-time sequence mixers of engine/ops (gated_delta.py, ssd.py) against their own
per-token recurrence and against transformers 5.25's torch code, float32, odd shapes.

- the chunked form equals the per-token lax.scan on lengths that are not a multiple of the
  chunk (and shorter than one chunk), from a non-zero start state;
- a prompt's forward plus N single-token steps leaves the same state (convolution window and
  recurrent state) and outputs as one forward over the whole sequence;
- gradients of the chunked form equal the scan's;
- the rule and the scan equal transformers' torch functions, and the whole mixer equals a tiny
  Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet / Mamba2Mixer with random weights copied in,
  one row right-padded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.ops import gated_delta, ssd
from tests.deps import need

torch = need("torch")
need("transformers")

from transformers import Mamba2Config, Qwen3NextConfig  # noqa: E402
from transformers.models.mamba2.modeling_mamba2 import (  # noqa: E402
    Mamba2Mixer,
    mamba2_chunk_scan,
    mamba2_selective_state_update,
)
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import (  # noqa: E402
    Qwen3NextGatedDeltaNet,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

TOL = 1e-5
# Odd sizes: 3 key heads serving 6 value heads, key dim 5, value dim 7; 37 tokens, chunks of 8.
B, T, HK, HV, DK, DV, CHUNK = 2, 37, 3, 6, 5, 7, 8
# Mamba2: 6 heads of dim 7 in 3 groups, state 5; model width 14 (expand 3).
HEADS, HEAD_DIM, GROUPS, STATE, WIDTH = 6, 7, 3, 5, 14


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def torch_of(x):
    return torch.from_numpy(np.asarray(x))


@pytest.fixture(scope="module")
def delta_inputs():
    """q, k, v, g, beta and a start state: decays spread over (-2.5, 0], beta over (0, 1)."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    g = -np.abs(normal(B, T, HV)) * 1.2
    beta = rng.uniform(0.05, 1.0, size=(B, T, HV)).astype(np.float32)
    return normal(B, T, HK, DK), normal(B, T, HK, DK), normal(B, T, HV, DV), g, beta, normal(B, HV, DK, DV)


@pytest.fixture(scope="module")
def ssd_inputs():
    """x, discretized dt, A, B, C, D and a start state."""
    rng = np.random.default_rng(1)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    dt_raw, dt_bias = normal(B, T, HEADS), normal(HEADS)
    a_h = -np.exp(normal(HEADS))
    return (
        normal(B, T, HEADS, HEAD_DIM),
        (dt_raw, dt_bias),
        a_h,
        normal(B, T, GROUPS, STATE),
        normal(B, T, GROUPS, STATE),
        normal(HEADS),
        normal(B, HEADS, HEAD_DIM, STATE),
    )


# ---- Gated DeltaNet: the rule ----


@pytest.mark.parametrize("time", [T, 5])
def test_gated_delta_chunked_equals_per_token_scan(delta_inputs, time):
    q, k, v, g, beta = (x[:, :time] for x in delta_inputs[:5])
    state = delta_inputs[5]
    out_chunked, state_chunked = gated_delta.gated_delta_chunked(q, k, v, g, beta, chunk_size=CHUNK, state_bhkv=state)
    out_scan, state_scan = gated_delta.gated_delta_scan(q, k, v, g, beta, state_bhkv=state)
    assert out_chunked.shape == (B, time, HV, DV)
    assert max_diff(out_chunked, out_scan) <= TOL
    assert max_diff(state_chunked, state_scan) <= TOL


def test_gated_delta_matches_transformers_functions(delta_inputs):
    q, k, v, g, beta, state = delta_inputs
    torch_args = [torch_of(x) for x in (q, k, v, g, beta)]
    common = dict(initial_state=torch_of(state), output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_chunk, ref_chunk_state = torch_chunk_gated_delta_rule(*torch_args, chunk_size=CHUNK, **common)
    ref_scan, ref_scan_state = torch_recurrent_gated_delta_rule(*torch_args, **common)
    out_chunked, state_chunked = gated_delta.gated_delta_chunked(q, k, v, g, beta, chunk_size=CHUNK, state_bhkv=state)
    out_scan, state_scan = gated_delta.gated_delta_scan(q, k, v, g, beta, state_bhkv=state)
    assert max_diff(out_chunked, ref_chunk.numpy()) <= TOL
    assert max_diff(state_chunked, ref_chunk_state.numpy()) <= TOL
    assert max_diff(out_scan, ref_scan.numpy()) <= TOL
    assert max_diff(state_scan, ref_scan_state.numpy()) <= TOL
    # One decoded token against transformers' decode path (its recurrent rule at t = 1).
    one = [x[:, :1] for x in torch_args]
    ref_step, ref_step_state = torch_recurrent_gated_delta_rule(*one, **common)
    out_step, step_state = gated_delta.gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    assert max_diff(out_step, ref_step[:, 0].numpy()) <= TOL
    assert max_diff(step_state, ref_step_state.numpy()) <= TOL


def test_gated_delta_gradients_chunked_equal_scan(delta_inputs):
    time = 13
    q, k, v, g, beta = (x[:, :time] for x in delta_inputs[:5])
    weights = jnp.asarray(np.random.default_rng(2).normal(size=(B, time, HV, DV)), jnp.float32)

    def loss(form, q, k, v, g, beta, state):
        if form == "chunked":
            out, final = gated_delta.gated_delta_chunked(q, k, v, g, beta, chunk_size=4, state_bhkv=state)
        else:
            out, final = gated_delta.gated_delta_scan(q, k, v, g, beta, state_bhkv=state)
        return jnp.sum(out * weights) + jnp.sum(final**2)

    args = (q, k, v, g, beta, delta_inputs[5])
    grads_chunked = jax.jit(jax.grad(lambda *a: loss("chunked", *a), argnums=tuple(range(6))))(*args)
    grads_scan = jax.jit(jax.grad(lambda *a: loss("scan", *a), argnums=tuple(range(6))))(*args)
    for name, chunked, scanned in zip("q k v g beta state".split(), grads_chunked, grads_scan, strict=True):
        assert np.all(np.isfinite(chunked)), name
        assert np.max(np.abs(scanned)) > 0, name
        assert max_diff(chunked, scanned) <= 1e-4 * max(1.0, float(np.max(np.abs(scanned)))), name


# ---- Gated DeltaNet: the mixer against transformers' modules ----

DELTA_DIMS = gated_delta.GatedDeltaDims(HK, HV, DK, DV, conv_kernel=4, norm_eps=1e-6)
DELTA_CONFIG = dict(
    hidden_size=11,
    linear_num_key_heads=HK,
    linear_num_value_heads=HV,
    linear_key_head_dim=DK,
    linear_value_head_dim=DV,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    num_hidden_layers=1,
    layer_types=["linear_attention"],
)


def randomized(module, seed: int):
    """Every parameter drawn again (norm weights around 1), so no weight hides at its init."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1.0 + 0.2 * noise if name.startswith("norm") else 0.2 * noise)
    return module.eval()


def delta_params_of(module, split: bool) -> dict[str, jax.Array]:
    weights = {name: jnp.asarray(p.detach().numpy()) for name, p in module.named_parameters()}
    params = {
        "conv_kc": weights["conv1d.weight"][:, 0, :].T,
        "a_log": weights["A_log"],
        "dt_bias": weights["dt_bias"],
        "norm": weights["norm.weight"],
        "w_out": weights["out_proj.weight"].T,
    }
    if split:  # Qwen3-Next: fused, per-key-head interleaved projections
        params |= gated_delta.split_qwen3_next_projections(
            weights["in_proj_qkvz.weight"].T, weights["in_proj_ba.weight"].T, DELTA_DIMS
        )
    else:  # Qwen3.5
        params |= {
            "w_qkv": weights["in_proj_qkv.weight"].T,
            "w_z": weights["in_proj_z.weight"].T,
            "w_b": weights["in_proj_b.weight"].T,
            "w_a": weights["in_proj_a.weight"].T,
        }
    return params


def padded_batch(width: int, seed: int):
    x = np.random.default_rng(seed).normal(size=(B, T, width)).astype(np.float32)
    mask = np.ones((B, T), np.float32)
    mask[1, T - 6 :] = 0  # the second row right-padded
    return x, mask


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_gated_deltanet_matches_transformers_module(family):
    if family == "qwen3_next":
        module = randomized(Qwen3NextGatedDeltaNet(Qwen3NextConfig(**DELTA_CONFIG), layer_idx=0), seed=3)
    else:
        module = randomized(Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(**DELTA_CONFIG), layer_idx=0), seed=4)
    params = delta_params_of(module, split=family == "qwen3_next")
    x, mask = padded_batch(11, seed=5)
    with torch.no_grad():
        expected = module(torch_of(x), attention_mask=torch_of(mask)).numpy()
    for form in ("chunked", "scan"):
        out, _ = gated_delta.gated_deltanet(params, x, DELTA_DIMS, mask_bt=mask, form=form, chunk_size=CHUNK)
        assert max_diff(out, expected) <= TOL, form


def test_gated_deltanet_prompt_then_decoded_steps_equal_full_forward():
    module = randomized(Qwen3NextGatedDeltaNet(Qwen3NextConfig(**DELTA_CONFIG), layer_idx=0), seed=6)
    params = delta_params_of(module, split=True)
    x = np.random.default_rng(7).normal(size=(B, T, 11)).astype(np.float32)
    prompt, decoded = 29, T - 29
    full_out, full_state = gated_delta.gated_deltanet(params, x, DELTA_DIMS, chunk_size=CHUNK)
    out, state = gated_delta.gated_deltanet(params, x[:, :prompt], DELTA_DIMS, chunk_size=CHUNK)
    step = jax.jit(lambda x_b1d, state: gated_delta.gated_deltanet(params, x_b1d, DELTA_DIMS, state=state))
    outputs = [out]
    for position in range(prompt, prompt + decoded):
        out, state = step(x[:, position : position + 1], state)
        outputs.append(out)
    assert max_diff(jnp.concatenate(outputs, axis=1), full_out) <= TOL
    assert max_diff(state.conv_bkc, full_state.conv_bkc) <= TOL
    assert max_diff(state.recurrent_bhkv, full_state.recurrent_bhkv) <= TOL
    assert max_diff(full_state.conv_bkc, x[:, -3:] @ params["w_qkv"]) <= TOL  # the window: the last K-1 inputs


# ---- Mamba2 SSD ----


def discretized(ssd_inputs):
    x, (dt_raw, dt_bias), a_h, b, c, d, state = ssd_inputs
    return x, ssd.discretize_dt(dt_raw, dt_bias, 0.01, 2.0), a_h, b, c, d, state


@pytest.mark.parametrize("time", [T, 5])
def test_ssd_chunked_equals_per_token_scan(ssd_inputs, time):
    x, dt, a_h, b, c, d, state = discretized(ssd_inputs)
    x, dt, b, c = (v[:, :time] for v in (x, dt, b, c))
    y_chunked, state_chunked = ssd.ssd_chunked(x, dt, a_h, b, c, chunk_size=CHUNK, d_h=d, state_bhpn=state)
    y_scan, state_scan = ssd.ssd_scan(x, dt, a_h, b, c, d_h=d, state_bhpn=state)
    assert y_chunked.shape == (B, time, HEADS, HEAD_DIM)
    assert max_diff(y_chunked, y_scan) <= TOL
    assert max_diff(state_chunked, state_scan) <= TOL


def test_ssd_matches_transformers_functions(ssd_inputs):
    x, (dt_raw, dt_bias), a_h, b, c, d, state = ssd_inputs
    ref_y, ref_state = mamba2_chunk_scan(
        *(torch_of(v) for v in (x, dt_raw, a_h, b, c)),
        chunk_size=CHUNK,
        D=torch_of(d),
        dt_bias=torch_of(dt_bias),
        initial_states=torch_of(state),
        dt_softplus=True,
        dt_limit=(0.01, 2.0),
        return_final_states=True,
    )
    x_, dt, *_ = discretized(ssd_inputs)
    y, final = ssd.ssd_chunked(x, dt, a_h, b, c, chunk_size=CHUNK, d_h=d, state_bhpn=state)
    assert max_diff(y, ref_y.numpy()) <= TOL
    assert max_diff(final, ref_state.numpy()) <= TOL
    # One decoded token against transformers' selective_state_update (its decode path; it does not clamp dt).
    next_state = torch_of(state).clone()
    expand = lambda v: torch_of(v)[..., None].expand(*v.shape, HEAD_DIM)  # noqa: E731
    ref_step = mamba2_selective_state_update(
        next_state,
        torch_of(x[:, 0]),
        expand(dt_raw[:, 0]),
        torch_of(a_h)[:, None, None].expand(HEADS, HEAD_DIM, STATE),
        torch_of(b[:, 0]),
        torch_of(c[:, 0]),
        expand(d),
        dt_bias=expand(dt_bias),
        dt_softplus=True,
    )
    step_dt = ssd.discretize_dt(dt_raw[:, 0], dt_bias)
    y_step, step_state = ssd.ssd_step(x[:, 0], step_dt, a_h, b[:, 0], c[:, 0], state, d_h=d)
    assert max_diff(y_step, ref_step.numpy()) <= TOL
    assert max_diff(step_state, next_state.numpy()) <= TOL


def test_ssd_gradients_chunked_equal_scan(ssd_inputs):
    time = 13
    x, dt, a_h, b, c, d, state = discretized(ssd_inputs)
    x, dt, b, c = (v[:, :time] for v in (x, dt, b, c))
    weights = jnp.asarray(np.random.default_rng(8).normal(size=(B, time, HEADS, HEAD_DIM)), jnp.float32)

    def loss(form, x, dt, a_h, b, c, d, state):
        if form == "chunked":
            y, final = ssd.ssd_chunked(x, dt, a_h, b, c, chunk_size=4, d_h=d, state_bhpn=state)
        else:
            y, final = ssd.ssd_scan(x, dt, a_h, b, c, d_h=d, state_bhpn=state)
        return jnp.sum(y * weights) + jnp.sum(final**2)

    args = (x, dt, a_h, b, c, d, state)
    grads_chunked = jax.jit(jax.grad(lambda *a: loss("chunked", *a), argnums=tuple(range(7))))(*args)
    grads_scan = jax.jit(jax.grad(lambda *a: loss("scan", *a), argnums=tuple(range(7))))(*args)
    for name, chunked, scanned in zip("x dt A B C D state".split(), grads_chunked, grads_scan, strict=True):
        assert np.all(np.isfinite(chunked)), name
        assert np.max(np.abs(scanned)) > 0, name
        assert max_diff(chunked, scanned) <= 1e-4 * max(1.0, float(np.max(np.abs(scanned)))), name


MAMBA_DIMS = ssd.Mamba2Dims(HEADS, HEAD_DIM, STATE, n_groups=GROUPS, conv_kernel=4, norm_eps=1e-5)


@pytest.fixture(scope="module")
def mamba_module():
    config = Mamba2Config(
        hidden_size=WIDTH,
        expand=3,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        n_groups=GROUPS,
        state_size=STATE,
        conv_kernel=4,
        chunk_size=CHUNK,
        use_bias=True,
        use_conv_bias=True,
        layer_norm_epsilon=1e-5,
        num_hidden_layers=1,
    )
    module = Mamba2Mixer(config, layer_idx=0)
    randomized(module, seed=9)
    with torch.no_grad():  # A_log, dt_bias back to their usual ranges; D random
        module.A_log.copy_(torch.log(torch.linspace(1.0, 6.0, HEADS)))
        module.dt_bias.copy_(torch.linspace(-4.0, 0.5, HEADS))
    weights = {name: jnp.asarray(p.detach().numpy()) for name, p in module.named_parameters()}
    params = {
        "w_in": weights["in_proj.weight"].T,
        "b_in": weights["in_proj.bias"],
        "conv_kc": weights["conv1d.weight"][:, 0, :].T,
        "conv_bias": weights["conv1d.bias"],
        "dt_bias": weights["dt_bias"],
        "a_log": weights["A_log"],
        "d": weights["D"],
        "norm": weights["norm.weight"],
        "w_out": weights["out_proj.weight"].T,
        "b_out": weights["out_proj.bias"],
    }
    return module, params


def test_mamba2_mixer_matches_transformers_module(mamba_module):
    module, params = mamba_module
    x, mask = padded_batch(WIDTH, seed=10)
    with torch.no_grad():
        expected = module(torch_of(x), attention_mask=torch_of(mask)).numpy()
    for form in ("chunked", "scan"):
        out, _ = ssd.mamba2_mixer(params, x, MAMBA_DIMS, mask_bt=mask, form=form, chunk_size=CHUNK)
        assert max_diff(out, expected) <= TOL, form


def test_mamba2_prompt_then_decoded_steps_equal_full_forward(mamba_module):
    _, params = mamba_module
    x = np.random.default_rng(11).normal(size=(B, T, WIDTH)).astype(np.float32)
    prompt = 30
    full_out, full_state = ssd.mamba2_mixer(params, x, MAMBA_DIMS, chunk_size=CHUNK)
    out, state = ssd.mamba2_mixer(params, x[:, :prompt], MAMBA_DIMS, chunk_size=CHUNK)
    step = jax.jit(lambda x_b1d, state: ssd.mamba2_mixer(params, x_b1d, MAMBA_DIMS, state=state))
    outputs = [out]
    for position in range(prompt, T):
        out, state = step(x[:, position : position + 1], state)
        outputs.append(out)
    assert max_diff(jnp.concatenate(outputs, axis=1), full_out) <= TOL
    assert max_diff(state.conv_bkc, full_state.conv_bkc) <= TOL
    assert max_diff(state.ssm_bhpn, full_state.ssm_bhpn) <= TOL
