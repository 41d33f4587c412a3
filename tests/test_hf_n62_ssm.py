"""Hugging Face parity of the state-space models: Mamba and Falcon-Mamba (engine/models/mamba1.py's
selective scan, Falcon-Mamba with scale-less RMSNorms on dt, B and C) and Mamba2, each a stack of
mixer-only layers.

Each case gets the checks tests/test_hf_parity.py makes of every family (its test functions,
collected here over this module's `case`): logits to 1e-4 with N(0, 0.3^2) weights, greedy tokens
and the recurrent sampler equal transformers' generate, the export loading cleanly in
transformers, config.json as transformers writes it, export -> convert bitwise. Plus: the Mamba1
block's chunked associative scan against its token-by-token recurrence, the state after a prompt
and decoded tokens against one forward's, a training step's gradients against torch's, and the
presets' parameter counts against transformers' (meta device). Tiny models with odd widths.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.config import ConfigError, load_config, resolve_model_preset  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf, model_config_to_hf  # noqa: E402
from engine.interop.hf.peft import adapter_from_peft, lora_config_from_peft, write_peft  # noqa: E402
from engine.models.config import LoraConfig, ModelConfig  # noqa: E402
from engine.models.lora import join, split_adapter  # noqa: E402
from engine.models.mamba1 import selective_scan, selective_step  # noqa: E402
from engine.models.params import abstract_model_params, apply_model, graphdef_of  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from engine.train.config import TrainConfig  # noqa: E402
from engine.train.plan import format_plan, plan_step  # noqa: E402
from engine.train.step import lm_loss_fn  # noqa: E402
from engine.train.targets import get_target  # noqa: E402
from tests import test_hf_parity  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    VOCAB,
    Case,
    batch,
    converted_case,
    prefill_then_decode,
    random_causal_lm,
    test_converted_model_matches_transformers_logits,
    test_export_then_convert_is_bitwise_identical,
    test_exported_config_json_is_what_transformers_writes,
)

TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
# Mamba: width 30, inner 90 (expand 3), state 7, dt rank 5, 3 taps, untied head; the chunked
# scan in chunks of 64 covers the 20-token batch in one, so the preset-independent test below
# takes chunks of 3 and 8.
MAMBA = dict(
    vocab_size=VOCAB,
    hidden_size=30,
    num_hidden_layers=3,
    state_size=7,
    expand=3,
    conv_kernel=3,
    time_step_rank=5,
    layer_norm_epsilon=1e-5,
    tie_word_embeddings=False,
    **TOKENS,
)


def hf_config(name: str):
    t = transformers
    return {
        "mamba": lambda: t.MambaConfig(**MAMBA),
        # tied head, no convolution bias, the norms' epsilon not the default
        "falcon_mamba": lambda: t.FalconMambaConfig(
            **{**MAMBA, "tie_word_embeddings": True, "use_conv_bias": False, "state_size": 5}, mixer_rms_eps=1e-5
        ),
        # 4 heads of 15 (expand 2) in 2 groups, state 6, 3 taps, chunks of 8 over 20 tokens
        "mamba2": lambda: t.Mamba2Config(
            vocab_size=VOCAB,
            hidden_size=30,
            num_hidden_layers=3,
            num_heads=4,
            head_dim=15,
            expand=2,
            state_size=6,
            n_groups=2,
            conv_kernel=3,
            chunk_size=8,
            **TOKENS,
        ),
        # layers M * M M: attention of 6 heads of 8 over 2 KV heads (half of each head rotary,
        # base 500), Mamba2 of 4 heads of 15 in 2 groups, state 6, 3 taps, chunks of 8; an MLP of 26
        "bamba": lambda: t.BambaConfig(
            vocab_size=VOCAB,
            hidden_size=30,
            intermediate_size=26,
            num_hidden_layers=4,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=64,
            attn_layer_indices=[1],
            mamba_n_heads=4,
            mamba_n_groups=2,
            mamba_d_state=6,
            mamba_d_conv=3,
            mamba_chunk_size=8,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            **TOKENS,
        ),
        # layers M A M M A (attention every 3rd from 1, no RoPE), experts in layers 0, 2, 4: 5
        # experts of 14, 2 a token (unnormalised softmax weights), dense MLPs of 14 in 1 and 3;
        # Mamba1 inner 90 (expand 3), state 6, dt rank 5, 3 taps, learned norms on dt, B, C
        "jamba": lambda: t.JambaConfig(
            vocab_size=VOCAB,
            hidden_size=30,
            intermediate_size=14,
            num_hidden_layers=5,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=64,
            attn_layer_period=3,
            attn_layer_offset=1,
            num_experts=5,
            num_experts_per_tok=2,
            expert_layer_period=2,
            expert_layer_offset=0,
            mamba_d_state=6,
            mamba_d_conv=3,
            mamba_expand=3,
            mamba_dt_rank=5,
            rms_norm_eps=1e-5,
            **TOKENS,
        ),
    }[name]()


CASES = ["mamba", "falcon_mamba", "mamba2", "bamba", "jamba"]
IMPLEMENTATIONS = {"attn_implementation": "eager", "experts_implementation": "eager"}


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory) -> Case:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = random_causal_lm(hf_config(name), 0, **IMPLEMENTATIONS)
    return converted_case(name, model, root, stand_in_tokenizer=True)


DECODED_ALIKE = {"falcon_mamba": "mamba"}  # a second case of a decoding path taken (CI time)


def test_greedy_generation_of_16_tokens_is_identical(case):
    """test_hf_parity's: greedy tokens and the recurrent sampler's equal transformers' generate."""
    if case.family in DECODED_ALIKE:
        pytest.skip(f"decodes as the {DECODED_ALIKE[case.family]} case does")
    test_hf_parity.test_greedy_generation_of_16_tokens_is_identical(case)


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    test_hf_parity.assert_export_reloads_cleanly(case, tmp_path / "export", **IMPLEMENTATIONS)


