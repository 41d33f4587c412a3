"""Hugging Face parity of the hybrid Mamba2 families (engine/models/mamba2.py as a mixer kind):
Nemotron-H, whose every layer is one of a Mamba2 mixer, NoPE attention, a relu2 MLP or (Nemotron
3) ungated relu2 experts behind DeepSeek-V3's grouped sigmoid router; Granite 4 hybrid.

Each family gets the checks tests/test_hf_parity.py makes of every family (collected here over
this module's `case`): greedy tokens and the recurrent sampler equal transformers', export
loads cleanly with the same logits, config.json as transformers writes it, export -> convert
bitwise; plus logits to 1e-5 at init-scale weights and 1e-4 at scaled ones (20 tokens, Mamba2
chunks of 8, one row right-padded and one left-padded), the state after a prompt and decoded
tokens against a full forward's, a training step against transformers' loss and gradients,
and what LoRA adapts.
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

from engine.config import ConfigError, load_config  # noqa: E402
from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.export import export_hf  # noqa: E402
from engine.interop.hf.mapping import model_config_from_hf  # noqa: E402
from engine.interop.hf.peft import adapter_from_peft, lora_config_from_peft, write_peft  # noqa: E402
from engine.models.config import LoraConfig  # noqa: E402
from engine.models.kv_cache import KVCache  # noqa: E402
from engine.models.lora import join, split_adapter  # noqa: E402
from engine.models.params import abstract_model_params, apply_model, graphdef_of  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from engine.train.config import TrainConfig  # noqa: E402
from engine.train.plan import format_plan, plan_step  # noqa: E402
from engine.train.step import lm_loss_fn  # noqa: E402
from engine.train.targets import get_target  # noqa: E402
from tests.test_hf_parity import (  # noqa: E402, F401  (collected here, over this module's `case`)
    VOCAB,
    Case,
    assert_export_reloads_cleanly,
    batch,
    converted_case,
    engine_logits,
    hf_logits,
    prefill_then_decode,
    random_causal_lm,
    test_export_then_convert_is_bitwise_identical,
    test_exported_config_json_is_what_transformers_writes,
    test_greedy_generation_of_16_tokens_is_identical,
)

# Odd sizes: 6 query heads over 2 KV heads of 8; Mamba2 4 heads of 5 in 2 groups, state 6,
# chunks of 8 (the 20-token batch is not a multiple); layers M - * - M.
SMALL = dict(vocab_size=VOCAB, hidden_size=30, num_attention_heads=6, num_key_value_heads=2, head_dim=8)
NEMOTRON_H = dict(
    **SMALL,
    intermediate_size=26,
    max_position_embeddings=64,
    layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention"],
    mamba_num_heads=4,
    mamba_head_dim=5,
    n_groups=2,
    ssm_state_size=6,
    chunk_size=8,
    layer_norm_epsilon=1e-5,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)

# Nemotron 3's experts: layers M E * - E; 6 experts of 14 in 2 groups, a token's 2 from its
# best group (topk_group 1), renormalised and scaled by 1.7; the shared expert 18 wide.
NEMOTRON_H_MOE = dict(
    {k: v for k, v in NEMOTRON_H.items() if k != "layers_block_type"},
    layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "moe"],
    n_routed_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=14,
    moe_shared_expert_intermediate_size=18,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=1.7,
)


# Granite 4 hybrid, dense: layers M * M M (NoPE attention, heads of 6), each with its gated
# MLP, every multiplier away from 1; Mamba2 4 heads of 18 (expand 2) in 2 groups, state 6.
GRANITE = dict(
    vocab_size=VOCAB,
    hidden_size=36,
    num_attention_heads=6,
    num_key_value_heads=2,
    intermediate_size=26,
    shared_intermediate_size=26,
    num_local_experts=0,
    num_hidden_layers=4,
    layer_types=["mamba", "attention", "mamba", "mamba"],
    mamba_n_heads=4,
    mamba_n_groups=2,
    mamba_d_state=6,
    mamba_chunk_size=8,
    rms_norm_eps=1e-5,
    embedding_multiplier=3.0,
    residual_multiplier=0.5,
    attention_multiplier=0.2,
    logits_scaling=2.0,
    tie_word_embeddings=True,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)


def hf_config(name: str):
    t = transformers
    return {
        "nemotron_h": lambda: t.NemotronHConfig(**NEMOTRON_H),
        "nemotron_h_moe": lambda: t.NemotronHConfig(**NEMOTRON_H_MOE),
        "granite_hybrid": lambda: t.GraniteMoeHybridConfig(**GRANITE),
    }[name]()


CASES = ["nemotron_h", "nemotron_h_moe", "granite_hybrid"]
ARCHITECTURES = {"nemotron_h": "NemotronHForCausalLM", "granite_hybrid": "GraniteMoeHybridForCausalLM"}
IMPLEMENTATIONS = {"attn_implementation": "eager", "experts_implementation": "eager"}


def implementations(name: str) -> dict:
    return IMPLEMENTATIONS if name == "nemotron_h_moe" else {"attn_implementation": "eager"}


def with_router_biases(model):
    """Nemotron-H's e_score_correction_bias (a buffer, zero at init) set to N(0, 0.1^2), so it
    takes part in choosing the experts."""
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def init_scale_model(name: str):
    """transformers' own initialisation (N(0, 0.02) matrices, its A_log, D, dt_bias), float32."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name), **implementations(name))
    return with_router_biases(model.float().eval())


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory) -> Case:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = with_router_biases(random_causal_lm(hf_config(name), 0, **implementations(name)))
    return converted_case(name, model, root, stand_in_tokenizer=True)


