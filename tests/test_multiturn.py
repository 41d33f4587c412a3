"""Multi-turn rollouts: the loss mask covers exactly the model's tokens (token by token against
hand-built episodes, chat and text), budgets truncate, failures are per episode; and a tool-
using policy learns the two-turn arithmetic task with GRPO on CPU."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from engine.config import ConfigError, load_config
from engine.data.tokenizer import (
    TokenizerBundle,
    TokenizerConfig,
    default_chat_template,
    save_tokenizer,
    train_tokenizer,
)
from engine.inference.sample import SampleOutput
from engine.models.config import ModelConfig
from engine.models.transformer import Transformer
from engine.posttrain.config import GRPOConfig
from engine.posttrain.environments import EnvironmentConfig, EnvironmentFailure, arithmetic_tool_rows
from engine.posttrain.grpo import run_grpo
from engine.posttrain.multiturn import EpisodeRunner, sampler_generate
from engine.train.checkpoint import Checkpointer, load_params

SPECIAL = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|tool|>"]
CHARS = [*"0123456789", "+", "=", ">", "c"]
UNTIMED = ("_seconds", "tokens_per_second", "tflops_per_device", "mfu")


def char_bundle(chat: bool = True) -> TokenizerBundle:
    """One token per character, plus the chat roles as special tokens (ids 0-4)."""
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL + CHARS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL)
    template = default_chat_template(["user", "assistant", "tool"], add_bos=False) if chat else None
    return TokenizerBundle(tok, eos_token="<eos>", pad_token="<pad>", chat_template=template)


BUNDLE = char_bundle()
ID = {t: i for i, t in enumerate(SPECIAL + CHARS)}


def ids(*pieces: str) -> list[int]:
    """Token ids of special tokens and character strings, written out by hand."""
    return [ID[p] if p in ID else ID[c] for p in pieces for c in ([p] if p in ID else p)]


def scripted(turns: list[list[list[int]]]):
    """A policy that plays given token ids: turns[t][row]; log-prob -(position + 1) per token
    so the test can see where each sampled log-prob landed. It records what it was shown, and
    in `generate.asked` which rows it was asked for; the others come back empty, as a
    server-backed sampler returns them."""
    seen = []

    def generate(contexts, max_new_tokens, turn, live):
        seen.append([list(c) for c in contexts])
        generate.asked.append(list(live))
        out = []
        for row, _ in enumerate(contexts):
            played = turns[turn][row][:max_new_tokens] if row in live else []
            out.append((played, [-(k + 1.0) for k in range(len(played))]))
        return out

    generate.asked = []
    return generate, seen


def runner(P=16, C=16, **env) -> EpisodeRunner:
    cfg = EnvironmentConfig.model_validate({"factory": "arithmetic_tool", **env})
    return EpisodeRunner(cfg, BUNDLE, max_prompt_length=P, max_completion_length=C, pad_id=0, log=lambda m: None)


ROW = {"question": "3+4", "answer": "7"}


def test_a_chat_episode_masks_exactly_the_models_tokens():
    run = runner(kwargs={"chat": True})
    # Row 0 calls the calculator, then copies its answer; row 1 answers at once, wrongly.
    generate, seen = scripted([[ids("c", "<eos>"), ids("5", "<eos>")], [ids("7", "<eos>"), []]])
    out = run(generate, [ROW, ROW])

    prompt = ids("<|user|>", "3+4", "<eos>", "<|assistant|>")
    # row 0: model "c<eos>" | env "<|tool|>7<eos><|assistant|>" | model "7<eos>"
    episode = ids("c", "<eos>", "<|tool|>", "7", "<eos>", "<|assistant|>", "7", "<eos>")
    model = [1, 1, 0, 0, 0, 0, 1, 1]
    assert out.prompt_tokens[0, -len(prompt) :].tolist() == prompt and out.prompt_mask[0].sum() == len(prompt)
    assert out.tokens[0].tolist() == episode + [0] * (16 - len(episode))
    assert out.model_mask[0].astype(int).tolist() == model + [0] * (16 - len(model))
    assert out.episode_mask[0].sum() == len(episode)
    # The sampler's log-probs sit on the model's tokens, zeros on the environment's.
    assert out.logprobs[0, : len(episode)].tolist() == [-1, -2, 0, 0, 0, 0, -1, -2]
    # Turn 2 was shown the whole episode so far: prompt, the call, the observation; and only
    # row 0, still running, was asked for (row 1 answered in turn 1).
    assert seen[1][0] == prompt + episode[:6]
    assert generate.asked == [[0, 1], [0]]
    # Per-turn rewards: 0.5 for the call, 1 for the right answer; the episode's is their sum.
    assert out.rewards.tolist() == [1.5, 0.0] and out.answers == ["7", "5"]
    np.testing.assert_array_equal(out.turn_rewards, [[0.5, 1.0, np.nan, np.nan], [0.0, np.nan, np.nan, np.nan]])
    assert out.metrics["reward/turn_1/mean"] == 0.25 and out.metrics["reward/turn_2/mean"] == 1.0
    assert out.metrics["env/turns"] == 1.5 and out.metrics["env/tool_calls"] == 0.5
    assert out.metrics["env/truncated"] == 0.0 and out.metrics["env/failed"] == 0.0


class RecordingSampler:
    """A sampler in Sampler's calling convention that plays scripted turns (turns[t][row]) and
    records, per call, the `rows` it was asked for and its seed; rows not asked for come back
    empty, as a server-backed sampler returns them."""

    def __init__(self, turns: list[list[list[int]]]):
        self.turns, self.rows, self.seeds = turns, [], []

    def __call__(self, params, tokens, mask, *, seed, max_new_tokens, rows=None, **settings):
        turn = len(self.rows)
        self.rows.append(None if rows is None else list(rows))
        self.seeds.append(np.asarray(jax.random.key_data(seed)).tolist())
        out = np.zeros((len(tokens), max_new_tokens), np.int32)
        keep = np.zeros(out.shape, bool)
        for row in range(len(tokens)):
            played = self.turns[turn][row][:max_new_tokens] if rows is None or row in rows else []
            out[row, : len(played)], keep[row, : len(played)] = played, True
        return SampleOutput(out, -np.ones(out.shape, np.float32), keep, keep.sum(1))


def test_the_engines_turns_name_the_running_episodes_to_the_sampler():
    """sampler_generate (the policy's turns from a Sampler) passes each turn's live rows on as
    `rows` and folds the turn into the seed: a server-backed sampler sends nothing for an
    episode that has ended."""
    sampler = RecordingSampler([[ids("c", "<eos>"), ids("5", "<eos>")], [ids("7", "<eos>"), []]])
    generate = sampler_generate(sampler, None, seed=jax.random.key(3), eos_id=ID["<eos>"], pad_id=0, temperature=1.0)
    out = runner(kwargs={"chat": True})(generate, [ROW, ROW])
    assert sampler.rows == [[0, 1], [0]]  # row 1 answered (wrongly) in turn 1
    assert sampler.seeds == [
        np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(3), t))).tolist() for t in (0, 1)
    ]
    assert out.rewards.tolist() == [1.5, 0.0] and out.answers == ["7", "5"]


def test_a_turn_cut_by_its_token_budget_gets_the_templates_closing_token_masked():
    run = runner(max_turn_tokens=1, kwargs={"chat": True})
    generate, _ = scripted([[ids("c", "<eos>")], [ids("7", "<eos>")]])  # each turn cut to 1 token
    out = run(generate, [ROW])
    # The template closes the call turn with <eos>, which the model did not write: the
    # environment supplies it, masked. The last turn ("7", cut) ends the episode as an answer.
    episode = ids("c", "<eos>", "<|tool|>", "7", "<eos>", "<|assistant|>", "7")
    assert out.tokens[0, : len(episode)].tolist() == episode
    assert out.model_mask[0, : len(episode)].astype(int).tolist() == [1, 0, 0, 0, 0, 0, 1]
    assert out.rewards.tolist() == [1.5]


def test_a_text_episode_appends_the_observation_as_the_environment_wrote_it():
    run = runner()
    generate, _ = scripted([[ids("c", "<eos>")], [ids("7", "<eos>")]])
    out = run(generate, [ROW])
    assert out.prompt_tokens[0, -4:].tolist() == ids("3+4=")
    episode = ids("c", "<eos>", "7", "7", "<eos>")
    assert out.tokens[0, : len(episode)].tolist() == episode
    assert out.model_mask[0, : len(episode)].astype(int).tolist() == [1, 1, 0, 1, 1]


def test_budgets_truncate_an_episode():
    call = ids("c", "<eos>")
    # Out of turns: one turn allowed, and it is a call.
    out = runner(max_turns=1)(scripted([[call]])[0], [ROW])
    assert out.metrics["env/truncated"] == 1.0 and out.rewards.tolist() == [0.5]  # the call's reward
    assert out.model_mask[0].sum() == 2 and out.episode_mask[0].sum() == 2  # no observation appended
    # Out of episode tokens: the observation ("7") and a next token do not fit in C = 3.
    out = runner(C=3)(scripted([[call]])[0], [ROW])
    assert out.metrics["env/truncated"] == 1.0 and out.episode_mask[0].sum() == 2
    # A prompt longer than max_prompt_length keeps its last tokens.
    out = runner(P=2)(scripted([[ids("7", "<eos>")]])[0], [ROW])
    assert out.prompt_tokens[0].tolist() == ids("4=")


FLAKY = """
from engine.posttrain.environments import Step


class Flaky:
    \"\"\"Raises in step on rows whose question is 'boom' (and in reset on 'reset').\"\"\"

    def reset(self, row):
        if row["question"] == "reset":
            raise RuntimeError("no such row")
        self.row = row
        return row["question"] + "="

    def step(self, turn):
        if self.row["question"] == "boom":
            raise ValueError("the environment broke")
        return Step(reward=1.0, done=True)
"""


def flaky_runner(monkeypatch, tmp_path):
    """A user environment named `module:Class`, imported from a directory on the path."""
    (tmp_path / "flaky_env.py").write_text(FLAKY)
    monkeypatch.syspath_prepend(str(tmp_path))
    logged = []
    cfg = EnvironmentConfig(factory="flaky_env:Flaky")
    run = EpisodeRunner(cfg, BUNDLE, max_prompt_length=8, max_completion_length=8, pad_id=0, log=logged.append)
    return run, logged


def test_a_failing_step_fails_its_episode_and_the_batch_goes_on(monkeypatch, tmp_path):
    run, logged = flaky_runner(monkeypatch, tmp_path)
    rows = [{"question": "1+1"}, {"question": "boom"}, {"question": "reset"}]
    out = run(scripted([[ids("2", "<eos>")] * 3])[0], rows)
    assert out.rewards[0] == 1.0 and np.isnan(out.rewards[1:]).all()
    assert out.errors[1] == "step raised ValueError: the environment broke"
    assert out.errors[2] == "reset raised RuntimeError: no such row"
    assert out.metrics["env/failed"] == 2.0 and len(logged) == 2 and "episode 1" in logged[0]
    with pytest.raises(EnvironmentFailure, match="every episode of the rollout batch failed; the first: step raised"):
        run(scripted([[ids("2", "<eos>")] * 2])[0], [{"question": "boom"}] * 2)


def test_an_environment_that_cannot_be_imported_is_one_sentence_naming_the_key():
    for factory, message in [
        ("no_such_module_xyz:Env", "environment.factory: cannot import module 'no_such_module_xyz' for"),
        ("engine.posttrain.environments:Nope", "environment.factory: module 'engine.posttrain.environments' has no"),
        ("arithmetic", "environment.factory: 'arithmetic' is neither a built-in (tools, arithmetic_tool, openenv) nor"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            runner(factory=factory)
    with pytest.raises(ConfigError, match="environment.kwargs: arithmetic_tool does not take these arguments"):
        runner(kwargs={"colour": "red"})


def test_tool_calls_through_the_runner_a_hanging_tool_is_killed_and_the_episode_goes_on():
    """The `tools` environment in chat mode with a byte-level tokenizer: one episode's Python
    call hangs (killed at its wall limit: a tool error the model sees), the other's runs."""
    bundle = train_tokenizer(TokenizerConfig(vocab_size=300), ["hello world"] * 10, add_bos=False)
    cfg = EnvironmentConfig(
        factory="tools",
        max_turns=3,
        max_turn_tokens=200,
        kwargs={"tools": ["python"], "observation_role": "user", "sandbox": {"wall_seconds": 2, "cpu_seconds": 1}},
    )
    run = EpisodeRunner(cfg, bundle, max_prompt_length=64, max_completion_length=600, pad_id=bundle.pad_id)
    encode = lambda text: bundle.tokenizer.encode(text, add_special_tokens=False).ids + [bundle.eos_id]  # noqa: E731
    call = '<tool_call>{"name": "python", "arguments": {"code": "%s"}}</tool_call>'
    turns = [[encode(call % "while True: pass"), encode(call % "print(6 * 7)")], [encode("42")] * 2]
    rows = [{"prompt": [{"role": "user", "content": "6 * 7?"}], "answer": "42"}] * 2
    out = run(scripted(turns)[0], rows)
    assert out.rewards.tolist() == [1.0, 1.0] and out.metrics["env/tool_calls"] == 1.0
    assert out.metrics["env/tool_errors"] == 0.5 and out.metrics["env/failed"] == 0.0
    hung = out.metrics["env/tool_failures/cpu_time"] + out.metrics["env/tool_failures/wall_time"]
    assert hung == 1.0 and out.metrics["env/tool_failures/error"] == 0.0
    assert out.metrics["env/tool_sandbox_weaker"] == 0.0  # bubblewrap, the default
    shown = [
        bundle.tokenizer.decode(t[m & ~k].tolist()) for t, m, k in zip(out.tokens, out.episode_mask, out.model_mask)
    ]
    assert "error: the code ran past the CPU-time limit of 1 s" in shown[0] or "wall-time limit of 2 s" in shown[0]
    assert "42" in shown[1] and "error" not in shown[1]


# --------------------------------------------------------------------------- learning, end to end


@pytest.fixture(scope="module")
def tool_task(tmp_path_factory) -> Path:
    """A random 2-layer policy with the character tokenizer, and arithmetic_tool rows."""
    out = tmp_path_factory.mktemp("tool_task")
    bundle = char_bundle(chat=False)
    save_tokenizer(bundle, out / "tokenizer")
    cfg = ModelConfig(
        vocab_size=len(ID),
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=64,
        max_seq_len=16,
    )
    params = nnx.to_pure_dict(nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1])
    ckpt = Checkpointer(out / "checkpoint", async_save=False)
    ckpt.save(0, params, {"unused": np.zeros((), np.int32)}, {"step": 0, "model": cfg.model_dump(mode="json")}, {})
    ckpt.close()
    with (out / "rows.jsonl").open("w") as f:
        for row in arithmetic_tool_rows(200, seed=0):
            f.write(json.dumps(row) + "\n")
    return out


