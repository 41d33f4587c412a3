"""What an evaluation measures: held-out loss on a token dataset and generation tasks
scored by reward functions. Apart from the run so pipeline validation does not import JAX."""

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


class EvalConfig(Strict):
    """What to measure for every model."""

    data_path: str | None = None
    """Token dataset (engine/data/shards.py) for held-out loss; None skips it."""
    split: str = "validation"
    loss_batches: int = Field(8, ge=1)
    seq_len: int = Field(128, gt=1)
    batch_size: int = Field(8, gt=0)
    tasks: list[GenerationTask] = []
    mesh: MeshConfig = MeshConfig()
    samples_in_report: int = Field(3, ge=0)
    """Example completions per model shown in report.md."""
    metrics: MetricsConfig = MetricsConfig()
    """Sinks that get each model's results (tags eval/<model>/<metric>, at the model's step)."""
