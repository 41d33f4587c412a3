"""What an evaluation measures: held-out loss on a token dataset, generation tasks scored by
reward functions, and lm-evaluation-harness tasks. Apart from the run so pipeline validation
imports neither JAX nor lm-eval."""

from __future__ import annotations

from pydantic import Field

from engine.config import Strict
from engine.parallel.config import MeshConfig
from engine.posttrain.rewards import RewardSpec
from engine.train.config import MetricsConfig


class GenerationTask(Strict):
    """Prompts from a JSONL file, completed by each model and scored by reward functions."""

    name: str = "generation"
    path: str | None = None
    """JSONL with a prompt column and the columns the rewards read (e.g. `answer`)."""
    prompt_field: str = "prompt"
    limit: int | None = Field(None, gt=0)
    """Use the first `limit` prompts (None: all)."""
    rewards: list[RewardSpec] = Field(min_length=1)
    correct: str | None = None
    """Which reward decides correctness (its name); default: the first."""
    correct_threshold: float = 1.0
    samples: int = Field(1, gt=0)
    """Completions per prompt; pass@k needs samples >= k."""
    pass_at: list[int] = [1]
    temperature: float = Field(0.0, ge=0)
    """0: greedy decoding."""
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(32, gt=0)
    batch_size: int = Field(128, gt=0)
    seed: int = 0


class HarnessConfig(Strict):
    """lm-evaluation-harness tasks run on every model (engine/evaluate/harness.py; the `eval`
    extra). Their metrics are recorded as `harness/<task>/<metric>`."""

    tasks: list[str] = Field(min_length=1)
    """Task, group or tag names: lm-eval's own, or those the task YAMLs under `include_path` define."""
    include_path: str | None = None
    """A directory of task YAMLs (lm-eval's --include_path); `{input:corpus}/...` names one in an input."""
    builtin_tasks: bool = True
    """Index lm-eval's own tasks too (about 15,000 YAMLs, 10-20 s); false: only those under include_path."""
    num_fewshot: int | None = Field(None, ge=0)
    """Few-shot examples per prompt (None: each task's own setting)."""
    limit: int | float | None = Field(None, gt=0)
    """Documents per task: a count, or below 1 a fraction (None: all)."""
    batch_size: int = Field(16, gt=0)
    """Rows per scoring or generation batch on the mesh."""
    max_length: int | None = Field(None, gt=1)
    """Tokens a scored row holds (None: the model's max_seq_len); longer inputs keep their end."""
    max_gen_toks: int = Field(256, gt=0)
    """Tokens generated at most, unless a task's generation_kwargs say otherwise."""
    bootstrap_iters: int = Field(1000, ge=0)
    """Resamples for bootstrapped standard errors (lm-eval's default is 100000; 0: no standard errors)."""
    seed: int = 0
    """lm-eval's random, numpy and few-shot seeds, and the sampler's."""


class EvalConfig(Strict):
    """What to measure for every model."""

    data_path: str | None = None
    """Token dataset (engine/data/shards.py) for held-out loss; None skips it."""
    split: str = "validation"
    loss_batches: int = Field(8, ge=1)
    seq_len: int = Field(128, gt=1)
    batch_size: int = Field(8, gt=0)
    tasks: list[GenerationTask] = []
    harness: HarnessConfig | None = None
    """lm-evaluation-harness tasks by name (None: none)."""
    mesh: MeshConfig = MeshConfig()
    samples_in_report: int = Field(3, ge=0)
    """Example completions per model shown in report.md."""
    metrics: MetricsConfig = MetricsConfig()
    """Sinks that get each model's results (tags eval/<model>/<metric>, at the model's step)."""
