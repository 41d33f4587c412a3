"""The C++ kernels (engine/ops/cpu_kernels): decode attention and training attention give the
reference's numbers (training attention: its gradients too), decode never reads slots past a
row's last visible one, one complete library per build however many processes build at
once, and a fallback or a clear error where a kernel cannot be built or cannot take the case."""

import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from engine.config import ConfigError
from engine.ops import attention, cpu_kernels
from engine.ops.attention import BF16_BITS, choose_decode_implementation, choose_implementation, stored
from engine.ops.attention_reference import _one_query_attention, reference_attention
from engine.ops.partitioning import MESH_AXES, use_mesh
from tests.conftest import REPO

# 8 rows, 2 kv heads of 3 query heads, head_dim 32 (two 16-lane vectors), 70 own slots (a
# 64-slot block, a 16-slot one is not whole: the scalar tail) and a 21-slot shared prefix.
B, K, G, H, S, P = 8, 2, 3, 32, 70, 21


def case(dtype, *, group=0, softcap=None, sinks=False, seed=0, G=G, H=H, S=S):
    """(q, keys, values, mask, shared or None, sinks or None), stored as a cache of `dtype`
    stores them, with masks full of holes, rows of every length and one row that sees
    nothing (the reference's uniform average, or the sinks alone)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, K, G, H)), jnp.float32)
    k, v = rng.normal(size=(B, K, H, S)), rng.normal(size=(B, K, S, H))
    mask = rng.random((B, S)) < 0.7
    mask[np.arange(B)[:, None] < np.arange(S)[None] - np.arange(B)[:, None] * 9 - 5] = False  # rows end early
    mask[1] = False
    shared = None
    if group:
        prompts = B // group
        kp, vp = rng.normal(size=(prompts, K, H, P)), rng.normal(size=(prompts, K, P, H))
        mask_p = rng.random((prompts, P)) < 0.6
        shared = (stored(jnp.asarray(kp), dtype), stored(jnp.asarray(vp), dtype), jnp.asarray(mask_p), group)
    sinks_kg = jnp.asarray(rng.normal(size=(K, G)) + 1.0, jnp.float32) if sinks else None
    return (
        stored(q, dtype),
        stored(jnp.asarray(k), dtype),
        stored(jnp.asarray(v), dtype),
        jnp.asarray(mask),
        shared,
        sinks_kg,
    )


def reference(q, k, v, mask, shared, sinks_kg, *, scale, softcap):
    q, k, v = (attention.cache_values(x) for x in (q, k, v))
    if shared is not None:
        shared = (attention.cache_values(shared[0]), attention.cache_values(shared[1]), *shared[2:])
    return _one_query_attention(
        q[:, None],
        k.transpose(0, 3, 1, 2),
        v.swapaxes(1, 2),
        mask[:, None],
        scale=scale,
        softcap=softcap,
        sinks_kg=sinks_kg,
        shared=shared,
    )


def kernel(q, k, v, mask, shared, sinks_kg, *, scale, softcap):
    group = None if shared is None else shared[3]
    fn = jax.jit(
        lambda q, k, v, mask, prefix: cpu_kernels.decode_attention(
            attention.cache_values(q),
            k,
            v,
            mask,
            None if prefix is None else (*prefix, group),
            scale=scale,
            softcap=softcap,
            sinks_kg=sinks_kg,
        )
    )
    return fn(q, k, v, mask, None if shared is None else shared[:3])


@pytest.fixture(scope="module", autouse=True)
def built():
    if cpu_kernels.compiler() is None:
        pytest.skip("no C++ compiler on this machine: the engine decodes with XLA's lowering")
    for name in cpu_kernels.SOURCES:
        reason = cpu_kernels.unavailable(name)
        assert reason is None, reason  # with a compiler, every kernel must build


@pytest.mark.parametrize("heads, head_dim, slots", [(5, 48, 20), (8, 64, 140), (1, 10, 9)])
def test_other_group_sizes_head_dims_and_lengths(heads, head_dim, slots):
    """Query groups of 5 (3 + 2), 8 (3 + 3 + 2) and 1, head_dims of 3 vectors, 4 (one block)
    and 10 (no whole vector: the scalar path), and slot counts with and without whole blocks."""
    args = case(BF16_BITS, group=2, sinks=True, G=heads, H=head_dim, S=slots)
    ours = np.asarray(kernel(*args, scale=0.3, softcap=None).astype(jnp.float32))
    theirs = np.asarray(reference(*args, scale=0.3, softcap=None).astype(jnp.float32))
    assert ours.shape == (B, K, heads, head_dim)
    np.testing.assert_allclose(ours, theirs, atol=2**-7, rtol=2**-7)


@pytest.mark.parametrize("dtype", [jnp.float32, BF16_BITS], ids=["float32", "bfloat16_bits"])
@pytest.mark.parametrize("variant", ["plain", "shared_prefix", "softcap_and_sinks", "prefix_and_sinks"])
def test_the_kernel_equals_the_reference(dtype, variant):
    options = dict(
        plain={},
        shared_prefix=dict(group=4),
        softcap_and_sinks=dict(softcap=2.5, sinks=True),
        prefix_and_sinks=dict(group=2, sinks=True),
    )[variant]
    softcap = options.get("softcap")
    args = case(dtype, **options)
    ours = np.asarray(kernel(*args, scale=0.2, softcap=softcap).astype(jnp.float32))
    theirs = np.asarray(reference(*args, scale=0.2, softcap=softcap).astype(jnp.float32))
    assert ours.shape == (B, K, G, H)
    if dtype == jnp.float32:
        np.testing.assert_allclose(ours, theirs, atol=2e-6)
    else:  # both round probabilities and outputs to bfloat16; a sum order may flip a last bit
        np.testing.assert_allclose(ours, theirs, atol=2**-7, rtol=2**-7)


def test_slots_past_the_last_visible_one_are_never_read():
    """Unfilled cache slots may hold anything (NaN here): their probability is exactly 0, and
    the kernel does not read them."""
    q, k, v, mask, _, _ = case(jnp.float32)
    last = np.asarray(mask).shape[1] - np.argmax(np.asarray(mask)[:, ::-1], axis=1)  # 1 + the last visible slot
    beyond = np.arange(S)[None] >= last[:, None]
    beyond[1] = False  # the row that sees nothing reads every slot (uniformly)
    poisoned_k = jnp.where(jnp.asarray(beyond)[:, None, None, :], jnp.nan, k)
    poisoned_v = jnp.where(jnp.asarray(beyond)[:, None, :, None], jnp.nan, v)
    ours = np.asarray(kernel(q, poisoned_k, poisoned_v, mask, None, None, scale=0.2, softcap=None))
    np.testing.assert_allclose(
        ours, np.asarray(reference(q, k, v, mask, None, None, scale=0.2, softcap=None)), atol=2e-6
    )


def test_auto_and_named_choice():
    unsplit = "3 rows do not divide over the 2 devices of the batch axes"
    assert choose_decode_implementation("auto", platform="cpu") == "cpu_kernel"
    assert choose_decode_implementation("auto", platform="cpu", unsplit=unsplit) == "reference"
    assert choose_decode_implementation("auto", platform="gpu") == "reference"
    assert choose_decode_implementation("reference", platform="cpu") == "reference"
    with pytest.raises(ConfigError, match=r"compute\.decode_attention_impl: cpu_kernel runs on CPU.*compiles for tpu"):
        choose_decode_implementation("cpu_kernel", platform="tpu")
    with pytest.raises(
        ConfigError,
        match=r"compute\.decode_attention_impl: cpu_kernel runs on each device's rows, "
        r"and 3 rows do not divide",
    ):
        choose_decode_implementation("cpu_kernel", platform="cpu", unsplit=unsplit)


@pytest.mark.parametrize(
    "shape, group, split",
    [((2, 1, 1, 1, 1), 4, True), ((2, 1, 2, 1, 1), 2, True), ((8, 1, 1, 1, 1), 4, False)],
    ids=["data2", "data2-fsdp2", "data8-prompts-do-not-divide"],
)
def test_under_a_mesh_a_decode_step_runs_per_shard_where_its_rows_and_prompts_divide(shape, group, split):
    """8 rows in groups sharing their prompt (GRPO's shared prefix), with sinks: on 2 and 4
    batch devices each runs the kernel on its rows and its prompts (one shard's shapes at the
    custom call); 2 prompts on 8 devices do not divide, so auto runs the reference there. The
    numbers are the reference's either way."""
    q, k, v, mask, shared, sinks_kg = case(BF16_BITS, group=group, sinks=True)
    q_btnh = attention.cache_values(q).reshape(B, 1, K * G, H)

    def step(impl):
        fn = jax.jit(
            lambda q, k, v, mask, prefix, sinks: attention.decode_attention(
                q, k, v, mask[:, None], impl=impl, scale=0.2, sinks_n=sinks, shared=(*prefix, group)
            )
        )
        args = (q_btnh, k, v, mask, shared[:3], sinks_kg.reshape(-1))
        return np.asarray(fn(*args).astype(jnp.float32)), fn.lower(*args).compile().as_text()

    mesh = Mesh(np.asarray(jax.devices()[: int(np.prod(shape))]).reshape(shape), MESH_AXES)
    with use_mesh(mesh):
        ours, hlo = step("auto")
    theirs, _ = step("reference")
    calls = [line for line in hlo.splitlines() if 'custom_call_target="trainflow_decode_attention"' in line]
    if split:
        rows = B // (shape[0] * shape[2])
        assert calls and all(f"[{rows},{K},{G},{H}]" in line for line in calls), calls
    else:
        assert not calls
        with use_mesh(mesh), pytest.raises(ConfigError, match="2 shared prompts do not divide over the 8 devices"):
            step("cpu_kernel")
    np.testing.assert_allclose(ours, theirs, atol=2**-7, rtol=2**-7)


def test_a_failed_build_falls_back_under_auto_and_is_an_error_by_name(monkeypatch, tmp_path):
    """A compiler that fails: auto warns once and uses XLA's lowering, cpu_kernel by name is a
    ConfigError saying why, and no library (complete or partial) is left in the cache."""
    monkeypatch.setenv("TRAINFLOW_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # exits 1
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(attention, "_told", set())
    with pytest.warns(
        UserWarning,
        match="decode attention: auto uses reference, not cpu_kernel: .*compiling decode_attention.cc failed",
    ):
        assert choose_decode_implementation("auto", platform="cpu") == "reference"
    with pytest.raises(
        ConfigError,
        match=r"compute\.decode_attention_impl: the CPU kernel decode_attention is "
        r"unavailable: compiling decode_attention.cc failed",
    ):
        choose_decode_implementation("cpu_kernel", platform="cpu")
    assert [p.name for p in tmp_path.iterdir()] == ["decode_attention.lock"]


def test_processes_building_at_once_share_one_complete_library(tmp_path):
    script = "from engine.ops import cpu_kernels; print(cpu_kernels.build('decode_attention'))"
    env = {**os.environ, "TRAINFLOW_KERNEL_CACHE": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    libraries = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".so")
    assert len(paths) == 1 and len(libraries) == 1 and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert os.path.basename(paths.pop()) == libraries[0]


# --------------------------------------------------------------------------- training attention


def training_case(b, t, n, kv, h, dtype, segments=None, seed=0):
    """q, k, v, a cotangent for the output that is 0 at padding (nothing reads a padding
    query's output in training), and segment ids (b, t)."""
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    segments = jnp.ones((b, t), jnp.int32) if segments is None else jnp.asarray(segments, jnp.int32)
    d_out = draw(b, t, n, h) * (segments != 0)[:, :, None, None].astype(dtype)
    return draw(b, t, n, h), draw(b, t, kv, h), draw(b, t, kv, h), d_out, segments


def kernel_and_reference(q, k, v, d_out, segments, window):
    """(output, (dq, dk, dv)) of the kernel and of the float32 reference, padding queries' outputs zeroed."""
    scale = q.shape[-1] ** -0.5
    valid = (segments != 0)[:, :, None, None]
    ker = lambda q, k, v: cpu_kernels.train_attention(q, k, v, segments, scale, window or 0)  # noqa: E731
    ref = lambda q, k, v: reference_attention(q, k, v, segments, scale=scale, window=window)  # noqa: E731

    def values_and_grads(fn, q, k, v, d_out):  # one program each: the forward, its vjp with d_out
        out, vjp = jax.vjp(fn, q, k, v)
        return jnp.where(valid, out, 0), vjp(d_out)

    f32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    run = jax.jit(values_and_grads, static_argnums=0)
    return run(ker, q, k, v, d_out), run(ref, *f32)


# Row 0: two documents and padding; row 1: one document; row 2: a document id that comes back
# after another (not contiguous runs: the kernel checks every key's id).
SEGMENTS_3x70 = [[1] * 30 + [2] * 31 + [0] * 9, [3] * 70, [1] * 20 + [2] * 20 + [1] * 30]


@pytest.mark.parametrize(
    "n, kv, h, window",
    [(6, 2, 64, None), (6, 2, 16, 9), (8, 1, 48, None), (4, 4, 32, 40)],
    ids=["gqa3-h64", "gqa3-h16-window", "gqa8-h48", "mha-h32-window"],
)
def test_training_attention_and_its_gradients_equal_the_reference(n, kv, h, window):
    """70 positions: two whole 32-position blocks and a partial one, keys padded to tiles of 32."""
    (out, grads), (ref_out, ref_grads) = kernel_and_reference(
        *training_case(3, 70, n, kv, h, jnp.float32, SEGMENTS_3x70), window
    )
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    for name, got, want in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"d{name}")


def test_training_attention_in_bfloat16_keeps_its_dtype_and_tracks_float32():
    q, k, v, d_out, segments = training_case(
        2, 96, 6, 2, 64, jnp.bfloat16, [[1] * 50 + [2] * 40 + [0] * 6, [1] * 96], seed=1
    )
    (out, grads), (ref_out, ref_grads) = kernel_and_reference(q, k, v, d_out, segments, None)
    assert out.dtype == jnp.bfloat16 and [g.dtype for g in grads] == [jnp.bfloat16] * 3
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=2e-2)
    for name, got, want in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(
            np.asarray(got, np.float32), want, atol=0.02 * float(jnp.abs(want).max()), err_msg=f"d{name}"
        )


