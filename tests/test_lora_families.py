"""LoRA on families whose projections PEFT names otherwise than Llama's, against PEFT (peft
over transformers, torch CPU), one tiny model per mechanism of engine/models/lora_targets.py:

- latent attention with experts (DeepSeek-V3): q_a_proj, q_b_proj, kv_a_proj_with_mqa,
  kv_b_proj (folded into the absorbed weights) and o_proj;
- a fused q/k/v (GPT-NeoX's query_key_value, rows grouped by head): one A, the parts' B's;
- GPT-2's Conv1D layout (c_attn fused and stored (in, out), c_proj on attention and MLP);
- Mamba (in_proj, x_proj: PEFT refuses out_proj on Mamba models and transformers' Mamba reads
  dt_proj.weight directly, ignoring an adapter there, so the engine refuses both).

A PEFT adapter with random factors (PEFT starts B at zero, which would hide a wrong B) is
read in and gives PEFT's logits; the adapter the engine writes is PEFT's tensor for tensor
and loads with PeftModel.from_pretrained; the merged weights the engine exports are
merge_and_unload's. Float32, rank 3.
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
from engine.interop.hf.export import hf_tensors  # noqa: E402
from engine.interop.hf.peft import ADAPTER_WEIGHTS, adapter_from_peft, lora_config_from_peft, write_peft  # noqa: E402
from engine.interop.hf.safetensors_io import SafetensorsFile  # noqa: E402
from engine.models.config import LoraConfig  # noqa: E402
from engine.models.lora import join, merge_into_base, split_adapter  # noqa: E402
from engine.models.params import abstract_model_params, apply_model, graphdef_of  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from tests.test_hf_parity import COMMON, batch, random_causal_lm  # noqa: E402

RANK, ALPHA = 3, 5.0
TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def hf_config(name: str):
    t = transformers
    return {
        # 2 of 5 experts and a shared one, layer 0 dense; a compressed query (q_lora_rank 12)
        "deepseek_v3": lambda: t.DeepseekV3Config(
            **{**COMMON, "num_hidden_layers": 2, "num_key_value_heads": 6, "head_dim": 4},
            kv_lora_rank=10,
            q_lora_rank=12,
            qk_rope_head_dim=4,
            qk_nope_head_dim=6,
            v_head_dim=7,
            moe_intermediate_size=14,
            first_k_dense_replace=1,
            n_routed_experts=5,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            num_nextn_predict_layers=0,
            **TOKENS,
        ),
        # 3 heads of 12, RoPE on half of each
        "gpt_neox": lambda: t.GPTNeoXConfig(
            vocab_size=COMMON["vocab_size"],
            hidden_size=36,
            intermediate_size=26,
            num_hidden_layers=2,
            num_attention_heads=3,
            max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
            **TOKENS,
        ),
        "gpt2": lambda: t.GPT2Config(
            vocab_size=COMMON["vocab_size"],
            n_embd=30,
            n_layer=2,
            n_head=6,
            n_inner=26,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **TOKENS,
        ),
        "mamba": lambda: t.MambaConfig(
            vocab_size=COMMON["vocab_size"],
            hidden_size=30,
            num_hidden_layers=2,
            state_size=7,
            expand=3,
            conv_kernel=3,
            time_step_rank=5,
            tie_word_embeddings=False,
            **TOKENS,
        ),
    }[name]()


# family -> PEFT target_modules (all-linear: PEFT expands it to the model's Linear and Conv1D names)
CASES = {
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "gpt_neox": "all-linear",
    "gpt2": "all-linear",
    "mamba": ["in_proj", "x_proj"],  # PEFT's all-linear raises on Mamba's out_proj
}


def base_model(family: str):
    implementations = {"attn_implementation": "eager"} if family != "mamba" else {}
    if family == "deepseek_v3":
        implementations["experts_implementation"] = "eager"
    return random_causal_lm(hf_config(family), 0, **implementations)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(f"lora-{family}")
    base_model(family).save_pretrained(root / "hf")
    convert_hf(root / "hf", root / "converted")
    cfg, params, _ = load_params(root / "converted" / "checkpoint")
    _, compute = stored_configs(root / "converted" / "checkpoint")
    peft_cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=CASES[family], lora_dropout=0.0)
    model = peft.get_peft_model(base_model(family), peft_cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(root / "adapter")
    lora = lora_config_from_peft(root / "adapter")
    shapes = split_adapter(abstract_model_params(cfg, compute, None, lora))[0]
    adapter = adapter_from_peft(root / "adapter", cfg, lora, shapes, scan_layers=compute.scan_layers)
    tokens, mask = batch(cfg.vocab_size)
    logits = jax.jit(lambda p, t, m: apply_model(graphdef_of(cfg, compute, lora), p, t, None, m))(
        join(adapter, params), jnp.asarray(tokens), jnp.asarray(mask)
    )
    return dict(
        family=family,
        model=model.eval(),
        cfg=cfg,
        compute=compute,
        base=params,
        lora=lora,
        adapter=adapter,
        root=root,
        logits=np.asarray(logits),
    )


def close(ours: np.ndarray, ref: np.ndarray, mask: np.ndarray) -> float:
    """max |ours - ref| over the real tokens, relative to the logits' size (at least 1)."""
    valid = mask.astype(bool)
    return float(np.abs(ours - ref)[valid].max()) / max(1.0, float(np.abs(ref[valid]).max()))


