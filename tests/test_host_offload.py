"""optimizer.host_offload: the optimizer's state kept in the hosts' memory (pinned_host)
between steps and brought to the devices for the update. It moves bytes, not values: a run
equals the same run without it, bitwise, and resumes from its checkpoints as one."""

import importlib.util

import jax
import pytest

from engine.config import load_config
from engine.train.config import TrainConfig
from engine.train.plan import format_plan, plan_step
from engine.train.pretrain import run_pretrain
from engine.train.targets import get_target
from engine.train.trainer import Trainer
from tests.test_train import assert_params_identical, assert_resumes_bitwise, tiny_config

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the test extra)")
OVERRIDES = {"steps": 6, "checkpoint.every_steps": 3, "optimizer.moment_dtype": "bfloat16"}


def test_the_state_lives_in_pinned_host_and_the_run_equals_one_without_it_and_resumes_bitwise(
    byte_dataset, tmp_path, capfd
):
    offloaded = {**OVERRIDES, "optimizer.host_offload": True}
    trainer = Trainer(tiny_config(byte_dataset, tmp_path / "t", **offloaded))
    assert {a.sharding.memory_kind for a in jax.tree.leaves(trainer.abstract_opt_state)} == {"pinned_host"}
    assert {a.sharding.memory_kind for a in jax.tree.leaves(trainer.abstract_params)} == {"device"}

    run_pretrain(tiny_config(byte_dataset, tmp_path / "plain", **OVERRIDES))
    run_pretrain(tiny_config(byte_dataset, tmp_path / "offloaded", **offloaded))
    assert_params_identical(tmp_path / "plain" / "checkpoint", tmp_path / "offloaded" / "checkpoint")

    assert_resumes_bitwise(byte_dataset, tmp_path, capfd, "offloaded", **offloaded)


@needs_libtpu
def test_a_plan_for_a_tpu_counts_the_offloaded_state_out_of_the_chips_memory():
    """Compiled for a v5e-1 through libtpu: offloaded, the step's HBM arguments shrink by at least
    the state's bytes (the chip pads each array to its tiles), and its total grows by less than
    them (the update holds the state on the chip at worst, where the plain step holds it
    throughout): the compiler's heap peak also counts the hosts' memory, which the plan leaves out."""
    tree = {"model": "tiny", "data": {"seq_len": 128, "batch_size": 8}, "steps": 3}
    plain = plan_step(load_config(tree=tree, schema=TrainConfig), get_target("v5e-1")).memory
    offloaded_tree = {**tree, "optimizer": {"host_offload": True}}
    offloaded_plan = plan_step(load_config(tree=offloaded_tree, schema=TrainConfig), get_target("v5e-1"))
    offloaded = offloaded_plan.memory
    assert offloaded.optimizer_state == plain.optimizer_state > 2 * offloaded.batch
    assert plain.argument - offloaded.argument >= offloaded.optimizer_state
    assert offloaded.total < plain.total + offloaded.optimizer_state
    assert "(in the hosts' memory: optimizer.host_offload)" in format_plan(offloaded_plan)