def test_the_family_reads_what_the_config_says(case):
    cfg, hf = case.cfg, case.hf_model.config
    mixers = {layer.mixer for layer in cfg.layer_pattern()}
    assert cfg.num_params() == sum(p.numel() for p in case.hf_model.parameters())
    if case.family == "jamba":
        assert [(x.mixer, x.ffn) for x in cfg.layer_pattern()] == [
            ("mamba1", "moe"),
            ("attention", "mlp"),
            ("mamba1", "moe"),
            ("mamba1", "mlp"),
            ("attention", "moe"),
        ]
        stacks = {"mamba1_blocks": (0, 2), "dense_blocks": (1,), "mamba1_dense_blocks": (3,), "blocks": (4,)}
        assert dict(cfg.layer_stacks()) == stacks and not any(x.rope for x in cfg.layer_pattern())
        assert cfg.mamba1.bcdt_norm == "weighted" and not cfg.moe.router_renormalize
        return
    if case.family == "bamba":
        assert [layer.mixer for layer in cfg.layer_pattern()] == ["mamba2", "attention", "mamba2", "mamba2"]
        assert dict(cfg.layer_stacks()) == {"mamba2_blocks": (0, 2, 3), "blocks": (1,)}
        assert (cfg.attention.head_dim, cfg.rope.rotary_dim, cfg.rope.theta) == (8, 4, 500.0)
        return
    assert {layer.ffn for layer in cfg.layer_pattern()} == {"none"}
    if case.family == "mamba2":
        assert mixers == {"mamba2"} and dict(cfg.layer_stacks()) == {"mamba2_only_blocks": (0, 1, 2)}
        assert (cfg.mamba2.num_heads, cfg.mamba2.head_dim, cfg.mamba2.n_groups) == (4, 15, 2)
        return
    assert mixers == {"mamba1"} and dict(cfg.layer_stacks()) == {"mamba1_only_blocks": (0, 1, 2)}
    m = cfg.mamba1
    assert (m.inner, m.state_size, m.dt_rank, m.conv_kernel) == (90, hf.state_size, 5, 3)
    assert m.bcdt_norm == ("weightless" if case.family == "falcon_mamba" else "none")
    assert m.conv_bias == (case.family == "mamba") and cfg.tie_embeddings == hf.tie_word_embeddings


def reference_scan(x, dt, a, b, c, segments, state):
    """The recurrence token by token (selective_step), the state zeroed where a document starts."""
    ys = []
    for t in range(x.shape[1]):
        if t:
            state = jnp.where((segments[:, t] == segments[:, t - 1])[:, None, None], state, 0.0)
        y, state = selective_step(x[:, t], dt[:, t], a, b[:, t], c[:, t], state)
        ys.append(y)
    return jnp.stack(ys, 1), state


