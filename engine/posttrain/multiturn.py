"""Multi-turn rollouts: episodes of model turns and environment observations, as token rows
GRPO trains on.

One episode (engine/posttrain/environments.py for the environment side):

    prompt = env.reset(row)                      text, or messages through the chat template
    repeat until done or a budget runs out:
        turn  = the policy's tokens (up to max_turn_tokens, ending at EOS)   loss on these
        step  = env.step(decoded turn)           reward, done, observation
        obs   = the observation's tokens         masked: no loss (TRL, verl)
    reward = the sum of the turns' rewards

The row GRPO sees is [prompt left-padded to max_prompt_length | turn, obs, turn, ... right-
padded to max_completion_length], so the policy loss, its log-probs and the trainer are
exactly single-turn GRPO's: `model_mask` (the completion mask) is 1 on the model's tokens
only, and the sequence's segment ids cover every token of the episode. The model's tokens
are kept as sampled (never re-tokenised from text); an observation in chat mode is the text
the chat template adds for it: render(history + [observation], add_generation_prompt) minus
render(history), plus whatever the template closes the model's turn with that the model did
not write (its EOS, when the turn was cut by max_turn_tokens).

The environments' steps of a turn run in up to `step_workers` threads (a sandboxed tool call
waits on its child process). Every turn samples all the batch's rows at once (rows whose episode ended are sampled and
thrown away), so the sampler compiles once per context-length bucket, not once per number
of live episodes. The context is re-prefilled each turn (no prefix cache across turns).

Failures: an environment whose reset or step raises fails that episode (reward NaN: zero
advantage, as an unscorable completion; `env/failed`, the error logged); a whole batch of
failed episodes raises EnvironmentFailure. A tool that hangs is the tool's to stop (the
sandbox kills it at its limit and the call is a tool error); `env/tool_failures/<kind>` counts
the batch's failed sandboxed calls by kind, and `env/tool_sandbox_weaker` is 1 when the
sandbox ran in the opted-in namespaces mode (both only for environments with a sandbox).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import numpy as np

from engine.config import ConfigError
from engine.data.chat import render
from engine.data.tokenizer import TokenizerBundle
from engine.inference.sample import SampleOutput, Sampler, left_pad
from engine.posttrain.environments import Environment, EnvironmentConfig, EnvironmentFailure, load_environment
from engine.posttrain.rollout import Rollout
from engine.posttrain.sandbox import FAILURE_KINDS

if TYPE_CHECKING:
    from engine.posttrain.config import GRPOConfig

# generate(contexts, max_new_tokens, turn, live) -> [(token ids, their log-probs)] per context:
# the policy's next turn for each context (the whole episode so far), ending at EOS or the
# limit. Only the contexts listed in `live` (the episodes still running) are read; the others
# keep the batch's shape, and a sampler may return them empty.
Generate = Callable[[list[list[int]], int, int, list[int]], list[tuple[list[int], list[float]]]]


@dataclass
class Episodes:
    """A batch of finished episodes, in GRPO's row layout (b rows, P + C columns)."""

    prompt_tokens: np.ndarray  # (b, P) int32, left-padded
    prompt_mask: np.ndarray  # (b, P) int32
    tokens: np.ndarray  # (b, C) int32: the episode after the prompt, pad after it
    model_mask: np.ndarray  # (b, C) bool: tokens the policy sampled (the loss's)
    episode_mask: np.ndarray  # (b, C) bool: every token of the episode (its segment)
    logprobs: np.ndarray  # (b, C) float32: the sampler's log-probs of the model's tokens, 0 elsewhere
    rewards: np.ndarray  # (b,) float64: sum of the turns' rewards, NaN for a failed episode
    turn_rewards: np.ndarray  # (b, max_turns) float64: NaN where there was no such turn
    answers: list[str]  # each episode's last model turn, decoded
    errors: list[str | None]  # why an episode failed
    metrics: dict[str, float]