def test_the_model_trains_through_the_kernel_as_through_blocked(monkeypatch):
    """A whole model's loss and gradients: auto (the kernel, on one CPU device; on an AVX2-only
    CPU auto leaves it for blocked, so it is taken as on AVX-512 here) against blocked."""
    monkeypatch.setattr(cpu_kernels, "has_avx512", lambda: True)
    from flax import nnx

    from engine.models.config import ComputeConfig, ModelConfig
    from engine.models.params import apply_model
    from engine.models.transformer import Transformer

    cfg = ModelConfig(
        vocab_size=61, d_model=48, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16, mlp_dim=64, max_seq_len=80
    )
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 61, (2, 80)))
    segments = jnp.asarray([[1] * 40 + [2] * 40, [1] * 80])

    def loss_and_grads(impl):
        graphdef, state = nnx.split(Transformer(cfg, ComputeConfig(attention_impl=impl), rngs=nnx.Rngs(0)))
        loss = lambda p: jnp.mean(jax.nn.log_softmax(apply_model(graphdef, p, tokens, None, segments)) ** 2)  # noqa
        return jax.jit(jax.value_and_grad(loss))(nnx.to_pure_dict(state))

    graphdef, state = nnx.split(Transformer(cfg, ComputeConfig(), rngs=nnx.Rngs(0)))
    hlo = jax.jit(lambda p: apply_model(graphdef, p, tokens, None, segments)).lower(nnx.to_pure_dict(state)).as_text()
    assert "trainflow_train_attention_fwd" in hlo  # auto took the kernel
    (loss, grads), (ref_loss, ref_grads) = loss_and_grads("auto"), loss_and_grads("blocked")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), grads, ref_grads)


