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
    "data.reasoning_gym": None,  # GRPO's prompts from reasoning-gym (engine/posttrain/procedural_tasks.py)
    # evaluate's lm-eval harness tasks
    "harness": None,
    "compute.weight_grad_dtype": "float32",
    "compute.mtp_loss": 0.0,
    "compute.matmul_precision": "default",
    "optimizer.moment_dtype": None,  # Adam's moments stored apart from the parameters' dtype
    "optimizer.host_offload": False,
    "mesh.dcn": {"data": 1, "expert": 1, "fsdp": 1, "context": 1, "pipeline": 1},
    # pipeline parallelism (engine/ops/pipeline.py); a set mesh.dcn keeps its id without it
    "mesh.dcn.pipeline": 1,
    "mesh.pipeline": 1,
    "compute.pipeline_microbatches": 0,
    # DeepSeek Sparse Attention's indexer training (engine/models/dsa.py)
    "compute.indexer_loss": "none",
    "compute.indexer_loss_weight": 1.0,
    "compute.indexer_ties": "first",  # DSA's top-k among tied scores (engine/models/dsa.py)
    "loss_tiles": 1,  # the LM head and loss in pieces of the sequence (engine/train/lm_head.py)
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
"""Fields added to a stage's config after artifacts were made with it: at these values they are
left out of artifact ids, so a store's finished stages keep their ids (and are skipped). The
model's own fields need no entry: engine/models/fingerprint.py leaves out any added since ids
were defined wherever it holds its default."""
TOKENIZE_NON_SEMANTIC_FIELDS = ("workers",)
"""Tokenizing: the shards are the same for any number of worker processes."""
