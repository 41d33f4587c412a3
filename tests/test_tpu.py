"""The accelerator paths executed on a TPU chip, each against a reference: splash attention
(packed segments, sliding windows, soft-caps, chunked attention) and its gradients, the MoE
experts' grouped matmuls (`ragged_dot`, megablox on TPU), the chunked forms of Gated DeltaNet
and Mamba2's SSD, the sampler, a training run resumed from its checkpoint, and a converted
Hugging Face model's logits in bfloat16 and in float32 at the highest matmul precision.

Marked `tpu` and skipped where JAX has no TPU (CI is CPU-only); bench/tpu_lane.sh runs them on
the chip (docs/development.md). The references run on the host CPU in float32 (JAX's CPU
device, or transformers' torch model): an exact reference for the chip's values. Where the
chip computes with bfloat16 passes (the default precision of its float32 products, or
bfloat16 inputs), a kernel is held to the error of XLA's own reference computation run the
same way on the chip, with a small margin, not to a number tuned to pass; each test prints
what it measured.
"""

from __future__ import annotations

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ON_TPU = jax.default_backend() == "tpu"
pytestmark = [pytest.mark.tpu, pytest.mark.skipif(not ON_TPU, reason="needs a TPU (bench/tpu_lane.sh on the chip)")]

HIGHEST = functools.partial(jax.default_matmul_precision, "highest")


def cpu():
    return jax.devices("cpu")[0]


def on_cpu(fn, *args):
    """fn(*args) jitted on the host CPU (the exact float32 reference)."""
    with jax.default_device(cpu()):
        return jax.jit(fn)(*jax.device_put(args, cpu()))


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def report(name: str, **errors: float) -> None:
    print(f"\n{name}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))


# ---- splash attention ----

from engine.ops.attention import attention, chunked_segment_ids  # noqa: E402

B, T, N, K = 2, 512, 4, 2
SCALE = 0.125
SEGMENTS = np.asarray([[1] * 200 + [2] * 250 + [0] * 62, [3] * T], np.int32)
ATTENTION_CASES = {
    "packed": dict(window=None, softcap=None, chunk=None),
    "sliding_window": dict(window=100, softcap=None, chunk=None),
    "softcap": dict(window=None, softcap=30.0, chunk=None),
    "window_and_softcap": dict(window=100, softcap=30.0, chunk=None),
    "chunked": dict(window=None, softcap=None, chunk=128),  # Llama 4's chunked local attention
}


def attention_fn(impl: str, case: dict, segments_bt):
    if case["chunk"]:
        positions = np.concatenate([np.arange(200), np.arange(250), np.zeros(62, int)])[None].repeat(2, 0)
        positions[1] = np.arange(T)
        segments_bt = chunked_segment_ids(jnp.asarray(segments_bt), jnp.asarray(positions), case["chunk"])
    segments_bt = jnp.asarray(segments_bt)

    def run(q, k, v, probe):
        fn = lambda q, k, v: attention(  # noqa: E731
            q,
            k,
            v,
            segments_bt,
            impl=impl,
            scale=SCALE,
            softcap=case["softcap"],
            window=case["window"],
            local=case["window"] is not None,
        )
        out, vjp = jax.vjp(fn, q, k, v)
        valid = (segments_bt != 0)[:, :, None, None]
        return out * valid, vjp((probe * valid).astype(out.dtype))

    return run


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_splash_and_its_gradients_equal_the_reference(case, dtype, head_dim):
    rng = np.random.default_rng(0)
    q, k, v, probe = (
        rng.standard_normal(shape).astype(np.float32)
        for shape in ((B, T, N, head_dim), (B, T, K, head_dim), (B, T, K, head_dim), (B, T, N, head_dim))
    )
    exact = on_cpu(attention_fn("reference", ATTENTION_CASES[case], SEGMENTS), q, k, v, probe)
    chip_inputs = [jnp.asarray(x, dtype) for x in (q, k, v, probe)]
    splash = jax.jit(attention_fn("splash", ATTENTION_CASES[case], SEGMENTS))(*chip_inputs)
    xla = jax.jit(attention_fn("reference", ATTENTION_CASES[case], SEGMENTS))(*chip_inputs)
    assert splash[0].dtype == jnp.dtype(dtype)
    names = ("out", "dq", "dk", "dv")
    got = [splash[0], *splash[1]]
    baseline = [xla[0], *xla[1]]
    want = [exact[0], *exact[1]]
    errors = {n: max_diff(g, w) for n, g, w in zip(names, got, want)}
    xla_errors = {n: max_diff(g, w) for n, g, w in zip(names, baseline, want)}
    report(f"splash {case} {dtype} h{head_dim}", **errors, **{f"xla_{n}": e for n, e in xla_errors.items()})
    for n in names:
        scale = float(np.max(np.abs(np.asarray(want[names.index(n)]))))
        assert errors[n] <= 2 * xla_errors[n] + 2e-3 * scale, (n, errors[n], xla_errors[n])


# ---- MoE: the experts' grouped matmuls ----

from engine.ops.grouped import grouped_mlp  # noqa: E402

ROWS, D_MODEL, EXPERTS, F = 300, 256, 6, 384
SIZES = np.asarray([70, 0, 45, 100, 33, 52], np.int32)  # one expert gets no row


def experts_loss(mlp):
    def loss(x, w_gate, w_up, w_down, dy):
        y = mlp(x, jnp.asarray(SIZES), w_gate, w_up, w_down, lambda g, u: jax.nn.silu(g) * u)
        return jnp.sum(y.astype(jnp.float32) * dy), y

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)


