"""reasoning-gym's datasets as GRPO prompts and its scorers as the reward (engine/posttrain/procedural_tasks.py).

The reference is reasoning-gym itself: the same dataset built by `reasoning_gym.create_dataset`,
its entries, and `score_answer(extract_answer(completion), entry)` on the same completions.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

import engine.posttrain.grpo as grpo
from engine.config import ConfigError, load_config
from engine.data.tokenizer import TokenizerBundle, save_tokenizer
from engine.models.config import ModelConfig
from engine.models.transformer import Transformer
from engine.posttrain.config import GRPOConfig
from engine.posttrain.procedural_tasks import ReasoningGymConfig, prompt_records, reasoning_gym_score
from engine.posttrain.rewards import RewardSpec, compute_rewards, load_reward
from engine.train.checkpoint import Checkpointer
from tests.deps import need

rg = need("reasoning_gym")
from reasoning_gym.utils import extract_answer  # noqa: E402

# Sums of two one-digit terms: answers -9 .. 18, each a token of the tiny tokenizer below.
CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
SOURCE = {"dataset": "chain_sum", "config": CHAIN_SUM, "size": 12, "seed": 3}


def own_scores(completions: list[str], where: list[dict]) -> list[float]:
    """reasoning-gym's own scores: each row's entry from its own dataset, its own extraction."""
    scores = []
    for completion, row in zip(completions, where):
        dataset = rg.create_dataset(row["dataset"], **row["config"], size=row["size"], seed=row["seed"])
        scores.append(dataset.score_answer(extract_answer(completion), dataset[row["index"]]))
    return scores


@pytest.mark.parametrize(
    "dataset, config",
    [
        ("chain_sum", CHAIN_SUM),
        ("leg_counting", {"min_animals": 1, "max_animals": 2}),
        ("spell_backward", {}),  # the base scorer: partial credit when the answer holds the oracle's
    ],
)
def test_prompts_are_the_datasets_entries_and_rewards_are_its_own_scores(dataset, config):
    spec = {"dataset": dataset, "config": config, "size": 5, "seed": 11}
    records = prompt_records(ReasoningGymConfig(**spec))
    reference = rg.create_dataset(dataset, **config, size=5, seed=11)
    assert [r["prompt"] for r in records] == [e["question"] for e in reference]
    assert [r["answer"] for r in records] == [str(e["answer"]) for e in reference]

    # Right, wrong, untagged, partial (the oracle inside a longer answer), empty: per entry.
    completions, where = [], []
    for record, entry in zip(records, reference):
        answer = str(entry["answer"])
        for text in (f"<answer>{answer}</answer>", "<answer>7x</answer>", answer, f"<answer>{answer}ab</answer>", ""):
            completions.append(text)
            where.append(record["reasoning_gym"])
    name, fn = load_reward(RewardSpec(function="reasoning_gym"))
    got = compute_rewards(
        [(name, fn, RewardSpec(function="reasoning_gym"))],
        prompts=[""] * len(completions),
        completions=completions,
        completion_ids=[[]] * len(completions),
        columns={"reasoning_gym": where},
        max_completion_length=8,
        step=0,
    )[:, 0]
    expected = own_scores(completions, where)
    np.testing.assert_array_equal(got, expected)
    assert 0.0 in expected and 1.0 in expected
    if dataset == "spell_backward":
        assert any(0.0 < s < 1.0 for s in expected), expected


def test_a_misnamed_dataset_a_bad_config_and_a_reward_without_the_prompts_are_refused(tmp_path):
    bad_name = {**SOURCE, "dataset": "chain_summ", "size": 2}
    with pytest.raises(
        ConfigError, match="data.reasoning_gym.dataset: reasoning-gym has no dataset 'chain_summ'.*chain_sum"
    ):
        grpo.load_prompts(load_config(tree={"reasoning_gym": bad_name}, schema=grpo.GRPODataConfig))
    bad_config = {**SOURCE, "config": {"min_terms": 2, "max_termz": 3}, "size": 2}
    with pytest.raises(ConfigError, match="data.reasoning_gym.config: reasoning-gym's chain_sum refuses this config"):
        grpo.load_prompts(load_config(tree={"reasoning_gym": bad_config}, schema=grpo.GRPODataConfig))
    tree = {
        "checkpoint": {"init_from": str(tmp_path), "directory": str(tmp_path / "out")},
        "data": {"path": str(tmp_path / "prompts.jsonl")},
        "rewards": [{"function": "reasoning_gym"}],
    }
    with pytest.raises(ConfigError, match="rewards.0: the reasoning_gym reward scores prompts from data.reasoning_gym"):
        load_config(tree=tree, schema=GRPOConfig)
    with pytest.raises(ConfigError, match="data.path .* or data.reasoning_gym, not both"):
        load_config(tree={**tree, "data": {"path": "p.jsonl", "reasoning_gym": SOURCE}}, schema=GRPOConfig)
    assert reasoning_gym_score(["<answer>1</answer>"], [{**SOURCE, "index": 0}]) == own_scores(
        ["<answer>1</answer>"], [{**SOURCE, "index": 0}]
    )


# --------------------------------------------------------------------------- GRPO steps on the tiny model


def write_task(out: Path) -> tuple[Path, ModelConfig]:
    """A character tokenizer of the questions' characters, plus one token per possible answer
    in reasoning-gym's format ('<answer>7</answer>'), so that an untrained policy's samples
    hold answers, right and wrong; and a random 2-layer model's checkpoint."""
    questions = [e["question"] for e in rg.create_dataset("chain_sum", **CHAIN_SUM, size=12, seed=3)]
    chars = sorted(set("".join(questions)))
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<pad>", "<eos>"])
    tok.add_tokens([AddedToken(f"<answer>{n}</answer>", special=False) for n in range(-9, 19)])
    save_tokenizer(TokenizerBundle(tok, eos_token="<eos>", pad_token="<pad>"), out / "tokenizer")
    cfg = ModelConfig(
        vocab_size=tok.get_vocab_size(),
        d_model=24,
        num_layers=2,
        num_heads=3,
        num_kv_heads=1,
        head_dim=8,
        mlp_dim=40,
        max_seq_len=24,
    )
    params = nnx.to_pure_dict(nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1])
    ckpt = Checkpointer(out / "checkpoint", async_save=False)
    ckpt.save(0, params, {"unused": np.zeros((), np.int32)}, {"step": 0, "model": cfg.model_dump(mode="json")}, {})
    ckpt.close()
    return out, cfg