def tool_config(task: Path, out: Path, **overrides) -> GRPOConfig:
    """GRPO on the arithmetic_tool environment: two turns of one token each."""
    tree = {
        "checkpoint": {
            "init_from": str(task / "checkpoint"),
            "directory": str(out / "checkpoint"),
            "every_steps": 100,
            "async_save": False,
        },
        "data": {"path": str(task / "rows.jsonl"), "prompt_field": "question"},
        "environment": {"factory": "arithmetic_tool", "max_turns": 2, "max_turn_tokens": 1},
        "optimizer": {"learning_rate": 1e-2},
        "prompts_per_step": 10,
        "num_generations": 16,
        "max_prompt_length": 4,
        "max_completion_length": 4,
        "steps": 40,
        "progress": False,
        "metrics_dir": str(out),
    }
    return load_config(tree=tree, overrides=[f"{k}={v}" for k, v in overrides.items()], schema=GRPOConfig)


def test_a_tool_using_policy_learns_the_two_turn_arithmetic_task(tool_task, tmp_path):
    """From a random policy: it learns to call the calculator (a per-turn reward of 0.5) and
    then, slower, to answer with the result it was shown (reward 1; chance is 1 in 19)."""
    run_grpo(tool_config(tool_task, tmp_path))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    curve = [r["reward"] for r in records]
    first, last = np.mean(curve[:3]), np.mean(curve[-5:])
    calls = [r["env/tool_calls"] for r in records]
    # Right answers after a call: the episode reward less the call's 0.5, once calls are all.
    right = np.mean([r["reward"] - 0.5 * r["env/tool_calls"] for r in records[-5:]])
    print(
        f"reward: first 3 steps {first:.3f}, last 5 {last:.3f}; calls {calls[0]:.2f} -> {calls[-1]:.2f}; "
        f"right after a call (last 5) {right:.3f}"
    )
    assert first < 0.2 and last > first + 0.4, curve
    assert calls[0] < 0.2 and min(calls[-5:]) > 0.9, calls
    assert right > 2 / 19, right  # above chance: it reads the observation
    assert all(r["env/failed"] == 0 and r["env/truncated"] == 0 for r in records)
    # The sampler's log-probs of the model's turns are the trainer's of the whole episode (rounding).
    assert max(r["sampling/sampling_logp_difference/max"] for r in records) < 1e-4


