"""The schema of a distillation run (TRL GKD's fields and names), kept apart from the run so
that validating a pipeline does not import JAX."""

from __future__ import annotations

from pydantic import Field, model_validator

from engine.config import Strict
from engine.models.config import ComputeConfig, LoraConfig, ModelConfig
from engine.posttrain.config import SFTDataConfig
from engine.train.config import OptimizerConfig, RunFields


class TeacherConfig(Strict):
    """The frozen teacher: any architecture (bigger than the student allowed) with the
    student's vocabulary, sharded on the student's mesh by its own parameters' logical axes."""

    checkpoint: str | None = None
    """Its checkpoint directory (a checkpoint or an adapter, read as its merged model); required."""
    tokenizer: str | None = None
    """Its tokenizer directory. None: `tokenizer/` next to teacher.checkpoint (an artifact's).
    It must hold the student's vocabulary."""
    compute: ComputeConfig | None = None
    """How the teacher computes. None: the settings its checkpoint was saved with."""


class DistillConfig(RunFields):
    """One distillation run (TRL's GKDTrainer definitions): a student starting at
    checkpoint.init_from learns a frozen teacher's next-token distributions."""

    model: ModelConfig | None = None
    """None: the student's architecture stored with checkpoint.init_from."""
    compute: ComputeConfig | None = None
    """None: the settings checkpoint.init_from was saved with."""
    tokenizer: str | None = None
    """The student's tokenizer directory. None: `tokenizer/` next to checkpoint.init_from."""
    teacher: TeacherConfig = TeacherConfig()
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=2e-5, weight_decay=0.0)
    """TRL's default learning rate for GKD (its SFT default)."""
    data: SFTDataConfig = SFTDataConfig()
    """SFT's examples (prompt/completion or messages); the loss is on the completion tokens
    (data.loss_on). On-policy and seq_kd steps take the examples' prompts."""
    beta: float = Field(0.5, ge=0, le=1)
    """The generalized JSD's interpolation: 0 forward KL(teacher || student), 1 reverse
    KL(student || teacher), between the JSD of the mixture (GKD's default 0.5)."""
    lmbda: float = Field(0.5, ge=0, le=1)
    """The fraction of steps whose completions the student samples itself (on-policy). TRL
    draws it per step with Python's random; here it is a draw from (seed, step), so a resumed
    run takes the same steps on-policy."""
    seq_kd: bool = False
    """On the other steps, train on completions the teacher samples (sequence-level KD)
    instead of the dataset's."""
    temperature: float = Field(0.9, gt=0)
    """The sampling temperature of on-policy and seq_kd completions (GKD's `temperature`;
    top-k and top-p off, as GKD generates)."""
    loss_temperature: float = Field(1.0, gt=0)
    """The softmax temperature of both distributions in the divergence (generalized_jsd_loss's
    `temperature`). GKDTrainer computes its loss at 1.0; TRL's DistillationTrainer uses its
    sampling temperature here."""
    max_new_tokens: int = Field(128, gt=0)
    """Tokens per sampled completion (GKD's max_new_tokens)."""
    max_prompt_length: int | None = Field(None, gt=0)
    """Prompt tokens kept for sampling (a longer prompt keeps its end). None: data.seq_len -
    max_new_tokens, so that a prompt and its completion fill one row."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter on the student instead of every weight; the stage then writes an adapter."""

    @model_validator(mode="after")
    def _check_sampling(self) -> DistillConfig:
        if not self.samples:
            return self
        if self.data.loss_on != "completion":
            raise ValueError(
                "lmbda > 0 and seq_kd sample completions for the examples' prompts, so data.loss_on "
                "must be completion (the prompt is what comes before the last completion)"
            )
        if self.max_new_tokens >= self.data.seq_len:
            raise ValueError(
                f"max_new_tokens ({self.max_new_tokens}) must be below data.seq_len "
                f"({self.data.seq_len}), the row a prompt and its sampled completion fill"
            )
        if self.prompt_length + self.max_new_tokens > self.data.seq_len:
            raise ValueError(
                f"max_prompt_length ({self.prompt_length}) + max_new_tokens ({self.max_new_tokens}) "
                f"must fit in data.seq_len ({self.data.seq_len}), the row a sampled completion fills"
            )
        return self

    @property
    def samples(self) -> bool:
        """Whether some steps train on sampled completions (the student's or the teacher's)."""
        return self.lmbda > 0 or self.seq_kd

    @property
    def prompt_length(self) -> int:
        return self.max_prompt_length or self.data.seq_len - self.max_new_tokens
