"""LoRA end to end as pipeline stages: convert a Hugging Face model, SFT an adapter on it,
export the adapter (PEFT's format) and the merged model, and load both in PEFT /
transformers with the engine's logits; the adapter artifact's lineage names its base."""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")
peft = need("peft")

from engine.config import ConfigError  # noqa: E402
from engine.data.tokenizer import TokenizerConfig, save_tokenizer, train_tokenizer  # noqa: E402
from engine.models.params import apply_model, graphdef_of  # noqa: E402
from engine.train.checkpoint import load_params, stored_configs  # noqa: E402
from flows.spec import Pipeline  # noqa: E402
from tasks.runner import RAN, execute_stage  # noqa: E402
from tasks.store.records import read_manifest  # noqa: E402
from tests.conftest import child_xla_flags  # noqa: E402

# The SFT stage's process on one device at LLVM -O0 (the test session's level): its few steps
# are mostly compilation, which -O0 does in about half the time of the default -O2.
ONE_DEVICE = {"kind": "local", "env": {"XLA_FLAGS": child_xla_flags()}}


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    """A random Llama-shaped transformers model (odd sizes) with a trained byte-level BPE."""
    out = tmp_path_factory.mktemp("hf-llama") / "hf"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=30,
        intermediate_size=26,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        initializer_range=0.2,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    texts = ["colour 0: red. colour 1: green. colour 2: blue. " * 30]
    save_tokenizer(train_tokenizer(TokenizerConfig(vocab_size=300), texts, add_bos=True), out.parent / "tok")
    for file in (out.parent / "tok").iterdir():
        shutil.copy(file, out / file.name)
    return out


def lora_pipeline(hf_dir: Path, store: Path, data: Path) -> Pipeline:
    p = Pipeline("lora", store=store)
    base = p.stage("convert", task="convert", config={"source": str(hf_dir)})
    sft = p.stage(
        "sft",
        task="sft",
        inputs={"checkpoint": base},
        launcher=ONE_DEVICE,
        config={
            "data": {"path": str(data), "seq_len": 32, "batch_size": 4},
            "steps": 6,
            "log_every": 2,
            "optimizer": {"learning_rate": 2e-2},
            "schedule": {"kind": "constant"},
            "lora": {"rank": 4, "alpha": 8, "target_modules": "all-linear"},
        },
    )
    p.stage("export_base", task="export", inputs={"checkpoint": base})
    p.stage("export_adapter", task="export", inputs={"checkpoint": sft})
    p.stage("export_merged", task="export", inputs={"checkpoint": sft}, config={"merged": True})
    p.stage("merge", task="merge", inputs={"adapter": sft})
    return p


