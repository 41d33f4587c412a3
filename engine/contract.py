"""What the engine promises the processes that run it: exit codes, the result line, the
checkpoint format, the names of an artifact's files, and which config fields cannot change a
result. (Each stage kind names its own entry-point module: tasks/registry.py, `entry_point`.)

`tasks/` (the launchers and stage kinds) and the engine both read these names from here,
so a contract is written once. Nothing here imports more than the standard library.
"""

from __future__ import annotations

# --------------------------------------------------------------------------- exit codes
# Every engine entry point (`python -m engine.train`, `engine.posttrain.sft`, ...) exits with:
EXIT_OK = 0
EXIT_FAILED = 1
"""The run failed (a non-finite loss, a reward function raising); the last good checkpoint is
kept. The launcher tells a divergence (`error: non-finite loss ...`, not retried: a resumed
run is deterministic and would diverge again) from other failures."""
EXIT_CONFIG_ERROR = 2
"""The config or the input is wrong: one line `error: ...` on stderr; retrying cannot help."""
EXIT_PREEMPTED = 143
"""Stopped by SIGTERM after saving a checkpoint of the current step (128 + 15)."""

RESULT_PREFIX = '{"result":'
"""An entry point's last stdout line is `{"result": {...final metrics...}}`."""

# --------------------------------------------------------------------------- checkpoints
CHECKPOINT_FORMAT = "trainflow.checkpoint/2"
"""Stored in every checkpoint's meta. 2: `model` holds the architecture only, `compute` the
dtype and memory settings the params were saved with (1 kept both in `model`)."""
CHECKPOINT_FORMATS_READ = ("trainflow.checkpoint/1", CHECKPOINT_FORMAT)

# --------------------------------------------------------------------------- artifact layout
# <store>/<stage>/<artifact-id>/ holds these (docs/design.md, "Artifacts and lineage").
MANIFEST = "artifact.json"
CHECKPOINT_DIR = "checkpoint"
"""An Orbax CheckpointManager directory (engine.train.checkpoint)."""
CHECKPOINT_URL_SCHEMES = ("gs://", "s3://")
"""Where the engine's checkpoints are written and read at the URL itself, by every process
(engine/train/bucket_paths.py); a bucket store of these schemes hands its stages the URL."""
TOKENIZER_DIR = "tokenizer"
"""A checkpoint or dataset artifact carries its tokenizer here."""
DATA_DIR = "data"
"""A dataset artifact's token shards (engine/data/shards.py)."""
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"

