"""LoRA against PEFT (peft from PyPI over transformers, torch CPU): the same adapter weights
give the engine's logits PEFT's, and the adapter's gradients torch autograd's; PEFT's
adapter files round-trip; a fresh adapter changes nothing; bad configs are refused.

Tiny held-out shapes (hidden 30, 6 query heads over 2 KV heads of 8, rank 3), random
adapter factors (PEFT starts B at zero, which would hide a wrong B), float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")
peft = need("peft")

from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.interop.hf.peft import adapter_from_peft, adapter_to_peft, lora_config_from_peft, write_peft  # noqa: E402
from engine.models.config import LoraConfig  # noqa: E402
from engine.models.lora import join, merge_into_base, split_adapter  # noqa: E402
from engine.models.params import abstract_model_params, apply_model, graphdef_of, init_params  # noqa: E402
from engine.parallel.config import MeshConfig  # noqa: E402
from engine.parallel.mesh import make_mesh  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from tests.test_hf_parity import batch, random_hf_model  # noqa: E402

RANK, ALPHA = 3, 5.0


def moe_model():
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=37,
        hidden_size=30,
        intermediate_size=26,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        num_experts_per_tok=2,
        num_experts=5,
        moe_intermediate_size=10,
    )
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    ).float()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if p.ndim == 1 else p.normal_(0.0, 0.3)
    return model.eval()


# (family, PEFT target_modules, use_rslora)
CASES = [
    ("llama", "all-linear", False),
    ("qwen3", ["q_proj", "v_proj", "down_proj"], True),
    ("gemma2", "all-linear", False),
    ("qwen3_moe", ["q_proj", "k_proj", "v_proj", "o_proj"], False),
]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request, tmp_path_factory):
    family, targets, rslora = request.param
    root = tmp_path_factory.mktemp(f"lora-{family}")
    base = moe_model() if family == "qwen3_moe" else random_hf_model(family)
    base.save_pretrained(root / "hf")
    convert_hf(root / "hf", root / "converted")
    cfg, params, _ = load_params(root / "converted" / "checkpoint")
    _, compute = stored_configs(root / "converted" / "checkpoint")
    peft_cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
    model = peft.get_peft_model(base, peft_cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(root / "adapter")
    lora = lora_config_from_peft(root / "adapter")
    shapes = split_adapter(abstract_model_params(cfg, compute, None, lora))[0]
    adapter = adapter_from_peft(root / "adapter", cfg, lora, shapes, scan_layers=compute.scan_layers)
    return dict(
        family=family, model=model, cfg=cfg, compute=compute, base=params, lora=lora, adapter=adapter, root=root
    )


def peft_logits(model, tokens, mask, grad_weights=None):
    out = model(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits
    return out


def jitted_apply(graphdef, params, *args):
    """The forward pass compiled as one program (as the engine's trainer and sampler run it):
    op by op, each of a family's dozens of primitives is dispatched and compiled on its own,
    and the gradient through them took ~30 s on 2 cores."""
    return jax.jit(lambda params, *args: apply_model(graphdef, params, *args))(params, *args)


def engine_logits(case, adapter, tokens, mask):
    graphdef = graphdef_of(case["cfg"], case["compute"], case["lora"])
    return jitted_apply(graphdef, join(adapter, case["base"]), jnp.asarray(tokens), None, jnp.asarray(mask))


def test_adapter_logits_match_peft(case):
    tokens, mask = batch()
    with torch.no_grad():
        ref = peft_logits(case["model"], tokens, mask).numpy()
        with case["model"].disable_adapter():
            base_ref = peft_logits(case["model"], tokens, mask).numpy()
    ours = np.asarray(engine_logits(case, case["adapter"], tokens, mask))
    valid = mask.astype(bool)
    delta = float(np.abs(ours - ref)[valid].max())
    print(f"\n{case['family']}: max |delta logit| = {delta:.2e}")
    assert delta <= 1e-5 * max(1.0, float(np.abs(ref[valid]).max())), delta
    assert np.abs(ref - base_ref)[valid].max() > 1e-2  # the adapter really changes the model


def test_adapter_gradients_match_torch_autograd(case):
    tokens, mask = batch()
    weights = np.random.default_rng(2).normal(size=(*tokens.shape, 37)).astype(np.float32) * mask[..., None]
    model = case["model"]
    model.zero_grad()
    loss = (peft_logits(model, tokens, mask) * torch.tensor(weights)).sum()
    loss.backward()
    ref = {
        name.removesuffix(".default.weight") + ".weight": p.grad.numpy()
        for name, p in model.named_parameters()
        if "lora_" in name
    }
    ref = {
        k.replace(".lora_A.weight", ".lora_A.weight").replace(".lora_B.weight", ".lora_B.weight"): v
        for k, v in ref.items()
    }

    def objective(adapter):
        return jnp.sum(engine_logits(case, adapter, tokens, mask) * weights)

    grads = jax.jit(jax.grad(objective))(jax.tree.map(jnp.asarray, case["adapter"]))
    ours = adapter_to_peft(
        case["cfg"], case["lora"], jax.tree.map(np.asarray, grads), scan_layers=case["compute"].scan_layers
    )
    assert set(ours) == set(ref)
    scale = max(float(np.abs(g).max()) for g in ref.values())
    worst = max(float(np.abs(ours[k] - ref[k]).max()) for k in ref)
    print(f"\n{case['family']}: {len(ref)} adapter tensors, max |delta grad| = {worst:.2e} (max |grad| {scale:.2e})")
    assert worst <= 1e-5 * max(1.0, scale)


def test_written_adapter_loads_in_peft_with_the_same_logits(case, tmp_path):
    write_peft(tmp_path / "out", case["cfg"], case["lora"], case["adapter"], scan_layers=case["compute"].scan_layers)
    base = moe_model() if case["family"] == "qwen3_moe" else random_hf_model(case["family"])
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "out").eval()
    tokens, mask = batch()
    with torch.no_grad():
        ref = loaded(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits.numpy()
    ours = np.asarray(engine_logits(case, case["adapter"], tokens, mask))
    valid = mask.astype(bool)
    assert np.abs(ours - ref)[valid].max() <= 1e-5 * max(1.0, float(np.abs(ref[valid]).max()))


def test_merged_weights_give_the_adapted_logits(case):
    tokens, mask = batch()
    merged = merge_into_base(jax.tree.map(np.asarray, join(case["adapter"], case["base"])), case["lora"].scale)
    plain = jitted_apply(
        graphdef_of(case["cfg"], case["compute"]),
        jax.tree.map(jnp.asarray, merged),
        jnp.asarray(tokens),
        None,
        jnp.asarray(mask),
    )
    adapted = engine_logits(case, case["adapter"], tokens, mask)
    valid = mask.astype(bool)
    assert np.abs(np.asarray(plain) - np.asarray(adapted))[valid].max() <= 1e-5 * max(
        1.0, float(np.abs(np.asarray(adapted)[valid]).max())
    )


def test_a_fresh_adapter_is_peft_initialised_and_changes_nothing():
    cfg = hf_tiny_cfg()
    lora = LoraConfig(rank=4, alpha=8, target_modules="all-linear")
    mesh = make_mesh(MeshConfig(data=1), jax.devices()[:1])
    from engine.models.config import ComputeConfig

    compute = ComputeConfig()
    base = init_params(cfg, compute, mesh, seed=0)
    adapter = init_params(cfg, compute, mesh, seed=0, lora=lora, adapter_only=True)
    a = np.asarray(adapter["blocks"]["attn"]["wq_dnh_lora_a"])
    assert a.shape == (cfg.num_layers, cfg.d_model, 4)
    bound = 1 / np.sqrt(cfg.d_model)
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.8 * bound  # Kaiming-uniform, fan-in d_model
    assert not np.asarray(adapter["blocks"]["mlp"]["w_down_fd_lora_b"]).any()  # B starts at zero
    tokens = jnp.arange(12).reshape(2, 6) % cfg.vocab_size
    plain = jitted_apply(graphdef_of(cfg, compute), base, tokens)
    adapted = jitted_apply(graphdef_of(cfg, compute, lora), join(adapter, base), tokens)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(adapted))


def hf_tiny_cfg():
    from engine.models.config import ModelConfig

    return ModelConfig(vocab_size=17, d_model=11, num_layers=2, num_heads=3, num_kv_heads=1, head_dim=6, mlp_dim=13)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(target_modules=["q_proj", "q.proj"]), "target module 'q.proj' is not a module name"),
        (dict(rank=0), "greater than 0"),
    ],
)
def test_bad_lora_configs_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        LoraConfig(**bad)


def test_experts_and_modules_the_model_has_not_are_refused_in_one_sentence():
    from engine.models.config import ModelConfig

    moe = ModelConfig(
        family="qwen3_moe",
        vocab_size=17,
        d_model=11,
        num_layers=2,
        num_heads=3,
        num_kv_heads=1,
        head_dim=6,
        mlp_dim=13,
        num_experts=4,
        qk_norm=True,
    )
    with pytest.raises(ValueError, match="mixture of experts: LoRA on its experts \\(up_proj\\) is not supported"):
        LoraConfig(target_modules=["q_proj", "up_proj"]).targets(moe)
    assert LoraConfig(target_modules="all-linear").targets(moe) == ("q_proj", "k_proj", "v_proj", "o_proj")
    with pytest.raises(ValueError, match="family 'qwen3_moe' has no module qkv to adapt; it can adapt: q_proj, k_proj"):
        LoraConfig(target_modules=["qkv"]).targets(moe)