def converted(model, tmp_path):
    model.save_pretrained(tmp_path / "hf")
    convert_hf(tmp_path / "hf", tmp_path / "converted")
    cfg, params, _ = load_params(tmp_path / "converted" / "checkpoint")
    return cfg, stored_configs(tmp_path / "converted" / "checkpoint")[1], params


def test_export_loads_in_transformers_cleanly_with_the_same_logits(case, tmp_path):
    export_hf(case.out_dir / "checkpoint", tmp_path / "export")
    assert_export_reloads_cleanly(case, tmp_path / "export", **implementations(case.family))


def test_scaled_weights_logits_match_transformers_to_1e4(case):
    tokens, mask = batch()
    ours = engine_logits(case.cfg, case.compute, case.params, tokens, mask)
    ref = hf_logits(case.hf_model, tokens, mask)
    valid = mask.astype(bool)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{case.family} (scaled weights): max |delta logit| = {delta:.2e}")
    assert delta <= 1e-4 and np.abs(ref[valid]).max() > 0.5


@pytest.mark.parametrize("name", CASES)
def test_init_scale_logits_match_transformers_to_1e5(name, tmp_path):
    model = init_scale_model(name)
    cfg, compute, params = converted(model, tmp_path)
    tokens, mask = batch()
    ours = engine_logits(cfg, compute, params, tokens, mask)
    ref = hf_logits(model, tokens, mask)
    valid = mask.astype(bool)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{name} (init scale): max |delta logit| = {delta:.2e}")
    assert delta <= 1e-5 and np.abs(ref[valid]).max() > 1e-3


def test_granite_honours_a_head_dim_key_as_transformers_does(tmp_path):
    """GraniteMoeHybridConfig declares no head_dim, but its attention reads one where config.json
    has it (found by the held-out sweep: the engine took hidden_size / heads and refused the
    tensors): 10-wide heads over a 36-wide model, init-scale logits, and export keeps the key."""
    config = hf_config("granite_hybrid")
    config.head_dim = 10
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, **implementations("granite_hybrid")).float().eval()
    cfg, compute, params = converted(model, tmp_path)
    assert cfg.attention.head_dim == 10 and model.model.layers[1].self_attn.k_proj.out_features == 2 * 10
    tokens, mask = batch()
    valid = mask.astype(bool)
    ref = hf_logits(model, tokens, mask)
    assert float(np.abs(engine_logits(cfg, compute, params, tokens, mask) - ref)[valid].max()) <= 1e-5
    export_hf(tmp_path / "converted" / "checkpoint", tmp_path / "export")
    implementation = implementations("granite_hybrid")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", **implementation)
    np.testing.assert_array_equal(hf_logits(reloaded.float().eval(), tokens, mask)[valid], ref[valid])