@pytest.mark.parametrize(
    "shape", [(2, 1, 1, 1, 2), (4, 1, 1, 1, 1), (1, 1, 2, 1, 2)], ids=["data2-tensor2", "data4", "fsdp2-tensor2"]
)
def test_under_a_mesh_the_kernel_runs_per_shard_and_equals_blocked(shape):
    """On a mesh of several CPU devices the kernel runs in a shard_map, each device on its rows
    and (with a tensor axis) its kv heads with their query heads: values and gradients equal
    blocked's under the same mesh, and the custom call is in the compiled program."""
    rng = np.random.default_rng(4)
    draw = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, k, v, probe = draw(4, 70, 6, 16), draw(4, 70, 2, 16), draw(4, 70, 2, 16), draw(4, 70, 6, 16)
    segments = jnp.asarray([[1] * 30 + [2] * 33 + [0] * 7, [1] * 70, [5] * 20 + [6] * 50, [1] * 64 + [0] * 6])
    valid = (segments != 0)[:, :, None, None]

    def run(impl):
        def fn(q, k, v):
            return attention.attention(q, k, v, segments, impl=impl, scale=0.25, window=9, local=True)

        def values_and_grads(q, k, v):  # one program: the forward, its vjp with probe * valid
            out, vjp = jax.vjp(fn, q, k, v)
            return out * valid, vjp(probe * valid)

        compiled = jax.jit(values_and_grads).lower(q, k, v).compile()
        return *compiled(q, k, v), compiled.as_text()

    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(shape), MESH_AXES)
    with use_mesh(mesh):
        out, grads, hlo = run("cpu_kernel")
        ref_out, ref_grads, _ = run("blocked")
    calls = [line for line in hlo.splitlines() if 'custom_call_target="trainflow_train_attention_fwd"' in line]
    rows, heads = 4 // (shape[0] * shape[1] * shape[2]), 6 // shape[4]
    assert calls and all(f"f32[{rows},70,{heads},16]" in line for line in calls), calls  # one shard's
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    for name, got, want in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"d{name}")