@pytest.mark.parametrize("chunk_size", [3, 8])
def test_the_chunked_selective_scan_is_the_recurrence(chunk_size):
    """Random inputs, two packed rows (documents restarting the state), a carried-in state: the
    chunked associative scan's outputs and final state equal the token-by-token recurrence's,
    whatever the chunk size (19 tokens: never a whole number of chunks)."""
    rng = np.random.default_rng(0)
    batch_size, time, channels, size = 2, 19, 11, 5
    x = jnp.asarray(rng.normal(size=(batch_size, time, channels)), jnp.float32)
    dt = jax.nn.softplus(jnp.asarray(rng.normal(size=(batch_size, time, channels)), jnp.float32))
    a = -jnp.exp(jnp.asarray(rng.normal(size=(channels, size)), jnp.float32))
    b, c = (jnp.asarray(rng.normal(size=(batch_size, time, size)), jnp.float32) for _ in range(2))
    segments = jnp.asarray(np.repeat([[1] * 7 + [2] * 12, [1] * 19], 1, axis=0), jnp.int32)
    state = jnp.asarray(rng.normal(size=(batch_size, channels, size)), jnp.float32)
    y, final = selective_scan(x, dt, a, b, c, state_bcn=state, segment_ids_bt=segments, chunk_size=chunk_size)
    y_ref, final_ref = jax.jit(reference_scan)(x, dt, a, b, c, segments, state)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(final), np.asarray(final_ref), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(y_ref[0, 7:])).max() > 0.1  # the second document is not all zero
    # and its gradients (the backward through the rematerialised chunks) with respect to every input
    weights = jnp.asarray(rng.normal(size=y.shape), jnp.float32)

    def loss(scan, *inputs):
        y, final = scan(*inputs)
        return jnp.sum(y * weights) + jnp.sum(final)

    def chunked(*inputs):
        return selective_scan(*inputs[:5], state_bcn=inputs[5], segment_ids_bt=segments, chunk_size=chunk_size)

    def recurrent(*inputs):
        return reference_scan(*inputs[:5], segments, inputs[5])

    inputs = (x, dt, a, b, c, state)
    ours = jax.jit(jax.grad(lambda *v: loss(chunked, *v), argnums=tuple(range(6))))(*inputs)
    theirs = jax.jit(jax.grad(lambda *v: loss(recurrent, *v), argnums=tuple(range(6))))(*inputs)
    for mine, reference in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(reference), rtol=1e-4, atol=1e-4)


STATE_CASES = ("mamba", "mamba2")


def test_the_state_after_a_prompt_and_decoded_tokens_is_a_full_forwards(case):
    """Prefill 9 tokens (one row left-padded by 3), decode 6 one at a time: every layer's
    convolution window and SSM state equal those of one forward over all 15, and so do the last
    logits."""
    if case.family not in STATE_CASES:
        pytest.skip("one case per mixer kind (CI time)")
    logits, cache, full_logits, full = prefill_then_decode(case)
    assert len(cache.states) == case.cfg.num_layers
    for ours, theirs in zip(cache.states, full.states, strict=True):
        if ours is None:  # an attention layer
            continue
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        assert np.abs(np.asarray(ours[1])).max() > 0.1
    np.testing.assert_allclose(np.asarray(logits[:, -1]), np.asarray(full_logits[:, -1]), atol=1e-4)


def test_projection_biases_convert_and_match_transformers_on_unpadded_rows(tmp_path):
    """Mamba with use_bias (in_proj and out_proj biases): logits to 1e-4 on a full and a
    right-padded row, export loads back with none missing. A left-padded row computes as its
    unpadded tokens do (transformers instead convolves the padding's in_proj bias into the
    first tokens' window; engine/models/mamba1.py)."""
    model = random_causal_lm(transformers.MambaConfig(**{**MAMBA, "use_bias": True}), 4)
    model.save_pretrained(tmp_path / "hf")
    convert_hf(tmp_path / "hf", tmp_path / "converted")
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    compute = stored_configs(tmp_path / "converted" / "checkpoint")[1]
    assert cfg.mamba1.proj_bias and "b_in_p" in params["mamba1_only_blocks"]["attn"]
    tokens, mask = batch()
    ours = test_hf_parity.engine_logits(cfg, compute, params, tokens, mask)
    ref = test_hf_parity.hf_logits(model, tokens[:2], mask[:2])
    valid = mask[:2].astype(bool)
    assert np.abs(ours[:2] - ref)[valid].max() <= 1e-4 and np.abs(ref[valid]).max() > 0.5
    unpadded = test_hf_parity.engine_logits(cfg, compute, params, tokens[2:, 6:], mask[2:, 6:])
    np.testing.assert_allclose(ours[2, 6:], unpadded[0], atol=1e-5)
    export_hf(tmp_path / "converted" / "checkpoint", tmp_path / "export")
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


