"""DPO on the shared trainer: preference rows, the reference, learning on a task whose
preferred answer is known, resume, bad input; sequence log-probs equal transformers'."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from engine.config import ConfigError, load_config
from engine.data.tokenizer import load_saved
from engine.posttrain.config import DPOConfig
from engine.posttrain.dpo import CHOSEN, REJECTED, load_pairs, pair_rows, run_dpo, tokenize_pair
from engine.train.checkpoint import load_params
from tests.conftest import child_xla_flags
from tests.deps import need
from tests.test_lora_train import base  # noqa: F401  (a tiny checkpoint artifact, init std 0.25)

NAMES = ["red", "green", "blue"]

# A stage's engine process on one device at LLVM -O0 (the test session's level): its few steps
# are mostly compilation, which -O0 does in about half the time of the default -O2.
ONE_DEVICE_ENV = {"XLA_FLAGS": child_xla_flags()}


@pytest.fixture(scope="module")
def preferences(tmp_path_factory) -> Path:
    """'colour i:' prefers the i-th colour to another one: learnable, the answer known."""
    path = tmp_path_factory.mktemp("dpo-data") / "pairs.jsonl"
    rng = np.random.default_rng(0)
    with path.open("w") as f:
        for i in range(72):
            right, wrong = i % 3, (i % 3 + 1 + rng.integers(0, 2)) % 3
            f.write(
                json.dumps({"prompt": f"colour {right}:", "chosen": f" {NAMES[right]}", "rejected": f" {NAMES[wrong]}"})
                + "\n"
            )
    return path


def dpo_config(base: Path, out: Path, data: Path, **overrides) -> DPOConfig:
    tree = {
        "checkpoint": {
            "init_from": str(base / "checkpoint"),
            "directory": str(out / "checkpoint"),
            "every_steps": 10,
            "async_save": False,
        },
        "data": {"path": str(data), "max_prompt_length": 8, "max_length": 16, "batch_size": 8, "eval_fraction": 0.25},
        "optimizer": {"learning_rate": 1e-3},
        "schedule": {"kind": "constant"},
        "steps": 20,
        "log_every": 5,
        "eval_every": 0,
        "progress": False,
        "metrics_dir": str(out),
    }
    return load_config(tree=tree, overrides=[f"{k}={v}" for k, v in overrides.items()], schema=DPOConfig)


def test_pair_rows_hold_chosen_then_rejected_with_the_completion_as_targets(base):
    bundle = load_saved(base / "tokenizer")
    cfg = dpo_config(base, Path("unused"), Path("unused.jsonl"))
    pair = tokenize_pair({"prompt": "colour 1:", "chosen": " green", "rejected": " red"}, "x:1", bundle, cfg.data)
    rows = pair_rows([pair], cfg.data.max_length)
    seg, mask = rows["segment_ids"][0], rows["loss_mask"][0]
    n_prompt, n_chosen = len(pair.prompt), len(pair.prompt) + len(pair.chosen) - 1
    # Padding-free within the row: the rejected sequence starts where the chosen one ends.
    assert (seg[:n_chosen] == CHOSEN).all() and seg[n_chosen] == REJECTED
    assert (seg[n_chosen : n_chosen + n_prompt + len(pair.rejected) - 1] == REJECTED).all()
    assert not seg[n_chosen + n_prompt + len(pair.rejected) - 1 :].any()
    np.testing.assert_array_equal(rows["targets"][0][mask.astype(bool) & (seg == CHOSEN)], pair.chosen)
    np.testing.assert_array_equal(rows["targets"][0][mask.astype(bool) & (seg == REJECTED)], pair.rejected)
    assert pair.chosen[-1] == bundle.eos_id and rows["positions"][0][n_chosen] == 0


def test_dpo_learns_the_preferred_answers_and_resumes_bitwise_after_sigkill(base, preferences, tmp_path):
    first = run_dpo(dpo_config(base, tmp_path / "run", preferences, steps=30))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rewards/chosen" in r]
    assert first["eval_rewards/accuracies"] > 0.9, first  # held out: the policy prefers the chosen answers
    assert first["eval_rewards/margins"] > 0 and steps[-1]["rewards/chosen"] > steps[-1]["rewards/rejected"]
    assert steps[0]["rewards/accuracies"] < steps[-1]["rewards/accuracies"]
    assert first["train_pairs"] == 54 and first["eval_pairs"] == 18
    print(
        f"\nDPO held-out preference accuracy {first['eval_rewards/accuracies']:.3f}, "
        f"margin {first['eval_rewards/margins']:.3f}"
    )

    # SIGKILLed past step 10 (asynchronous checkpoints) and rerun == 30 straight, the reference's
    # log-probs precomputed this time: the same numbers, so the same run.
    from engine.config import to_yaml
    from tests.engine_kill import kill_then_resume

    cfg = dpo_config(
        base,
        tmp_path / "killed",
        preferences,
        steps=30,
        precompute_ref=True,
        **{"checkpoint.async_save": True, "checkpoint.every_steps": 5},
    )
    (tmp_path / "killed").mkdir()
    (tmp_path / "killed" / "dpo.yaml").write_text(to_yaml(cfg))
    logs = kill_then_resume(
        "engine.posttrain.dpo", tmp_path / "killed" / "dpo.yaml", tmp_path / "killed" / "checkpoint", after_step=10
    )
    assert "precomputed" in logs
    a = load_params(tmp_path / "run" / "checkpoint")[1]
    b = load_params(tmp_path / "killed" / "checkpoint")[1]
    for (path, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("loss_type", ["ipo", "simpo", "apo_zero", "orpo", ["aot", "sft"]])
def test_other_loss_types_train_with_lora_and_no_reference_copy(base, preferences, tmp_path, loss_type):
    result = run_dpo(
        dpo_config(
            base,
            tmp_path / "+".join(loss_type if isinstance(loss_type, list) else [loss_type]),
            preferences,
            steps=12,
            loss_type=loss_type,
            **{"lora.rank": 4, "lora.target_modules": "all-linear", "optimizer.learning_rate": 2e-2},
        )
    )
    assert result["eval_rewards/accuracies"] > 0.7, result


def test_a_pair_without_rejected_names_its_line_and_identical_pairs_are_counted(base, tmp_path):
    bundle = load_saved(base / "tokenizer")
    cfg = dpo_config(base, tmp_path, tmp_path / "pairs.jsonl")
    (tmp_path / "pairs.jsonl").write_text(
        json.dumps({"prompt": "a", "chosen": " b", "rejected": " c"})
        + "\n"
        + json.dumps({"prompt": "a", "chosen": " b"})
        + "\n"
    )
    with pytest.raises(ConfigError, match=r"pairs.jsonl:2: no 'rejected' key \(the record has: prompt, chosen\)"):
        load_pairs(cfg.data, bundle, print)
    (tmp_path / "pairs.jsonl").write_text(
        "".join(json.dumps({"prompt": "a", "chosen": " b", "rejected": r}) + "\n" for r in (" c", " b", " b"))
    )
    logs = []
    pairs, _ = load_pairs(cfg.data.model_copy(update={"eval_fraction": 0.0}), bundle, logs.append)
    assert len(pairs) == 1 and "2 pair(s)" in logs[0] and "pairs.jsonl:2" in logs[0]
    with pytest.raises(ConfigError, match="beta"):
        dpo_config(base, tmp_path, tmp_path / "pairs.jsonl", beta=0)
    # An implicit prompt: the messages chosen and rejected share.
    chat = [{"role": "user", "content": "colour 1?"}]
    pair = tokenize_pair(
        {
            "chosen": chat + [{"role": "assistant", "content": "green"}],
            "rejected": chat + [{"role": "assistant", "content": "red"}],
        },
        "x:1",
        bundle,
        cfg.data,
    )
    assert "green" in bundle.tokenizer.decode(pair.chosen.tolist())
    # The shared messages are the prompt, cut to max_prompt_length (8) from the left: its end is kept.
    assert len(pair.prompt) == 8 and bundle.tokenizer.decode(pair.prompt.tolist()).endswith("our 1?")


def test_sequence_log_probs_equal_transformers_on_a_converted_model(tmp_path):
    torch = need("torch")
    need("transformers")
    from engine.interop.hf.convert import convert_hf
    from engine.models.params import graphdef_of
    from engine.posttrain.dpo import Pair, make_logps_fn
    from engine.train.checkpoint import stored_configs
    from tests.test_hf_parity import random_hf_model

    model = random_hf_model("qwen3")
    model.save_pretrained(tmp_path / "hf")
    convert_hf(tmp_path / "hf", tmp_path / "out")
    cfg, params, _ = load_params(tmp_path / "out" / "checkpoint")
    _, compute = stored_configs(tmp_path / "out" / "checkpoint")
    rng = np.random.default_rng(4)
    pairs = [
        Pair(rng.integers(0, 37, n), rng.integers(0, 37, c), rng.integers(0, 37, r))
        for n, c, r in ((3, 5, 2), (6, 1, 7), (2, 9, 4))
    ]  # odd, unequal lengths
    rows = pair_rows(pairs, 16)
    logps = jax.jit(make_logps_fn(graphdef_of(cfg, compute)))  # one program, not op by op
    ours = np.asarray(logps(params, {k: jnp.asarray(v) for k, v in rows.items()}))
    for i, pair in enumerate(pairs):
        for j, completion in enumerate((pair.chosen, pair.rejected)):
            ids = torch.tensor(np.concatenate([pair.prompt, completion]))[None]
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits.double(), -1)[0, :-1]
            ref = logp[torch.arange(len(ids[0]) - 1), ids[0, 1:]][len(pair.prompt) - 1 :].sum().item()
            assert abs(ours[i, j] - ref) <= 1e-5 * max(1.0, abs(ref)), (i, j, ours[i, j], ref)


@pytest.mark.slow
def test_dpo_is_a_pipeline_stage_with_a_reference_input_lineage_and_a_plan(base, preferences, tmp_path):
    from flows.spec import Pipeline
    from tasks.plan import plan_pipeline
    from tasks.runner import RAN, execute_stage
    from tasks.store.records import read_manifest
    from tests.test_grpo import _CheckpointCopy  # noqa: F401  (registers test-checkpoint-copy)

    p = Pipeline("prefs", store=tmp_path / "store")
    start = p.stage("base", task="test-checkpoint-copy", config={"path": str(base)})
    reference = p.stage("reference", task="test-checkpoint-copy", config={"path": str(base)})
    p.stage(
        "dpo",
        task="dpo",
        inputs={"checkpoint": start, "reference": reference},  # TRL's ref_model
        launcher={"kind": "local", "env": ONE_DEVICE_ENV},
        config={
            "data": {
                "path": str(preferences),
                "max_prompt_length": 8,
                "max_length": 16,
                "batch_size": 8,
                "eval_fraction": 0.1,
            },
            "steps": 3,
            "log_every": 1,
            "lora": {"rank": 4, "target_modules": "all-linear"},
        },
    )
    plan = p.plan()
    assert [execute_stage(s.job, plan.store).status for s in plan.stages.values()] == [RAN, RAN, RAN]
    out = plan.store.artifact_dir("dpo", plan.stages["dpo"].job.artifact_id)
    manifest = read_manifest(out)
    assert manifest["kind"] == "adapter" and [q["stage"] for q in manifest["parents"]] == ["base", "reference"]
    ran = yaml.safe_load((out / "dpo.yaml").read_text())  # the child read the reference input's checkpoint
    reference_dir = plan.store.artifact_dir("reference", plan.stages["reference"].job.artifact_id)
    assert ran["reference"]["checkpoint"] == str(reference_dir / "checkpoint")
    assert manifest["metrics"]["steps"] == 3 and "eval_rewards/accuracies" in manifest["metrics"]
    plans, notes = plan_pipeline(plan, "local")
    assert (
        [q.stage for q in plans] == ["dpo"] and plans[0].fits and plans[0].memory.gradients < plans[0].memory.parameters
    )
    assert any("(dpo): the frozen reference's parameters (" in note for note in notes), notes


def test_the_held_out_loss_is_the_training_loss_definition_with_rpo(base):
    """Evaluation adds the loss's parts up over batches (normaliser 1) and divides once: on one
    batch that equals the training step's loss, RPO's per-token NLL term included."""
    from engine.models.params import graphdef_of
    from engine.posttrain.dpo import HELD_OUT_SUMS, held_out_metrics, make_loss_fn, pairs_and_chosen_tokens
    from engine.train.checkpoint import stored_configs

    bundle = load_saved(base / "tokenizer")
    cfg = dpo_config(base, Path("unused"), Path("unused.jsonl"), rpo_alpha=0.7)
    pairs = [
        tokenize_pair(
            {"prompt": f"colour {i}:", "chosen": f" {NAMES[i]}", "rejected": " red blue green"},
            f"x:{i}",
            bundle,
            cfg.data,
        )
        for i in range(3)
    ]
    batch = {k: jnp.asarray(v) for k, v in pair_rows(pairs, cfg.data.max_length).items()}
    batch["ref_logps"] = jnp.asarray(np.random.default_rng(0).normal(-20, 3, (3, 2)), jnp.float32)
    model_cfg, params, _ = load_params(base / "checkpoint")
    loss_fn = make_loss_fn(graphdef_of(model_cfg, stored_configs(base / "checkpoint")[1]), cfg)
    training, _ = loss_fn(params, batch, pairs_and_chosen_tokens(batch))
    _, aux = loss_fn(params, batch, 1.0)
    held_out = held_out_metrics({k: float(aux[k]) for k in HELD_OUT_SUMS}, cfg)
    assert held_out["eval_loss"] == pytest.approx(float(training), rel=1e-5)
    assert float(aux["chosen_nll_sum"]) > 0 and held_out["eval_pairs"] == 3


def test_lora_dropout_acts_in_dpo_training_steps_only(base):
    """A training batch carries the rows' dropout seeds (the trainer adds them with
    lora.dropout > 0): the loss then drops the adapter's inputs; without seeds it does not."""
    from flax import nnx

    from engine.models.lora import LORA_SEED
    from engine.models.transformer import Transformer
    from engine.posttrain.dpo import make_loss_fn, pairs_and_chosen_tokens
    from engine.train.checkpoint import stored_configs

    bundle = load_saved(base / "tokenizer")
    cfg = dpo_config(base, Path("unused"), Path("unused.jsonl"), lora={"rank": 4, "dropout": 0.5})
    model_cfg, compute = stored_configs(base / "checkpoint")
    graphdef, state = nnx.split(Transformer(model_cfg, compute, rngs=nnx.Rngs(0), lora=cfg.lora))
    # B away from zero, so the adapter (and what dropout does to its input) shows in the loss.
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.5 if "lora_b" in jax.tree_util.keystr(path) else x, nnx.to_pure_dict(state)
    )
    pairs = [
        tokenize_pair(
            {"prompt": f"colour {i}:", "chosen": f" {NAMES[i]}", "rejected": " red"}, f"x:{i}", bundle, cfg.data
        )
        for i in range(3)
    ]
    batch = {k: jnp.asarray(v) for k, v in pair_rows(pairs, cfg.data.max_length).items()}
    batch["ref_logps"] = jnp.zeros((len(pairs), 2), jnp.float32)
    loss_fn = jax.jit(make_loss_fn(graphdef, cfg))
    normaliser = pairs_and_chosen_tokens(batch)
    plain = float(loss_fn(params, batch, normaliser)[0])
    seeds = jnp.arange(len(pairs), dtype=jnp.int32)[:, None]
    dropped = float(loss_fn(params, {**batch, LORA_SEED: seeds}, normaliser)[0])
    again = float(loss_fn(params, {**batch, LORA_SEED: seeds}, normaliser)[0])
    assert dropped != plain and dropped == again, (plain, dropped, again)