def peft_logits(model, family: str) -> np.ndarray:
    tokens, mask = batch(COMMON["vocab_size"])
    with torch.no_grad():
        # transformers' Mamba takes no attention mask: the right-padded row's padding comes after
        # its real tokens and the left-padded row is compared from its first real token on
        if family == "mamba":
            rows = [model(torch.tensor(tokens[:2])).logits.numpy()]
            last = model(torch.tensor(tokens[2:, 6:])).logits.numpy()
            return np.concatenate([rows[0], np.pad(last, ((0, 0), (6, 0), (0, 0)))])
        return model(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits.numpy()


def test_a_peft_adapter_gives_peft_s_logits(case):
    _, mask = batch(COMMON["vocab_size"])
    ref = peft_logits(case["model"], case["family"])
    with case["model"].disable_adapter():
        base_ref = peft_logits(case["model"], case["family"])
    delta = close(case["logits"], ref, mask)
    print(f"\n{case['family']}: {case['lora'].targets(case['cfg'])}: relative |delta logit| {delta:.1e}")
    assert delta <= 1e-4
    assert close(base_ref, ref, mask) > 1e-2  # the adapter changes the logits: a dropped one would show


def test_the_written_adapter_is_peft_s_and_loads_in_peft(case, tmp_path):
    compute = case["compute"]
    write_peft(tmp_path, case["cfg"], case["lora"], case["adapter"], scan_layers=compute.scan_layers)
    with (
        SafetensorsFile(case["root"] / "adapter" / ADAPTER_WEIGHTS) as theirs,
        SafetensorsFile(tmp_path / ADAPTER_WEIGHTS) as ours,
    ):
        assert sorted(ours.names()) == sorted(theirs.names())
        for name in theirs.names():
            np.testing.assert_array_equal(ours.get(name), theirs.get(name), err_msg=name)
    loaded = peft.PeftModel.from_pretrained(base_model(case["family"]), tmp_path).eval()
    assert close(case["logits"], peft_logits(loaded, case["family"]), batch(COMMON["vocab_size"])[1]) <= 1e-4


def test_the_merged_export_is_merge_and_unload_s(case):
    cfg, lora = case["cfg"], case["lora"]
    joined = jax.tree.map(np.asarray, join(case["adapter"], case["base"]))
    merged = merge_into_base(joined, lora.scale, lora.weights(cfg))
    ours = {name: build() for name, (_, _, build) in hf_tensors(merged, cfg, case["compute"]).items()}
    theirs = peft.PeftModel.from_pretrained(base_model(case["family"]), case["root"] / "adapter").merge_and_unload()
    reference = {name: p.detach().numpy() for name, p in theirs.state_dict().items()}
    # (transformers stores a mixture's experts as one tensor per layer: compared by the logits tests)
    common = sorted(set(ours) & set(reference))
    for name in common:
        np.testing.assert_allclose(ours[name], reference[name], rtol=0, atol=1e-6, err_msg=name)
    with SafetensorsFile(case["root"] / "adapter" / ADAPTER_WEIGHTS) as file:
        adapted = {
            n.removeprefix("base_model.model.").replace(".lora_A.", ".") for n in file.names() if ".lora_A." in n
        }
    assert adapted <= set(common)
    base = {name: build() for name, (_, _, build) in hf_tensors(joined, cfg, case["compute"]).items()}
    assert all(not np.array_equal(ours[name], base[name]) for name in adapted)  # each merged weight moved


def test_targets_are_the_family_s_module_names(case):
    cfg = case["cfg"]
    all_linear = LoraConfig(target_modules="all-linear").targets(cfg)
    assert set(case["lora"].targets(cfg)) == set(
        all_linear if CASES[case["family"]] == "all-linear" else CASES[case["family"]]
    )
    with pytest.raises(ValueError, match=f"family '{cfg.family}' has no module qkv to adapt; it can adapt: "):
        LoraConfig(target_modules=["qkv"]).targets(cfg)
    if cfg.family == "mamba":
        assert set(LoraConfig(target_modules="all-linear").targets(cfg)) == {"in_proj", "x_proj"}
        with pytest.raises(ValueError, match="family 'mamba' cannot adapt out_proj as PEFT would \\(PEFT refuses"):
            LoraConfig(target_modules=["in_proj", "out_proj"]).targets(cfg)
    if cfg.is_moe:
        with pytest.raises(ValueError, match="mixture of experts: LoRA on its experts \\(up_proj\\)"):
            LoraConfig(target_modules=["up_proj"]).targets(cfg)
        with pytest.raises(ValueError, match="lora.dropout must be 0 with kv_b_proj"):
            LoraConfig(target_modules=["kv_b_proj"], dropout=0.1).targets(cfg)