class _Episode:
    def __init__(self, env: Environment | None, error: str | None = None):
        self.env, self.error = env, error
        self.prompt: list[int] = []
        self.chat: list[dict] | None = None  # the messages so far, in chat mode
        self.ids: list[int] = []  # after the prompt
        self.model: list[bool] = []
        self.logprobs: list[float] = []
        self.rewards: list[float] = []
        self.answer = ""
        self.turns = self.tool_calls = self.tool_errors = 0
        self.tool_failures: Counter[str] = Counter()
        self.done = error is not None
        self.truncated = False

    def extend(self, ids: Sequence[int], model: bool, logprobs: Sequence[float] | None = None) -> None:
        self.ids += ids
        self.model += [model] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)

    def fail(self, error: str) -> None:
        self.error, self.done = error, True


class EpisodeRunner:
    """Runs the episodes of a rollout batch against fresh environments from `cfg`."""

    def __init__(
        self,
        cfg: EnvironmentConfig,
        bundle: TokenizerBundle,
        *,
        max_prompt_length: int,
        max_completion_length: int,
        pad_id: int,
        log: Callable[[str], None] = print,
    ):
        self.cfg, self.bundle, self.log = cfg, bundle, log
        self.make_env = load_environment(cfg)  # a bad factory or kwargs fails here, before any sampling
        self.P, self.C, self.pad_id = max_prompt_length, max_completion_length, pad_id
        self.pool = ThreadPoolExecutor(cfg.step_workers, thread_name_prefix="env-step")

    # ---- text <-> tokens

    def _encode(self, text: str, special: bool = False) -> list[int]:
        return self.bundle.tokenizer.encode(text, add_special_tokens=special).ids

    def _decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.bundle.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _start(self, episode: _Episode, row: dict) -> None:
        assert episode.env is not None
        prompt = episode.env.reset(row)
        tools = getattr(episode.env, "tools", None)
        if isinstance(prompt, str):
            ids = self._encode(prompt, special=True)  # framed as GRPO frames text prompts
        elif isinstance(prompt, list) and prompt:
            episode.chat = list(prompt)
            ids = self._encode(render(self.bundle, episode.chat, add_generation_prompt=True, tools=tools))
        else:
            raise TypeError(f"reset returned {type(prompt).__name__}: it must be text or a non-empty message list")
        if not ids:
            raise ValueError("reset returned an empty prompt")
        episode.prompt = ids[-self.P :]  # a longer prompt keeps its last tokens, as GRPO's do

    def observation_ids(self, episode: _Episode, turn_ids: Sequence[int], observation: str) -> list[int]:
        """The tokens that follow the model's turn: the observation as the environment gives
        it (text mode), or the chat template's rendering of it as the next message."""
        if episode.chat is None:
            return self._encode(observation)
        tools = getattr(episode.env, "tools", None)
        role = getattr(episode.env, "observation_role", "tool")
        before = render(self.bundle, episode.chat[:-1], add_generation_prompt=True, tools=tools)
        with_turn = render(self.bundle, episode.chat, tools=tools)
        after = render(
            self.bundle,
            [*episode.chat, {"role": role, "content": observation}],
            add_generation_prompt=True,
            tools=tools,
        )
        if not (with_turn.startswith(before) and after.startswith(with_turn)):
            raise ConfigError(
                "the chat template is not prefix-stable (rendering a conversation with one more message does not "
                "extend its text), so an observation's tokens cannot be appended to the episode"
            )
        turn_text, written = with_turn[len(before) :], self._decode(turn_ids, skip_special_tokens=False)
        closing = turn_text[len(written) :] if turn_text.startswith(written) else ""
        return self._encode(closing + after[len(with_turn) :])

    # ---- the loop

    def __call__(self, generate: Generate, rows: list[dict]) -> Episodes:
        cfg = self.cfg
        episodes = []
        for row in rows:
            try:
                episode = _Episode(self.make_env())
                self._start(episode, row)
            except Exception as e:  # noqa: BLE001 - user code: the episode fails, the batch goes on
                episode = _Episode(None, f"reset raised {type(e).__name__}: {e}")
            episodes.append(episode)

        try:
            for turn in range(cfg.max_turns):
                live = [i for i, e in enumerate(episodes) if not e.done]
                if not live:
                    break
                new_tokens = min(cfg.max_turn_tokens, max(self.C - len(episodes[i].ids) for i in live))
                # Every row, so the engine sampler's batch keeps its shape (and its compiled
                # program); a server-backed sampler is asked for the live rows only.
                contexts = [(e.prompt + e.ids) or [self.pad_id] for e in episodes]
                outputs = generate(contexts, new_tokens, turn, live)
                last = turn == cfg.max_turns - 1
                steps = [(e, list(ids), list(lp), last) for e, (ids, lp) in zip(episodes, outputs) if not e.done]
                # Each step touches only its own episode: the environments' steps overlap in threads.
                for _ in self.pool.map(lambda job: self._turn(*job), steps):
                    pass
        finally:  # an environment holding a resource (a server's session) lets it go with its episode
            for episode in episodes:
                close_environment(episode.env)
        return self._collect(episodes)

    def _turn(self, episode: _Episode, ids: list[int], logprobs: list[float], last_turn: bool) -> None:
        room = self.C - len(episode.ids)
        ids, logprobs = ids[:room], logprobs[:room]
        episode.extend(ids, True, logprobs)
        episode.turns += 1
        episode.answer = self._decode(ids)
        if episode.chat is not None:
            episode.chat.append({"role": "assistant", "content": episode.answer})
        assert episode.env is not None
        try:
            step = episode.env.step(episode.answer)
        except Exception as e:  # noqa: BLE001 - user code: the episode fails, the batch goes on
            episode.fail(f"step raised {type(e).__name__}: {e}")
            return
        episode.rewards.append(float(step.reward))
        episode.tool_calls += step.tool_calls
        episode.tool_errors += step.tool_errors
        episode.tool_failures.update(step.tool_failures)
        if step.done:
            episode.done = True
            return
        try:
            observation = self.observation_ids(episode, ids, step.observation or "")
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - an observation the template or tokenizer refuses
            episode.fail(f"the observation could not be rendered: {type(e).__name__}: {e}")
            return
        # Out of turns, or no room for the observation and a token of the next turn: truncated.
        if last_turn or len(episode.ids) + len(observation) >= self.C:
            episode.done = episode.truncated = True
            return
        episode.extend(observation, False)
        if episode.chat is not None:
            episode.chat.append(
                {"role": getattr(episode.env, "observation_role", "tool"), "content": step.observation or ""}
            )

    def _collect(self, episodes: list[_Episode]) -> Episodes:
        b, C, T = len(episodes), self.C, self.cfg.max_turns
        failed = [e for e in episodes if e.error is not None]
        if failed and len(failed) == b:
            raise EnvironmentFailure(
                f"environment '{self.cfg.factory}': every episode of the rollout batch failed; "
                f"the first: {failed[0].error}"
            )
        for i, e in enumerate(episodes):
            if e.error is not None:
                self.log(f"environment '{self.cfg.factory}': episode {i} of the batch failed: {e.error}")
        # (A failed reset leaves no prompt: its row is one pad token, and its reward NaN.)
        prompt_tokens, prompt_mask = left_pad([e.prompt or [self.pad_id] for e in episodes], self.pad_id, self.P)
        tokens = np.full((b, C), self.pad_id, np.int32)
        model_mask, episode_mask = np.zeros((b, C), bool), np.zeros((b, C), bool)
        logprobs = np.zeros((b, C), np.float32)
        turn_rewards = np.full((b, T), np.nan)
        for i, e in enumerate(episodes):
            n = len(e.ids)
            tokens[i, :n], model_mask[i, :n], episode_mask[i, :n], logprobs[i, :n] = e.ids, e.model, True, e.logprobs
            turn_rewards[i, : len(e.rewards)] = e.rewards
        rewards = np.array([math.nan if e.error else float(sum(e.rewards)) for e in episodes])
        ok = [e for e in episodes if e.error is None] or episodes
        metrics = {
            "env/turns": float(np.mean([e.turns for e in ok])),
            "env/tool_calls": float(np.mean([e.tool_calls for e in ok])),
            "env/tool_errors": float(np.mean([e.tool_errors for e in ok])),
            "env/truncated": float(np.mean([e.truncated for e in ok])),
            "env/failed": float(len(failed)),
            "env/episode_length": float(np.mean([len(e.ids) for e in ok])),
        }
        isolations = {getattr(e.env, "sandbox_isolation", None) for e in episodes} - {None}
        if isolations:  # a sandboxed tool: its failures by kind (batch totals) and its isolation
            for kind in FAILURE_KINDS:
                metrics[f"env/tool_failures/{kind}"] = float(sum(e.tool_failures[kind] for e in episodes))
            metrics["env/tool_sandbox_weaker"] = float(isolations != {"bubblewrap"})
        for t in range(T):
            column = turn_rewards[:, t]
            if not np.isnan(column).all():
                metrics[f"reward/turn_{t + 1}/mean"] = float(np.nanmean(column))
        return Episodes(
            prompt_tokens,
            prompt_mask,
            tokens,
            model_mask,
            episode_mask,
            logprobs,
            rewards,
            turn_rewards,
            [e.answer for e in episodes],
            [e.error for e in episodes],
            metrics,
        )


