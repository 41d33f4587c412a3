"""The rollout seam of GRPO: prompts in, completions out, with what the loss needs to know
about them (which tokens the model produced, and the log-probabilities it sampled them with).

`generate_rollout` is the single-turn path on the engine's own sampler; the trainer's process
calls it (synchronous GRPO) and so does each rollout worker (async_rollout.py). Another rollout
path (multi-turn environments, an inference server) returns the same `Rollout`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from engine.data.tokenizer import TokenizerBundle
from engine.inference.sample import SampleOutput, Sampler, encode_prompts, left_pad


@dataclasses.dataclass
class Rollout:
    """G completions of each of a batch's prompts, rows p * G + g."""

    prompt_tokens: np.ndarray  # (b, P) int32, left-padded, each prompt repeated G times
    prompt_mask: np.ndarray  # (b, P) int32
    output: SampleOutput
    """tokens (b, C), logprobs (b, C): the behaviour policy's log-probs of the sampled tokens
    (the sampler's numerics, its weights), mask (b, C): the completion's tokens, lengths (b,)."""
    loss_mask: np.ndarray | None = None
    """(b, C): the tokens that carry loss (the model's own); None: every completion token. A
    multi-turn rollout masks the environment's tokens here, and keeps them in `output.mask`."""
    rewards: np.ndarray | None = None
    """(b,) float64: an environment's episode rewards (multiturn.py; NaN for a failed episode),
    one more reward term of weight 1; None: the reward functions alone score the rollout."""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """The rollout path's own metrics (a multi-turn rollout's env/turns, env/tool_calls, ...)."""
    weights_version: int = 0
    """The optimizer update whose weights generated it (staleness = step - version)."""
    seconds: float = 0.0


def generate_rollout(
    sampler: Sampler,
    bundle: TokenizerBundle,
    params,
    prompt_inputs: list,
    *,
    step: int,
    seed: int,
    num_generations: int,
    max_prompt_length: int,
    max_completion_length: int,
    temperature: float,
    top_k: int,
    top_p: float,
    pad_id: int,
) -> Rollout:
    """Sample `num_generations` completions per prompt (one prefill per prompt, its cache
    shared by the G rows) with the key of (seed, step), so any process draws the same ones."""
    prompt_tokens, prompt_mask = left_pad(
        encode_prompts(bundle, prompt_inputs), pad_id=pad_id, length=max_prompt_length
    )
    out = sampler(
        params,
        prompt_tokens,
        prompt_mask,
        num_generations=num_generations,
        seed=jax.random.fold_in(jax.random.key(seed), step),
        max_new_tokens=max_completion_length,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_ids=(bundle.eos_id,),
        pad_id=pad_id,
    )
    G = num_generations
    return Rollout(np.repeat(prompt_tokens, G, 0), np.repeat(prompt_mask, G, 0), out)


def rollout_of_config(
    cfg, sampler: Sampler, bundle: TokenizerBundle, params, prompt_inputs: list, *, step: int, pad_id: int
) -> Rollout:
    """`generate_rollout` with the sampling settings of a GRPO config (the trainer's own
    rollouts and a rollout worker's draw alike)."""
    return generate_rollout(
        sampler,
        bundle,
        params,
        prompt_inputs,
        step=step,
        seed=cfg.seed,
        num_generations=cfg.num_generations,
        max_prompt_length=cfg.max_prompt_length,
        max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        pad_id=pad_id,
    )
