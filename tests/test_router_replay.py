"""Rollout routing replay (R3; engine/models/router_replay.py) on a tiny mixture of experts:

- a MoE layer under replay routes each token to exactly the replayed experts, weighted by the
  trainer's own router softmax over them (renormalised): its output equals the experts' MLPs
  written out by hand;
- the model's forward under replay uses exactly the replayed experts at every expert layer
  (recorded back while replaying), dense layers untouched, the scanned layers the same as the
  unrolled ones;
- the engine's sampler records every prompt and completion token's experts, and the trainer's
  forward over the rollout replaying them gives the sampler's log-probs (float32);
- GRPO replays by default on a MoE with the engine's sampler, and refuses it in one sentence
  where the rollout cannot record its routes (a dense model);
- a vLLM server's routes (`routed_experts`, encoded as vLLM 0.32 encodes them) are laid out as
  the engine's sampler records them, and replaying them gives the sampler's log-probs; a server
  started without --enable-return-routed-experts, or a completion without routes, is refused
  in one sentence naming router_replay. (With vLLM's own model: tests/test_vllm_rollouts.py.)
"""

from __future__ import annotations

import base64
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine.config import ConfigError
from engine.inference.sample import Sampler, prompt_positions, rollout_params
from engine.interop.vllm_server import returns_routed_experts, routed_expert_rows
from engine.models import router_replay
from engine.models.common import Build
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.lora import in_layer
from engine.models.moe import MoE
from engine.models.params import abstract_model_params, apply_model_with_aux, graphdef_of
from engine.models.transformer import Transformer
from engine.posttrain.async_rollout import replays_routes
from engine.posttrain.grpo import run_grpo, step_spec
from engine.posttrain.policy_loss import completion_logps
from engine.posttrain.vllm_rollout import VLLMSampler
from tests.test_grpo import grpo_config, make_copy_task

# Three layers, the first dense (DeepSeek-V3's layout), 5 experts, top 2: odd sizes.
CFG = ModelConfig(
    family="glm4_moe",
    vocab_size=16,
    d_model=16,
    num_layers=3,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    mlp_dim=24,
    max_seq_len=16,
    num_experts=5,
    experts_per_token=2,
    first_dense_layers=1,
)
F32 = ComputeConfig(dtype="float32", param_dtype="float32")
UNROLLED = F32.model_copy(update={"scan_layers": False})


@pytest.fixture(scope="module")
def params():
    return nnx.to_pure_dict(nnx.split(Transformer(CFG, F32, rngs=nnx.Rngs(3)))[1])


def test_a_replayed_moe_layer_uses_the_given_experts_weighted_by_its_own_router():
    spec = next(layer.ffn for layer in CFG.layer_specs() if layer.is_moe)
    moe = MoE(spec, Build.of(CFG, F32), rngs=nnx.Rngs(1))
    b, t, k = 2, 7, CFG.moe.experts_per_token
    x_btd = jax.random.normal(jax.random.key(0), (b, t, CFG.d_model))
    experts_btk = jnp.stack(
        [jax.random.permutation(jax.random.key(i), CFG.moe.num_experts)[:k] for i in range(b * t)]
    ).reshape(b, t, k)
    layers_bltk = jnp.zeros((b, 2, t, k), jnp.int32).at[:, 1].set(experts_btk)
    with router_replay.replaying(layers_bltk), in_layer(1):
        out_btd, _ = moe(x_btd)

    # By hand: softmax of the router logits at the given experts, renormalised, times each MLP.
    probs_bte = jax.nn.softmax(x_btd @ moe.w_router_de[...], axis=-1)
    weights_btk = jnp.take_along_axis(probs_bte, experts_btk, axis=-1)
    weights_btk = weights_btk / weights_btk.sum(-1, keepdims=True)
    expected = jnp.zeros_like(x_btd)
    for j in range(k):
        e = experts_btk[..., j]
        gate = jnp.einsum("btd,btdf->btf", x_btd, moe.w_gate_edf[...][e])
        up = jnp.einsum("btd,btdf->btf", x_btd, moe.w_up_edf[...][e])
        down = jnp.einsum("btf,btfd->btd", jax.nn.silu(gate) * up, moe.w_down_efd[...][e])
        expected = expected + weights_btk[..., j : j + 1] * down
    scale = float(jnp.abs(expected).max())
    np.testing.assert_allclose(out_btd, expected, atol=1e-5 * scale)
    with in_layer(1):  # without replay the router's own top 2 differ from the random ones
        own_btd, _ = moe(x_btd)
    assert float(jnp.abs(own_btd - out_btd).max()) > 0.1 * scale


def unrolled_params(params):
    """The same weights in the layout of the model with scan_layers off (recording appends per
    layer, which the unrolled layers allow)."""
    return rollout_params(params, "float32", abstract_model_params(CFG, UNROLLED, None))


def _rows(b: int, t: int):
    tokens = jax.random.randint(jax.random.key(5), (b, t), 2, CFG.vocab_size)
    return tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), jnp.int32)


