"""The schema of a reward-model run (engine/posttrain/reward_model.py), kept apart from the
run so that validating a pipeline does not import JAX."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.config import Strict
from engine.models.config import ComputeConfig, LoraConfig, ModelConfig
from engine.posttrain.config import DPODataConfig
from engine.train.config import OptimizerConfig, RunFields


class ProcessRewardConfig(Strict):
    """A process reward model (TRL's PRMTrainer): one label per reasoning step, read by a
    token-classification head (2 labels) at the last token of each step. Data: JSONL of
    {"prompt": "...", "completions": ["step 1", "step 2", ...], "labels": [true, false, ...]}."""

    step_separator: str = "\n"
    """Appended to every step; the step's label sits on its last token (TRL's step_separator)."""
    completions_field: str = "completions"
    labels_field: str = "labels"
    train_on_last_step_only: bool = False
    """Train on the last step's label only (held-out steps keep them all), as TRL's option."""
    max_completion_length: int | None = Field(None, gt=0)
    """Steps' tokens kept (separators included) before max_length cuts the whole; None: no cut."""
    aggregate: Literal["min", "product", "last"] = "min"
    """How a GRPO reward term reads this model: the completion's reward is the min over its
    steps of P(step correct) (default, as Math-Shepherd: one wrong step makes the solution
    wrong, and the min does not fall with the number of steps as the product does, which would
    pay the policy for fewer steps), their product (Lightman et al.), or the last step's."""


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
    process: ProcessRewardConfig | None = None
    """A process reward model (step labels, a token-classification head) instead of a
    Bradley-Terry one (engine/posttrain/process_reward.py); `data` is then read as step-labelled
    examples (its path, prompt_field, max_prompt_length, max_length, batch_size, eval split)."""
    # checkpoint.init_from (the decoder to start from) and checkpoint.directory are required.

    @model_validator(mode="after")
    def _check_process(self) -> RewardModelConfig:
        if self.process is not None and self.center_rewards_coefficient is not None:
            raise ValueError(
                "center_rewards_coefficient applies to a Bradley-Terry reward model, not to a process one (`process:`)"
            )
        return self
