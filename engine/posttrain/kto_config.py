"""The schema of a KTO run (engine/posttrain/kto.py), kept apart from the run so that
validating a pipeline does not import JAX."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.config import Strict
from engine.models.config import ComputeConfig, LoraConfig, ModelConfig
from engine.posttrain.config import ReferenceConfig
from engine.train.config import OptimizerConfig, RunFields


class KTODataConfig(Strict):
    """Unpaired feedback: JSONL in TRL's unpaired preference format, one example per line:

    {"prompt": "...", "completion": "...", "label": true}                  text
    {"prompt": [messages], "completion": [messages], "label": false}       conversational

    `label` true: a desirable completion; false: an undesirable one.
    """

    path: str | None = None
    """A JSONL file, or a directory whose *.jsonl files are read in name order; required."""
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    label_field: str = "label"
    eval_path: str | None = None
    """Held-out examples (same format). None: the last `eval_fraction` of `path`."""
    eval_fraction: float = Field(0.0, ge=0, lt=1)
    eval_batches: int = Field(0, ge=0)
    """Batches of held-out examples per evaluation (0 = all of them)."""
    max_prompt_length: int = Field(128, gt=0)
    """A longer prompt keeps its last tokens."""
    max_length: int = Field(256, gt=1)
    """Prompt + completion tokens of each sequence; a longer completion keeps its start. Each
    row holds the example, then its prompt with the KL completion (2 x max_length)."""
    batch_size: int = Field(8, gt=0)
    """Examples per optimizer step."""
    shuffle: bool = True
    seed: int = 0

    @model_validator(mode="after")
    def _check_lengths(self) -> KTODataConfig:
        if self.max_prompt_length >= self.max_length:
            raise ValueError(
                f"max_prompt_length ({self.max_prompt_length}) must be below max_length "
                f"({self.max_length}), which leaves the completion its share"
            )
        return self


class KTOConfig(RunFields):
    """One KTO run (TRL's KTOTrainer definitions): a policy starting at checkpoint.init_from
    and a frozen reference, on desirable and undesirable completions that need not be paired."""

    model: ModelConfig | None = None
    """None: the architecture stored with checkpoint.init_from."""
    compute: ComputeConfig | None = None
    """None: the settings checkpoint.init_from was saved with."""
    tokenizer: str | None = None
    """Tokenizer directory. None: `tokenizer/` next to checkpoint.init_from."""
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-6, weight_decay=0.0)
    """TRL's default learning rate for KTO."""
    data: KTODataConfig = KTODataConfig()
    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"
    """kto: KTO's value function against the KL estimate (Ethayarajh et al. 2024, eq. 7);
    apo_zero_unpaired: APO-zero's unpaired form (no KL term, no KL completions)."""
    beta: float = Field(0.1, gt=0)
    desirable_weight: float = Field(1.0, gt=0)
    """The weight of a desirable example's loss (lambda_D; TRL's desirable_weight)."""
    undesirable_weight: float = Field(1.0, gt=0)
    """The weight of an undesirable example's loss (lambda_U). KTO's paper keeps
    lambda_D n_D / (lambda_U n_U) in [1, 4/3]; the run logs where the data puts it."""
    reference: ReferenceConfig = ReferenceConfig()
    """The reference; by default the start policy. A pipeline sets it from the stage's
    `reference` input."""
    precompute_ref: bool = False
    """Compute the reference's log-probabilities of every example (and its KL completion) once
    before training, so no reference model is held while training."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter; the reference is then the base with the adapter off (no copy),
    unless reference.checkpoint names another."""

    @property
    def reference_free(self) -> bool:
        """KTO always reads a reference (engine/posttrain/dpo.py: Reference)."""
        return False

    @property
    def calculate_kl(self) -> bool:
        return self.loss_type == "kto"

    @model_validator(mode="after")
    def _check_kl_batch(self) -> KTOConfig:
        if self.calculate_kl and self.data.batch_size // self.grad_accum < 2:
            raise ValueError(
                f"loss_type kto estimates its KL term from the other examples of a micro-batch: data.batch_size "
                f"/ grad_accum must be at least 2, not {self.data.batch_size // self.grad_accum}"
            )
        return self
