"""LoRA training on the shared trainer: only the adapter trains and is saved, the base stays
as it was, a resumed run equals an uninterrupted one, and a sharded run equals one device."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from engine.config import ConfigError
from engine.data.tokenizer import TokenizerConfig, save_tokenizer, train_tokenizer
from engine.models.config import ModelConfig
from engine.models.transformer import Transformer
from engine.posttrain.sft import run_sft
from engine.train.checkpoint import Checkpointer, read_meta
from tests.test_sft import MODEL, sft_config

LORA = {"lora.rank": 4, "lora.alpha": 8, "lora.target_modules": "all-linear"}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A checkpoint artifact whose random weights are large enough (std 0.25) that a frozen
    LM head can express confident answers: with GPT-2's 0.02 only the full fine-tune could."""
    out = tmp_path_factory.mktemp("lora-base")
    bundle = train_tokenizer(
        TokenizerConfig(vocab_size=300),
        ["the quick brown fox jumps over the lazy dog " * 20, "colour 0: red, 1: green, 2: blue"],
        add_bos=True,
    )
    save_tokenizer(bundle, out / "tokenizer")
    cfg = ModelConfig(**MODEL, init_std=0.25)
    params = nnx.to_pure_dict(nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1])
    ckpt = Checkpointer(out / "checkpoint", async_save=False)
    ckpt.save(
        0,
        params,
        {"unused": np.zeros((), np.int32)},
        {"step": 0, "model": cfg.model_dump(mode="json"), "format": "trainflow.checkpoint/1"},
        {},
    )
    ckpt.close()
    return out


@pytest.fixture(scope="module")
def colours(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("lora-data") / "pairs.jsonl"
    names = ["red", "green", "blue"]
    with data.open("w") as f:
        for i in range(60):
            f.write(json.dumps({"prompt": f"colour {i % 3}:", "completion": f" {names[i % 3]}"}) + "\n")
    return data


def leaves(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


# One uninterrupted LoRA run (dropout on) is the reference of both resume tests below.
LEARNING = {**LORA, "optimizer.learning_rate": 3e-2, "lora.dropout": 0.1, "checkpoint.every_steps": 4}


@pytest.fixture(scope="module")
def straight(base, colours, tmp_path_factory) -> tuple[Path, dict]:
    """(run directory, result) of 24 uninterrupted LoRA SFT steps with dropout, checkpointed
    every 4: what a run resumed in-process and one SIGKILLed mid-run must both end equal to
    (one reference run, not one per test)."""
    out = tmp_path_factory.mktemp("lora-straight")
    return out, run_sft(sft_config(base, out, colours, steps=24, **LEARNING))


def test_lora_sft_trains_only_the_adapter_and_resumes_bitwise(base, colours, straight, tmp_path):
    run, first = straight
    assert first["eval_loss"] < 0.35 * np.log(300), first["eval_loss"]  # it learns, with the base frozen

    # The checkpoint is the adapter: A and B of every projection, nothing of the base.
    directory = run / "checkpoint"
    _, meta = read_meta(directory)
    assert meta["lora"]["rank"] == 4 and meta["lora"]["base_checkpoint"] == str(base / "checkpoint")
    params, opt = restore_adapter(directory), restore_adapter(directory, "opt_state")
    assert params and all(n.endswith(("_lora_a']", "_lora_b']")) for n in params), list(params)
    assert len(params) == 2 * 7  # A and B of 7 projections, stacked over the layers
    adapter_size = sum(v.size for v in params.values())
    assert sum(v.size for v in opt.values()) <= 2 * adapter_size + 8  # Adam's moments of the adapter alone
    assert all(k.endswith(("_lora_a']", "_lora_b']")) for k in opt if "mu" in k or "nu" in k)

    # Interrupted at 12 and resumed to 24 == 24 straight (dropout masks included).
    run_sft(sft_config(base, tmp_path / "split", colours, steps=12, **LEARNING))
    logs = []
    run_sft(sft_config(base, tmp_path / "split", colours, steps=24, **LEARNING), log=logs.append)
    assert any("resumed from checkpoint step 12" in line for line in logs)
    straight_adapter = restore_adapter(run / "checkpoint")
    resumed = restore_adapter(tmp_path / "split" / "checkpoint")
    assert straight_adapter.keys() == resumed.keys()
    for key in straight_adapter:
        np.testing.assert_array_equal(straight_adapter[key], resumed[key], err_msg=key)


def restore_adapter(directory: Path, item: str = "params") -> dict[str, np.ndarray]:
    """The saved arrays of a checkpoint item by key path, restored as they were saved."""
    with ocp.CheckpointManager(
        directory, item_names=(item,), options=ocp.CheckpointManagerOptions(read_only=True)
    ) as manager:
        restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(**{item: ocp.args.StandardRestore()}))
    return leaves(restored[item])


def test_lora_sft_on_data_fsdp_tensor_equals_data_parallel(base, colours, tmp_path):
    """With dropout on: each row's masks come from its seed, not from where the row lives."""
    common = {**LORA, "optimizer.learning_rate": 3e-2, "data.batch_size": 8, "lora.dropout": 0.1}  # masks too
    one = run_sft(sft_config(base, tmp_path / "one", colours, steps=4, **common, **{"mesh.data": 8}))
    sharded = run_sft(
        sft_config(
            base, tmp_path / "mesh", colours, steps=4, **common, **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}
        )
    )
    assert sharded["layout"]["mesh"]["tensor"] == 2
    a, b = restore_adapter(tmp_path / "one" / "checkpoint"), restore_adapter(tmp_path / "mesh" / "checkpoint")
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-3, atol=2e-5, err_msg=key)  # Adam near 0 grads: lr 3e-2
    assert abs(one["eval_loss"] - sharded["eval_loss"]) < 1e-4