def dense_mlp(x_md, sizes_g, w_gate, w_up, w_down, glu):
    """Each row times its own expert's matrices, gathered: what ragged_dot computes."""
    expert_m = jnp.repeat(jnp.arange(EXPERTS), SIZES, total_repeat_length=x_md.shape[0])
    gate = jnp.einsum("md,mdf->mf", x_md, w_gate[expert_m])
    up = jnp.einsum("md,mdf->mf", x_md, w_up[expert_m])
    return jnp.einsum("mf,mfd->md", glu(gate, up), w_down[expert_m])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_experts_mlp_and_its_gradients_equal_a_dense_gather(dtype):
    rng = np.random.default_rng(1)
    shapes = ((ROWS, D_MODEL), (EXPERTS, D_MODEL, F), (EXPERTS, D_MODEL, F), (EXPERTS, F, D_MODEL), (ROWS, D_MODEL))
    args = [(rng.standard_normal(s) / np.sqrt(s[-2] if len(s) == 3 else 1)).astype(np.float32) for s in shapes]
    (_, want), want_grads = on_cpu(experts_loss(dense_mlp), *args)
    chip = [jnp.asarray(a, dtype) for a in args[:4]] + [jnp.asarray(args[4])]
    with HIGHEST():
        (_, got), got_grads = jax.jit(experts_loss(grouped_mlp))(*chip)
        (_, base), base_grads = jax.jit(experts_loss(dense_mlp))(*chip)
    assert got.dtype == jnp.dtype(dtype)
    names = ("y", "dx", "dw_gate", "dw_up", "dw_down")
    errors = {n: max_diff(g, w) for n, g, w in zip(names, [got, *got_grads], [want, *want_grads])}
    base_errors = {n: max_diff(g, w) for n, g, w in zip(names, [base, *base_grads], [want, *want_grads])}
    report(f"grouped_mlp {dtype}", **errors, **{f"dense_{n}": e for n, e in base_errors.items()})
    for n, w in zip(names, [want, *want_grads]):
        scale = float(np.max(np.abs(np.asarray(w))))
        bound = 1e-5 * scale if dtype == "float32" else 2 * base_errors[n] + 1e-2 * scale
        assert errors[n] <= bound, (n, errors[n], bound)


# ---- Gated DeltaNet and Mamba2: the chunked forms ----

from engine.ops import gated_delta, ssd  # noqa: E402

LT, HK, HV, DK, DV = 300, 2, 4, 128, 128
MIXER_SEGMENTS = np.asarray([[1] * 120 + [2] * 180, [5] * LT], np.int32)


def rel(a, b) -> float:
    return max_diff(a, b) / float(np.max(np.abs(np.asarray(b))))


