"""The schema of a reward-model run (engine/posttrain/reward_model.py), kept apart from the
run so that validating a pipeline does not import JAX."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.models.config import ComputeConfig, LoraConfig, ModelConfig
from engine.posttrain.config import DPODataConfig
from engine.train.config import OptimizerConfig, RunFields


class RewardModelConfig(RunFields):
    """One reward-model run (TRL's RewardTrainer definitions): a Bradley-Terry scalar head on
    the decoder at checkpoint.init_from, trained on preference pairs."""

    model: ModelConfig | None = None
    """None: the architecture stored with checkpoint.init_from."""
    compute: ComputeConfig | None = None
    """None: the settings checkpoint.init_from was saved with."""
    tokenizer: str | None = None
    """Tokenizer directory. None: `tokenizer/` next to checkpoint.init_from."""
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-4, weight_decay=0.0)
    """TRL's RewardConfig default learning rate."""
    data: DPODataConfig = DPODataConfig()
    """The pairs, in DPO's formats (engine/posttrain/config.py: DPODataConfig). A `margin`
    column (a number per pair, TRL's optional margin) is honoured where present."""
    center_rewards_coefficient: float | None = Field(None, ge=0)
    """Adds coefficient * mean((r_chosen + r_rejected)^2), pulling rewards toward zero mean
    (TRL's center_rewards_coefficient; Eisenstein et al. suggest 0.01). None: no term."""
    head_init: Literal["normal", "zero"] = "normal"
    """The score head's start: normal: N(0, model.init_std^2), as transformers initialises
    `score` (initializer_range); zero: every reward 0 at step 0."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter on the frozen decoder; the score head trains beside it."""
    # checkpoint.init_from (the decoder to start from) and checkpoint.directory are required.