def test_the_pattern_is_what_the_config_says(case):
    hf = case.hf_model.config
    layers = case.cfg.layer_pattern()
    assert not any(
        x.rope for x in layers
    )  # the attention layers have no RoPE (Granite 4: position_embedding_type null)
    stacks = dict(case.cfg.layer_stacks())
    if case.family.startswith("nemotron_h"):
        kinds = {
            "linear_attention": ("mamba2", "none"),
            "full_attention": ("attention", "none"),
            "mlp": ("none", "mlp"),
            "moe": ("none", "moe"),
        }
        assert [(x.mixer, x.ffn) for x in layers] == [kinds[t] for t in hf.layers_block_type]
        expected = {
            "nemotron_h": {"mamba2_only_blocks": (0, 4), "mlp_only_blocks": (1, 3), "attention_only_blocks": (2,)},
            "nemotron_h_moe": {
                "mamba2_only_blocks": (0,),
                "moe_only_blocks": (1, 4),
                "attention_only_blocks": (2,),
                "mlp_only_blocks": (3,),
            },
        }
        assert stacks == expected[case.family]
    else:
        assert [x.mixer for x in layers] == ["mamba2", "attention", "mamba2", "mamba2"]
        assert stacks == {"mamba2_blocks": (0, 2, 3), "blocks": (1,)}
        assert case.cfg.attention.scale == 0.2 and case.cfg.head.divisor == 2.0
    assert case.cfg.num_params() == sum(p.numel() for p in case.hf_model.parameters())


def test_the_state_after_a_prompt_and_decoded_tokens_is_a_full_forwards(case):
    """Prefill 9 tokens (one row left-padded by 3), decode 6 one at a time: every Mamba2
    layer's convolution window and SSM state equal those of one forward over all 15, and so
    do the last logits."""
    logits, cache, full_logits, full = prefill_then_decode(case)
    mamba = [i for i, x in enumerate(case.cfg.layer_pattern()) if x.mixer == "mamba2"]
    assert mamba and all(cache.states[i] is not None for i in mamba)
    for i in mamba:
        for a, b in zip(cache.states[i], full.states[i], strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)  # states up to ~5
        assert np.abs(np.asarray(cache.states[i].ssm_bhpn)).max() > 0.1
    np.testing.assert_allclose(np.asarray(logits[:, -1]), np.asarray(full_logits[:, -1]), atol=1e-4)


def test_a_training_step_is_transformers_loss_and_gradients(case):
    """The loss of a right-padded batch and its gradient with respect to every Mamba2, attention
    and MLP weight, against torch's autograd on the same transformers model."""
    tokens, mask = batch()
    targets = np.roll(tokens, -1, axis=1)
    loss_mask = (mask * np.roll(mask, -1, axis=1)).astype(np.float32)
    loss_mask[:, -1] = 0
    loss_mask[2] = 0  # the left-padded row: transformers numbers its positions differently
    train_batch = {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(20), tokens.shape),
        "segment_ids": mask.astype(np.int32),
        "targets": targets,
        "loss_mask": loss_mask,
    }
    compute = case.compute.model_copy(update={"moe_balance_loss": 0.0, "moe_router_z_loss": 0.0})  # plain NLL
    step = jax.jit(jax.value_and_grad(lm_loss_fn(graphdef_of(case.cfg, compute)), has_aux=True))
    (loss, _), grads = step(case.params, train_batch, float(loss_mask.sum()))
    model = case.hf_model
    model.zero_grad()
    logits = model(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), torch.tensor(targets).reshape(-1), reduction="none"
    )
    ref = (nll * torch.tensor(loss_mask).reshape(-1)).sum() / float(loss_mask.sum())
    ref.backward()
    assert abs(float(loss) - float(ref.detach())) <= 1e-5
    hf_grads = {name: p.grad.numpy() for name, p in model.named_parameters()}
    stacks = dict(case.cfg.layer_stacks())
    checks = {
        "nemotron_h": {
            ("mamba2_only_blocks", "attn", "w_in_dp"): "model.layers.{i}.mixer.in_proj.weight",
            ("mamba2_only_blocks", "attn", "a_log_h"): "model.layers.{i}.mixer.A_log",
            ("mamba2_only_blocks", "attn", "conv_c1k"): "model.layers.{i}.mixer.conv1d.weight",
            ("attention_only_blocks", "attn", "wq_dnh"): "model.layers.{i}.mixer.q_proj.weight",
            ("mlp_only_blocks", "mlp", "w_up_df"): "model.layers.{i}.mixer.up_proj.weight",
        },
        "nemotron_h_moe": {
            ("mamba2_only_blocks", "attn", "w_in_dp"): "model.layers.{i}.mixer.in_proj.weight",
            ("moe_only_blocks", "mlp", "w_router_de"): "model.layers.{i}.mixer.gate.weight",
            ("moe_only_blocks", "mlp", "w_up_edf"): "model.layers.{i}.mixer.experts.up_proj",
            ("moe_only_blocks", "mlp", "w_down_efd"): "model.layers.{i}.mixer.experts.down_proj",
            ("moe_only_blocks", "mlp", "w_shared_up_dg"): "model.layers.{i}.mixer.shared_experts.up_proj.weight",
            ("mlp_only_blocks", "mlp", "w_down_fd"): "model.layers.{i}.mixer.down_proj.weight",
        },
        "granite_hybrid": {
            ("mamba2_blocks", "attn", "w_in_dp"): "model.layers.{i}.mamba.in_proj.weight",
            ("mamba2_blocks", "attn", "dt_bias_h"): "model.layers.{i}.mamba.dt_bias",
            ("blocks", "attn", "wk_dkh"): "model.layers.{i}.self_attn.k_proj.weight",
            ("mamba2_blocks", "mlp", "w_down_fd"): "model.layers.{i}.shared_mlp.output_linear.weight",
        },
    }[case.family]
    for (stack, *path), hf_name in checks.items():
        ours = grads[stack]
        for key in path:
            ours = ours[key]
        for slot, i in enumerate(stacks[stack]):
            theirs = hf_grads[hf_name.format(i=i)]
            mine = np.asarray(ours[slot])
            if mine.ndim == 3 and "experts." in hf_name:  # stacked experts: (E, out, in) in transformers
                mine = np.swapaxes(mine, 1, 2)
            elif mine.ndim >= 2 and "conv" not in hf_name:
                mine = mine.reshape(theirs.shape[::-1]).T
            scale = max(1.0, float(np.abs(theirs).max()))
            np.testing.assert_allclose(mine.reshape(theirs.shape), theirs, atol=1e-5 * scale, err_msg=hf_name)
            assert np.abs(theirs).max() > 0


