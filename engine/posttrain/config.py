"""The schemas of post-training runs: SFT (examples) and GRPO/GSPO (prompts and rewards).

Kept apart from the runs so that validating a pipeline does not import JAX.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from engine.config import ConfigError, Strict
from engine.models.config import ComputeConfig, LoraConfig, ModelConfig
from engine.parallel.config import MeshConfig, unsplittable
from engine.posttrain import advantages  # noqa: F401 - registers the built-in advantage estimators
from engine.posttrain.environments import EnvironmentConfig
from engine.posttrain.preference_types import LABEL_SMOOTHING, MEAN_LOGP, REFERENCE_FREE
from engine.posttrain.preference_types import LossType as PreferenceLoss
from engine.posttrain.procedural_tasks import ReasoningGymConfig
from engine.posttrain.registry import (
    ADVANTAGE_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTION_BOUNDS,
    ROLLOUT_CORRECTIONS,
)
from engine.posttrain.rewards import RewardSpec
from engine.posttrain.rollout_server import RolloutServerConfig
from engine.train.config import (
    CheckpointConfig,
    MetricsConfig,
    OptimizerConfig,
    RunFields,
    ScheduleConfig,
    TrainConfig,
    trainer_view,
)


class SFTDataConfig(Strict):
    """Where the examples come from and how they become rows."""

    path: str | None = None
    """A JSONL file, or a directory whose *.jsonl files are read in name order; required."""
    format: Literal["auto", "prompt_completion", "messages"] = "auto"
    """auto: a record with `messages` is a conversation, otherwise prompt/completion."""
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    loss_on: Literal["completion", "all"] = "completion"
    """completion: loss only on completion tokens / assistant turns (TRL: completion_only_loss
    and assistant_only_loss); all: on every token of the example."""
    eval_path: str | None = None
    """Held-out examples (same format). None: the last `eval_fraction` of `path`."""
    eval_fraction: float = Field(0.0, ge=0, lt=1)
    eval_batches: int = Field(0, ge=0)
    """Batches of held-out rows per evaluation (0 = all of them)."""
    seq_len: int = Field(512, gt=1)
    """Row length in tokens; a longer example is truncated (its start kept)."""
    batch_size: int = Field(8, gt=0)
    """Rows per optimizer step."""
    packing: bool = True
    """Several examples per row, kept apart by segment ids; False: one example per row."""
    shuffle: bool = True
    seed: int = 0


class SFTConfig(RunFields):
    """One SFT run: the pretraining engine's sections plus SFT data."""

    model: ModelConfig | None = None
    """None: the architecture stored with checkpoint.init_from. If given it must be that
    architecture (how the run computes is `compute`)."""
    compute: ComputeConfig | None = None
    """None: the settings checkpoint.init_from was saved with (its dtypes, scan, remat)."""
    tokenizer: str | None = None
    """Tokenizer directory. None: `tokenizer/` next to checkpoint.init_from (a checkpoint artifact)."""
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=2e-5, weight_decay=0.0)
    data: SFTDataConfig = SFTDataConfig()
    lora: LoraConfig | None = None
    """Train a LoRA adapter on the frozen checkpoint.init_from (PEFT's LoraConfig fields)
    instead of every parameter; the stage then writes an adapter."""
    # checkpoint.init_from (the model to fine-tune) and checkpoint.directory are required.


class GRPODataConfig(Strict):
    """The prompts: JSONL, one record per line, `prompt` text or a message list plus any
    columns the reward functions read (e.g. `answer`); or a reasoning-gym dataset's entries."""

    path: str | None = None
    """A JSONL file or a directory of *.jsonl files; required unless `reasoning_gym` is given."""
    reasoning_gym: ReasoningGymConfig | None = None
    """Instead of a file, the entries of one of reasoning-gym's procedural datasets, by name and
    config (engine/posttrain/procedural_tasks.py); the `reasoning_gym` reward scores them with
    the dataset's own scorer."""
    prompt_field: str = "prompt"
    shuffle: bool = True
    seed: int = 0

    @model_validator(mode="after")
    def _one_source(self) -> GRPODataConfig:
        if self.path and self.reasoning_gym is not None:
            raise ValueError("give the prompts as data.path (a JSONL file) or data.reasoning_gym, not both")
        return self