GRADIENTS = {  # the engine's Mamba1 array -> transformers' parameter of the mixer
    "w_in_dp": "in_proj.weight",
    "w_x_cq": "x_proj.weight",
    "w_dt_rc": "dt_proj.weight",
    "b_dt_c": "dt_proj.bias",
    "a_log_cn": "A_log",
    "conv_c1k": "conv1d.weight",
    "d_c": "D",
    "w_out_cd": "out_proj.weight",
}


def test_a_training_step_is_transformers_loss_and_gradients(tmp_path):
    """Mamba's loss on a full and a right-padded row of 70 tokens and its gradient with respect to
    every Mamba1 weight (through the chunked scan: a chunk of 64 and one of 6, each
    rematerialised, the state carried between them), against torch's autograd."""
    model = random_causal_lm(hf_config("mamba"), 3)
    model.save_pretrained(tmp_path / "hf")
    convert_hf(tmp_path / "hf", tmp_path / "converted")
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    compute = stored_configs(tmp_path / "converted" / "checkpoint")[1]
    assert cfg.layer_specs()[0].mixer.chunk_size == 64
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 70))
    mask = np.ones_like(tokens)
    mask[1, 50:] = 0
    targets = np.roll(tokens, -1, axis=1)
    loss_mask = (mask * np.roll(mask, -1, axis=1)).astype(np.float32)
    loss_mask[:, -1] = 0
    train_batch = {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(70), tokens.shape),
        "segment_ids": mask.astype(np.int32),
        "targets": targets,
        "loss_mask": loss_mask,
    }
    step = jax.jit(jax.value_and_grad(lm_loss_fn(graphdef_of(cfg, compute)), has_aux=True))
    (loss, _), grads = step(params, train_batch, float(loss_mask.sum()))
    model.zero_grad()
    logits = model(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), torch.tensor(targets).reshape(-1), reduction="none"
    )
    ref = (nll * torch.tensor(loss_mask).reshape(-1)).sum() / float(loss_mask.sum())
    ref.backward()
    assert abs(float(loss) - float(ref.detach())) <= 1e-5
    for key, name in GRADIENTS.items():
        for i in range(cfg.num_layers):
            theirs = model.backbone.layers[i].mixer.get_parameter(name).grad.numpy()
            mine = np.asarray(grads["mamba1_only_blocks"]["attn"][key][i])
            if key.startswith("w_"):  # (in, out) here, (out, in) in torch
                mine = mine.T
            scale = max(1.0, float(np.abs(theirs).max()))
            np.testing.assert_allclose(mine.reshape(theirs.shape), theirs, atol=1e-5 * scale, err_msg=name)
            assert np.abs(theirs).max() > 0


def test_what_the_families_do_not_run_is_refused_in_one_sentence():
    mamba = {**hf_config("mamba").to_dict(), "architectures": ["MambaForCausalLM"]}
    mamba2 = {**hf_config("mamba2").to_dict(), "architectures": ["Mamba2ForCausalLM"]}
    bamba = {**hf_config("bamba").to_dict(), "architectures": ["BambaForCausalLM"]}
    jamba = {**hf_config("jamba").to_dict(), "architectures": ["JambaForCausalLM"]}
    for config, message in (
        ({**mamba, "hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported \(silu\)"),
        ({**mamba2, "num_heads": 5}, r"hidden_size x expand \(30 x 2\) must equal num_heads x head_dim \(5 x 15\)"),
        ({**bamba, "head_dim": 6}, r"head_dim 6 must be a multiple of 4 \(half of it rotary, in pairs\)"),
        ({**jamba, "expert_layer_offset": 7}, r"expert_layer_offset puts experts in none of the 5 layers"),
    ):
        with pytest.raises(ConfigError, match=message) as refused:
            model_config_from_hf(config)
        assert "\n" not in str(refused.value)
    # Jamba places attention by a period and an offset: two attention layers of three cannot be written
    cfg, _ = model_config_from_hf(jamba)
    with pytest.raises(ConfigError, match=r"this model's \(\[0, 1, 3, 4\]\) are not so placed"):
        model_config_to_hf(cfg.model_copy(update={"mixer_pattern": ["attention", "attention", "mamba1"]}))
    # LoRA: a pure state-space model's in_proj and x_proj (tests/test_lora_families.py)
    mamba_cfg, _ = model_config_from_hf(mamba)
    assert set(LoraConfig(target_modules="all-linear").targets(mamba_cfg)) == {"in_proj", "x_proj"}
    with pytest.raises(ValueError, match=r"family 'mamba' has no module q_proj to adapt; it can adapt: "):
        LoraConfig(target_modules=["q_proj"]).targets(mamba_cfg)
    # LoRA: Jamba's attention and Mamba mixers (not dt_proj, whose weight transformers reads
    # directly; its experts and dense MLPs are not adapted)
    jamba_targets = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "x_proj")
    assert LoraConfig(target_modules="all-linear").targets(cfg) == jamba_targets