def test_lora_on_latent_attention_or_without_a_base_is_refused(base, colours, tmp_path):
    with pytest.raises(ConfigError, match="lora.target_modules: unknown|lora.target_modules"):
        run_sft(sft_config(base, tmp_path / "bad", colours, steps=2, **{"lora.target_modules": "[q_proj, wq]"}))


def test_grpo_with_lora_learns_and_its_reference_is_the_base_with_the_adapter_off(tmp_path):
    """The copy task of test_grpo.py on a frozen base: reward rises through the adapter alone;
    with beta > 0 the KL to the reference is 0 at the first update (a fresh adapter is the
    base exactly) and grows as the adapter moves away from it."""
    from engine.posttrain.grpo import run_grpo
    from tests.test_grpo import grpo_config, make_copy_task

    cfg = ModelConfig(
        vocab_size=16,
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=64,
        max_seq_len=16,
        init_std=0.25,
    )
    task = make_copy_task(tmp_path / "task", cfg)
    overrides = {**LORA, "beta": 0.01, "num_iterations": 2, "steps": 12}
    result = run_grpo(grpo_config(task, tmp_path / "run", **overrides))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    curve = [r["reward"] for r in records]
    assert np.mean(curve[-3:]) > np.mean(curve[:3]) + 0.3, curve
    assert records[0]["kl"] < records[-1]["kl"] and records[-1]["kl"] > 0
    params = restore_adapter(tmp_path / "run" / "checkpoint")
    assert all(k.endswith(("_lora_a']", "_lora_b']")) for k in params) and result["steps"] == 12


@pytest.mark.parametrize("base_dtype", ["nf4", "int8"])
def test_qlora_holds_the_base_quantized_and_learns(base, colours, tmp_path, base_dtype):
    """QLoRA: the frozen base's projections are qwix QArrays (4-bit NF4 or int8 values with
    float scales) on a data x fsdp x tensor mesh, the step compiles over them and the adapter
    learns; the quantized base's loss at step 0 is close to the float one's."""
    import qwix

    from engine.posttrain.finetune import finetune_start
    from engine.posttrain.sft import train_config
    from engine.train.trainer import Trainer

    overrides = {
        **LORA,
        "optimizer.learning_rate": 3e-2,
        "lora.base_dtype": base_dtype,
        "mesh.data": 2,
        "mesh.fsdp": 2,
        "mesh.tensor": 2,
    }
    cfg = sft_config(base, tmp_path / "q", colours, steps=20, **overrides)
    trainer = Trainer(train_config(cfg, *finetune_start(cfg)[:2]))
    quantized = trainer.load_base()
    wq = quantized["blocks"]["attn"]["wq_dnh"]
    assert isinstance(wq, qwix.QArray) and str(wq.qvalue.dtype) == ("uint4" if base_dtype == "nf4" else "int8")
    assert not isinstance(quantized["embed_vd"], qwix.QArray)  # embeddings, norms and the head stay float
    assert wq.qvalue.sharding.spec == trainer.abstract_base["blocks"]["attn"]["wq_dnh"].qvalue.sharding.spec
    error = float(
        np.abs(
            np.asarray(qwix.dequantize(wq))
            - np.asarray(trainer._load_init_from(None, as_numpy=True)["blocks"]["attn"]["wq_dnh"])
        ).max()
    )
    assert 0 < error < (0.35 if base_dtype == "nf4" else 0.02)  # of weights with std 0.25
    result = run_sft(cfg)
    assert result["eval_loss"] < 0.4 * np.log(300), result["eval_loss"]


