"""Stage kinds as one definition each: the artifact ids of the shipped pipelines are pinned
(a refactor of the kinds, the registry or the planner must not move them), and a kind
defined in a test module runs, resumes and is planned through the interface the built-in
kinds use."""

from __future__ import annotations

import pytest

from flows.spec import load_plan
from tests.conftest import REPO

PIPELINES = REPO / "configs" / "pipelines"

# The ids `trainflow status` shows for the shipped pipelines on an empty store (the README's
# quickstart output shows the same for quickstart). A change here is a change users see: every
# finished stage of their stores would run again.
SHIPPED_IDS = {
    "quickstart": {
        "problems": "0c4726574677a693",
        "tokenize": "1f0da58d2d6c1401",
        "pretrain": "a4b7b72ff158c4e6",
        "sft": "c82e84fb27fdaba7",
        "grpo": "f7ff91297020fbfa",
        "evaluate": "922e4ee894f31038",
    },
    "tiny": {"tokenize": "01b9e0d01ca57d13", "pretrain": "fcc982a3dcd4f08d"},
    "posttrain": {
        "problems": "e34e7bdfb02d3024",
        "tokenize": "7dd53ccb95bf09d9",
        "pretrain": "6c39daa1dc696826",
        "sft": "8857546d4e1237d6",
        "reward_model": "a51d9942e9283ae4",
        "dpo": "3e99bbe40a1ce48d",
        "grpo": "e279c37c3170199a",
        "pretrain_small": "0d335299016abcda",
        "distill": "195178854c400a9d",
        "evaluate": "0dd5371e8410108e",
    },
    "sweep": {
        "problems": "0c4726574677a693",
        "tokenize": "1f0da58d2d6c1401",
        "pretrain": "1da926cb3268a252",
        "early": "99e9d615d03659a8",
        "sft[lr=0.001,rank=8]": "28ea72b52c3d006c",
        "sft[lr=0.001,rank=16]": "aa2ec8335a1a72af",
        "sft[lr=0.005,rank=8]": "0782e95ea433216f",
        "sft[lr=0.005,rank=16]": "778b2ad5dbc381e6",
        "evaluate": "1dad27d48836e96e",
        "export": "",  # after a selection: known once the sweep has run
    },
    "tools": {
        "problems": "0c4726574677a693",
        "tokenize": "1f0da58d2d6c1401",
        "pretrain": "a4b7b72ff158c4e6",
        "sft": "c82e84fb27fdaba7",
        "grpo": "cbd8e78db70bfbd8",
    },
}


@pytest.mark.parametrize("name", sorted(SHIPPED_IDS))
def test_the_shipped_pipelines_keep_their_artifact_ids(name, tmp_path):
    plan = load_plan(PIPELINES / f"{name}.yaml", store=tmp_path)
    assert {stage: planned.job.artifact_id for stage, planned in plan.stages.items()} == SHIPPED_IDS[name]