def test_gated_delta_chunked_on_the_chip_equals_the_per_token_scan():
    rng = np.random.default_rng(2)
    normal = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q, k, v = normal(2, LT, HK, DK), normal(2, LT, HK, DK), normal(2, LT, HV, DV)
    g = -np.abs(normal(2, LT, HV)) * 1.2
    beta = rng.uniform(0.05, 1.0, (2, LT, HV)).astype(np.float32)
    state = normal(2, HV, DK, DV) * 0.1

    def loss(form):
        def run(q, k, v, g, beta, state):
            out, final = form(q, k, v, g, beta, state_bhkv=state, segment_ids_bt=jnp.asarray(MIXER_SEGMENTS))
            return jnp.sum(out**2) + jnp.sum(final**2), (out, final)

        return jax.value_and_grad(run, argnums=(0, 1, 2, 3, 4), has_aux=True)

    (_, want), want_grads = on_cpu(loss(gated_delta.gated_delta_scan), q, k, v, g, beta, state)
    with HIGHEST():
        chunked = functools.partial(gated_delta.gated_delta_chunked, chunk_size=64)
        (_, got), got_grads = jax.jit(loss(chunked))(q, k, v, g, beta, state)
    errors = {"out": rel(got[0], want[0]), "state": rel(got[1], want[1])}
    errors.update({f"d{n}": rel(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta"), got_grads, want_grads)})
    report("gated_delta_chunked (relative)", **errors)
    assert max(errors.values()) <= 1e-4, errors


def test_ssd_chunked_on_the_chip_equals_the_per_token_scan():
    rng = np.random.default_rng(3)
    normal = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    heads, head_dim, groups, n = 8, 64, 2, 128
    x = normal(2, LT, heads, head_dim)
    dt = np.asarray(ssd.discretize_dt(normal(2, LT, heads), normal(heads), 0.01, 2.0))
    a_h, d_h = -np.exp(normal(heads)), normal(heads)
    b, c = normal(2, LT, groups, n), normal(2, LT, groups, n)
    state = normal(2, heads, head_dim, n) * 0.1

    def loss(form):
        def run(x, dt, b, c):
            y, final = form(x, dt, a_h, b, c, d_h=d_h, state_bhpn=state, segment_ids_bt=jnp.asarray(MIXER_SEGMENTS))
            return jnp.sum(y**2) + jnp.sum(final**2), (y, final)

        return jax.value_and_grad(run, argnums=(0, 1, 2, 3), has_aux=True)

    (_, want), want_grads = on_cpu(loss(ssd.ssd_scan), x, dt, b, c)
    with HIGHEST():
        (_, got), got_grads = jax.jit(loss(functools.partial(ssd.ssd_chunked, chunk_size=128)))(x, dt, b, c)
    errors = {"y": rel(got[0], want[0]), "state": rel(got[1], want[1])}
    errors.update({f"d{n}": rel(a, b) for n, a, b in zip(("x", "dt", "b", "c"), got_grads, want_grads)})
    report("ssd_chunked (relative)", **errors)
    assert max(errors.values()) <= 1e-4, errors


# ---- the sampler ----


def test_the_sampler_on_the_chip_is_greedy_exact_and_seeded():
    from flax import nnx

    from engine.inference.sample import Sampler, left_pad
    from engine.models.config import ComputeConfig, ModelConfig
    from engine.models.transformer import Transformer
    from tests.test_sample import ODD, PROMPTS, SETTINGS, teacher_forced

    cfg = ModelConfig(**ODD)
    params = jax.jit(lambda: nnx.to_pure_dict(nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1]))()
    sampler = Sampler(cfg)
    tokens, mask = left_pad(PROMPTS)
    with HIGHEST():
        greedy = sampler(params, tokens, mask, seed=0, temperature=0.0, **SETTINGS)
        _, logits = teacher_forced(cfg, params, tokens, mask, greedy, 0.0)
        drawn = sampler(params, tokens, mask, seed=7, temperature=0.7, **SETTINGS)
        again = sampler(params, tokens, mask, seed=7, temperature=0.7, **SETTINGS)
        other = sampler(params, tokens, mask, seed=8, temperature=0.7, **SETTINGS)
        forced, _ = teacher_forced(cfg, params, tokens, mask, drawn, 0.7)
    p = tokens.shape[1]
    np.testing.assert_array_equal(np.argmax(np.asarray(logits[:, p - 1 : -1]), -1), greedy.tokens)
    np.testing.assert_array_equal(drawn.tokens, again.tokens)
    assert not np.array_equal(drawn.tokens, other.tokens)
    error = max_diff(drawn.logprobs[drawn.mask], forced[drawn.mask])
    report("sampler logprobs vs teacher forcing", max_abs=error)
    assert error <= 1e-4
    cpu_params = jax.device_put(params, cpu())
    with jax.default_device(cpu()):
        host_sampler = Sampler(cfg, ComputeConfig(attention_impl="blocked"))
        on_host = host_sampler(cpu_params, tokens, mask, seed=0, temperature=0.0, **SETTINGS)
    np.testing.assert_array_equal(on_host.tokens, greedy.tokens)


# ---- a resumed training run ----


# float32 master weights as they fit a 1B model on one chip: bf16 compute, bf16 Adam moments
# kept in the host's memory between steps (docs/benchmarks.md)
MASTER_OFFLOADED = {"compute.dtype": "bfloat16", "optimizer.moment_dtype": "bfloat16", "optimizer.host_offload": True}


@pytest.mark.parametrize("settings", [{}, MASTER_OFFLOADED], ids=["default", "float32_master_offloaded"])
def test_a_run_resumed_from_its_checkpoint_on_the_chip_is_bitwise_identical(byte_dataset, tmp_path, settings):
    from engine.train.pretrain import run_pretrain
    from tests.test_train import assert_params_identical, losses, tiny_config

    settings = {"checkpoint.every_steps": 4, **settings}
    run_pretrain(tiny_config(byte_dataset, tmp_path / "a", steps=8, **settings))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoint" / "8")
    for metrics in (tmp_path / "b").glob("*.jsonl"):  # the resumed run writes steps 5-8 again
        metrics.unlink()
    logged = []
    run_pretrain(tiny_config(byte_dataset, tmp_path / "b", steps=8, **settings), log=logged.append)
    assert any("resumed from checkpoint step 4" in line for line in logged), logged
    assert_params_identical(tmp_path / "a" / "checkpoint", tmp_path / "b" / "checkpoint")
    assert losses(tmp_path / "a")[4:] == losses(tmp_path / "b")[-4:]


# ---- a converted Hugging Face model ----


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from engine.interop.hf.convert import convert_hf
    from engine.train.checkpoint import load_params, stored_configs
    from tests.test_hf_parity import random_hf_model

    cases = {}
    for family in ("llama", "qwen3", "gemma2"):
        root = tmp_path_factory.mktemp(family)
        model = random_hf_model(family)
        model.save_pretrained(root / "hf")
        convert_hf(root / "hf", root / "converted")
        cfg, params, _ = load_params(root / "converted" / "checkpoint")
        _, compute = stored_configs(root / "converted" / "checkpoint")
        cases[family] = (model, cfg, compute, params)
    return cases


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_converted_model_logits_on_the_chip_match_transformers(converted, family):
    from tests.test_hf_parity import batch, engine_logits, hf_logits

    model, cfg, compute, params = converted[family]
    tokens, mask = batch()
    valid = mask.astype(bool)
    ref = hf_logits(model, tokens, mask)
    with HIGHEST():
        f32 = engine_logits(cfg, compute, params, tokens, mask)
    bf16_compute = compute.model_copy(update={"dtype": "bfloat16"})
    bf16 = engine_logits(cfg, bf16_compute, params, tokens, mask)
    host_compute = bf16_compute.model_copy(update={"attention_impl": "blocked"})  # "auto" would pick for the TPU
    with jax.default_device(cpu()):
        bf16_host = engine_logits(cfg, host_compute, jax.device_put(params, cpu()), tokens, mask)
    errors = {
        "float32_highest": float(np.abs(f32 - ref)[valid].max()),
        "bfloat16": float(np.abs(bf16 - ref)[valid].max()),
        "bfloat16_on_cpu": float(np.abs(bf16_host - ref)[valid].max()),
    }
    report(f"{family} logits vs transformers", **errors)
    # Four significant digits of the largest logit: the chip's exp and tanh (Gemma 2's soft-caps)
    # carry four to five even at the highest matmul precision.
    assert errors["float32_highest"] <= 1e-4 * float(np.abs(ref[valid]).max())
    assert errors["bfloat16"] <= 2 * errors["bfloat16_on_cpu"] + 1e-2
    assert np.abs(ref[valid]).max() > 0.5