def test_training_attention_choice(monkeypatch):
    """What auto takes for training on CPU, and why not the kernel. On a CPU without AVX-512
    auto takes blocked (the kernel lost 2.5x there); the reasons are checked as on AVX-512."""
    monkeypatch.setattr(attention, "_told", set())  # each reason's warning afresh
    case0 = dict(dtype=jnp.bfloat16, head_dim=64, seq_len=512, softcap=None, groups=3, value_dim=64)
    monkeypatch.setattr(cpu_kernels, "has_avx512", lambda: False)
    assert choose_implementation("auto", platform="cpu", **case0) == "blocked"
    monkeypatch.setattr(cpu_kernels, "has_avx512", lambda: True)
    case = dict(dtype=jnp.bfloat16, head_dim=64, seq_len=512, softcap=None, groups=3, value_dim=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning where the kernel runs
        assert choose_implementation("auto", platform="cpu", **case) == "cpu_kernel"
    for change, reason in [
        (dict(softcap=30.0), "no logit soft-cap"),
        (dict(sinks=True), "no attention sinks"),
        (dict(head_dim=72, value_dim=72), "multiple of 16"),
        (dict(value_dim=32), "alike"),
        (dict(groups=12), "at most 8"),
        (dict(dtype=jnp.float16), "not float16"),
    ]:
        attention._told.clear()  # two reasons share a message
        with pytest.warns(UserWarning, match=f"auto uses blocked, not cpu_kernel, on cpu: .*{reason}"):
            assert choose_implementation("auto", platform="cpu", **{**case, **change}) == "blocked"
        with pytest.raises(ConfigError, match=f"compute.attention_impl: cpu_kernel cannot run this model: .*{reason}"):
            choose_implementation("cpu_kernel", platform="cpu", **{**case, **change})
    with pytest.raises(
        ConfigError,
        match=r"compute\.attention_impl: cpu_kernel runs on CPU, and this run compiles "
        r"for gpu",
    ):
        choose_implementation("cpu_kernel", platform="gpu", **case)
