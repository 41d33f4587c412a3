"""The schema of a training run: optimizer, schedule, data, checkpoints and the loop's
settings (RunFields, shared by pretraining and SFT), and TrainConfig, all of pretraining."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.config import ConfigError, Strict
from engine.models.config import ComputeConfig, LoraConfig, ModelConfig
from engine.parallel.config import MeshConfig, unsplittable


class OptimizerConfig(Strict):
    """AdamW with decoupled weight decay and global-norm clipping."""

    learning_rate: float = Field(3e-4, gt=0)
    b1: float = Field(0.9, ge=0, lt=1)
    b2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    decay_norms_and_embeddings: bool = False
    """False: weight decay skips norm scales and embeddings (the usual choice)."""
    grad_clip_norm: float | None = Field(1.0, gt=0)
    router_bias_update_rate: float = Field(0.0, ge=0)
    """Mixtures of experts whose router has a choosing bias (DeepSeek-V3): each step every
    layer's bias moves by this much per expert, up where the expert got fewer than the mean
    of the assignments, down where more (DeepSeek-V3's auxiliary-loss-free balancing; it
    pretrained with 0.001). 0: the bias stays as loaded, as transformers fine-tunes it."""
    moment_dtype: Literal["float32", "bfloat16"] | None = None
    """Storage dtype of Adam's two moments. None: the parameters' (compute.param_dtype), and the
    update computed in it, as before. Set: the step casts the gradients up to float32, updates
    the moments and the parameters' step in float32 and stores the moments in this dtype
    (MaxText's mu_dtype). float32 parameters with bfloat16 moments are float32 master weights
    at 8 bytes of state per parameter, not 12 (docs/benchmarks.md: what fits one TPU v5e)."""
    host_offload: bool = False
    """Keep the optimizer's state in the hosts' memory (JAX's pinned_host) between steps; each
    step brings it to the devices for the update and sends it back: its bytes are off the
    chips' memory while the forward and backward passes run, for two transfers of it per step
    (MaxText's optimizer_memory_host_offload)."""


class ScheduleConfig(Strict):
    """Learning-rate schedule: linear warmup then cosine decay or warmup-stable-decay."""

    kind: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    decay_fraction: float = Field(0.2, gt=0, le=1)
    """WSD only: fraction of the steps spent in the final linear decay."""
    final_lr_fraction: float = Field(0.1, ge=0, le=1)


class DataConfig(Strict):
    """Token shards written by the tokenize stage (see engine/data/shards.py)."""

    path: str | None = None
    """Dataset directory (holding meta.json); required for training."""
    seq_len: int = Field(128, gt=1)
    batch_size: int = Field(8, gt=0)
    """Global batch size in rows (per optimizer step, before accumulation splits it)."""
    shuffle: bool = True
    seed: int = 0
    packing: bool = True
    """Concatenate documents into full rows (segment-aware attention keeps them apart)."""
    eval_split: str = "validation"
    eval_batches: int = Field(4, ge=0)
    worker_buffer: int = Field(2, ge=0)
    """Rows prefetched by a background thread (0 = none)."""


class CheckpointConfig(Strict):
    """Where Orbax checkpoints go, how often, how many are kept, and where training starts from."""

    directory: str | None = None
    """Where Orbax checkpoints go; required for training."""
    every_steps: int = Field(100, gt=0)
    keep: int = Field(3, gt=0)
    """How many recent checkpoints to keep."""
    async_save: bool = True
    init_from: str | None = None
    """Start from the params of this checkpoint directory (fresh optimizer), not from scratch."""


class MlflowConfig(Strict):
    """Where the `mlflow` sink logs (needs the `mlflow` extra)."""

    tracking_uri: str | None = None
    """An MLflow tracking server (http://host:5000) or store URI; None: MLFLOW_TRACKING_URI, else ./mlruns."""
    experiment: str = "trainflow"


class WandbConfig(Strict):
    """Where the `wandb` sink logs (needs the `wandb` extra)."""

    project: str = "trainflow"
    entity: str | None = None
    mode: Literal["online", "offline", "disabled"] | None = None
    """None: WANDB_MODE, else online. offline keeps the run in <metrics_dir>/wandb for `wandb sync`."""


class MetricsConfig(Strict):
    """Where a run's metrics go besides metrics.jsonl, which is always written."""

    sinks: list[Literal["tensorboard", "mlflow", "wandb"]] = ["tensorboard"]
    run_name: str | None = None
    """The run's name in TensorBoard (its event directory under tensorboard/), MLflow and W&B;
    a pipeline stage sets its stage name."""
    mlflow: MlflowConfig = MlflowConfig()
    wandb: WandbConfig = WandbConfig()


class RunFields(Strict):
    """What every training run has besides its model, optimizer and data (pretraining, SFT)."""

    mesh: MeshConfig = MeshConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    steps: int = Field(100, gt=0)
    """Optimizer steps (batches) of the run."""
    grad_accum: int = Field(1, gt=0)
    """Micro-batches per optimizer step; data.batch_size must divide evenly."""
    seed: int = 0
    """Seeds the initial parameters."""
    log_every: int = Field(10, gt=0)
    """Steps between metrics lines (metrics.jsonl, TensorBoard)."""
    eval_every: int = Field(0, ge=0)
    """Steps between held-out evaluations (0 = only at the end)."""
    metrics_dir: str | None = None
    """JSONL + TensorBoard output (default: next to the checkpoints)."""
    metrics: MetricsConfig = MetricsConfig()
    """Metric sinks: TensorBoard, MLflow, Weights & Biases."""
    progress: bool = True
    """A progress bar on stderr."""

    @model_validator(mode="after")
    def _check_accumulation(self):
        if self.data.batch_size % self.grad_accum:
            raise ValueError(
                f"data.batch_size ({self.data.batch_size}) must be divisible by grad_accum ({self.grad_accum})"
            )
        seq_len = getattr(self.data, "seq_len", None)
        reason = None if seq_len is None else unsplittable(seq_len, self.mesh.context, "data.seq_len")
        if reason:
            raise ValueError(reason)
        return self


class TrainConfig(RunFields):
    """Everything one pretraining run of the engine needs."""

    model: ModelConfig
    compute: ComputeConfig = ComputeConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    data: DataConfig = DataConfig()
    z_loss: float = Field(0.0, ge=0)
    """Weight of the z-loss (log Z squared) that keeps the softmax normaliser near 1 (PaLM)."""
    loss_tiles: int = Field(1, gt=0)
    """The LM head and the loss run over each row's positions in this many pieces, one after
    another, each piece's logits made again in the backward pass (engine/train/lm_head.py;
    MaxText's num_vocab_tiling): the step holds batch x seq_len / loss_tiles logits instead of
    all of them (Llama 3.2 1B at 8 x 2048: 4.0 GiB of bf16 logits), for a third more of the
    head's FLOPs. 1 = the whole sequence at once. Must divide data.seq_len."""
    lora: LoraConfig | None = None
    """Train a low-rank adapter on the frozen checkpoint.init_from instead of every parameter
    (engine/models/lora.py): the state, optimizer and checkpoints hold the adapter alone."""

    @model_validator(mode="after")
    def _check_length(self) -> TrainConfig:
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(f"data.seq_len ({self.data.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})")
        if self.loss_tiles > 1:
            if self.data.seq_len % self.loss_tiles:
                raise ValueError(f"loss_tiles ({self.loss_tiles}) must divide data.seq_len ({self.data.seq_len})")
            if reason := tiles_unsupported(self.model, self.compute):
                raise ValueError(f"loss_tiles ({self.loss_tiles}) needs the whole logits at once here: {reason}")
        return self


def tiles_unsupported(model: ModelConfig, compute: ComputeConfig) -> str | None:
    """Why the LM head cannot run in pieces (TrainConfig.loss_tiles) for this model, None if
    it can: the parts of the forward pass that read the whole logits or the head's input."""
    if model.mtp_layers and compute.mtp_loss:
        return "the multi-token-prediction loss (compute.mtp_loss) reads the head's input in the forward pass"
    if compute.indexer_loss == "warmup":
        return "the sparse-attention warm-up (compute.indexer_loss: warmup) stops the logits' gradient"
    return None


TRAINER_FIELDS = (*RunFields.model_fields, "optimizer", "lora")
"""The fields a post-training config shares with the trainer's: the loop's (RunFields), the
optimizer and the adapter. A config that lacks one (GRPO has no eval_every) gets its default."""


def trainer_view(
    cfg: Strict, model: ModelConfig, compute: ComputeConfig, data: dict, *, stage: str | None = None
) -> TrainConfig:
    """The trainer's view of a post-training run: `cfg`'s TRAINER_FIELDS, the model it trains
    and the rows the trainer sees (`data`: seq_len, batch_size, ...). With `stage`, an invalid
    combination is a ConfigError naming it."""
    tree = cfg.model_dump(include=set(TRAINER_FIELDS) & set(type(cfg).model_fields))
    tree.update(model=model.model_dump(), compute=compute.model_dump(), data=data)
    try:
        return TrainConfig.model_validate(tree)
    except ValueError as e:
        if stage is None:
            raise
        raise ConfigError(f"{stage}: {e}") from None