def test_the_preflight_prices_the_adapter_and_the_frozen_base_and_names_lora_among_the_knobs():
    """`trainflow plan` of a LoRA step: the arguments hold the base and the adapter, the
    optimizer state and the gradients the adapter's alone; a quantized base is smaller still;
    a full fine-tune's does-not-fit sentence names lora and lora.base_dtype."""
    from engine.config import load_config
    from engine.train.config import TrainConfig
    from engine.train.memory import knobs
    from engine.train.plan import plan_step
    from engine.train.targets import get_target

    tree = {"model": "tiny", "data": {"seq_len": 64, "batch_size": 8}, "steps": 3}
    full = plan_step(load_config(tree=tree, schema=TrainConfig), get_target("local"))
    lora_cfg = load_config(tree={**tree, "lora": {"rank": 4, "target_modules": "all-linear"}}, schema=TrainConfig)
    lora = plan_step(lora_cfg, get_target("local"))
    nf4 = plan_step(
        lora_cfg.model_copy(update={"lora": lora_cfg.lora.model_copy(update={"base_dtype": "nf4"})}),
        get_target("local"),
    )
    assert lora.how == "compiled" and lora.memory.gradients < 0.1 * full.memory.gradients
    assert lora.memory.optimizer_state < 0.1 * full.memory.optimizer_state
    assert lora.memory.parameters == pytest.approx(full.memory.parameters + lora.memory.gradients)
    assert lora.memory.parameters + lora.memory.optimizer_state + lora.memory.batch == pytest.approx(
        lora.memory.argument, rel=1e-3
    )  # the compiled step's arguments are base + adapter + its state
    assert nf4.memory.argument < lora.memory.argument
    assert "lora: {rank: 16}" in knobs(load_config(tree=tree, schema=TrainConfig))
    assert "lora.base_dtype: nf4" in knobs(lora_cfg) and "lora: {rank" not in knobs(lora_cfg)


def test_a_lora_run_killed_with_sigkill_resumes_and_ends_bitwise_equal(base, colours, straight, tmp_path):
    """SIGKILL the engine's process mid-run (asynchronous checkpoints, so possibly mid-save);
    the rerun resumes from the newest committed step and its adapter equals an uninterrupted
    run's bit for bit, dropout masks included (they are drawn from the seed and the step)."""
    from engine.config import to_yaml
    from tests.engine_kill import kill_then_resume

    run, result = straight
    cfg = sft_config(base, tmp_path / "killed", colours, steps=24, **LEARNING, **{"checkpoint.async_save": True})
    (tmp_path / "killed").mkdir()
    (tmp_path / "killed" / "sft.yaml").write_text(to_yaml(cfg))
    checkpoints = tmp_path / "killed" / "checkpoint"
    kill_then_resume("engine.posttrain.sft", tmp_path / "killed" / "sft.yaml", checkpoints, after_step=8)
    a, b = restore_adapter(run / "checkpoint"), restore_adapter(checkpoints)
    assert a.keys() == b.keys() and result["steps"] == 24
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_lora_dropout_is_inverted_per_row_per_layer_and_off_outside_training():
    import jax.numpy as jnp

    from engine.models.lora import _dropout, dropout_rows, in_layer

    x = jnp.ones((4, 64, 32))
    assert _dropout(x, "wq_dnh", 0.25) is x  # no seeds: evaluation and sampling drop nothing
    seeds = jnp.array([[1], [2], [1], [3]], jnp.int32)
    with dropout_rows(seeds), in_layer(jnp.int32(0)):
        a = np.asarray(_dropout(x, "wq_dnh", 0.25))
        other_module = np.asarray(_dropout(x, "wv_dkh", 0.25))
    with dropout_rows(seeds), in_layer(jnp.int32(1)):
        other_layer = np.asarray(_dropout(x, "wq_dnh", 0.25))
    assert set(np.unique(a)) == {0.0, np.float32(1 / 0.75)}  # kept values scaled by 1 / (1 - p)
    assert abs((a == 0).mean() - 0.25) < 0.02
    np.testing.assert_array_equal(a[0], a[2])  # the same seed, the same mask
    assert (a[0] != a[1]).any() and (a != other_module).any() and (a != other_layer).any()