def test_episodes_in_a_rollout_worker_at_staleness_zero_are_the_synchronous_run_bitwise(tool_task, tmp_path):
    """A worker process runs the same episodes with the weights it was sent: every logged
    number (rewards per turn, env/turns, tool calls, ...) and the trained params are equal."""
    small = {"steps": 3, "prompts_per_step": 4, "num_generations": 8, "optimizer.learning_rate": 5e-2}
    run_grpo(tool_config(tool_task, tmp_path / "sync", **small))
    logs: list[str] = []
    run_grpo(tool_config(tool_task, tmp_path / "async", rollout_workers=1, max_staleness=0, **small), log=logs.append)
    assert any("rollout worker 0 started" in line for line in logs), logs
    untimed = lambda r: {k: v for k, v in r.items() if not k.endswith(UNTIMED)}  # noqa: E731
    sync, async_ = (
        [untimed(json.loads(x)) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()]
        for n in ("sync", "async")
    )
    assert len(sync) == 3 and sync == async_
    assert all("env/tool_calls" in r and "reward/turn_1/mean" in r for r in sync)
    assert len({r["env/tool_calls"] for r in sync}) > 1  # the policy moved between batches
    params = [load_params(tmp_path / name / "checkpoint")[1] for name in ("sync", "async")]
    for a, b in zip(jax.tree.leaves(params[0]), jax.tree.leaves(params[1]), strict=True):
        np.testing.assert_array_equal(a, b)