def test_a_reference_of_another_vocabulary_is_one_sentence_naming_it(base, tmp_path):
    import shutil

    from engine.data.tokenizer import TokenizerConfig, save_tokenizer, train_tokenizer
    from engine.posttrain.dpo import reference_model
    from engine.train.checkpoint import stored_configs

    other = tmp_path / "other"
    shutil.copytree(base / "checkpoint", other / "checkpoint")  # the same model, another tokenizer beside it
    bundle = train_tokenizer(TokenizerConfig(vocab_size=300), ["zebra quartz " * 50], add_bos=True)
    save_tokenizer(bundle, other / "tokenizer")
    model_cfg, _ = stored_configs(base / "checkpoint")
    ours = load_saved(base / "tokenizer")
    cfg = dpo_config(base, tmp_path / "run", Path("unused.jsonl"), reference={"checkpoint": str(other / "checkpoint")})
    with pytest.raises(
        ConfigError, match=r"^reference.checkpoint: the reference's tokenizer \(.*other/tokenizer\) is not"
    ):
        reference_model(cfg, model_cfg, ours)
    same = dpo_config(base, tmp_path / "run", Path("unused.jsonl"), reference={"checkpoint": str(base / "checkpoint")})
    assert reference_model(same, model_cfg, ours)[0] == model_cfg
    with pytest.raises(ConfigError, match="loss_type simpo is reference-free: it reads no reference.checkpoint"):
        dpo_config(base, tmp_path / "run", Path("unused.jsonl"), loss_type="simpo", reference={"checkpoint": "x"})


def test_loss_type_lists_and_the_new_loss_types_are_checked_in_one_sentence(base, tmp_path):
    data = Path("unused.jsonl")
    cases = [
        ({"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0]}, "loss_weights has 1 weights for 2 loss type"),
        ({"loss_type": ["sigmoid", "orpo"]}, "loss_type orpo stands alone"),
        ({"loss_type": ["sigmoid", "sigmoid"]}, "loss_type lists a loss type twice"),
        ({"loss_type": "exo_pair"}, "loss_type exo_pair needs label_smoothing > 0"),
        ({"loss_type": ["sigmoid", "sft"], "rpo_alpha": 1.0}, "rpo_alpha and an `sft` loss_type are the same"),
        ({"loss_type": "orpo", "precompute_ref": True}, "loss_type orpo is reference-free: precompute_ref"),
        ({"loss_type": "nca_pair", "label_smoothing": 0.1}, "label_smoothing applies to loss_type robust"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            dpo_config(base, tmp_path / "run", data, **overrides)