class RolloutCorrectionConfig(Strict):
    """Truncated (or masked) importance sampling between the policy that sampled a rollout (its
    behaviour log-probs) and the trainer's policy the update starts from: TRL's
    vllm_importance_sampling_correction, verl's rollout_corr. Corrects stale rollouts
    (max_staleness > 0) and another engine's numerics (rollout_dtype bfloat16)."""

    mode: str = "token_truncate"
    """A registered correction (registry.ROLLOUT_CORRECTIONS; engine/posttrain/rollout_correction.py)
    or module:function. token_*: one ratio per token; sequence_*: the product over the
    completion's tokens. *_truncate: the ratio clipped to [clip_min, clip_max] (TIS); *_mask: 0
    outside it (MIS, TRL's). icepop: tokens whose ratio is outside [clip_min, clip_max] removed
    from the loss (IcePop); sequence_geometric_mask: sequences whose geometric-mean ratio is
    outside it removed (verl's geometric rejection)."""
    clip_max: float | None = Field(3.0, gt=0)
    """C_max (TRL's vllm_importance_sampling_clip_max, default 3.0; icepop 5.0, IcePop's beta;
    sequence_geometric_mask 1.001); None: no upper bound."""
    clip_min: float | None = Field(None, ge=0)
    """C_min; None: no lower bound (icepop 0.5, IcePop's alpha; sequence_geometric_mask 0.999)."""

    @model_validator(mode="before")
    @classmethod
    def _mode_bounds(cls, data):
        """A mode whose reference fixes its own bounds gets them where the config leaves them out."""
        if isinstance(data, dict) and data.get("mode") in ROLLOUT_CORRECTION_BOUNDS:
            low, high = ROLLOUT_CORRECTION_BOUNDS[data["mode"]]
            data = {"clip_min": low, "clip_max": high, **data}
        return data

    @field_validator("mode")
    @classmethod
    def _registered_mode(cls, value: str) -> str:
        return ROLLOUT_CORRECTIONS.check(value)

    @model_validator(mode="after")
    def _check_bounds(self) -> RolloutCorrectionConfig:
        if self.clip_min is not None and self.clip_max is not None and self.clip_min > self.clip_max:
            raise ValueError(f"clip_min ({self.clip_min}) must not exceed clip_max ({self.clip_max})")
        return self


