"""Fine-tuning stages on more than one process: 2 processes x 1 device give what 1 x 2 gives.

Split from tests/test_multihost.py (pretraining's layouts, SIGTERM and SIGKILL across ranks),
which it shares its helpers with, so that `pytest -n 2 --dist loadfile` runs the two halves
side by side.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from engine.posttrain.reward_model import load_reward_params
from engine.train.checkpoint import load_adapter
from tasks.launch.run import run_child
from tests.test_multihost import launcher, params

pytestmark = pytest.mark.slow


def adapter(out: Path) -> dict[str, np.ndarray]:
    """A LoRA run's saved A and B by key path (not load_params: that folds them into the base)."""
    leaves = jax.tree_util.tree_flatten_with_path(load_adapter(out / "checkpoint")[2])[0]
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in leaves}


@pytest.fixture(scope="module")
def copy_task(tmp_path_factory) -> Path:
    """A random 2-layer checkpoint artifact, a character tokenizer, prompts and SFT examples."""
    from flax import nnx
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from engine.data.tokenizer import TokenizerBundle, save_tokenizer
    from engine.models.config import ModelConfig
    from engine.models.transformer import Transformer
    from engine.train.checkpoint import Checkpointer

    out = tmp_path_factory.mktemp("copy_task")
    digits = [str(d) for d in range(10)]
    tok = Tokenizer(
        models.WordLevel(
            {"<pad>": 0, "<eos>": 1, **{d: i + 2 for i, d in enumerate(digits)}, "=": 12}, unk_token="<pad>"
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<pad>", "<eos>"])
    save_tokenizer(TokenizerBundle(tok, eos_token="<eos>", pad_token="<pad>"), out / "tokenizer")
    cfg = ModelConfig(
        vocab_size=16, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=16
    )
    checkpointer = Checkpointer(out / "checkpoint", async_save=False)
    checkpointer.save(
        0,
        nnx.to_pure_dict(nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1]),
        {"unused": np.zeros((), np.int32)},
        {"step": 0, "model": cfg.model_dump(mode="json")},
        {},
    )
    checkpointer.close()
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{d}=", "answer": d}) + "\n" for d in digits))
    (out / "sft.jsonl").write_text("".join(json.dumps({"prompt": f"{d}=", "completion": d}) + "\n" for d in digits))
    (out / "prefs.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{d}=", "chosen": d, "rejected": str((int(d) + 1) % 10)}) + "\n" for d in digits)
    )
    return out


STAGES = ["sft", "grpo", "sft-lora", "dpo", "distill", "reward_model"]
REPO = Path(__file__).resolve().parents[1]


def stage_config(copy_task: Path, stage: str, out: Path) -> Path:
    """`out`/run.yaml: the run of `stage` (an engine.posttrain module, `-lora` for a LoRA run)."""
    stage, _, variant = stage.partition("-")
    cfg = {
        "checkpoint": {
            "init_from": str(copy_task / "checkpoint"),
            "directory": str(out / "checkpoint"),
            "every_steps": 100,
            "async_save": False,
        },
        "tokenizer": str(copy_task / "tokenizer"),
        "metrics_dir": str(out),
        "progress": False,
        "mesh": {"data": 2},
        "log_every": 1,
    }
    if stage == "grpo":
        cfg.update(
            data={"path": str(copy_task / "prompts.jsonl")},
            optimizer={"learning_rate": 2e-2},
            steps=3,
            rewards=[{"function": "exact_match", "kwargs": {"pattern": r"^(\d)"}}],
            prompts_per_step=4,
            num_generations=4,
            max_prompt_length=2,
            max_completion_length=2,
        )
    elif stage == "distill":  # on- and off-policy steps; the teacher here is the start model itself
        cfg.update(
            data={"path": str(copy_task / "sft.jsonl"), "seq_len": 8, "batch_size": 4, "eval_fraction": 0.2},
            teacher={"checkpoint": str(copy_task / "checkpoint")},
            lmbda=0.5,
            seed=1,
            max_new_tokens=2,
            steps=4,
            eval_every=2,
            optimizer={"learning_rate": 1e-2},
        )
    elif stage in ("dpo", "reward_model"):
        cfg.update(
            data={
                "path": str(copy_task / "prefs.jsonl"),
                "max_prompt_length": 2,
                "max_length": 4,
                "batch_size": 4,
                "eval_fraction": 0.2,
            },
            steps=4,
            eval_every=2,
            optimizer={"learning_rate": 1e-2},
        )
    else:
        cfg.update(
            data={"path": str(copy_task / "sft.jsonl"), "seq_len": 8, "batch_size": 4, "eval_fraction": 0.2},
            steps=4,
            eval_every=2,
        )
    if variant == "lora":
        cfg.update(
            lora={"rank": 4, "alpha": 8, "target_modules": "all-linear"}, optimizer={"learning_rate": 2e-2}
        )  # the default 2e-5 barely moves B from zero in 4 steps
    out.mkdir(parents=True)
    (out / "run.yaml").write_text(yaml.safe_dump(cfg))
    return out / "run.yaml"