def test_the_forward_under_replay_routes_exactly_the_replayed_experts_scanned_or_not(params):
    b, t, k = 3, 6, CFG.moe.experts_per_token
    tokens, positions, segments = _rows(b, t)
    keys = jax.random.split(jax.random.key(9), b * t * CFG.num_layers)
    random_bltk = jnp.stack([jax.random.permutation(key, CFG.moe.num_experts)[:k] for key in keys])
    random_bltk = random_bltk.reshape(b, CFG.num_layers, t, k)
    unrolled = graphdef_of(CFG, UNROLLED)
    per_layer = unrolled_params(params)
    with router_replay.replaying(random_bltk), router_replay.recording() as routes:
        logits_unrolled, _ = apply_model_with_aux(unrolled, per_layer, tokens, positions, segments)
    assert len(routes) == 2  # the two expert layers, the dense one not routed
    np.testing.assert_array_equal(jnp.stack(routes, 1), random_bltk[:, 1:])
    with router_replay.recording() as own:  # the router's own choice is another
        apply_model_with_aux(unrolled, per_layer, tokens, positions, segments)
    assert not np.array_equal(jnp.stack(own, 1), random_bltk[:, 1:])
    # The scanned stack replays by the layer index its scan carries: the same logits.
    with router_replay.replaying(random_bltk):
        logits_scanned, _ = apply_model_with_aux(graphdef_of(CFG, F32), params, tokens, positions, segments)
    np.testing.assert_allclose(logits_scanned, logits_unrolled, atol=2e-5)


def test_the_sampler_records_every_tokens_experts_and_replaying_them_gives_its_log_probs(params):
    sampler = Sampler(CFG, F32, record_experts=True)
    prompt_tokens = np.array([[0, 0, 3, 4, 5], [0, 6, 7, 8, 9]], np.int32)
    prompt_mask = (prompt_tokens != 0).astype(np.int32)
    G, C = 3, 4
    out = sampler(params, prompt_tokens, prompt_mask, seed=1, max_new_tokens=C, num_generations=G)
    assert out.experts.shape == (2 * G, CFG.num_layers, 5 + C, CFG.moe.experts_per_token)
    assert (out.experts[:, 0] == 0).all()  # the dense layer's slot
    tokens = np.concatenate([np.repeat(prompt_tokens, G, 0), out.tokens], 1)
    segments = np.concatenate([np.repeat(prompt_mask, G, 0), out.mask.astype(np.int32)], 1)
    positions = prompt_positions(jnp.asarray(segments))
    graphdef = graphdef_of(CFG, UNROLLED)
    per_layer = unrolled_params(params)
    with router_replay.replaying(jnp.asarray(out.experts)), router_replay.recording() as routes:
        logits, _ = apply_model_with_aux(graphdef, per_layer, tokens, positions, segments)
    valid = segments.astype(bool)
    for j, layer in enumerate((1, 2)):  # the real tokens went through the sampler's experts
        np.testing.assert_array_equal(np.asarray(routes[j])[valid], out.experts[:, layer][valid])
    logp, _ = completion_logps(logits[:, 4:-1], jnp.asarray(out.tokens), 1.0)
    np.testing.assert_allclose(np.where(out.mask, logp, 0.0), out.logprobs, atol=2e-5)


def test_grpo_replays_by_default_on_a_moe_and_refuses_what_cannot_record_routes(tmp_path):
    task = make_copy_task(tmp_path / "task", CFG.model_copy(update={"vocab_size": 16}))
    base = {"steps": 2, "prompts_per_step": 2, "num_generations": 4}
    result = run_grpo(grpo_config(task, tmp_path / "on", **base))
    assert result["router_replay"] == 1.0
    # The planner compiles the step with the routes in the batch, as the run feeds it.
    spec = step_spec(grpo_config(task, tmp_path / "plan", **base), {"checkpoint": (CFG, F32)})
    assert spec.batch[router_replay.ROUTER_EXPERTS].shape == (8, CFG.num_layers, 4, CFG.moe.experts_per_token)
    off = run_grpo(grpo_config(task, tmp_path / "off", router_replay=False, **base))
    assert off["router_replay"] == 0.0
    records = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in records)
    # With a vLLM server the rollout's routes are the server's (on by default there too).
    served = grpo_config(task, tmp_path / "vllm", **{"rollout.url": "http://127.0.0.1:9"}, **base)
    assert replays_routes(served, CFG) and not replays_routes(served.model_copy(update={"router_replay": False}), CFG)
    dense = make_copy_task(
        tmp_path / "dense",
        ModelConfig(**{**CFG.model_dump(), "family": "llama", "num_experts": 0, "first_dense_layers": 0}),
    )
    with pytest.raises(ConfigError, match=r"^router_replay: .*mixture of experts"):
        run_grpo(grpo_config(dense, tmp_path / "dense_run", router_replay=True, **base))


