"""SFT: which tokens carry loss, packing invariance, chat templates, a run that learns and resumes."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from engine.config import ConfigError, load_config
from engine.data.tokenizer import TokenizerConfig, load_saved, save_tokenizer, train_tokenizer
from engine.models.config import ModelConfig
from engine.models.transformer import Transformer
from engine.posttrain.config import SFTConfig, SFTDataConfig
from engine.posttrain.sft import load_examples, pack_rows, run_sft, tokenize_example
from engine.train.checkpoint import Checkpointer, load_params, read_meta
from engine.train.step import lm_loss_fn

MODEL = dict(
    vocab_size=300, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=128
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A checkpoint artifact: checkpoint/ (random tiny model) and tokenizer/ (byte-level BPE)."""
    out = tmp_path_factory.mktemp("base")
    texts = ["the quick brown fox jumps over the lazy dog " * 20, "Capital of France? Paris. Rome. Be brief."]
    bundle = train_tokenizer(TokenizerConfig(vocab_size=300), texts, add_bos=True)
    save_tokenizer(bundle, out / "tokenizer")
    cfg = ModelConfig(**MODEL)
    params = nnx.to_pure_dict(nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1])
    ckpt = Checkpointer(out / "checkpoint", async_save=False)
    meta = {"step": 0, "model": cfg.model_dump(mode="json"), "format": "trainflow.checkpoint/1"}
    ckpt.save(0, params, {"unused": np.zeros((), np.int32)}, meta, {})
    ckpt.close()
    return out


def decode(bundle, ids) -> str:
    return bundle.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def test_prompt_tokens_get_no_loss_and_completion_tokens_do(base):
    bundle = load_saved(base / "tokenizer")
    data = SFTDataConfig()
    ex = tokenize_example({"prompt": "Capital of France?", "completion": " Paris."}, "x:1", bundle, data)
    assert ex.ids[0] == bundle.bos_id and ex.ids[-1] == bundle.eos_id
    assert decode(bundle, ex.ids[ex.loss == 1]) == " Paris." + bundle.eos_token
    assert decode(bundle, ex.ids[ex.loss == 0]) == bundle.bos_token + "Capital of France?"

    chat = tokenize_example({"messages": CHAT}, "x:2", bundle, data)
    # Only the assistant turns (with the eos the default template closes them with) are targets.
    assert decode(bundle, chat.ids[chat.loss == 1]) == f"Paris.{bundle.eos_token}Rome.{bundle.eos_token}"
    assert "France" in decode(bundle, chat.ids[chat.loss == 0]) and "Be brief" in decode(bundle, chat.ids)

    everything = tokenize_example({"messages": CHAT}, "x:3", bundle, SFTDataConfig(loss_on="all"))
    assert everything.loss[0] == 0 and everything.loss[1:].all()


def test_conversational_prompt_completion_and_a_tokenizers_own_chat_template(base):
    bundle = load_saved(base / "tokenizer")
    bundle.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    record = {"prompt": CHAT[:2], "completion": [CHAT[2]]}
    ex = tokenize_example(record, "x:1", bundle, SFTDataConfig())
    assert decode(bundle, ex.ids) == "[system] Be brief.\n[user] Capital of France?\n[assistant] Paris.\n"
    assert decode(bundle, ex.ids[ex.loss == 1]) == "Paris.\n"


# A Qwen/ChatML-style template: system default, loop controls, tojson, generation markers.
CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{{ {'messages': messages | length} | tojson }}"
)


@pytest.mark.parametrize("template", ["default", "chatml"])
def test_chat_rendering_matches_transformers(base, template):
    from transformers.utils.chat_template_utils import render_jinja_template

    from engine.data.chat import chat_template, render

    bundle = load_saved(base / "tokenizer")
    bundle.chat_template = CHATML if template == "chatml" else None
    for messages, prompt in ((CHAT, False), (CHAT[1:2], True)):
        expected, _ = render_jinja_template(
            conversations=[messages],
            chat_template=chat_template(bundle),
            add_generation_prompt=prompt,
            bos_token=bundle.bos_token,
            eos_token=bundle.eos_token,
            pad_token=bundle.pad_token,
        )
        assert render(bundle, messages, add_generation_prompt=prompt) == expected[0]