@pytest.mark.slow
def test_a_lora_sft_stage_exports_a_peft_adapter_and_a_merged_model_with_the_engines_logits(hf_base, tmp_path):
    data = tmp_path / "pairs.jsonl"
    names = ["red", "green", "blue"]
    data.write_text(
        "".join(json.dumps({"prompt": f"colour {i % 3}:", "completion": f" {names[i % 3]}"}) + "\n" for i in range(24))
    )
    plan = lora_pipeline(hf_base, tmp_path / "store", data).plan()
    assert {name: execute_stage(s.job, plan.store).status for name, s in plan.stages.items()} == {
        name: RAN for name in plan.stages
    }

    def out(stage):
        return plan.store.artifact_dir(stage, plan.stages[stage].job.artifact_id)

    manifest = read_manifest(out("sft"))
    assert manifest["kind"] == "adapter" and [p["stage"] for p in manifest["parents"]] == ["convert"]
    adapter_bytes = sum(f["size"] for name, f in manifest["files"].items() if name.startswith("checkpoint/"))
    base_bytes = sum(
        f["size"] for name, f in read_manifest(out("convert"))["files"].items() if name.startswith("checkpoint/")
    )
    print(
        f"\nadapter artifact checkpoint bytes {adapter_bytes:,} (all kept steps, Adam state included); "
        f"base {base_bytes:,}"
    )
    adapter_dir, merged_dir, base_dir = (
        out("export_adapter") / "hf",
        out("export_merged") / "hf",
        out("export_base") / "hf",
    )
    assert sorted(p.name for p in adapter_dir.glob("adapter_*")) == ["adapter_config.json", "adapter_model.safetensors"]

    # The engine's view of the adapter artifact (its base with the adapter folded in).
    cfg, params, step = load_params(out("sft") / "checkpoint")
    _, compute = stored_configs(out("sft") / "checkpoint")
    assert step == 6
    tokens = np.random.default_rng(0).integers(0, 300, (2, 12))
    mask = np.ones_like(tokens)
    ours = np.asarray(apply_model(graphdef_of(cfg, compute), params, jnp.asarray(tokens), None, jnp.asarray(mask)))

    with warnings.catch_warnings(record=True) as caught, _captured("peft", "transformers") as logged:
        warnings.simplefilter("always")
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
        model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    assert not [w for w in caught if "adapter" in str(w.message).lower() or "missing" in str(w.message).lower()], [
        str(w.message) for w in caught
    ]
    assert not [r for r in logged if r.levelno >= logging.WARNING], [r.getMessage() for r in logged]
    with torch.no_grad():
        peft_logits = model(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits.numpy()
        with model.disable_adapter():
            base_logits = model(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits.numpy()
        merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
        merged_logits = merged(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits.numpy()
    scale = max(1.0, float(np.abs(peft_logits).max()))
    assert np.abs(peft_logits - base_logits).max() > 1e-3  # training moved the adapter off zero
    assert np.abs(ours - peft_logits).max() <= 1e-5 * scale
    assert np.abs(merged_logits - peft_logits).max() <= 1e-5 * scale

    # The merge stage: a plain checkpoint artifact of the same model, its lineage through the adapter.
    assert read_manifest(out("merge"))["kind"] == "checkpoint"
    assert [p["stage"] for p in read_manifest(out("merge"))["parents"]] == ["sft"]
    merged_cfg, merged_params, _ = load_params(out("merge") / "checkpoint")
    again = np.asarray(
        apply_model(graphdef_of(merged_cfg, compute), merged_params, jnp.asarray(tokens), None, jnp.asarray(mask))
    )
    np.testing.assert_array_equal(again, ours)


class _captured:
    """Records the log records of the named loggers (warnings PEFT or transformers log)."""

    def __init__(self, *names):
        self.names, self.records = names, []

    def __enter__(self):
        self.handler = logging.Handler()
        self.handler.emit = self.records.append
        for name in self.names:
            logging.getLogger(name).addHandler(self.handler)
        return self.records

    def __exit__(self, *exc):
        for name in self.names:
            logging.getLogger(name).removeHandler(self.handler)


def test_an_adapter_whose_base_is_gone_is_refused_in_one_sentence(tmp_path):
    from engine.train.checkpoint import adapter_base

    meta = {"lora": {"base_checkpoint": str(tmp_path / "gone" / "checkpoint"), "base_relative": "../../gone"}}
    with pytest.raises(ConfigError, match="holds a LoRA adapter whose base checkpoint .*gone; restore the base"):
        adapter_base(tmp_path / "adapter", meta)


def test_trainflow_convert_takes_a_peft_adapter_onto_its_base_and_refuses_one_that_does_not_fit(
    hf_base, tmp_path, capsys
):
    from flows.cli import main as trainflow

    store = tmp_path / "store"
    assert trainflow(["convert", str(hf_base), "--store", str(store), "--json"]) == 0
    base_path = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["path"]
    torch.manual_seed(3)
    model = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(hf_base),
        peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"]),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path / "peft")

    assert trainflow(["convert", str(tmp_path / "peft"), "--base", base_path, "--json"]) == 0
    converted = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    manifest = read_manifest(Path(converted["path"]))
    assert manifest["kind"] == "adapter" and [p["input"] for p in manifest["parents"]] == ["base"]
    cfg, params, _ = load_params(Path(converted["path"]) / "checkpoint")  # the base with the adapter folded in
    _, compute = stored_configs(Path(converted["path"]) / "checkpoint")
    tokens = np.random.default_rng(1).integers(0, 300, (2, 9))
    ours = np.asarray(apply_model(graphdef_of(cfg, compute), params, jnp.asarray(tokens)))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    assert np.abs(ours - ref).max() <= 1e-5 * max(1.0, float(np.abs(ref).max()))

    # An adapter of a wider model: one sentence naming both shapes, exit 2, no artifact.
    wide = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=36,
        intermediate_size=26,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
    )
    other = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_config(wide), peft.LoraConfig(r=2, target_modules=["q_proj"])
    )
    other.save_pretrained(tmp_path / "wide")
    before = sorted(p.name for p in (store / "convert").iterdir())
    assert trainflow(["convert", str(tmp_path / "wide"), "--base", base_path]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "lora_A.weight' has shape (2, 36), which does not fit this base model's (30, 2)" in err, err
    assert sorted(p.name for p in (store / "convert").iterdir()) == before or all(
        read_manifest(store / "convert" / name).get("status") != "complete"
        for name in set(p.name for p in (store / "convert").iterdir()) - set(before)
    )
