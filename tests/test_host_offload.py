"""optimizer.host_offload: the optimizer's state kept in the hosts' memory (pinned_host)
between steps and brought to the devices for the update. It moves bytes, not values: a run
equals the same run without it, bitwise, and resumes from its checkpoints as one."""

import shutil

import jax

from engine.train.pretrain import run_pretrain
from engine.train.trainer import Trainer
from tests.test_train import assert_params_identical, tiny_config

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

    shutil.copytree(tmp_path / "offloaded", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoint" / "6")
    capfd.readouterr()
    run_pretrain(tiny_config(byte_dataset, tmp_path / "resumed", **offloaded))
    assert "resumed from checkpoint step 3" in capfd.readouterr().err
    assert_params_identical(tmp_path / "offloaded" / "checkpoint", tmp_path / "resumed" / "checkpoint")