def test_a_record_without_its_completion_is_rejected_naming_the_line(base, tmp_path):
    bundle = load_saved(base / "tokenizer")
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"prompt": "a"}) + "\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: no 'completion' key \(the record has: prompt\)"):
        load_examples(SFTDataConfig(path=str(path)), bundle)


def test_packed_and_unpacked_batches_give_the_same_loss(base):
    bundle = load_saved(base / "tokenizer")
    rng = np.random.default_rng(0)
    words = ["fox", "dog", "lazy", "quick", "brown", "Paris", "Rome"]
    records = [
        {
            "prompt": " ".join(rng.choice(words, rng.integers(1, 6))) + "?",
            "completion": " " + " ".join(rng.choice(words, rng.integers(1, 5))),
        }
        for _ in range(12)
    ]
    examples = [tokenize_example(r, f"x:{i}", bundle, SFTDataConfig()) for i, r in enumerate(records)]
    packed = pack_rows(examples, seq_len=64, packing=True)
    unpacked = pack_rows(examples, seq_len=64, packing=False)
    assert len(packed["tokens"]) < len(unpacked["tokens"]) == 12
    assert packed["loss_mask"].sum() == unpacked["loss_mask"].sum() == sum(e.loss[1:].sum() for e in examples)

    cfg = ModelConfig(**MODEL)
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(3)))
    loss_fn = jax.jit(lambda params, batch: lm_loss_fn(graphdef, 0.0)(params, batch, batch["loss_mask"].sum())[0])
    params = nnx.to_pure_dict(state)
    np.testing.assert_allclose(loss_fn(params, packed), loss_fn(params, unpacked), rtol=1e-5)


def sft_config(base: Path, out: Path, data: Path, **overrides) -> SFTConfig:
    tree = {
        "checkpoint": {
            "init_from": str(base / "checkpoint"),
            "directory": str(out / "checkpoint"),
            "every_steps": 10,
            "async_save": False,
        },
        "data": {"path": str(data), "seq_len": 64, "batch_size": 8, "eval_fraction": 0.2},
        "optimizer": {"learning_rate": 1e-2},
        "schedule": {"kind": "constant"},
        "steps": 40,
        "log_every": 5,
        "progress": False,
        "metrics_dir": str(out),
    }
    return load_config(tree=tree, overrides=[f"{k}={v}" for k, v in overrides.items()], schema=SFTConfig)


def test_sft_learns_the_completions_resumes_and_writes_a_loadable_checkpoint(base, tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    colours = ["red", "green", "blue"]
    with data.open("w") as f:
        for i in range(60):  # the answer is a function of the prompt: learnable from scratch
            f.write(json.dumps({"prompt": f"colour {i % 3}:", "completion": f" {colours[i % 3]}"}) + "\n")
    first = run_sft(sft_config(base, tmp_path / "run", data, steps=30))
    assert first["train_examples"] == 48 and first["eval_examples"] == 12
    # An untrained model is near uniform, ln(300) = 5.7 nats per token; the answers take ~1.
    assert first["eval_loss"] < 0.2 * np.log(300), (
        first["eval_loss"],
        (tmp_path / "run" / "metrics.jsonl").read_text(),
    )

    logs = []
    resumed = run_sft(sft_config(base, tmp_path / "run", data, steps=40), log=logs.append)
    assert any("resumed from checkpoint step 30" in line for line in logs)
    assert resumed["steps"] == 40 and resumed["eval_loss"] < 0.1, resumed["eval_loss"]
    model_cfg, params, step = load_params(tmp_path / "run" / "checkpoint")
    assert step == 40 and model_cfg == ModelConfig(**MODEL)
    assert read_meta(tmp_path / "run" / "checkpoint")[1]["stage"] == "sft"

    # `trainflow generate` on the result: greedy decoding answers a held-out prompt.
    from flows.cli import main as trainflow

    code = trainflow(
        [
            "generate",
            str(tmp_path / "run"),
            "--tokenizer",
            str(base / "tokenizer"),
            "--prompt",
            "colour 1:",
            "--temperature",
            "0",
            "--max-new-tokens",
            "8",
            "--json",
        ]
    )
    assert code == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["completion"] == " green"