def test_grpo_samples_and_trains_on_a_quantized_base(tmp_path):
    """QLoRA in GRPO: rollouts decode through the NF4 base (dequantized per layer) plus the
    adapter, and the KL reference is that quantized base with the adapter off."""
    from engine.posttrain.grpo import run_grpo
    from tests.test_grpo import grpo_config, make_copy_task

    cfg = ModelConfig(
        vocab_size=16,
        d_model=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        mlp_dim=64,
        max_seq_len=16,
        init_std=0.25,
    )
    task = make_copy_task(tmp_path / "task", cfg)
    result = run_grpo(
        grpo_config(
            task,
            tmp_path / "run",
            **LORA,
            **{"lora.base_dtype": "nf4", "beta": 0.01, "steps": 3, "prompts_per_step": 4, "num_generations": 4},
        )
    )
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert result["steps"] == 3 and len(records) == 3
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6) and all(np.isfinite(r["loss"]) for r in records)


def test_qlora_steps_on_latent_attention_whose_query_is_held_quantized(tmp_path):
    """Kimi Linear's MLA layers have no q_lora: their query projection has attention's name
    (wq_dnh), so an NF4 base holds it quantized, and the MLA reads it dequantized as attention
    does (it reached the product as a QArray and the step failed to trace)."""
    import qwix

    from engine.config import load_config
    from engine.train.config import TrainConfig
    from engine.train.trainer import Trainer

    tree = {
        "model": "tiny-kimi-linear",
        "compute": {"dtype": "float32"},
        "mesh": {"data": 1},
        "data": {"batch_size": 2, "seq_len": 12},
        "optimizer": {"learning_rate": 1e-2},
        "steps": 2,
    }
    base_cfg = load_config(tree=dict(tree), schema=TrainConfig)
    params = jax.device_get(Trainer(base_cfg, devices=jax.devices()[:1]).init_state().params)
    ckpt = Checkpointer(tmp_path / "base", async_save=False)
    meta = {"step": 0, "model": base_cfg.model.model_dump(mode="json"), "format": "trainflow.checkpoint/1"}
    ckpt.save(0, params, {"unused": np.zeros((), np.int32)}, meta, {})
    ckpt.close()
    lora = {"rank": 2, "alpha": 4, "target_modules": "all-linear", "base_dtype": "nf4"}
    init = {"init_from": str(tmp_path / "base")}
    cfg = load_config(tree={**tree, "lora": lora, "checkpoint": init}, schema=TrainConfig)
    trainer = Trainer(cfg, devices=jax.devices()[:1])
    quantized = jax.tree_util.tree_leaves_with_path(trainer.load_base(), is_leaf=lambda x: isinstance(x, qwix.QArray))
    assert any(isinstance(v, qwix.QArray) and "wq_dnh" in jax.tree_util.keystr(p) for p, v in quantized)
    state = trainer.init_state()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (2, 13)).astype(np.int32)
    batch = trainer.global_batch(
        {
            "tokens": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "positions": np.tile(np.arange(12, dtype=np.int32), (2, 1)),
            "segment_ids": np.ones((2, 12), np.int32),
            "loss_mask": np.ones((2, 12), np.float32),
        }
    )
    adapter, opt_state, first = trainer.train_step(state.params, state.opt_state, batch)
    _, _, second = trainer.train_step(adapter, opt_state, batch)
    assert np.isfinite(float(first["loss"])) and np.isfinite(float(second["loss"]))