@pytest.fixture(scope="module")
def fine_tuned(copy_task, tmp_path_factory) -> dict[tuple[str, int], Path | BaseException]:
    """Every stage of STAGES on 1 process x 2 devices and on 2 x 1: (stage, processes) -> its
    output folder, or the error that ended its layout's run first. The stages of one layout run
    one after another in one process per rank (tests/mh_driver.py): a process start (imports,
    jax.distributed's join, the backend) per rank, not per stage and rank."""
    runs: dict[tuple[str, int], Path | BaseException] = {}
    for processes, devices in ((1, 2), (2, 1)):
        root = tmp_path_factory.mktemp(f"{processes}x{devices}")
        outs = {stage: root / stage for stage in STAGES}
        argv = [
            f"engine.posttrain.{stage.partition('-')[0]}={stage_config(copy_task, stage, out)}"
            for stage, out in outs.items()
        ]
        lines: list[str] = []
        try:
            run_child(
                [sys.executable, "-m", "tests.mh_driver", *argv],
                launcher=launcher(processes, devices),
                log=lines.append,
                cwd=REPO,
            )
            error = None
        except Exception as e:  # noqa: BLE001 (the stages that finished are still compared)
            error = e
        for stage, out in outs.items():  # a stage that did not finish carries the error
            done = any(line.endswith(f" {out / 'run.yaml'}") and "mh_driver: finished" in line for line in lines)
            runs[stage, processes] = out if done or error is None else error
    return runs


@pytest.mark.parametrize("stage", STAGES)
def test_fine_tuning_on_two_processes_equals_one(fine_tuned, stage):
    """SFT's packed rows and held-out loss, GRPO's rollouts (sampled on every process from the
    same seed), rewards and updates: the same on 2 processes x 1 device as on 1 x 2. With a
    LoRA section the saved adapter (on the frozen base) is what must agree. DPO's pair rows and
    its reference's log-probs (computed on every process's share of the rows) too."""
    results = {}
    for processes in (1, 2):
        out = fine_tuned[stage, processes]
        if isinstance(out, BaseException):
            raise out
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        timings = ("_seconds", "tokens_per_second", "tflops_per_device", "mfu")
        if stage == "reward_model":  # the decoder and its scalar head
            trained = [np.asarray(a) for a in jax.tree.leaves(load_reward_params(out / "checkpoint")[2])]
        else:
            trained = list(adapter(out).items()) if stage.endswith("-lora") else params(out)
        results[processes] = ([{k: v for k, v in r.items() if not k.endswith(timings)} for r in records], trained)
    (one, one_params), (two, two_params) = results[1], results[2]
    assert [r["step"] for r in one] == [r["step"] for r in two] and len(one) >= 3
    for a, b in zip(one, two):
        assert a.keys() == b.keys()
        values = [[np.nan if r[k] is None else r[k] for k in sorted(r)] for r in (a, b)]  # None: not finite
        np.testing.assert_allclose(*values, rtol=1e-6, atol=1e-7)
    if stage.endswith("-lora"):  # A and B of 7 projections; B starts at zero, so nonzero B means it trained
        assert [k for k, _ in one_params] == [k for k, _ in two_params] and len(one_params) == 2 * 7
        assert all(np.abs(b).max() > 1e-4 for k, b in one_params if k.endswith("_lora_b']")), one_params
        one_params, two_params = [b for _, b in one_params], [b for _, b in two_params]
    for a, b in zip(one_params, two_params):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
