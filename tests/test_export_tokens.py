"""A checkpoint trained here (no Hugging Face source, only its tokenizer) exports with its
tokenizer's bos/eos/pad ids in config.json and generation_config.json, so transformers'
generate() stops at eos; a converted checkpoint keeps the ids its source wrote.

The model is built to say eos after any prompt: every token embeds to the same vector, the
attention and MLP outputs are zero, and the LM head's only non-zero column is eos's. Without
the ids in the export, generate() would run to max_new_tokens, eos after eos."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.data.tokenizer import TokenizerConfig, save_tokenizer, train_tokenizer
from engine.interop.hf.export import export_hf
from engine.interop.hf.files import export_token_ids
from engine.models.config import ComputeConfig, ModelConfig
from engine.train.checkpoint import save_params
from tests.deps import need

torch = need("torch")
transformers = need("transformers")

TEXTS = ["the quick brown fox jumps over the lazy dog. " * 20, "a b c d e f g h i j k l m n o p. " * 20]
D_MODEL = 12


def eos_saying_params(cfg: ModelConfig, eos: int) -> dict:
    """The engine's param tree (one layer stack) of a model whose next token is always eos."""
    d, f, v = cfg.d_model, cfg.mlp.dim, cfg.vocab_size
    heads, kv, hd = cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.attention.head_dim
    rng = np.random.default_rng(0)
    head_dv = np.zeros((d, v), np.float32)
    head_dv[:, eos] = 1.0
    return {
        "blocks": {
            "attn": {
                "wq_dnh": rng.normal(size=(1, d, heads, hd)).astype(np.float32),
                "wk_dkh": rng.normal(size=(1, d, kv, hd)).astype(np.float32),
                "wv_dkh": rng.normal(size=(1, d, kv, hd)).astype(np.float32),
                "wo_nhd": np.zeros((1, heads, hd, d), np.float32),  # attention adds nothing
            },
            "attn_norm": {"scale": np.ones((1, d), np.float32)},
            "mlp": {
                "w_gate_df": rng.normal(size=(1, d, f)).astype(np.float32),
                "w_up_df": rng.normal(size=(1, d, f)).astype(np.float32),
                "w_down_fd": np.zeros((1, f, d), np.float32),  # nor does the MLP
            },
            "mlp_norm": {"scale": np.ones((1, d), np.float32)},
        },
        "embed_vd": np.ones((v, d), np.float32),  # every token the same vector
        "final_norm": {"scale": np.ones((d,), np.float32)},
        "lm_head_dv": head_dv,
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An artifact as a stage here leaves it: checkpoint/ (meta without `hf`) and tokenizer/."""
    artifact = tmp_path_factory.mktemp("export-tokens") / "sft"
    bundle = train_tokenizer(TokenizerConfig(vocab_size=300), TEXTS, add_bos=True)
    save_tokenizer(bundle, artifact / "tokenizer")
    cfg = ModelConfig(
        vocab_size=bundle.vocab_size,
        d_model=D_MODEL,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=6,
        mlp_dim=20,
        max_seq_len=64,
    )
    meta = {"step": 3, "model": cfg.model_dump(mode="json"), "compute": ComputeConfig().model_dump(mode="json")}
    save_params(artifact / "checkpoint", 3, eos_saying_params(cfg, bundle.eos_id), meta)
    return artifact, bundle


def test_the_exported_model_stops_generating_at_the_tokenizers_eos(trained, tmp_path):
    artifact, bundle = trained
    export_hf(artifact / "checkpoint", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    ids = {"bos_token_id": bundle.bos_id, "eos_token_id": bundle.eos_id, "pad_token_id": bundle.pad_id}
    assert bundle.eos_id is not None and bundle.bos_id is not None
    assert {k: config[k] for k in ids} == ids
    assert {k: generation.get(k) for k in ids} == ids

    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id == bundle.eos_id
    prompt = tokenizer("the quick brown fox", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    new = out[0, prompt["input_ids"].shape[1] :].tolist()
    assert new == [bundle.eos_id], new  # one token, eos, and no more: generate stopped there


def test_a_converted_checkpoint_keeps_the_ids_its_source_wrote(trained):
    _, bundle = trained
    tokenizer_dir = trained[0] / "tokenizer"
    ids = {"bos_token_id": 7, "eos_token_id": 9, "pad_token_id": None}  # as a source's config.json gave them
    assert export_token_ids({"token_ids": ids}, tokenizer_dir) == export_token_ids({"token_ids": ids}, None) == ids
    assert export_token_ids({"token_ids": None}, tokenizer_dir) == dict.fromkeys(ids)  # the source had none
    theirs = {"bos_token_id": bundle.bos_id, "eos_token_id": bundle.eos_id, "pad_token_id": bundle.pad_id}
    assert export_token_ids(None, tokenizer_dir) == theirs  # trained here: no source