class GRPOConfig(Strict):
    """One GRPO/GSPO run (and RLOO, REINFORCE++, CISPO through the estimator and loss fields)."""

    algorithm: Literal["grpo", "gspo"] = "grpo"
    """grpo: token-level importance ratios; gspo: the length-normalised sequence ratio."""
    gspo_variant: Literal["sequence", "token"] = "sequence"
    """gspo only. sequence: one clipped ratio per sequence (TRL); token: GSPO-token, the
    sequence ratio's value with per-token gradients (Tunix's gspo-token)."""
    model: ModelConfig | None = None
    """None: the architecture stored with checkpoint.init_from."""
    compute: ComputeConfig | None = None
    """None: the settings checkpoint.init_from was saved with."""
    tokenizer: str | None = None
    """Tokenizer directory. None: `tokenizer/` next to checkpoint.init_from."""
    mesh: MeshConfig = MeshConfig()
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-6, weight_decay=0.0)
    schedule: ScheduleConfig = ScheduleConfig(kind="constant")
    data: GRPODataConfig = GRPODataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    """checkpoint.init_from (the policy to start from) and checkpoint.directory are required."""
    rewards: list[RewardSpec]
    """Reward terms; the reward of a completion is their weighted sum.
    At least one, unless an `environment` scores the episodes (its reward is then one more
    term, of weight 1)."""
    environment: EnvironmentConfig | None = None
    """Multi-turn episodes against an environment (engine/posttrain/environments.py,
    multiturn.py) instead of one completion per prompt: `factory` (a built-in or
    module:Class), max_turns, max_turn_tokens, kwargs. max_completion_length is then the
    budget of the whole episode after the prompt; the loss is on the model's tokens only."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter on the frozen checkpoint.init_from: rollouts sample from base +
    adapter unmerged, and the KL reference (beta > 0) is the base with the adapter off."""
    steps: int = Field(100, gt=0)
    """Rollout batches; each makes num_iterations optimizer updates."""
    prompts_per_step: int = Field(8, gt=0)
    num_generations: int = Field(8, ge=2)
    """G: completions per prompt, the group the advantages are relative to."""
    max_prompt_length: int = Field(256, gt=0)
    """Longer prompts keep their last tokens (TRL truncates on the left too)."""
    max_completion_length: int = Field(256, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    rollout_dtype: Literal["float32", "bfloat16"] | None = None
    """The dtype rollouts sample in (engine/inference/sample.py, Sampler dtype). bfloat16: a
    bf16 copy of the live params made once per rollout batch, products accumulated in f32,
    logits and the draw in f32, as Tunix and MaxText roll out in bf16 (XLA:CPU runs its bf16
    products on AVX512-BF16 / AMX). None: the compute dtype of training. The loss's log-probs
    are always the training forward's."""
    loss_type: str = "dapo"
    """A registered policy loss (engine/posttrain/registry.py: grpo, bnpo, dr_grpo, dapo, luspo,
    cispo, sapo, gmpo, TRL's names) or your own surrogate as module:function."""
    loss_aggregation: str | None = None
    """How per-token losses become the loss (verl's loss_agg_mode): token_mean, token_mean_local,
    seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm, or module:function. None:
    the loss type's own (token_mean for a user's surrogate)."""
    advantage_estimator: str = "grpo"
    """A registered estimator (engine/posttrain/advantages.py: grpo, rloo, reinforce_plus_plus,
    reinforce_plus_plus_baseline) or module:function."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the group's reward std, the batch's, or not at all (Dr. GRPO; rloo
    with none is TRL's RLOOTrainer, with batch its normalize_advantages)."""
    rollout: RolloutServerConfig | None = None
    """Rollouts from an inference server (vLLM) the policy's weights are pushed to after each
    update (engine/posttrain/rollout_server.py): `{engine: vllm, url: ...}`; None: the engine's
    own sampler."""
    rollout_correction: RolloutCorrectionConfig | None = None
    """Importance-sampling correction of off-policy rollouts; None: none applied (its metrics
    are still logged whenever the rollout is off-policy). The rollout/trainer log-prob gap is
    logged every step either way (engine/posttrain/rollout_correction.py)."""
    router_replay: bool | None = None
    """A mixture of experts' rollout routing replay (R3; engine/models/router_replay.py): the
    sampler records each token's experts per layer and the trainer's forwards over the rollout
    use them instead of choosing again (the weights still the trainer's router scores). None:
    on for a mixture of experts sampled by the engine (synchronous or workers) or by a vLLM
    server (`rollout:`; the server must return them: --enable-return-routed-experts, else the
    run is refused naming this key), off with an environment; true there is refused."""
    max_staleness: int = 0
    """Rollouts generated with weights this many updates old (exactly, after the first steps):
    0 is on-policy, today's synchronous GRPO; 1-2 lets rollout workers generate the next batches
    while the trainer updates (NeMo-RL's one-step off-policy, MaxText's off_policy_steps).
    Needs rollout_workers >= 1 when above 0."""
    rollout_workers: int = Field(0, ge=0)
    """Processes that generate rollouts, each with its own copy of the weights, sent after every
    update (no artifact store in between). 0: the trainer's process generates (synchronous)."""
    rollout_worker_restarts: int = Field(2, ge=0)
    """How many times a dead rollout worker is restarted before the stage fails."""
    rollout_worker_env: dict[str, str] = Field(default_factory=dict)
    """Environment variables of the worker processes, set before their JAX runtime starts: how
    a worker gets devices of its own (CUDA_VISIBLE_DEVICES on a GPU host; XLA_FLAGS'
    --xla_force_host_platform_device_count on CPU). Empty: the trainer's environment and
    mesh; set: the worker lays its devices out on `data` alone (its own mesh)."""
    epsilon: float = Field(0.2, gt=0)
    """Clipping: the ratio is kept within [1 - epsilon, 1 + epsilon_high]. gmpo: log-space bounds,
    the ratio within (exp(-epsilon), exp(epsilon_high)); 0.4 when left out (TRL's GMPO default)."""
    epsilon_high: float | None = Field(None, gt=0)
    """None: epsilon. DAPO's clip-higher uses e.g. 0.28."""
    beta: float = Field(0.0, ge=0)
    """KL penalty weight to the frozen initial policy (k3 estimator); 0 keeps no reference model."""
    sapo_temperature_pos: float = Field(1.0, gt=0)
    """sapo: the gate's temperature for positive advantages (TRL's sapo_temperature_pos)."""
    sapo_temperature_neg: float = Field(1.05, gt=0)
    """sapo: for the others (TRL's sapo_temperature_neg; SAPO keeps it above the positive one)."""
    num_iterations: int = Field(1, gt=0)
    """mu: optimizer updates per rollout batch, each on the whole batch."""
    grad_accum: int = Field(1, gt=0)
    """Micro-batches per update; prompts_per_step * num_generations must divide evenly."""
    seed: int = 0
    log_every: int = Field(1, gt=0)
    metrics_dir: str | None = None
    metrics: MetricsConfig = MetricsConfig()
    """Metric sinks: TensorBoard, MLflow, Weights & Biases."""
    progress: bool = True

    @field_validator("loss_type")
    @classmethod
    def _registered_loss(cls, value: str) -> str:
        return POLICY_LOSSES.check(value)

    @field_validator("loss_aggregation")
    @classmethod
    def _registered_aggregation(cls, value: str | None) -> str | None:
        return value if value is None else LOSS_AGGREGATIONS.check(value)

    @field_validator("advantage_estimator")
    @classmethod
    def _registered_estimator(cls, value: str) -> str:
        return ADVANTAGE_ESTIMATORS.check(value)

    @field_validator("max_staleness")
    @classmethod
    def _staleness(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"max_staleness must be 0 (on-policy) or more updates, not {value}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _gmpo_epsilon(cls, data):
        """loss_type gmpo clips in log space, with TRL's default 0.4 where the config sets none."""
        if isinstance(data, dict) and data.get("loss_type") == "gmpo" and "epsilon" not in data:
            data = {**data, "epsilon": 0.4}
        return data

    @model_validator(mode="before")
    @classmethod
    def _environment_scores(cls, data):
        """With an environment, `rewards` may be left out (the environment's reward is a term)."""
        if isinstance(data, dict) and data.get("environment") is not None and "rewards" not in data:
            data = {**data, "rewards": []}
        return data

    @model_validator(mode="after")
    def _check(self) -> GRPOConfig:
        if not self.rewards and self.environment is None:
            raise ValueError("rewards: give at least one reward term (or an environment that scores the episodes)")
        if self.max_staleness > 0 and self.rollout_workers == 0:
            raise ValueError(
                f"max_staleness {self.max_staleness} needs rollout_workers >= 1: with 0 the trainer's "
                "process generates each batch on-policy"
            )
        if self.loss_type == "gmpo" and self.algorithm != "grpo":
            raise ValueError(
                "loss_type gmpo makes its own sequence weight (the geometric mean of the token ratios): "
                "it needs algorithm grpo, not gspo"
            )
        for key in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if self.loss_type != "sapo" and getattr(self, key) != type(self).model_fields[key].default:
                raise ValueError(f"{key} applies to loss_type sapo only, not {self.loss_type}")
        if self.loss_type == "cispo" and self.epsilon_high is None:
            raise ValueError(
                "loss_type cispo clips the importance weight at epsilon_high, an absolute bound "
                "(ScaleRL's eps_max, e.g. 5.0): set epsilon_high"
            )
        rows = self.prompts_per_step * self.num_generations
        if rows % self.grad_accum:
            raise ValueError(
                f"prompts_per_step * num_generations ({rows}) must be divisible by grad_accum ({self.grad_accum})"
            )
        if self.gspo_variant != "sequence" and self.algorithm != "gspo":
            raise ValueError("gspo_variant applies to algorithm: gspo only")
        for i, spec in enumerate(self.rewards):
            if spec.function == "reasoning_gym" and self.data.reasoning_gym is None:
                raise ValueError(
                    f"rewards.{i}: the reasoning_gym reward scores prompts from data.reasoning_gym; set it "
                    "(e.g. {dataset: leg_counting}) or use another reward"
                )
        reason = unsplittable(
            self.max_prompt_length + self.max_completion_length,
            self.mesh.context,
            "max_prompt_length + max_completion_length",
        )
        if reason:
            raise ValueError(reason)
        return self

    @property
    def off_policy(self) -> bool:
        """Whether a batch carries the old policy's log-probs to correct the rollout's towards (and
        logs the correction's ratios): stale rollouts, or a correction asked for (e.g. bf16 rollouts)."""
        return self.max_staleness > 0 or self.rollout_correction is not None

    @property
    def importance_sampling_level(self) -> str:
        if self.algorithm == "grpo":
            return "token"
        return "sequence" if self.gspo_variant == "sequence" else "sequence_token"


def train_config(cfg: GRPOConfig, model_cfg: ModelConfig, compute: ComputeConfig) -> TrainConfig:
    """GRPO's trainer view (the trainer's, and a rollout worker's, which holds the weights as
    the trainer does): a step is a rollout batch of prompts x G rows (each makes mu updates, so
    the schedule spans steps x mu)."""
    seq_len = cfg.max_prompt_length + cfg.max_completion_length
    if seq_len > model_cfg.max_seq_len:
        raise ConfigError(
            f"max_prompt_length + max_completion_length ({seq_len}) exceeds the model's max_seq_len "
            f"({model_cfg.max_seq_len})"
        )
    rows = {"seq_len": max(seq_len, 2), "batch_size": cfg.prompts_per_step * cfg.num_generations}
    return trainer_view(cfg, model_cfg, compute, rows)


class DPODataConfig(Strict):
    """Preference pairs: JSONL in TRL's formats, one pair per line:

    {"prompt": "...", "chosen": "...", "rejected": "..."}                      text
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}      conversational
    {"chosen": [messages], "rejected": [messages]}                            implicit prompt: the
                                                                               messages they share
    """

    path: str | None = None
    """A JSONL file, or a directory whose *.jsonl files are read in name order; required."""
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    eval_path: str | None = None
    """Held-out pairs (same format). None: the last `eval_fraction` of `path`."""
    eval_fraction: float = Field(0.0, ge=0, lt=1)
    eval_batches: int = Field(0, ge=0)
    """Batches of held-out pairs per evaluation (0 = all of them)."""
    max_prompt_length: int = Field(128, gt=0)
    """A longer prompt keeps its last tokens (truncated on the left, as TRL's DPO did)."""
    max_length: int = Field(256, gt=1)
    """Prompt + completion tokens of each sequence; a longer completion keeps its start. Each
    row holds a pair: the chosen then the rejected sequence, apart by segment ids (2 x max_length)."""
    batch_size: int = Field(8, gt=0)
    """Pairs per optimizer step."""
    shuffle: bool = True
    seed: int = 0

    @model_validator(mode="after")
    def _check_lengths(self) -> DPODataConfig:
        if self.max_prompt_length >= self.max_length:
            raise ValueError(
                f"max_prompt_length ({self.max_prompt_length}) must be below max_length "
                f"({self.max_length}), which leaves the completion its share"
            )
        return self


class ReferenceConfig(Strict):
    """DPO's frozen reference when it is not the start policy (TRL's `ref_model`)."""

    checkpoint: str | None = None
    """Its checkpoint directory (a checkpoint, or an adapter read as its merged model), of the
    policy's vocabulary; any architecture. None: the start policy (checkpoint.init_from; with
    LoRA, the base with the adapter off)."""
    compute: ComputeConfig | None = None
    """How the reference computes. None: the settings its checkpoint was saved with."""


class DPOConfig(RunFields):
    """One DPO run (TRL's DPOTrainer definitions): a policy starting at checkpoint.init_from
    and a frozen reference, on preference pairs."""

    model: ModelConfig | None = None
    """None: the architecture stored with checkpoint.init_from."""
    compute: ComputeConfig | None = None
    """None: the settings checkpoint.init_from was saved with."""
    tokenizer: str | None = None
    """Tokenizer directory. None: `tokenizer/` next to checkpoint.init_from."""
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-6, weight_decay=0.0)
    """TRL's default learning rate for DPO."""
    data: DPODataConfig = DPODataConfig()
    loss_type: PreferenceLoss | list[PreferenceLoss] = "sigmoid"
    """TRL's names (engine/posttrain/preference_loss.py); simpo and orpo are reference-free (no
    reference model). A list combines several, as TRL's list-valued loss_type: the loss is
    sum_k loss_weights[k] * loss_k; `sft` in a list is the NLL per chosen completion token."""
    loss_weights: list[float] | None = None
    """One weight per loss_type of a list (TRL's loss_weights); None: 1.0 each."""
    beta: float = Field(0.1, gt=0)
    """The KL strength (DPO's beta; IPO's tau; ORPO's lambda, the odds-ratio term's weight)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """robust, simpo, aot, aot_unpaired: the assumed fraction of flipped labels; exo_pair: its
    epsilon (> 0; EXO's paper suggests 1e-3)."""
    simpo_gamma: float = Field(0.5, ge=0)
    """simpo: the target reward margin gamma (TRL's simpo_gamma)."""
    discopop_tau: float = Field(0.05, gt=0)
    """discopop: the temperature of its log-ratio modulation (TRL's discopop_tau)."""
    rpo_alpha: float | None = Field(None, ge=0)
    """RPO: add alpha x the NLL of the chosen completions (mean per token; TRL's `sft` loss term)."""
    reference: ReferenceConfig = ReferenceConfig()
    """The reference; by default the start policy. A pipeline sets it from the stage's
    `reference` input."""
    precompute_ref: bool = False
    """Compute the reference's log-probabilities of every pair once before training (TRL's
    precompute_ref_log_probs), so no reference model is held while training."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter; the reference is then the base with the adapter off (no copy),
    unless reference.checkpoint names another."""

    @property
    def loss_types(self) -> tuple[str, ...]:
        return tuple(self.loss_type) if isinstance(self.loss_type, list) else (self.loss_type,)

    @property
    def weighted_losses(self) -> tuple[tuple[str, float], ...]:
        """(loss type, weight) of every term."""
        return tuple(zip(self.loss_types, self.loss_weights or [1.0] * len(self.loss_types), strict=True))

    @property
    def reference_free(self) -> bool:
        """No term reads a reference model (simpo, orpo, sft)."""
        return all(t in REFERENCE_FREE for t in self.loss_types)

    @property
    def loss_name(self) -> str:
        return "+".join(self.loss_types)

    @model_validator(mode="after")
    def _check_loss(self) -> DPOConfig:
        types, name = self.loss_types, self.loss_name
        if not types:
            raise ValueError("loss_type: give a loss type or a non-empty list of them")
        if len(set(types)) != len(types):
            raise ValueError(f"loss_type lists a loss type twice ({', '.join(types)})")
        if self.loss_weights is not None and len(self.loss_weights) != len(types):
            raise ValueError(
                f"loss_weights has {len(self.loss_weights)} weights for {len(types)} loss type(s) ({name}): "
                "give one per loss_type"
            )
        alone = [t for t in types if t in MEAN_LOGP]
        if alone and len(types) > 1:
            raise ValueError(f"loss_type {alone[0]} stands alone: it cannot be combined with others in a list")
        if self.label_smoothing and not set(types) & set(LABEL_SMOOTHING):
            raise ValueError(f"label_smoothing applies to loss_type {', '.join(LABEL_SMOOTHING)}, not {name}")
        if "exo_pair" in types and not self.label_smoothing:
            raise ValueError("loss_type exo_pair needs label_smoothing > 0, its epsilon (EXO's paper suggests 1e-3)")
        if self.rpo_alpha is not None and "sft" in types:
            raise ValueError("rpo_alpha and an `sft` loss_type are the same NLL term: give one of them")
        if self.precompute_ref and self.reference_free:
            raise ValueError(f"loss_type {name} is reference-free: precompute_ref has nothing to compute")
        if self.reference.checkpoint and self.reference_free:
            raise ValueError(f"loss_type {name} is reference-free: it reads no reference.checkpoint")
        return self