def test_grpo_steps_score_each_completion_as_reasoning_gym_does(tmp_path, monkeypatch):
    task, _ = write_task(tmp_path / "task")
    seen = []  # (completions, their rows' `reasoning_gym` column, the rewards GRPO computed)

    def recording(rewards, **kwargs):
        out = compute_rewards(rewards, **kwargs)
        seen.append((kwargs["completions"], kwargs["columns"]["reasoning_gym"], out[:, 0]))
        return out

    monkeypatch.setattr(grpo, "compute_rewards", recording)
    tree = {
        "checkpoint": {"init_from": str(task / "checkpoint"), "directory": str(tmp_path / "run/checkpoint")},
        "data": {"reasoning_gym": SOURCE},
        "rewards": [{"function": "reasoning_gym"}],
        "prompts_per_step": 4,
        "num_generations": 8,
        "max_prompt_length": 20,
        "max_completion_length": 2,
        "steps": 2,
        "progress": False,
        "metrics_dir": str(tmp_path / "run"),
    }
    grpo.run_grpo(load_config(tree=tree, schema=GRPOConfig), log=lambda line: None)

    logged = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len(seen) == len(logged) == 2
    for (completions, where, rewards), metrics in zip(seen, logged):
        expected = own_scores(completions, where)
        np.testing.assert_array_equal(rewards, expected)
        assert metrics["reward/reasoning_gym/mean"] == pytest.approx(np.mean(expected), abs=1e-12)
    every = [s for _, _, rewards in seen for s in rewards]
    assert 1.0 in every and 0.0 in every, every  # the policy's samples hold right and wrong answers
