"""The C++ decode-attention kernel (engine/ops/cpu_kernels): the reference's numbers, slots
past a row's last visible one never read, one complete library per build however many
processes build at once, and a fallback or a clear error where it cannot be built."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import ConfigError
from engine.ops import attention, cpu_kernels
from engine.ops.attention import BF16_BITS, choose_decode_implementation, stored
from engine.ops.attention_reference import _one_query_attention
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
    return stored(q, dtype), stored(jnp.asarray(k), dtype), stored(jnp.asarray(v), dtype), jnp.asarray(mask), shared, \
        sinks_kg


def reference(q, k, v, mask, shared, sinks_kg, *, scale, softcap):
    q, k, v = (attention.cache_values(x) for x in (q, k, v))
    if shared is not None:
        shared = (attention.cache_values(shared[0]), attention.cache_values(shared[1]), *shared[2:])
    return _one_query_attention(q[:, None], k.transpose(0, 3, 1, 2), v.swapaxes(1, 2), mask[:, None], scale=scale,
                                softcap=softcap, sinks_kg=sinks_kg, shared=shared)


def kernel(q, k, v, mask, shared, sinks_kg, *, scale, softcap):
    group = None if shared is None else shared[3]
    fn = jax.jit(lambda q, k, v, mask, prefix: cpu_kernels.decode_attention(
        attention.cache_values(q), k, v, mask, None if prefix is None else (*prefix, group), scale=scale,
        softcap=softcap, sinks_kg=sinks_kg))
    return fn(q, k, v, mask, None if shared is None else shared[:3])


@pytest.fixture(scope="module", autouse=True)
def built():
    if cpu_kernels.compiler() is None:
        pytest.skip("no C++ compiler on this machine: the engine decodes with XLA's lowering")
    reason = cpu_kernels.unavailable("decode_attention")
    assert reason is None, reason  # with a compiler, the kernel must build


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
    options = dict(plain={}, shared_prefix=dict(group=4), softcap_and_sinks=dict(softcap=2.5, sinks=True),
                   prefix_and_sinks=dict(group=2, sinks=True))[variant]
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
    np.testing.assert_allclose(ours, np.asarray(reference(q, k, v, mask, None, None, scale=0.2, softcap=None)),
                               atol=2e-6)


def test_auto_and_named_choice():
    assert choose_decode_implementation("auto", platform="cpu", devices=1) == "cpu_kernel"
    assert choose_decode_implementation("auto", platform="cpu", devices=8) == "reference"
    assert choose_decode_implementation("auto", platform="gpu", devices=1) == "reference"
    assert choose_decode_implementation("reference", platform="cpu", devices=1) == "reference"
    with pytest.raises(ConfigError, match=r"compute\.decode_attention_impl: cpu_kernel runs on CPU.*compiles for tpu"):
        choose_decode_implementation("cpu_kernel", platform="tpu", devices=1)
    with pytest.raises(ConfigError, match=r"compute\.decode_attention_impl: cpu_kernel runs on one device.*has 4"):
        choose_decode_implementation("cpu_kernel", platform="cpu", devices=4)


def test_a_failed_build_falls_back_under_auto_and_is_an_error_by_name(monkeypatch, tmp_path):
    """A compiler that fails: auto warns once and uses XLA's lowering, cpu_kernel by name is a
    ConfigError saying why, and no library (complete or partial) is left in the cache."""
    monkeypatch.setenv("TRAINFLOW_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # exits 1
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(attention, "_told", set())
    with pytest.warns(UserWarning, match="decode attention: auto uses reference, not cpu_kernel: .*compiling "
                                         "decode_attention.cc failed"):
        assert choose_decode_implementation("auto", platform="cpu", devices=1) == "reference"
    with pytest.raises(ConfigError, match=r"compute\.decode_attention_impl: the CPU kernel decode_attention is "
                                          r"unavailable: compiling decode_attention.cc failed"):
        choose_decode_implementation("cpu_kernel", platform="cpu", devices=1)
    assert [p.name for p in tmp_path.iterdir()] == ["decode_attention.lock"]


def test_processes_building_at_once_share_one_complete_library(tmp_path):
    script = "from engine.ops import cpu_kernels; print(cpu_kernels.build('decode_attention'))"
    env = {**os.environ, "TRAINFLOW_KERNEL_CACHE": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    libraries = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".so")
    assert len(paths) == 1 and len(libraries) == 1 and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert os.path.basename(paths.pop()) == libraries[0]
