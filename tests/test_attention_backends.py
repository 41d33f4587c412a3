"""Every attention implementation computes the reference's function and gradients; `auto`
picks by platform and falls back, saying why; local layers are static under the layer scan;
the train step with splash attention compiles for a TPU topology.

On CPU: `blocked` natively, `splash` in the Pallas interpreter (the real kernel's code, run
op by op), and `cudnn`'s translation into jax.nn.dot_product_attention arguments run
through XLA instead of cuDNN (which needs a GPU).
"""

import importlib.util
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import topologies
from jax.sharding import Mesh

from engine.config import ConfigError, load_config
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.params import apply_model, graphdef_of
from engine.models.transformer import Transformer
from engine.ops import attention as attention_module
from engine.ops.attention import attention, choose_implementation
from engine.ops.attention_cudnn import cudnn_attention
from engine.ops.partitioning import MESH_AXES, current_platform, use_mesh
from engine.parallel.mesh import replicated
from engine.train.config import TrainConfig
from engine.train.step import make_train_step
from engine.train.trainer import Trainer

# Splash's key blocks are multiples of 128 positions; everything else is odd.
B, T, N, K, H = 2, 128, 6, 2, 10
SCALE = 0.3
# Row 0: two packed documents, then padding; row 1: one document.
SEGMENTS = jnp.asarray([[1] * 45 + [2] * 70 + [0] * 13, [3] * T])
VALID = (SEGMENTS != 0)[:, :, None, None]
CASES = {  # every case is grouped-query (6 query heads over 2 kv heads) and causal
    "packed": dict(window=None, softcap=None),
    "sliding_window": dict(window=7, softcap=None),
    "softcap": dict(window=None, softcap=2.0),
    "window_and_softcap": dict(window=7, softcap=2.0),
}


def _qkv_probe(dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    return draw(B, T, N, H), draw(B, T, K, H), draw(B, T, K, H), draw(B, T, N, H)


def _run(impl: str, case: dict, segments=SEGMENTS):
    """fn(q, k, v) of implementation `impl` for `case`."""
    window, softcap = case["window"], case["softcap"]
    if impl == "cudnn_via_xla":
        return lambda q, k, v: cudnn_attention(q, k, v, segments, scale=SCALE, window=window, implementation="xla")
    return lambda q, k, v: attention(
        q, k, v, segments, impl=impl, scale=SCALE, softcap=softcap, window=window, local=True, block=32
    )


def _value_and_grads(fn, q, k, v, probe, valid=VALID):
    """Outputs and d(sum(out * probe))/d(q, k, v), padding positions left out: one program
    (the forward pass once, its vector-Jacobian product with probe * valid)."""

    def run(q, k, v):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp((probe * valid).astype(out.dtype))

    out, grads = jax.jit(run)(q, k, v)
    return out * valid, grads


_REFERENCES: dict = {}


def _reference_value_and_grads(case: str, q, k, v, probe, segments=SEGMENTS, valid=VALID, seed=0):
    """_value_and_grads of the reference for `case` (by name), computed once per case, inputs'
    seed and dtype, and packing: several implementations' tests compare against the same one."""
    key = (case, seed, q.dtype.name, segments is None)
    if key not in _REFERENCES:
        _REFERENCES[key] = _value_and_grads(_run("reference", CASES[case], segments), q, k, v, probe, valid)
    return _REFERENCES[key]


def _cases_for(impl):
    # cuDNN has no soft-cap (auto falls back, asked by name it is an error: tested below).
    return [c for c in CASES if not (impl == "cudnn_via_xla" and CASES[c]["softcap"] is not None)]


IMPL_CASES = [(impl, case) for impl in ("blocked", "splash", "cudnn_via_xla") for case in _cases_for(impl)]


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    """Each test sees the once-per-process warnings afresh."""
    monkeypatch.setattr(attention_module, "_told", set())


@pytest.mark.parametrize("impl,case", IMPL_CASES, ids=[f"{i}-{c}" for i, c in IMPL_CASES])
def test_each_implementation_and_its_gradients_equal_the_reference(impl, case):
    q, k, v, probe = _qkv_probe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # splash off TPU says it runs in the interpreter
        out, grads = _value_and_grads(_run(impl, CASES[case]), q, k, v, probe)
    ref_out, ref_grads = _reference_value_and_grads(case, q, k, v, probe)
    np.testing.assert_allclose(out, ref_out, atol=5e-6)
    for name, got, want in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("impl", ["blocked", "splash", "cudnn_via_xla"])
def test_unpacked_rows_need_no_segment_ids(impl):
    q, k, v, probe = _qkv_probe(seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, grads = _value_and_grads(_run(impl, CASES["sliding_window"], segments=None), q, k, v, probe, valid=1.0)
    ref_out, ref_grads = _reference_value_and_grads("sliding_window", q, k, v, probe, segments=None, valid=1.0, seed=1)
    np.testing.assert_allclose(out, ref_out, atol=5e-6)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("impl", ["reference", "blocked", "splash", "cudnn_via_xla"])
def test_bfloat16_keeps_its_dtype_and_tracks_float32(impl):
    q, k, v, probe = _qkv_probe(jnp.bfloat16, seed=2)
    case = "sliding_window" if impl == "cudnn_via_xla" else "window_and_softcap"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, grads = _value_and_grads(_run(impl, CASES[case]), q, k, v, probe)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, probe)]
    ref_out, ref_grads = _reference_value_and_grads(case, *f32, seed=2)
    assert out.dtype == jnp.bfloat16 and [g.dtype for g in grads] == [jnp.bfloat16] * 3
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=3e-2)
    for name, got, want in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(
            np.asarray(got, np.float32), want, atol=0.03 * float(jnp.abs(want).max()), err_msg=f"d{name}"
        )