def test_lora_targets_are_peft_names_and_the_rest_is_refused(case):
    """LoRA adapts the attention layers' q/k/v/o_proj, Nemotron-H's MLP layers' up/down_proj and
    the Mamba2 in_proj (PEFT's names; PEFT refuses Nemotron-H's out_proj, a Mamba model's);
    Nemotron-H's MLP has no gate_proj; Granite's fuses gate and up in input_linear, one module."""
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    if case.family == "granite_hybrid":
        granite = (*attention, "in_proj", "out_proj", "input_linear", "output_linear")
        assert LoraConfig(target_modules="all-linear").targets(case.cfg) == granite
        with pytest.raises(ValueError, match=r"family 'granite_hybrid' has no module gate_proj to adapt"):
            LoraConfig(target_modules=["gate_proj"]).targets(case.cfg)
        return
    if case.family == "nemotron_h_moe":  # a mixture of experts: LoRA adapts the attention and Mamba2 only
        assert LoraConfig(target_modules="all-linear").targets(case.cfg) == (*attention, "in_proj")
        with pytest.raises(ValueError, match=r"family 'nemotron_h' is a mixture of experts: LoRA on its experts"):
            LoraConfig(target_modules=["q_proj", "up_proj"]).targets(case.cfg)
        return
    assert LoraConfig(target_modules="all-linear").targets(case.cfg) == (*attention, "up_proj", "down_proj", "in_proj")
    with pytest.raises(ValueError, match=r"family 'nemotron_h' has no module gate_proj to adapt"):
        LoraConfig(target_modules=["q_proj", "gate_proj"]).targets(case.cfg)
    with pytest.raises(ValueError, match=r"family 'nemotron_h' cannot adapt out_proj as PEFT would"):
        LoraConfig(target_modules=["out_proj"]).targets(case.cfg)


