"""The kto stage: a checkpoint (or adapter) artifact and a JSONL file of unpaired feedback
(prompt, completion, label) in, optionally a `reference` checkpoint (or adapter) artifact
(TRL's `ref_model`; without it the reference is the start policy), a checkpoint (or, with
`lora:`, an adapter) artifact out.

    <out>/checkpoint/     Orbax checkpoints of the policy (engine.train.checkpoint.load_params)
    <out>/tokenizer/      the input's tokenizer, carried along
    <out>/kto.yaml        the resolved engine config the child ran
    <out>/metrics.jsonl   per step and held out: loss, kl, rewards/{chosen,rejected,margins}, logps/...

The engine runs in a child process (`python -m engine.posttrain.kto <out>/kto.yaml`); a re-run
resumes from the latest checkpoint. The artifact id covers the inputs' ids (the reference's
too) and the examples' bytes.
"""

from __future__ import annotations

from engine.posttrain.kto_config import KTOConfig
from tasks.stages.dpo import DPOStage


class KTOStage(DPOStage):
    task = "kto"
    entry_point = "engine.posttrain.kto"
    planner = "engine.posttrain.kto:step_spec"  # its inputs are DPO's: the policy, and optionally a reference
    config_schema = KTOConfig
    console_metrics = ("loss", "kl", "rewards/margins")
    version = 1
    data_doc = "a JSONL file of unpaired feedback (prompt, completion, label)"