def test_splash_under_a_mesh_runs_per_shard_and_equals_the_reference():
    """Under a (data 2, tensor 2) mesh the kernel runs in a shard_map, two examples and one
    kv head group per device: the same values and gradients."""
    q, k, v, probe = _qkv_probe(seed=5)
    case = CASES["window_and_softcap"]
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 1, 1, 1, 2), MESH_AXES)
    with use_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert "sdy.manual_computation" in jax.jit(_run("splash", case)).lower(q, k, v).as_text()
        out, grads = _value_and_grads(_run("splash", case), q, k, v, probe)
    ref_out, ref_grads = _reference_value_and_grads("window_and_softcap", q, k, v, probe, seed=5)
    np.testing.assert_allclose(out, ref_out, atol=5e-6)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got, want, atol=2e-5)


# --------------------------------------------------------------------------- choosing one

BF16_CASE = dict(dtype=jnp.bfloat16, head_dim=64, seq_len=256, softcap=None)


def test_auto_on_cpu_picks_blocked_where_the_cpu_kernel_cannot_run():
    """The C++ kernel (tests/test_cpu_kernels.py) needs a head_dim that is a multiple of 16;
    these probes have head_dim 10, so auto runs blocked, saying why."""
    assert current_platform() == "cpu"
    q, k, v, _ = _qkv_probe()
    with pytest.warns(UserWarning, match="auto uses blocked, not cpu_kernel, on cpu: .*multiple of 16"):
        auto = _run("auto", CASES["packed"])(q, k, v)
    np.testing.assert_array_equal(auto, _run("blocked", CASES["packed"])(q, k, v))


def test_auto_leaves_the_cpu_kernel_to_cpus_with_avx512(monkeypatch):
    """On AVX2 alone the C++ kernel ran 2.5x slower than blocked (docs/benchmarks.md): auto
    picks it only where the CPU has AVX-512; a named cpu_kernel still runs anywhere."""
    from engine.ops import cpu_kernels

    case = dict(dtype=jnp.float32, head_dim=64, seq_len=256, softcap=None)
    monkeypatch.setattr(cpu_kernels, "_cpu", lambda: "model name : AMD EPYC 7B13\nflags : fpu sse avx avx2 fma")
    assert not cpu_kernels.has_avx512()
    assert choose_implementation("auto", platform="cpu", **case) == "blocked"
    monkeypatch.setattr(cpu_kernels, "_cpu", lambda: "model name : Intel Xeon\nflags : fpu avx2 avx512f avx512bw")
    assert cpu_kernels.has_avx512()
    if cpu_kernels.unavailable("train_attention") is None:  # a C++ compiler here
        assert choose_implementation("auto", platform="cpu", **case) == "cpu_kernel"


def test_auto_picks_cudnn_on_gpu_and_splash_on_tpu_where_they_fit():
    assert choose_implementation("auto", platform="gpu", **BF16_CASE) == "cudnn"
    assert choose_implementation("auto", platform="tpu", **{**BF16_CASE, "softcap": 30.0}) == "splash"