def test_a_peft_adapter_on_bamba_reads_in_and_writes_out_with_transformers_logits(tmp_path):
    """LoRA on every module the engine adapts in Bamba (q/k/v/o, gate/up/down, the Mamba2 in_proj
    and out_proj), random A and B: read into the engine it gives PEFT's logits, and written back
    PEFT loads it with the same logits."""
    peft = need("peft")
    cfg, compute = model_config_from_hf({**hf_config("bamba").to_dict(), "architectures": ["BambaForCausalLM"]})
    targets = list(LoraConfig(target_modules="all-linear").targets(cfg))
    assert targets == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "in_proj",
        "out_proj",
    ]
    base = random_causal_lm(hf_config("bamba"), 0, **IMPLEMENTATIONS)
    base.save_pretrained(tmp_path / "hf")
    convert_hf(tmp_path / "hf", tmp_path / "converted")
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "adapter")
    lora = lora_config_from_peft(tmp_path / "adapter")
    shapes = split_adapter(abstract_model_params(cfg, compute, None, lora))[0]
    adapter = adapter_from_peft(tmp_path / "adapter", cfg, lora, shapes, scan_layers=compute.scan_layers)
    tokens, mask = batch()
    graphdef = graphdef_of(cfg, compute, lora)
    ours = np.asarray(
        jax.jit(lambda p: apply_model(graphdef, p, jnp.asarray(tokens), None, jnp.asarray(mask)))(join(adapter, params))
    )
    valid = mask.astype(bool)
    ref = test_hf_parity.hf_logits(model, tokens, mask)
    with model.disable_adapter():
        assert np.abs(ref - test_hf_parity.hf_logits(model, tokens, mask))[valid].max() > 1e-2
    assert np.abs(ours - ref)[valid].max() <= 2e-5 * max(1.0, float(np.abs(ref[valid]).max()))
    write_peft(tmp_path / "out", cfg, lora, adapter, scan_layers=compute.scan_layers)
    fresh = random_causal_lm(hf_config("bamba"), 0, **IMPLEMENTATIONS)
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "out").eval()
    np.testing.assert_allclose(test_hf_parity.hf_logits(loaded, tokens, mask)[valid], ref[valid], atol=1e-5)


PRESETS = {  # preset -> its published parameter count, in billions
    "mamba-130m": 0.13,
    "mamba-2.8b": 2.77,
    "falcon-mamba-7b": 7.27,
    "mamba2-2.7b": 2.70,
    "bamba-9b": 9.78,
    "jamba-1.5-mini": 51.57,  # "52B total, 12B active" (12.11B: ModelConfig.num_params(active=True))
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_presets_are_the_published_models(preset):
    """Each preset builds as the transformers model of the same parameter count (on the meta
    device), the published one, and its config.json reads back as itself."""
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": preset}, preset)["model"])
    hf = transformers.AutoConfig.for_model(**model_config_to_hf(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert round(cfg.num_params() / 1e9, 2) == PRESETS[preset]
    again, _ = model_config_from_hf({**hf.to_dict(), "architectures": [hf.architectures[0]]})
    assert again == cfg
    if preset == "bamba-9b":  # the published attention layers
        assert hf.attn_layer_indices == [9, 18, 27]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the test extra)")
@pytest.mark.parametrize("model", ["tiny-mamba"])
def test_the_plan_compiles_a_training_step_for_a_tpu_slice(model):
    """The Mamba1 parameters' sharding (inner channels over tensor, in_proj over fsdp) beside
    attention heads and experts compiles for a v5p-8, fsdp 2 x tensor 2."""
    tree = {
        "model": model,
        "mesh": {"data": 1, "fsdp": -1, "tensor": 2},
        "data": {"seq_len": 128, "batch_size": 8},
        "steps": 3,
        "compute": {"dtype": "bfloat16"},
    }
    plan = plan_step(load_config(tree=tree, schema=TrainConfig), get_target("v5p-8"))
    assert plan.how == "compiled" and plan.fits
    assert "tensor=2" in format_plan(plan)