# --------------------------------------------------------------------------- fingerprints
NON_SEMANTIC_FIELDS = ("log_every", "progress", "metrics_dir", "metrics", "checkpoint.async_save")
"""Fields of a training config that cannot change its result: left out of artifact ids."""
CHECKPOINT_CADENCE_FIELDS = ("checkpoint.every_steps", "checkpoint.keep")
"""Change what is kept on disk, not the final result (a resumed run equals an uninterrupted one)."""
ADDED_AT_DEFAULT = {
    "mesh.context": 1,
    "lora": None,
    "preference_pairs": 0,
    # GRPO's estimators, off-policy correction and asynchronous rollouts
    "loss_aggregation": None,
    "advantage_estimator": "grpo",
    "rollout_correction": None,
    "router_replay": None,
    "max_staleness": 0,
    "rollout_workers": 0,
    "rollout_worker_restarts": 2,
    "rollout_worker_env": {},
    # multi-turn environments and a rollout server
    "environment": None,
    "rollout": None,
    "rollout.weights_url": None,  # the bucket weight sync (engine/interop/weight_sync.py)
    # evaluate's lm-eval harness tasks
    "harness": None,
    "compute.weight_grad_dtype": "float32",
    "compute.mtp_loss": 0.0,
    "compute.matmul_precision": "default",
    "mesh.dcn": {"data": 1, "expert": 1, "fsdp": 1, "context": 1, "pipeline": 1},
    # pipeline parallelism (engine/ops/pipeline.py); a set mesh.dcn keeps its id without it
    "mesh.dcn.pipeline": 1,
    "mesh.pipeline": 1,
    "compute.pipeline_microbatches": 0,
    # the layer pattern's per-layer kinds (engine/models/config.py: ModelConfig.layer_pattern)
    "model.rope_pattern": None,
    "model.rotary_dim": None,
    "model.pre_norms": True,
    "model.qk_norm_across_heads": False,
    "model.ffn_pattern": None,
    "model.router_group_score": "top2_sum",
    "model.mtp_layers": 0,
    # Gemma 4's global layers and DeepSeek Sparse Attention's indexer (engine/models/config.py)
    "model.global_head_dim": None,
    "model.global_num_kv_heads": None,
    "model.global_values_from_keys": False,
    "model.value_norm": False,
    "model.layer_scale": False,
    "model.rope_scaling.rotated_fraction": 1.0,  # RoPE kind proportional's share (Gemma 4)
    "model.rope_scaling.short_factor": None,  # RoPE kind longrope's (Phi-3.5, Phi-4-mini)
    "model.rope_scaling.long_factor": None,
    "model.moe_beside_mlp": False,  # Gemma 4's mixture of experts
    "model.router_input_norm": False,
    "model.router_expert_scale": False,
    "model.index_topk": None,
    "model.index_heads": 64,
    "model.index_head_dim": 128,
    "model.index_rope_interleave": False,
    "compute.indexer_loss": "none",
    "compute.indexer_loss_weight": 1.0,
    "compute.indexer_ties": "first",
    # mixer kinds (ModelConfig.mixer_pattern: Qwen3-Next's Gated DeltaNet layers)
    "model.mixer_pattern": None,
    "model.gated_delta": None,
    "model.attention_output_gate": False,
    "model.shared_expert_gate": False,
    # Llama 4 (engine/models/families/llama4.py)
    "model.attention_chunk_size": None,
    "model.qk_l2_norm": False,
    "model.attn_temperature_floor": None,
    "model.attn_temperature_scale": 0.1,
    "model.router_scales_input": False,
    # Mamba2 layers and MLPs without a gate (engine/models/mamba2.py; Nemotron-H)
    "model.mamba2": None,
    "model.mlp_gated": True,
    "model.embedding_multiplier": None,
    "model.residual_multiplier": None,
    "model.attention_scale": None,
    "model.logits_scaling": None,
    # Gemma 4's small models: per-layer embeddings and KV sharing
    "model.per_layer_input_dim": None,
    "model.kv_shared_layers": 0,
    "model.kv_shared_wide_mlp": False,
    # Falcon-H1 (engine/models/parallel_hybrid.py): its multipliers, Mamba2 without a gated norm
    "model.mup": None,
    "model.mamba2.gated_norm": True,
    "model.mamba2.norm_before_gate": False,
    "model.shared_expert_mlp_dim": None,  # Granite 4's shared MLP beside its experts
    "model.mrope_section": None,  # Qwen3.5's multimodal RoPE split, kept for the export
    # DPO's separate reference (its checkpoint comes from an input, and is not in the id)
    "reference": {"checkpoint": None, "compute": None},
    # DPO's list-valued loss_type with weights, DiscoPOP's temperature (issue 53)
    "loss_weights": None,
    "discopop_tau": 0.05,
    # GRPO's SAPO gate temperatures (issue 53)
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    # a reward model's process (step-label) form (engine/posttrain/process_reward.py)
    "process": None,
}
"""Fields added to a config after artifacts were made with it: at these values they are left
out of artifact ids, so a store's finished stages keep their ids (and are skipped)."""
TOKENIZE_NON_SEMANTIC_FIELDS = ("workers",)
"""Tokenizing: the shards are the same for any number of worker processes."""