FALLBACKS = {
    "gpu_softcap": ("gpu", dict(softcap=50.0), "no logit soft-cap"),
    "gpu_float32": ("gpu", dict(dtype=jnp.float32), "not float32"),
    "gpu_head_dim": ("gpu", dict(head_dim=132), "head_dim a multiple of 8"),
    "gpu_odd_packed_length": ("gpu", dict(seq_len=255), "even sequence length"),
    "tpu_length": ("tpu", dict(seq_len=200), "multiple of 128"),
}


@pytest.mark.parametrize("name", FALLBACKS)
def test_auto_falls_back_to_blocked_and_says_why_once(name):
    platform, change, reason = FALLBACKS[name]
    with pytest.warns(UserWarning, match=reason):
        assert choose_implementation("auto", platform=platform, **{**BF16_CASE, **change}) == "blocked"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time, silence
        assert choose_implementation("auto", platform=platform, **{**BF16_CASE, **change}) == "blocked"


def test_cudnn_off_a_gpu_is_a_config_error():
    q, k, v, _ = _qkv_probe()
    with pytest.raises(ConfigError, match=r"compute.attention_impl: cudnn runs on NVIDIA GPUs.*compiles for cpu"):
        _run("cudnn", CASES["packed"])(q, k, v)


@pytest.mark.parametrize(
    "impl,platform,change,reason",
    [
        ("cudnn", "gpu", dict(softcap=50.0), "no logit soft-cap"),
        ("splash", "tpu", dict(seq_len=200), "multiple of 128"),
    ],
)
def test_a_named_kernel_that_cannot_take_the_model_is_a_config_error(impl, platform, change, reason):
    with pytest.raises(ConfigError, match=f"compute.attention_impl: {impl} cannot run this model: .*{reason}"):
        choose_implementation(impl, platform=platform, **{**BF16_CASE, **change})


def test_splash_off_tpu_says_it_runs_in_the_interpreter():
    with pytest.warns(UserWarning, match="Pallas interpreter"):
        assert choose_implementation("splash", platform="cpu", **BF16_CASE) == "splash"


# --------------------------------------------------------------------------- in the model

# Gemma-3-like: five local layers then a global one, over 8 layers (2 left after the scan).
GEMMA3_LIKE = ModelConfig(
    family="gemma3",
    vocab_size=37,
    d_model=22,
    num_layers=8,
    num_heads=6,
    num_kv_heads=2,
    head_dim=10,
    mlp_dim=26,
    max_seq_len=64,
    attention_pattern=["local"] * 5 + ["global"],
    sliding_window=5,
    rope_local_theta=100.0,
    attn_logit_softcap=3.0,
    qk_norm=True,
    post_norms=True,
    norm_zero_centered=True,
)


def _batch(t, seed=3):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 37, (2, t)))
    first = t // 2 - 3
    segments = jnp.asarray([[1] * first + [2] * (t - first - 3) + [0] * 3, [1] * t])
    positions = jnp.asarray([list(range(first)) + list(range(t - first - 3)) + [0] * 3, list(range(t))])
    return tokens, positions, segments


def _unrolled(cfg, stacked_params):
    """The stacked params laid out one entry per layer (scan_layers: false)."""
    params = dict(stacked_params)
    params["blocks"] = {i: jax.tree.map(lambda x, i=i: x[i], stacked_params["blocks"]) for i in range(cfg.num_layers)}
    return params


PATTERN_SCANS = {  # (pattern, remat): 8 layers are 1 unit of 6 + 2, or 2 units of 3 + 2
    "gemma3_unit": (["local"] * 5 + ["global"], "none"),
    "two_units_remat": (["local", "local", "global"], "full"),
}


