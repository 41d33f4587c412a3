"""optimizer.moment_dtype: Adam's moments stored in their own dtype, the update computed in
float32. float32 parameters with bfloat16 moments are float32 master weights at 8 bytes of
state per parameter (docs/benchmarks.md: what fits one TPU v5e)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import ConfigError, load_config
from engine.train.config import OptimizerConfig, ScheduleConfig, TrainConfig
from engine.train.optimizer import make_optimizer
from engine.train.pretrain import run_pretrain
from engine.train.trainer import Trainer
from tasks.registry import get_stage_kind
from tests.test_train import assert_resumes_bitwise, tiny_config


def _params_and_grads(dtype):
    """Odd sizes: a matrix that decays, an embedding and a norm scale that do not."""
    rng = np.random.default_rng(0)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    params = {"embed_vd": draw(17, 7), "w_df": draw(7, 11), "norm": {"scale": draw(7)}}
    return params, jax.tree.map(lambda p: draw(*p.shape) * 0.1, params)


def _adam(params, moment_dtype):
    return make_optimizer(OptimizerConfig(moment_dtype=moment_dtype), ScheduleConfig(), 10, params)[0]


def _moments(state) -> list:
    return [leaf for leaf in jax.tree.leaves(state) if jnp.issubdtype(leaf.dtype, jnp.floating)]


def test_bfloat16_moments_round_the_float32_state_after_an_update_computed_in_float32():
    """Two steps beside the float32-moment optimizer: the first update (from zero moments) is the
    float32 one bitwise, the moments then are its moments rounded to bf16, and the second update
    is the float32 optimizer's from those rounded moments: the rounding happens once, on storing."""
    params, grads = _params_and_grads(jnp.float32)
    narrow, wide = _adam(params, "bfloat16"), _adam(params, "float32")
    state, reference = narrow.init(params), wide.init(params)
    assert {m.dtype for m in _moments(state)} == {jnp.dtype(jnp.bfloat16)}
    assert {m.dtype for m in _moments(reference)} == {jnp.dtype(jnp.float32)}
    for _ in range(2):
        updates, state = narrow.update(grads, state, params)
        expected, reference = wide.update(grads, reference, params)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), updates, expected)
        assert all(u.dtype == jnp.float32 for u in jax.tree.leaves(updates))
        for got, want in zip(_moments(state), _moments(reference)):
            assert got.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))
        reference = jax.tree.map(lambda r: r.astype(jnp.bfloat16).astype(r.dtype), reference)  # what was stored


def test_bfloat16_parameters_with_float32_moments_update_in_float32_and_the_default_follows_the_parameters():
    """bf16 parameters and gradients, float32 moments: the update is the float32 optimizer's on
    the same values cast up, bitwise; unset, the moments are the parameters' bf16 (as before)."""
    params, grads = _params_and_grads(jnp.bfloat16)
    wide = _adam(params, "float32")
    updates, state = wide.update(grads, wide.init(params), params)
    up = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # noqa: E731
    reference = _adam(up(params), None)
    expected, expected_state = reference.update(up(grads), reference.init(up(params)), up(params))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), updates, expected)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state, expected_state)
    assert {m.dtype for m in _moments(_adam(params, None).init(params))} == {jnp.dtype(jnp.bfloat16)}


def test_the_trainers_state_holds_the_moments_in_the_configured_dtype(byte_dataset, tmp_path):
    cfg = tiny_config(byte_dataset, tmp_path, **{"optimizer.moment_dtype": "bfloat16"})
    trainer = Trainer(cfg)
    assert {a.dtype for a in jax.tree.leaves(trainer.abstract_params)} == {jnp.dtype(jnp.float32)}
    assert {m.dtype for m in _moments(trainer.abstract_opt_state)} == {jnp.dtype(jnp.bfloat16)}


def test_a_run_with_bfloat16_moments_resumes_to_bitwise_identical_parameters(byte_dataset, tmp_path, capfd):
    """float32 master weights, bf16 compute and moments: six steps in one go, and the same run
    resumed from its step-3 checkpoint (the moments restored in bf16), end bitwise equal."""
    overrides = {
        "steps": 6,
        "checkpoint.every_steps": 3,
        "compute.dtype": "bfloat16",
        "optimizer.moment_dtype": "bfloat16",
    }
    run_pretrain(tiny_config(byte_dataset, tmp_path / "whole", **overrides))
    assert_resumes_bitwise(byte_dataset, tmp_path, capfd, "whole", **overrides)


def test_unset_moment_dtype_stays_out_of_artifact_ids_and_a_set_one_enters_them():
    """As host_offload at false: a default config's id is the id of before the two fields."""
    kind = get_stage_kind("pretrain")
    base = {"model": "tiny", "steps": 3, "data": {"seq_len": 32, "batch_size": 4}}
    prints = {
        dtype: kind.fingerprint(kind.resolve_config({**base, "optimizer": {"moment_dtype": dtype}}, "t.yaml"))
        for dtype in (None, "bfloat16")
    }
    assert not {"moment_dtype", "host_offload"} & set(prints[None]["optimizer"])
    assert prints["bfloat16"]["optimizer"]["moment_dtype"] == "bfloat16"
    assert prints[None] == kind.fingerprint(kind.resolve_config(base, "t.yaml"))


def test_a_bad_moment_dtype_is_refused_in_one_sentence_naming_the_key():
    with pytest.raises(ConfigError) as refused:
        load_config(tree={"model": "tiny", "optimizer": {"moment_dtype": "float16"}}, schema=TrainConfig)
    message = str(refused.value)
    assert "optimizer.moment_dtype" in message and "'bfloat16'" in message and "float16" in message
    assert "\n" not in message