def sampler_generate(
    sampler: Sampler,
    params,
    *,
    seed: jax.Array,
    eos_id: int,
    pad_id: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Generate:
    """The policy's turns from the engine's sampler: each turn's contexts left-padded into one
    batch (one draw per row; the turn's key is fold_in(seed, turn)), the live rows named to
    the sampler (`rows`), which a server-backed one asks for alone."""

    def generate(contexts: list[list[int]], max_new_tokens: int, turn: int, live: list[int]):
        tokens, mask = left_pad(contexts, pad_id=pad_id)
        out = sampler(
            params,
            tokens,
            mask,
            seed=jax.random.fold_in(seed, turn),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_ids=(eos_id,),
            pad_id=pad_id,
            rows=live,
        )
        return [(row[keep].tolist(), lp[keep].tolist()) for row, lp, keep in zip(out.tokens, out.logprobs, out.mask)]

    return generate


def multiturn_rollout(
    runner: EpisodeRunner,
    sampler: Sampler,
    bundle: TokenizerBundle,
    params,
    records: list[dict],
    *,
    cfg: GRPOConfig,
    step: int,
) -> Rollout:
    """GRPO's rollout seam (rollout.py) for an environment: G episodes of each record (rows
    p * G + g), with the key of (seed, step) as the single-turn path. The episode's tokens are
    the output's mask (its segment), the model's the loss mask; the rewards come along."""
    t0 = time.perf_counter()
    G = cfg.num_generations
    generate = sampler_generate(
        sampler,
        params,
        seed=jax.random.fold_in(jax.random.key(cfg.seed), step),
        eos_id=bundle.eos_id,
        pad_id=runner.pad_id,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
    )
    episodes = runner(generate, [record for record in records for _ in range(G)])
    output = SampleOutput(
        tokens=episodes.tokens,
        logprobs=episodes.logprobs,
        mask=episodes.episode_mask,
        lengths=episodes.episode_mask.sum(1),
    )
    return Rollout(
        episodes.prompt_tokens,
        episodes.prompt_mask,
        output,
        loss_mask=episodes.model_mask,
        rewards=episodes.rewards,
        metrics=episodes.metrics,
        seconds=time.perf_counter() - t0,
    )


def close_environment(env) -> None:
    """An environment's optional `close()`; its failure is not the episode's (it is over)."""
    close = getattr(env, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception:  # noqa: BLE001 - user code, after the episode's result is in
        pass
