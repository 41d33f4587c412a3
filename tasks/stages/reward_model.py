"""The reward_model stage: a checkpoint (or adapter) artifact and a JSONL file of preference
pairs in, a reward_model artifact out (with `lora:` too: its checkpoint is then the adapter
and the head, on the input's base).

    <out>/checkpoint/     Orbax checkpoints of decoder + score head (engine.posttrain.reward_model:
                          load_reward_params); meta `reward_model`
    <out>/tokenizer/      the input's tokenizer, carried along (a GRPO stage scoring with this
                          model must have the same)
    <out>/reward_model.yaml  the resolved engine config the child ran
    <out>/metrics.jsonl   per step and held out: loss, accuracy, margin, mean/min/max reward

The engine runs in a child process (`python -m engine.posttrain.reward_model <out>/reward_model.yaml`);
a re-run resumes from the latest checkpoint. The artifact id covers the pairs' bytes.
`trainflow export` writes it as transformers' <Family>ForSequenceClassification; `trainflow
convert` of one gives a reward_model artifact back.
"""

from __future__ import annotations

from engine.posttrain.reward_config import RewardModelConfig
from tasks.engine_stage import FineTuneStage

REWARD_MODEL = "reward_model"
"""The artifact kind."""


class RewardModelStage(FineTuneStage):
    task = "reward_model"
    entry_point = "engine.posttrain.reward_model"
    planner = "engine.posttrain.reward_model:step_spec"
    output = REWARD_MODEL
    possible_outputs = ()
    inputs = FineTuneStage.checkpoint_inputs("the decoder the reward model starts from, and its tokenizer/")
    config_schema = RewardModelConfig
    console_metrics = ("loss", "accuracy", "margin")
    version = 1
    data_doc = "a JSONL file of preference pairs (prompt, chosen, rejected[, margin])"

    def output_kind(self, config) -> str:
        return REWARD_MODEL