@pytest.mark.parametrize("name", PATTERN_SCANS)
def test_the_pattern_scan_equals_unrolled_layers_in_logits_and_gradients(name):
    """The scan over pattern units plus the two layers left over computes what the unrolled
    layers do (themselves run with the reference attention)."""
    pattern, remat = PATTERN_SCANS[name]
    cfg = GEMMA3_LIKE.model_copy(update={"attention_pattern": pattern})
    scanned = ComputeConfig(remat=remat, attention_block=16)
    unrolled = ComputeConfig(remat=remat, scan_layers=False, attention_impl="reference")
    graphdef, state = nnx.split(Transformer(cfg, scanned, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)
    unrolled_graphdef = graphdef_of(cfg, unrolled)  # the structure only: no second initialisation
    tokens, positions, segments = _batch(27)
    valid = (segments != 0)[..., None]

    def logits_and_grads(gd, p):
        def loss(p):
            return jnp.sum(jnp.where(valid, apply_model(gd, p, tokens, positions, segments), 0.0) ** 2)

        return jax.jit(lambda p: (apply_model(gd, p, tokens, positions, segments), jax.grad(loss)(p)))(p)

    logits, grads = logits_and_grads(graphdef, params)
    logits_unrolled, grads_unrolled = logits_and_grads(unrolled_graphdef, _unrolled(cfg, params))
    np.testing.assert_allclose(logits * valid, logits_unrolled * valid, atol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(jnp.abs(b).max()))),
        _unrolled(cfg, grads),
        grads_unrolled,
    )
    # The window matters here: with every layer global the logits move (the test can fail).
    all_global = cfg.model_copy(update={"attention_pattern": ["global"]})
    global_graphdef = graphdef_of(all_global, scanned)
    global_logits = jax.jit(lambda p: apply_model(global_graphdef, p, tokens, positions, segments))(params)
    assert float(jnp.abs((global_logits - logits) * valid).max()) > 1e-3


def test_the_model_gives_the_same_logits_with_every_cpu_implementation():
    cfg = GEMMA3_LIKE.model_copy(update={"num_layers": 2, "attention_pattern": ["local", "global"], "max_seq_len": T})
    tokens, positions, segments = _batch(T, seed=4)
    valid = (segments != 0)[..., None]
    logits = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for impl in ("reference", "blocked", "splash"):
            model = Transformer(cfg, ComputeConfig(attention_impl=impl, attention_block=32), rngs=nnx.Rngs(0))
            logits[impl] = np.asarray(jax.jit(lambda m: m(tokens, positions, segments))(model) * valid)
    np.testing.assert_allclose(logits["blocked"], logits["reference"], atol=1e-5)
    np.testing.assert_allclose(logits["splash"], logits["reference"], atol=1e-5)


# --------------------------------------------------------------------------- TPU, ahead of time


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the test extra)")
def test_the_train_step_with_splash_compiles_for_a_v5e_8_topology():
    """Forward and backward, packed segments, local and global layers, a data x fsdp x tensor
    mesh: compiled ahead of time for a v5e-8 slice (8 chips) on this CPU host, the real kernel
    inside."""
    topology = topologies.get_topology_desc("v5e:2x4", "tpu")
    model = dict(
        family="gemma3",
        vocab_size=256,
        d_model=96,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        mlp_dim=160,
        max_seq_len=256,
        attention_pattern=["local", "local", "global"],
        sliding_window=64,
        attn_logit_softcap=20.0,
        qk_norm=True,
    )
    cfg = load_config(
        tree={
            "model": model,
            "compute": {"attention_impl": "splash", "dtype": "bfloat16"},
            "mesh": {"data": 2, "fsdp": 2, "tensor": 2},
            "data": {"batch_size": 4, "seq_len": 256},
        },
        schema=TrainConfig,
    )
    trainer = Trainer(cfg, devices=topology.devices)
    assert len(topology.devices) == 8 and dict(trainer.mesh.shape)["fsdp"] == 2
    step = jax.jit(
        make_train_step(trainer.objective, trainer.tx, cfg.grad_accum),
        in_shardings=(trainer.param_shardings, trainer.opt_shardings, trainer.batch_sharding),
        out_shardings=(trainer.param_shardings, trainer.opt_shardings, replicated(trainer.mesh)),
    )
    row = lambda dtype: jax.ShapeDtypeStruct((4, 256), dtype, sharding=trainer.batch_sharding)  # noqa: E731
    batch = {
        "tokens": row(jnp.int32),
        "targets": row(jnp.int32),
        "positions": row(jnp.int32),
        "segment_ids": row(jnp.int32),
        "loss_mask": row(jnp.float32),
    }
    with use_mesh(trainer.mesh):
        lowered = step.trace(trainer.abstract_params, trainer.abstract_opt_state, batch).lower()
    # Local and global layers: forward, dq and dkv kernels each (the interpreter has none).
    assert lowered.as_text().count("tpu_custom_call") == 6
    memory = lowered.compile().memory_analysis()
    assert memory.argument_size_in_bytes > 0