def test_what_nemotron_h_and_granite_cannot_do_yet_is_refused_in_one_sentence():
    granite = {**hf_config("granite_hybrid").to_dict(), "architectures": [ARCHITECTURES["granite_hybrid"]]}
    with pytest.raises(ConfigError, match=r"hidden_act 'gelu' is not supported \(silu\)"):
        model_config_from_hf({**granite, "hidden_act": "gelu"})
    hf = {**hf_config("nemotron_h").to_dict(), "architectures": ["NemotronHForCausalLM"]}
    moe = {**hf_config("nemotron_h_moe").to_dict(), "architectures": ["NemotronHForCausalLM"]}
    with pytest.raises(ConfigError, match=r"moe_latent_size \(the experts in a projected space\) is not supported"):
        model_config_from_hf({**moe, "moe_latent_size": 16})
    # transformers' default layers (M E * -) read as the experts' pattern; E in the older key too
    cfg, _ = model_config_from_hf({**moe, "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"]})
    assert [(x.mixer, x.ffn) for x in cfg.layer_pattern()][1] == ("none", "moe") and not cfg.mlp.gated
    assert (cfg.moe.num_experts, cfg.moe.router_groups, cfg.moe.router_group_top, cfg.moe.router_scale) == (
        6,
        2,
        1,
        1.7,
    )
    assert cfg.shared_mlp_dim == 18 and cfg.moe.router_bias and cfg.moe.router_score == "sigmoid"
    old_moe = {k: v for k, v in moe.items() if k != "layers_block_type"}
    assert model_config_from_hf({**old_moe, "hybrid_override_pattern": "ME*-E"})[0] == model_config_from_hf(moe)[0]
    with pytest.raises(ConfigError, match=r"mlp_hidden_act 'silu' is not supported \(relu2\)"):
        model_config_from_hf({**hf, "mlp_hidden_act": "silu"})
    # the older key, one character a layer, reads as layers_block_type
    old = {k: v for k, v in hf.items() if k != "layers_block_type"}
    cfg, _ = model_config_from_hf({**old, "hybrid_override_pattern": "M-*-M"})
    assert cfg == model_config_from_hf(hf)[0]


def test_the_recurrent_state_is_the_sampler_cache():
    """KVCache.init gives Mamba2 layers their state and no keys or values, MLP layers nothing."""
    cfg, compute = model_config_from_hf(
        {**hf_config("nemotron_h").to_dict(), "architectures": ["NemotronHForCausalLM"]}
    )
    cache = KVCache.init(cfg, compute, 3, 11)
    kinds = [(x.mixer, x.ffn) for x in cfg.layer_pattern()]
    for kind, k, state in zip(kinds, cache.k, cache.states, strict=True):
        assert (k.size > 0) == (kind[0] == "attention")
        assert (state is not None) == (kind[0] == "mamba2")
    assert cache.states[0].ssm_bhpn.shape == (3, 4, 5, 6) and cache.states[0].ssm_bhpn.dtype == jnp.float32


def test_a_peft_adapter_reads_in_and_writes_out_with_transformers_logits(case, tmp_path):
    """A PEFT LoRA on every module the engine adapts (random A and B): read into the engine it
    gives PEFT's logits, and written back PEFT loads it with the same logits."""
    peft = need("peft")
    targets = list(LoraConfig(target_modules="all-linear").targets(case.cfg))
    base = with_router_biases(random_causal_lm(hf_config(case.family), 0, **implementations(case.family)))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "adapter")
    lora = lora_config_from_peft(tmp_path / "adapter")
    shapes = split_adapter(abstract_model_params(case.cfg, case.compute, None, lora))[0]
    adapter = adapter_from_peft(tmp_path / "adapter", case.cfg, lora, shapes, scan_layers=case.compute.scan_layers)
    tokens, mask = batch()
    graphdef = graphdef_of(case.cfg, case.compute, lora)
    params = join(adapter, case.params)
    ours = np.asarray(jax.jit(lambda p: apply_model(graphdef, p, jnp.asarray(tokens), None, jnp.asarray(mask)))(params))
    valid = mask.astype(bool)
    with torch.no_grad():
        ref = hf_logits(model, tokens, mask)
        with model.disable_adapter():
            assert np.abs(ref - hf_logits(model, tokens, mask))[valid].max() > 1e-2
    # 1e-5 of the largest logit on the Intel Xeon hosts; 1.6e-5 (Granite 4 hybrid) on an AMD EPYC one,
    # also at the commit before the typed-spec decoder
    assert np.abs(ours - ref)[valid].max() <= 2e-5 * max(1.0, float(np.abs(ref[valid]).max()))
    write_peft(tmp_path / "out", case.cfg, lora, adapter, scan_layers=case.compute.scan_layers)
    fresh = with_router_biases(random_causal_lm(hf_config(case.family), 0, **implementations(case.family)))
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "out").eval()
    np.testing.assert_allclose(hf_logits(loaded, tokens, mask)[valid], ref[valid], atol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the test extra)")
@pytest.mark.parametrize("model", ["tiny-nemotron-h", "tiny-granite-hybrid"])
def test_the_plan_compiles_a_training_step_for_a_tpu_slice(model):
    """The Mamba2 parameters' sharding (in_proj's mixed output axis replicated, the model axis
    over fsdp) and the attention heads over tensor compile for a v5p-8, fsdp 2 x tensor 2."""
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
