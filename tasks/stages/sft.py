"""The sft stage: a checkpoint artifact and a JSONL file of examples in, a checkpoint artifact out.

    <out>/checkpoint/     Orbax checkpoints (engine.train.checkpoint.load_params), as pretrain writes
    <out>/tokenizer/      the input checkpoint's tokenizer, carried along
    <out>/sft.yaml        the resolved engine config the child ran
    <out>/metrics.jsonl   train and held-out metrics; <out>/tensorboard/

The engine runs in a child process (`python -m engine.posttrain.sft <out>/sft.yaml`) started
by the stage's launcher; a re-run resumes from the latest checkpoint. The examples live
outside the store, so the artifact id covers their bytes: editing the data makes a new artifact.
"""

from __future__ import annotations

from engine.posttrain.config import SFTConfig
from tasks.engine_stage import FineTuneStage


class SFTStage(FineTuneStage):
    task = "sft"
    entry_point = "engine.posttrain.sft"
    planner = "engine.posttrain.sft:step_spec"
    inputs = FineTuneStage.checkpoint_inputs("the model to fine-tune (params; a fresh optimizer) and its tokenizer/")
    config_schema = SFTConfig
    version = 2  # 2: the checkpoint's meta holds `compute` apart from the architecture
    data_doc = "a JSONL file of examples"
