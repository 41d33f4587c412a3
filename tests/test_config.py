"""Config errors are for users: one message naming the key and what would be valid."""

import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import ConfigError, load_config, load_yaml
from engine.models.config import ComputeConfig, ModelConfig
from engine.parallel.mesh import make_mesh
from engine.train.config import TrainConfig

REPO = Path(__file__).resolve().parent.parent


def test_unknown_key_names_it_and_suggests_the_closest(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: tiny\noptimizer:\n  learning_rat: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, schema=TrainConfig)
    msg = str(e.value)
    assert "optimizer.learning_rat" in msg and "did you mean 'learning_rate'" in msg and str(path) in msg


def test_unknown_top_level_key_in_override():
    with pytest.raises(ConfigError, match=r"unknown key 'stpes'; did you mean 'steps'"):
        load_config(tree={"model": "tiny"}, overrides=["stpes=3"], schema=TrainConfig)


def test_wrong_type_and_range_fail_before_anything_compiles():
    with pytest.raises(ConfigError, match=r"key 'steps'.*got 'many'"):
        load_config(tree={"model": "tiny"}, overrides=["steps=many"], schema=TrainConfig)
    with pytest.raises(ConfigError, match=r"key 'optimizer.learning_rate'.*greater than 0"):
        load_config(tree={"model": "tiny"}, overrides=["optimizer.learning_rate=-1"], schema=TrainConfig)
    for bad in ("0", "all", "true"):  # one line naming the key, not a line per branch of its type
        with pytest.raises(
            ConfigError, match=r"^[^\n]*key 'compute.scan_unroll': .*'auto' or a number of layers >= 1[^\n]*$"
        ):
            load_config(tree={"model": "tiny"}, overrides=[f"compute.scan_unroll={bad}"], schema=TrainConfig)


def test_inconsistent_model_and_batch_are_rejected():
    with pytest.raises(ConfigError, match=r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        load_config(tree={"model": "tiny"}, overrides=["model.num_heads=6", "model.num_kv_heads=4"], schema=TrainConfig)
    with pytest.raises(ConfigError, match=r"batch_size \(6\) must be divisible by grad_accum \(4\)"):
        load_config(tree={"model": "tiny"}, overrides=["data.batch_size=6", "grad_accum=4"], schema=TrainConfig)


def test_unknown_preset_suggests_a_name():
    with pytest.raises(ConfigError, match=r"unknown model preset 'tinny'; did you mean 'tiny'"):
        load_config(tree={"model": "tinny"}, schema=TrainConfig)


def test_overrides_parse_yaml_scalars():
    cfg = load_config(
        tree={"model": "tiny"},
        overrides=["steps=7", "optimizer.grad_clip_norm=null", "compute.remat=full", "data.packing=false"],
        schema=TrainConfig,
    )
    assert cfg.steps == 7 and cfg.optimizer.grad_clip_norm is None
    assert cfg.compute.remat == "full" and cfg.data.packing is False


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml", schema=TrainConfig)


def test_impossible_meshes_are_clear_errors():
    import jax

    devices = jax.devices()
    assert len(devices) == 8
    with pytest.raises(ConfigError, match=r"data=3 fsdp=1 tensor=-1 does not divide 8 devices"):
        make_mesh(load_config(tree={"model": "tiny", "mesh": {"data": 3, "tensor": -1}}, schema=TrainConfig).mesh)
    with pytest.raises(ConfigError, match=r"needs 4 devices but 8 are available"):
        make_mesh(
            load_config(tree={"model": "tiny", "mesh": {"data": 2, "fsdp": 2, "tensor": 1}}, schema=TrainConfig).mesh
        )
    with pytest.raises(ConfigError, match="at most one mesh axis may be -1"):
        load_config(tree={"model": "tiny", "mesh": {"data": -1, "fsdp": -1}}, schema=TrainConfig)


def test_a_dimension_that_does_not_divide_its_mesh_axis_is_named(tmp_path):
    from engine.train.trainer import Trainer

    # tiny has 2 kv heads: tensor=4 cannot split them.
    cfg = load_config(tree={"model": "tiny", "mesh": {"data": 2, "tensor": 4}}, schema=TrainConfig)
    with pytest.raises(ConfigError, match=r"parameter 'blocks.attn.wk_dkh' has a dimension of 2 .* 'tensor' of size 4"):
        Trainer(cfg)


def test_every_shipped_model_preset_parses():
    presets = sorted((REPO / "configs" / "models").glob("*.yaml"))
    assert len(presets) >= 4
    for path in presets:
        tree = load_yaml(path)
        ComputeConfig.model_validate(tree.pop("compute", {}))
        ModelConfig.model_validate(tree)


def test_a_presets_compute_settings_are_defaults_the_run_overrides():
    cfg = load_config(tree={"model": "llama3-1b"}, overrides=["compute.remat=full"], schema=TrainConfig)
    assert (cfg.compute.dtype, cfg.compute.remat, cfg.compute.param_dtype) == ("bfloat16", "full", "float32")
    assert load_config(tree={"model": "tiny"}, schema=TrainConfig).compute == ComputeConfig()


def test_llama3_presets_have_the_published_parameter_counts():
    assert round(load_config(tree={"model": "llama3-8b"}, schema=TrainConfig).model.num_params() / 1e9, 2) == 8.03
    assert round(load_config(tree={"model": "llama3-1b"}, schema=TrainConfig).model.num_params() / 1e9, 2) == 1.24
    assert isinstance(load_config(tree={"model": "tiny"}, schema=TrainConfig), TrainConfig)


@pytest.mark.parametrize("module", ["engine.train", "engine.posttrain.sft", "engine.posttrain.grpo"])
def test_engine_help_exits_0_and_lists_the_config_sections(module):
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: python -m {module} CONFIG.yaml")
    for section in ("mesh.*", "checkpoint.*", "optimizer.*", "compute.*"):
        assert f"\n  {section} " in proc.stdout
    no_args = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, timeout=120)
    assert no_args.returncode == 2 and "usage:" in no_args.stderr


def test_overrides_index_lists_and_name_what_is_wrong():
    from engine.config import apply_overrides

    tree = {"tasks": [{"name": "a", "limit": 5}, {"name": "b"}], "steps": 3}
    apply_overrides(tree, ["tasks.0.limit=50", "tasks.1.rewards.0=x", "tasks.2={name: c}"])
    assert (
        tree["tasks"] == [{"name": "a", "limit": 50}, {"name": "b", "rewards": {"0": "x"}}, {"name": "c"}]
        or tree["tasks"][0]["limit"] == 50
    )
    assert tree["tasks"][2] == {"name": "c"}
    with pytest.raises(ConfigError, match=r"'tasks.7.limit': 'tasks' has 3 item\(s\); index 7 is out of range"):
        apply_overrides(tree, ["tasks.7.limit=1"])
    with pytest.raises(ConfigError, match=r"'tasks' is a list; index it with a number, not 'first'"):
        apply_overrides(tree, ["tasks.first.limit=1"])
    with pytest.raises(ConfigError, match=r"'steps' is a value, not a section"):
        apply_overrides(tree, ["steps.x=1"])