def vllm_encoded(routes_tlk: np.ndarray) -> str:
    """A choice's `routed_experts` as vLLM 0.32 writes it (vllm/utils/serial_utils.py
    numpy2base64 of the capturer's uint8 snapshot, up to 256 experts)."""
    buffer = io.BytesIO()
    np.save(buffer, routes_tlk.astype(np.uint8), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def test_a_vllm_servers_routes_are_laid_out_as_the_engine_sampler_records_them(params):
    """The engine's own rollout, its routes written per completion as vLLM returns them (prompt
    and completion tokens but the last, layers by model index, dense layers 0), read back into
    the sampler's layout: equal at every forwarded token, and the trainer's forward replaying
    them gives the sampler's log-probs (the last token's slot is never read)."""
    sampler = Sampler(CFG, F32, record_experts=True)
    prompt_tokens = np.array([[0, 0, 3, 4, 5], [0, 6, 7, 8, 9], [11, 12, 13, 2, 3]], np.int32)
    prompt_mask = (prompt_tokens != 0).astype(np.int32)
    G, C, P = 2, 4, prompt_tokens.shape[1]
    out = sampler(params, prompt_tokens, prompt_mask, seed=3, max_new_tokens=C, num_generations=G, eos_ids=(1,))
    prompts = [
        row[m.astype(bool)].tolist() for row, m in zip(np.repeat(prompt_tokens, G, 0), np.repeat(prompt_mask, G, 0))
    ]
    forwarded = np.zeros((len(prompts), P + C), bool)  # the tokens vLLM has routes for
    encoded = {}
    for r, prompt in enumerate(prompts):
        n = int(out.lengths[r])
        forwarded[r, P - len(prompt) : P + n - 1] = True
        encoded[r] = vllm_encoded(out.experts[r][:, forwarded[r]].transpose(1, 0, 2))
    url = "http://127.0.0.1:9"
    rows = routed_expert_rows(encoded, prompts, P, C, CFG, url)
    assert rows.shape == out.experts.shape and rows.dtype == np.int32
    np.testing.assert_array_equal(rows.transpose(0, 2, 1, 3)[forwarded], out.experts.transpose(0, 2, 1, 3)[forwarded])
    assert (rows[:, 0] == 0).all() and (rows.transpose(0, 2, 1, 3)[~forwarded] == 0).all()

    tokens = np.concatenate([np.repeat(prompt_tokens, G, 0), out.tokens], 1)
    segments = np.concatenate([np.repeat(prompt_mask, G, 0), out.mask.astype(np.int32)], 1)
    with router_replay.replaying(jnp.asarray(rows)):
        logits, _ = apply_model_with_aux(
            graphdef_of(CFG, UNROLLED),
            unrolled_params(params),
            tokens,
            prompt_positions(jnp.asarray(segments)),
            segments,
        )
    logp, _ = completion_logps(logits[:, P - 1 : -1], jnp.asarray(out.tokens), 1.0)
    np.testing.assert_allclose(np.where(out.mask, logp, 0.0), out.logprobs, atol=2e-5)

    with pytest.raises(
        ConfigError, match=r"^router_replay: .* returned a completion without routed_experts .*glm4_moe"
    ):
        routed_expert_rows({**encoded, 1: None}, prompts, P, C, CFG, url)
    two_layers = vllm_encoded(np.zeros((6, 2, CFG.moe.experts_per_token)))
    with pytest.raises(
        ConfigError, match=r"^router_replay: .* routes of shape \(6, 2, 2\) .* not \(tokens - 1, 3 layers"
    ):
        routed_expert_rows({0: two_layers}, prompts, P, C, CFG, url)


class ServerInfo(BaseHTTPRequestHandler):
    """vLLM 0.32's /v1/models and /server_info?config_format=json, trimmed to what the seam reads;
    `server.routes`: what --enable-return-routed-experts sets."""

    def do_GET(self):
        if self.path.startswith("/v1/models"):
            body = {"data": [{"id": "policy", "max_model_len": 32}]}
        else:
            aux = {"enable_return_routed_experts": self.server.routes, "max_bytes": None}
            body = {
                "vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs"}, "aux_output_config": aux},
                "vllm_env": {},
            }
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_a_server_that_does_not_return_routes_is_refused_naming_router_replay(tmp_path):
    task = make_copy_task(tmp_path / "task", CFG)
    server = ThreadingHTTPServer(("127.0.0.1", 0), ServerInfo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        cfg = grpo_config(task, tmp_path / "run", **{"rollout.url": url, "rollout.weights_dir": str(tmp_path / "w")})
        trainer = SimpleNamespace(quantized_base=False, cfg=SimpleNamespace(compute=F32))
        server.routes = False
        with pytest.raises(
            ConfigError, match=r"^router_replay: .* does not return the experts .*--enable-return-routed"
        ):
            VLLMSampler(cfg, trainer, CFG, None)
        assert not VLLMSampler(cfg.model_copy(update={"router_replay": False}), trainer, CFG, None).replay
        server.routes = True
        assert VLLMSampler(cfg, trainer, CFG, None).replay
    finally:
        server.shutdown()
        server.server_close()
    assert not returns_routed_experts({}) and returns_routed_experts(
        {"model_config": {"enable_return_routed_experts": 1}}
    )
