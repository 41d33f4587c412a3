"""Context parallelism: a mesh `context` axis splits each sequence's positions over its devices
(engine/ops/attention.py, "Context parallelism"). Attention gathers the keys and values and
runs each device's queries at their offset; everything else is position-wise. The same
numbers as one device, in attention, a training step, a mixture of experts and sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from engine.config import ConfigError, load_config, load_preset
from engine.inference.sample import Sampler
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.params import init_params, param_shardings
from engine.ops import attention as attention_ops
from engine.ops.attention_blocked import blocked_attention
from engine.ops.attention_reference import reference_attention
from engine.ops.attention_splash import _kernel, balanced, balanced_order
from engine.ops.partitioning import MESH_AXES, use_mesh
from engine.parallel.config import MeshConfig
from engine.parallel.mesh import make_mesh
from engine.posttrain.config import GRPOConfig
from engine.train.config import TrainConfig
from engine.train.trainer import Trainer

B, T, N, K, H = 4, 64, 4, 2, 16
SEGMENTS = np.ones((B, T), np.int32)
SEGMENTS[0, 20:] = 2  # a document boundary inside the first context shard of 4
SEGMENTS[1, 40:] = 0  # padding
SEGMENTS[2, :10], SEGMENTS[2, 10:33], SEGMENTS[2, 33:] = 1, 2, 3  # boundaries across shard edges


def _mesh(data=1, expert=1, fsdp=1, context=1, tensor=1) -> Mesh:
    shape = (data, expert, fsdp, context, tensor)
    return Mesh(np.asarray(jax.devices()[: int(np.prod(shape))]).reshape(shape), MESH_AXES)


def _draw(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


_ONE_DEVICE: dict = {}  # case id -> blocked attention on one device: its values, loss and gradients


@pytest.mark.parametrize(
    "axes",
    [dict(context=2), dict(data=2, context=2, tensor=2), dict(fsdp=2, context=4)],
    ids=["context2", "data2-context2-tensor2", "fsdp2-context4"],
)
@pytest.mark.parametrize(
    "case",
    [dict(), dict(window=24, local=True), dict(softcap=5.0), dict(sinks=True)],
    ids=["global", "window", "softcap", "sinks"],
)
def test_context_parallel_attention_equals_one_device_in_values_and_gradients(axes, case):
    """Values and the gradients of q, k, v (and sinks) equal `blocked` on one device, over
    packed documents whose boundaries fall inside and across the shards' edges; each device's
    shard_map body holds its own t / C queries (and b / batch rows, n / tensor heads) only.
    The one-device program depends on the case, not the mesh: it compiles once per case, and
    each side's values and gradients come from one program."""
    rng = np.random.default_rng(0)
    q, k, v, probe = _draw(rng, B, T, N, H), _draw(rng, B, T, K, H), _draw(rng, B, T, K, H), _draw(rng, B, T, N, H)
    sinks = _draw(rng, N) if case.get("sinks") else None
    segments = jnp.asarray(SEGMENTS)
    valid = (segments != 0)[:, :, None, None]
    window = case.get("window")
    kwargs = dict(scale=0.3, block=16, softcap=case.get("softcap"))
    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)

    def values_and_grads(fn):
        loss = lambda q, k, v, s: jnp.sum(fn(q, k, v, s) * probe * valid)  # noqa: E731
        return jax.jit(lambda q, k, v, s: (fn(q, k, v, s), jax.value_and_grad(loss, argnums=argnums)(q, k, v, s)))

    one = lambda q, k, v, s: blocked_attention(q, k, v, segments, window=window, sinks_n=s, **kwargs)  # noqa: E731
    mesh = _mesh(**axes)

    def sharded(q, k, v, s):
        with use_mesh(mesh):
            return attention_ops.attention(
                q, k, v, segments, impl="blocked", window=window, local=bool(case.get("local")), sinks_n=s, **kwargs
            )

    key = repr(sorted(case.items()))
    if key not in _ONE_DEVICE:
        _ONE_DEVICE[key] = values_and_grads(one)(q, k, v, sinks)
    want_out, (want_loss, want_grads) = _ONE_DEVICE[key]
    got_out, (got_loss, got_grads) = values_and_grads(sharded)(q, k, v, sinks)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-5)
    for name, a, b in zip("qkvs", want_grads, got_grads):
        np.testing.assert_allclose(b, a, atol=1e-5 * float(np.abs(a).max()), err_msg=f"d{name}")
    np.testing.assert_allclose(got_out * valid, want_out * valid, atol=2e-6)

    bodies = [e for e in jax.make_jaxpr(sharded)(q, k, v, sinks).jaxpr.eqns if e.primitive.name == "shard_map"]
    assert len(bodies) == 1
    local_q = bodies[0].params["jaxpr"].invars[0].aval.shape
    rows = B // (axes.get("data", 1) * axes.get("fsdp", 1))
    assert local_q == (rows, T // axes["context"], N // axes.get("tensor", 1), H)


def _eqns(jaxpr, primitive: str) -> list:
    """The equations of `primitive` in `jaxpr` and in the jaxprs nested in it (scans, custom
    VJPs, shard_maps)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            found.append(eqn)
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else [param]:
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    found += _eqns(inner, primitive)
    return found


SPLASH_CASES = [  # (mesh axes, positions, case): 256 positions in shards of 128 keep their order;
    # 512 and more take the load-balanced layout (two half-chunks of 128 or more per shard)
    *[
        (axes, 256, case)
        for axes in (dict(context=2), dict(data=2, context=2, tensor=2))
        for case in (dict(), dict(window=40), dict(sinks=True))
    ],
    *[
        (axes, 512, case)
        for axes in (dict(context=2), dict(data=2, context=2, tensor=2))
        for case in (dict(), dict(window=200))
    ],
    (dict(context=4), 1024, dict(window=200, sinks=True)),
]


_REFERENCE: dict = {}  # (positions, case) -> the reference's loss and gradients


@pytest.mark.parametrize(
    "axes, t, case",
    SPLASH_CASES,
    ids=lambda v: "-".join(f"{k}{x}" for k, x in v.items()) or "global" if isinstance(v, dict) else str(v),
)
def test_splash_with_context_parallelism_equals_the_reference(axes, t, case):
    """The TPU kernel, made once for the whole mask with its tables split by query rows over
    `context` (run here in the Pallas interpreter): values and gradients equal the reference's
    over packed documents whose boundaries fall inside and across shards and half-chunks, in
    the contiguous layout and in the load-balanced one."""
    rng = np.random.default_rng(2)
    b, h = 2, 64
    q, k, v, probe = _draw(rng, b, t, N, h), _draw(rng, b, t, K, h), _draw(rng, b, t, K, h), _draw(rng, b, t, N, h)
    sinks = _draw(rng, N) if case.get("sinks") else None
    segments = np.ones((b, t), np.int32)
    segments[0, 100:], segments[0, 300:], segments[1, t - 56 :] = 2, 3, 0  # documents; padding at the end
    segments = jnp.asarray(segments)
    valid = (segments != 0)[:, :, None, None]
    window = case.get("window")
    mesh = _mesh(**axes)

    def sharded(q, k, v):
        with use_mesh(mesh):
            return attention_ops.attention(
                q, k, v, segments, impl="splash", scale=0.125, window=window, local=window is not None, sinks_n=sinks
            )

    def one(q, k, v):
        return reference_attention(q, k, v, segments, scale=0.125, window=window, sinks_n=sinks)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * probe * valid)

    key = (t, repr(sorted(case.items())))  # the reference does not depend on the mesh: once per (t, case)
    if key not in _REFERENCE:
        _REFERENCE[key] = jax.jit(jax.value_and_grad(loss(one), argnums=(0, 1, 2)))(q, k, v)
    got, got_grads = jax.jit(jax.value_and_grad(loss(sharded), argnums=(0, 1, 2)))(q, k, v)
    want, want_grads = _REFERENCE[key]
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for name, a, g in zip("qkv", want_grads, got_grads):
        np.testing.assert_allclose(g, a, atol=1e-5 * float(np.abs(a).max()), err_msg=f"d{name}")
    (body,) = _eqns(jax.make_jaxpr(sharded)(q, k, v).jaxpr, "shard_map")
    # q, k, v enter as (b, heads, t / C, h); the kernel's mask tables come before them.
    lengths = [x.aval.shape[2] for x in body.params["jaxpr"].invars if x.aval.ndim == 4 and x.aval.shape[3] == h]
    assert lengths == [t // axes["context"]] * 3
    # The balanced layout exchanges half-chunks between shards (ppermutes), the contiguous one does not.
    assert bool(_eqns(body.params["jaxpr"], "ppermute")) == balanced(t, axes["context"])


@pytest.mark.parametrize("t, shards", [(8192, 2), (8192, 4), (16384, 8)])
def test_the_balanced_layout_gives_every_shard_the_same_number_of_tiles(t, shards):
    """The splash kernel's own block tables (which (query block, key block) tiles it computes):
    with each shard's positions in order the last shard computes the most; in the balanced
    layout (half-chunks d and 2C - 1 - d) every shard computes the same number, fewer than
    that last one (8,192 positions over 4 shards: 34 each against 10, 26, 42 and 58)."""

    def tiles(rows):
        table = np.asarray(_kernel(1, t, None, None, True, q_seq_shards=shards, rows=rows).fwd_mask_info.block_mask)
        return [int((part != 0).sum()) for part in np.array_split(table[0], shards, axis=0)]

    contiguous, balanced_tiles = tiles(None), tiles(balanced_order(t, shards))
    assert contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1]
    assert len(set(balanced_tiles)) == 1 and balanced_tiles[0] < contiguous[-1]
    assert sum(balanced_tiles) == sum(contiguous)  # the same causal work, spread evenly


@pytest.mark.parametrize("window", [None, 24])
def test_a_context_shard_takes_every_key_on_a_global_layer_and_its_window_on_a_local_one(window):
    """Each shard's offset is its index times t / C, a traced value: on a global layer every
    query block multiplies its 16 queries by all 64 gathered keys; on a sliding-window layer
    by its window of them only (16 + 24 - 1 keys, from a start computed on the device)."""
    rng = np.random.default_rng(1)
    q, k, v = _draw(rng, 1, T, 2, H), _draw(rng, 1, T, 2, H), _draw(rng, 1, T, 2, H)
    mesh = _mesh(context=4)

    def fn(q, k, v):
        with use_mesh(mesh):
            return attention_ops.attention(
                q, k, v, None, impl="blocked", scale=0.25, block=16, window=window, local=window is not None
            )

    # The forward's score products: (b, kv heads, 16 query rows, h) x (b, kv heads, keys, h).
    products = [
        tuple(v.aval.shape for v in e.invars[:2]) for e in _eqns(jax.make_jaxpr(fn)(q, k, v).jaxpr, "dot_general")
    ]
    scores = [rhs for lhs, rhs in products if lhs[2:] == (16, H)]
    assert scores and {rhs[2] for rhs in scores} == {T if window is None else 16 + 24 - 1}
    want = blocked_attention(q, k, v, scale=0.25, block=16, window=window)
    np.testing.assert_allclose(jax.jit(fn)(q, k, v), want, atol=2e-6)


def _trainer(mesh: dict, devices: int) -> Trainer:
    model = dict(
        vocab_size=38,
        d_model=24,
        num_layers=3,
        num_heads=6,
        num_kv_heads=2,
        head_dim=10,
        mlp_dim=28,
        max_seq_len=64,
        sliding_window=6,
        attention_pattern=["local", "global"],
    )
    cfg = load_config(tree={"model": model, "mesh": mesh, "data": {"batch_size": 8, "seq_len": 16}}, schema=TrainConfig)
    return Trainer(cfg, devices=jax.devices()[:devices])


@pytest.mark.parametrize(
    "mesh",
    [dict(data=2, context=2, tensor=2), dict(data=1, fsdp=2, context=4)],
    ids=["data2-context2-tensor2", "fsdp2-context4"],
)
def test_a_training_step_with_context_parallelism_equals_one_device(mesh):
    """Packed rows (a document boundary, padding) through sliding-window and global layers:
    the loss and every gradient equal one device's; the parameters are split over `context`
    as over `fsdp`, and the hidden states over it along the sequence."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 38, (8, 17)).astype(np.int32)
    segments = np.ones((8, 16), np.int32)
    segments[0, 5:], segments[1, 12:] = 2, 0
    positions = np.tile(np.arange(16, dtype=np.int32), (8, 1))
    positions[0, 5:] -= 5
    batch_np = {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": positions,
        "segment_ids": segments,
        "loss_mask": (segments > 0).astype(np.float32),
    }

    def step(trainer):
        params = init_params(trainer.cfg.model, trainer.cfg.compute, trainer.mesh, seed=0)
        batch = trainer.global_batch(batch_np)
        grad_fn = jax.jit(
            jax.value_and_grad(trainer.objective.loss_fn, has_aux=True),
            in_shardings=(trainer.param_shardings, trainer.batch_sharding, None),
        )
        with use_mesh(trainer.mesh):
            compiled = grad_fn.lower(params, batch, jnp.float32(120)).compile()
            traced = jax.make_jaxpr(trainer.objective.loss_fn)(params, batch, jnp.float32(120))
        (loss, _), grads = compiled(params, batch, jnp.float32(120))
        return params, float(loss), grads, traced

    if "step" not in _ONE_DEVICE:  # the same one-device step for every mesh: computed once
        _ONE_DEVICE["step"] = step(_trainer({"data": 1}, 1))
    (_, loss_1, grads_1, _), (params_n, loss_n, grads_n, traced) = _ONE_DEVICE["step"], step(_trainer(mesh, 8))
    assert np.isfinite(loss_1) and loss_n == pytest.approx(loss_1, rel=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_1), jax.tree.leaves(grads_n)):
        np.testing.assert_allclose(
            b, a, rtol=1e-4, atol=1e-6 * float(np.abs(a).max()), err_msg=jax.tree_util.keystr(path)
        )
    wq = params_n["blocks"]["attn"]["wq_dnh"]
    assert wq.sharding.spec == P(None, ("fsdp", "context"), "tensor", None)
    assert wq.addressable_shards[0].data.shape[1] == 24 // (mesh.get("fsdp", 1) * mesh["context"])
    # Every layer's attention ran per context shard, on its rows' t / C queries.
    queries = {e.params["jaxpr"].invars[0].aval.shape[1] for e in _eqns(traced.jaxpr, "shard_map")}
    assert queries == {16 // mesh["context"]}


def test_context_parallelism_divides_a_long_sequences_activation_memory():
    """Two rows of 1,024 positions (the tiny model): the compiled step's temporaries per device
    fall as the context axis grows (fsdp=2 alone, then x context 2, x context 4), to under
    0.6x at 4 shards (0.45x; bench/context_parallel.py measures 2,048 positions and more,
    whose three compiles cost a test more). Each device's queries see every key (an offset
    the device computes), so the score tiles do not shrink as the hidden states do."""
    from bench.context_parallel import cpu_temporaries

    temporaries = [cpu_temporaries(1024, context) for context in (1, 2, 4)]
    assert temporaries[0] > temporaries[1] > temporaries[2]
    assert temporaries[2] < 0.6 * temporaries[0], temporaries


def test_the_parameters_of_a_mesh_without_context_are_split_as_before():
    """A context axis of one device leaves every parameter's spec as it was without the axis."""
    cfg = ModelConfig(vocab_size=38, d_model=24, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=10, mlp_dim=28)
    _, shardings = param_shardings(cfg, ComputeConfig(), make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
    assert shardings["blocks"]["attn"]["wq_dnh"].spec == P(None, "fsdp", "tensor", None)
    assert shardings["embed_vd"].spec == P("tensor", "fsdp")


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_a_mixture_of_experts_with_context_parallelism_equals_one_device(family):
    """expert=2 x context=2 x data=2: each device's tokens are its rows' slice of positions;
    they reach their experts by all-to-all, and loss, balance loss and gradients equal one
    device's. DeepSeek-V3: latent attention (values narrower than the keys), dense first
    layers, grouped sigmoid routing, a shared expert."""
    from tests.test_moe import assert_mesh_step_equals_one_device, random_params, tiny

    if family == "mixtral":
        cfg, vocab = tiny(num_layers=2, num_experts=4, mlp_dim=8), 37
    else:
        tree = load_preset("tiny-deepseek-v3", "test")
        tree.pop("compute", None)
        cfg, vocab = ModelConfig(**{**tree, "vocab_size": 64}), 64
    compute = ComputeConfig(moe_dispatch="dropless")
    tokens = np.random.default_rng(0).integers(0, vocab, (8, 16))
    segments = np.ones((8, 16), np.int32)
    segments[3, 11:], segments[0, 6:] = 0, 2  # padding; a second document across the shards' edge
    positions = np.broadcast_to(np.arange(16), (8, 16)).copy()
    positions[0, 6:] -= 6
    batch = {
        "tokens": tokens,
        "positions": positions,
        "segment_ids": segments,
        "targets": np.roll(tokens, -1, 1),
        "loss_mask": (segments > 0).astype(np.float32),
    }
    assert_mesh_step_equals_one_device(
        cfg, compute, random_params(cfg, compute, std=0.2), batch, MeshConfig(data=2, expert=2, context=2)
    )


def test_sampling_on_a_context_parallel_mesh_equals_one_device():
    """The prompts' prefill splits its hidden states' positions over `context` (its attention
    over the KV cache runs unsplit) and the decode steps (one position) do not split: the
    same tokens and log-probabilities as one device."""
    cfg = ModelConfig(
        vocab_size=38, d_model=24, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=10, mlp_dim=26, max_seq_len=64
    )
    params = init_params(cfg, ComputeConfig(), make_mesh(MeshConfig(data=1), jax.devices()[:1]), seed=0)
    prompts = np.random.default_rng(5).integers(1, 38, (4, 8)).astype(np.int32)
    mask = np.ones_like(prompts, bool)
    mask[1, :3] = False  # left padding
    settings = dict(max_new_tokens=6, seed=3, top_k=12)
    one = Sampler(cfg)(params, prompts, mask, **settings)
    mesh = make_mesh(MeshConfig(data=2, context=2, tensor=2))
    _, shardings = param_shardings(cfg, ComputeConfig(), mesh)
    sharded = Sampler(cfg, ComputeConfig(), mesh, shardings)(
        jax.device_put(params, shardings), prompts, mask, **settings
    )
    np.testing.assert_array_equal(sharded.tokens, one.tokens)
    np.testing.assert_allclose(sharded.logprobs, one.logprobs, atol=1e-5)


def test_what_context_parallelism_cannot_take_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"data.seq_len \(30\) must be divisible by the mesh's context axis \(4 "):
        load_config(tree={"model": "tiny", "mesh": {"context": 4}, "data": {"seq_len": 30}}, schema=TrainConfig)
    with pytest.raises(ConfigError, match=r"data.seq_len \(30\) must be divisible by the mesh's context axis \(4 "):
        Trainer(
            load_config(
                tree={"model": "tiny", "mesh": {"data": 2, "context": -1}, "data": {"seq_len": 30}}, schema=TrainConfig
            )
        )
    with pytest.raises(
        ConfigError,
        match=r"max_prompt_length \+ max_completion_length \(5\) must be divisible "
        r"by the mesh's context axis \(2 devices\)",
    ):
        load_config(
            tree={
                "mesh": {"context": 2},
                "max_prompt_length": 3,
                "max_completion_length": 2,
                "data": {"path": "prompts.jsonl"},
                "rewards": [{"function": "exact_match"}],
            },
            schema=GRPOConfig,
        )
    # The CPU kernel takes no query offset: by name it is refused, naming the axis; auto runs blocked.
    with pytest.raises(
        ConfigError,
        match=r"cpu_kernel cannot run this model: context parallelism "
        r"\(mesh axis context=2\)",
    ):
        attention_ops.choose_implementation(
            "cpu_kernel", platform="cpu", dtype=jnp.float32, head_dim=16, seq_len=64, context=2
        )
    assert (
        attention_ops.choose_implementation(
            "auto", platform="cpu", dtype=jnp.float32, head_dim=16, seq_len=64, context=2
        )
        == "blocked"
    )
    # Splash splits its mask by query rows: each shard's positions must be whole 128-lane blocks.
    tpu = dict(platform="tpu", dtype=jnp.bfloat16, head_dim=128)
    assert attention_ops.choose_implementation("auto", seq_len=1024, context=2, **tpu) == "splash"
    assert attention_ops.choose_implementation("auto", seq_len=384, context=2, **tpu) == "blocked"
    with pytest.raises(ConfigError, match=r"each context shard's 192 positions \(mesh axis context=2\)"):
        attention_ops.choose_implementation("splash", seq_len=384, context=2, **tpu)
    # A length that does not divide (a prefill of 7 positions) is not split.
    assert attention_ops.context_shards(_mesh(context=2), 7) == 1
    assert attention_ops.context_shards(_mesh(context=2), 8) == 2
