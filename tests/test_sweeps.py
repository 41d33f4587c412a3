"""Sweeps, selections, gates and checkpoint-step inputs (flows/sweep.py, flows/gates.py,
flows/steps.py) with the cheap stage kinds of tests/sweep_toys.py, on the session's real
Prefect server, on a local store and on the moto S3 store: what ran is counted in each
toy's trace file, what Prefect recorded is read back through its client."""

import json
import threading
import time
from pathlib import Path

import pytest
import yaml

import tests.sweep_toys  # noqa: F401
from engine.config import ConfigError
from flows.cli import main
from flows.pipeline import Pipeline, run_plan
from flows.spec import load_plan
from tasks.store.records import read_manifest
from tests.conftest import REPO, child_xla_flags
from tests.test_grpo import _CheckpointCopy  # noqa: F401  (registers test-checkpoint-copy)
from tests.test_object_store import bucket, s3_endpoint  # noqa: F401  (the moto server and a bucket per test)
from tests.test_pipeline_flow import artifacts_of, flow_run_of, task_runs_of
from tests.test_sft import base  # noqa: F401  (a random tiny checkpoint artifact, with its tokenizer)

pytestmark = pytest.mark.slow

LRS = [1e-5, 3e-4]
RANKS = [8, 16]


def sweep_yaml(path: Path, store: Path, trace: Path, lrs=LRS, ranks=RANKS, threshold=1.0, best_lr=1e-3) -> Path:
    """base -> sft (lr x rank) -> evaluate (fan-in); best (select) -> export (gated on best's
    own eval_loss: |lr - 3e-4| x 1000 + 1/rank, 0.95 at its default lr 1e-3 and rank 4)."""
    spec = {
        "name": "sweep",
        "store": str(store),
        "imports": ["tests.sweep_toys"],
        "defaults": {"config": {"toy-train": {"trace": str(trace)}, "toy-eval": {"trace": str(trace)}}},
        "stages": {
            "base": {"task": "toy-train", "config": {"steps": 2}},
            "sft": {
                "task": "toy-train",
                "inputs": {"checkpoint": "base"},
                "matrix": {"optimizer.learning_rate": lrs, "lora.rank": ranks},
                "max_parallel": 2,
                "config": {"steps": 3, "step_seconds": 0.2, "slots": str(path.parent / "slots")},
            },
            "evaluate": {"task": "toy-eval", "inputs": {"models": "sft[*]"}},
            "best": {
                "task": "toy-train",
                "inputs": {"checkpoint": {"select": {"from": "sft[*]", "by": "metrics.eval_loss", "best": "min"}}},
                "config": {"optimizer": {"learning_rate": best_lr}},
            },
            "export": {
                "task": "toy-eval",
                "inputs": {"model": "best"},
                "when": f'best.metrics["eval_loss"] < {threshold} '
                'and evaluate.metrics["models[lr=0.0003,rank=8]/step"] == 3',
            },
        },
    }
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def ran(trace: Path) -> list[str]:
    return trace.read_text().split() if trace.is_file() else []


def statuses(result: dict) -> dict[str, str]:
    return {name: r["status"] for name, r in result.items()}


def test_points_are_named_by_their_labels_and_fan_in_as_one_input_each(tmp_path):
    plan = load_plan(sweep_yaml(tmp_path / "p.yaml", tmp_path / "store", tmp_path / "trace"))
    points = [f"sft[lr={lr!r},rank={rank}]" for lr in LRS for rank in RANKS]
    assert list(plan.stages) == ["base", *points, "evaluate", "best", "export"]
    assert plan.stages["sft[lr=1e-05,rank=8]"].job.config.optimizer.learning_rate == 1e-5
    assert plan.stages["sft[lr=1e-05,rank=8]"].params == {"lr": 1e-5, "rank": 8}
    assert {n: up for n, (up, _) in plan.stages["evaluate"].job.inputs.items()} == {
        f"models[{p[4:-1]}]": p for p in points
    }
    assert len({plan.stages[p].job.artifact_id for p in points}) == 4
    status = plan.status()
    assert status["best"]["state"] == "pending (selection)" and status["export"]["state"] == "pending (selection)"


def test_a_stage_reading_a_sweep_fans_out_and_a_matrix_may_range_over_inputs(tmp_path):
    p = Pipeline("fan", store=tmp_path / "store")
    p.stage("a", task="toy-train")
    p.stage("b", task="toy-train", config={"steps": 2})
    p.stage("sft", task="toy-train", inputs={"checkpoint": "a"}, matrix={"lora.rank": [8, 16]})
    # One per point, same labels; its gate reads its own point of the sweep.
    p.stage("grpo", task="toy-train", inputs={"checkpoint": "sft"}, when="sft.metrics['eval_loss'] < 1")
    p.stage("probe", task="toy-eval", inputs={"m": "grpo[rank=16]"})
    p.stage("again", task="toy-train", matrix={"inputs.checkpoint": ["a", "b"], "steps": [1, 3]})
    plan = p.plan()
    assert [n for n in plan.stages if n.startswith("grpo")] == ["grpo[rank=8]", "grpo[rank=16]"]
    assert plan.stages["grpo[rank=16]"].job.inputs["checkpoint"][0] == "sft[rank=16]"
    assert plan.stages["grpo[rank=16]"].gate_stages == {"sft": "sft[rank=16]"}
    assert plan.stages["probe"].depends_on == ["grpo[rank=16]"]
    again = {n: plan.stages[n].job.inputs["checkpoint"][0] for n in plan.stages if n.startswith("again")}
    assert again == {
        "again[checkpoint=a,steps=1]": "a",
        "again[checkpoint=a,steps=3]": "a",
        "again[checkpoint=b,steps=1]": "b",
        "again[checkpoint=b,steps=3]": "b",
    }


def test_the_shipped_sweep_expands_real_sft_configs_into_named_points():
    plan = load_plan(REPO / "configs" / "pipelines" / "sweep.yaml")
    points = [name for name in plan.stages if name.startswith("sft[")]
    assert points == [f"sft[lr={lr},rank={rank}]" for lr in ("0.001", "0.005") for rank in (8, 16)]
    config = plan.stages["sft[lr=0.005,rank=16]"].job.config
    assert (config.optimizer.learning_rate, config.lora.rank, config.lora.alpha) == (5e-3, 16, 32)
    assert plan.stages["sft[lr=0.005,rank=16]"].job.kind.output_kind(config) == "adapter"
    assert plan.stages["early"].follows == ["pretrain"] and plan.stages["early"].depends_on == ["tokenize"]
    assert plan.stages["early"].job.inputs["pretrain"][0] == "pretrain@100"
    assert plan.status()["export"]["state"] == "pending (selection)"


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"matrix": {"optimizer.lerning_rate": [1e-5]}},
            "p.yaml: stages.sft.matrix.optimizer.lerning_rate: 'optimizer.lerning_rate' is not a config key of "
            "this stage (did you mean 'optimizer.learning_rate'?)",
        ),
        ({"matrix": {}}, "p.yaml: stages.sft.matrix: is empty"),
        ({"matrix": {"lora.rank": []}}, "p.yaml: stages.sft.matrix.lora.rank: needs a non-empty list of values"),
        (
            {"when": "evaluat.metrics['x'] > 1"},
            "p.yaml: stages.sft.when: names stage 'evaluat', which is not in the pipeline; did you mean 'evaluate'?",
        ),
        ({"when": "base.metrics['x'] + 1 > 1"}, "p.yaml: stages.sft.when: 'base.metrics['x'] + 1' is a BinOp"),
        ({"when": "__import__('os').system('true')"}, "is a Call"),
        ({"inputs": {"checkpoint": "base@3"}}, "stage 'base' trains for 2 steps; pick a step in 1..2"),
    ],
)
def test_bad_sweeps_and_gates_are_one_sentence_naming_the_file_and_key(tmp_path, capsys, change, message):
    path = sweep_yaml(tmp_path / "p.yaml", tmp_path / "store", tmp_path / "trace")
    spec = yaml.safe_load(path.read_text())
    spec["stages"]["sft"].update(change)
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError):
        load_plan(path)
    assert main(["status", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message.replace("p.yaml", str(path)) in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "store").exists()  # nothing ran, nothing was written


def test_a_sweep_fans_in_selects_the_best_gates_and_grows_running_only_new_points(prefect_server, tmp_path):
    store, trace = tmp_path / "store", tmp_path / "trace"
    first = run_plan(load_plan(sweep_yaml(tmp_path / "p.yaml", store, trace)))
    points = [f"sft[lr={lr!r},rank={rank}]" for lr in LRS for rank in RANKS]
    assert statuses(first) == {
        "base": "ran",
        **dict.fromkeys(points, "ran"),
        "evaluate": "ran",
        "best": "ran",
        "export": "ran",
    }
    # max_parallel: 2 -> no more than two points ever worked at once.
    assert max(first[p]["metrics"]["concurrent"] for p in points) <= 2
    # The selection took the point with the lowest eval_loss (lr=3e-4, rank=16) and says so in the lineage.
    assert first["best"]["selected"] == {"checkpoint": "sft[lr=0.0003,rank=16]"}
    best = json.loads((Path(first["best"]["path"]) / "artifact.json").read_text())
    assert best["parents"][0]["stage"] == "sft[lr=0.0003,rank=16]"
    chosen = best["decisions"]["select"]["checkpoint"]
    assert chosen["chosen"] == "sft[lr=0.0003,rank=16]" and set(chosen["values"]) == set(points)
    gate = json.loads((Path(first["export"]["path"]) / "artifact.json").read_text())["decisions"]["when"]
    assert gate["result"] is True and gate["values"]["best.metrics['eval_loss']"] == pytest.approx(0.95)

    # One task run per point, its parameters in its name and tags; the fan-in's sweep summary.
    flow_run = flow_run_of(first)
    runs = task_runs_of(flow_run.id)
    assert set(points) <= set(runs)
    assert {"sweep:sft", "lr=1e-05", "rank=16", "stage:sft[lr=1e-05,rank=16]"} <= set(
        runs["sft[lr=1e-05,rank=16]"].tags
    )
    by_key = {a.key: a for a in artifacts_of(flow_run.id)}
    table = by_key["sweep-evaluate-sweep-table"]
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert [row["point"] for row in rows] == points and {row["lr"] for row in rows} == set(LRS)
    assert "data:image/png;base64," in by_key["sweep-evaluate-sweep"].data
    assert "## evaluate: sweep over models (4 points)" in by_key["sweep-evaluate"].data  # its summary page too

    # A 3 x 2 grid: the four points it had are skipped, only the two new ones run.
    before = len(ran(trace))
    grown = run_plan(load_plan(sweep_yaml(tmp_path / "p.yaml", store, trace, lrs=[*LRS, 1e-3])))
    new = [f"sft[lr=0.001,rank={rank}]" for rank in RANKS]
    assert [s for s in ran(trace)[before:] if s.startswith("sft")] == sorted(new, key=ran(trace)[before:].index)
    assert {p: grown[p]["status"] for p in points + new} == {
        **dict.fromkeys(points, "skipped"),
        **dict.fromkeys(new, "ran"),
    }
    assert grown["evaluate"]["status"] == "ran" and grown["best"]["status"] == "skipped"  # the same point is best


def test_the_printed_sweep_table_fits_a_log_view_and_keeps_every_value():
    """`trainflow run` prints a fan-in's sweep table: a point per row, as many metrics as its
    stages report (a real SFT point's, below), every line at most 160 characters wide."""
    from flows.sweep_report import table_text

    metrics = [
        "compile_seconds", "eval_loss", "eval_perplexity", "eval_tokens", "loss", "grad_norm", "learning_rate",
        "tokens_per_second", "tflops_per_device", "mfu", "steps", "final_loss", "num_params", "tokens",
        "peak_flops", "train_examples", "eval_examples",
    ]  # fmt: skip
    rows = [
        {"point": f"sft[lr={lr},rank={rank}]", "lr": lr, "rank": rank, "artifact_id": "0123456789abcdef"}
        | {m: (i + 1) * 1234.5678 + j for j, m in enumerate(metrics)}
        for i, (lr, rank) in enumerate((lr, rank) for lr in (1e-5, 3e-4, 0.001) for rank in (8, 16))
    ]
    text = table_text(rows, ["lr", "rank"])
    assert max(len(line) for line in text.splitlines()) <= 160, text
    headers = [line.split() for line in text.splitlines() if line.startswith("point ")]
    assert len(headers) > 1 and sorted(m for h in headers for m in h[1:]) == sorted(metrics)
    for row in rows:  # each point's values, in the tables that show its metrics
        shown = [line.split() for line in text.splitlines() if line.startswith(row["point"] + " ")]
        assert [v for line in shown for v in line[1:]] == [f"{row[m]:,.0f}" for h in headers for m in h[1:]]


def test_a_false_gate_skips_records_what_it_saw_then_runs_after_a_config_change(prefect_server, tmp_path, capsys):
    store, trace = tmp_path / "store", tmp_path / "trace"
    path = sweep_yaml(tmp_path / "p.yaml", store, trace, lrs=[1e-5], ranks=[8], threshold=0.5)
    spec = yaml.safe_load(path.read_text())
    spec["stages"]["export"]["when"] = 'best.metrics["eval_loss"] < 0.5'
    # A stage reading a skipped one is skipped too.
    spec["stages"]["after"] = {"task": "toy-eval", "inputs": {"model": "best"}, "when": "export.config.trace != ''"}
    path.write_text(yaml.safe_dump(spec))
    first = run_plan(load_plan(path))
    assert first["export"]["status"] == "skipped (condition)" and first["after"]["status"] == "skipped (condition)"
    assert first["export"]["condition"]["values"] == {"best.metrics['eval_loss']": pytest.approx(0.95)}
    assert "export" not in ran(trace) and "after" not in ran(trace)
    assert main(["status", str(path)]) == 0
    table = capsys.readouterr().out
    assert any(line.startswith("export ") and "skipped (condition)" in line for line in table.splitlines()), table

    # best's learning rate 1e-3 -> 3e-4: its eval_loss 0.25 < 0.5, the gate opens.
    spec["stages"]["best"]["config"] = {"optimizer": {"learning_rate": 3e-4}}
    path.write_text(yaml.safe_dump(spec))
    second = run_plan(load_plan(path))
    assert second["export"]["status"] == "ran" and second["after"]["status"] == "ran"
    assert "export" in ran(trace)
    assert main(["status", str(path)]) == 0
    assert "skipped (condition)" not in capsys.readouterr().out


def test_a_checkpoint_step_feeds_a_stage_while_its_trainer_still_runs(prefect_server, tmp_path):
    hold = tmp_path / "hold"
    p = Pipeline("steps", store=tmp_path / "store")
    p.stage("pretrain", task="toy-train", config={"steps": 4, "every": 2, "hold": str(hold)})
    p.stage("early", task="toy-eval", inputs={"model": "pretrain@2"})
    plan = p.plan()
    early_dir = plan.store.artifact_dir("early", plan.stages["early"].job.artifact_id)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(run_plan(p.plan())))
    runner.start()
    try:
        deadline = time.monotonic() + 120
        while (
            not (early_dir / "artifact.json").is_file() or "complete" not in (early_dir / "artifact.json").read_text()
        ):
            assert time.monotonic() < deadline, "the step's consumer never finished"
            time.sleep(0.1)
        # The consumer is done while pretrain still holds its lock, waiting for `hold`.
        assert plan.status()["pretrain"]["state"] == "running"
        report = json.loads((early_dir / "report.json").read_text())
        assert report == {"model/step": 2, "model/weight": 2.0}
    finally:
        hold.touch()
        runner.join(timeout=120)
    assert statuses(result) == {"pretrain": "ran", "early": "ran"}
    early = json.loads((early_dir / "artifact.json").read_text())
    assert early["parents"][0]["stage"] == "pretrain@2"
    snapshot = plan.store.artifact_dir("pretrain@2", plan.stages["pretrain"].job.artifact_id)
    assert json.loads((snapshot / "artifact.json").read_text())["parents"][0]["stage"] == "pretrain"
    assert sorted(p.name for p in (snapshot / "checkpoint").iterdir()) == ["2"]


def test_sweep_selection_gates_and_a_step_input_on_the_s3_store(prefect_server, bucket, tmp_path, capsys):  # noqa: F811
    store = f"s3://{bucket}/artifacts"
    p = Pipeline("s3sweep", store=store)
    p.stage("base", task="toy-train", config={"steps": 2})
    p.stage("early", task="toy-eval", inputs={"model": "base@1"})
    p.stage("sft", task="toy-train", inputs={"checkpoint": "base"}, matrix={"lora.rank": [8, 16]})
    p.stage("evaluate", task="toy-eval", inputs={"models": "sft[*]"})
    best = {"select": {"from": "sft[*]", "by": "metrics.eval_loss", "best": "min"}}
    p.stage("best", task="toy-train", inputs={"checkpoint": best})
    p.stage("yes", task="toy-eval", inputs={"m": "best"}, when="evaluate.metrics['models[rank=16]/step'] == 1")
    p.stage("no", task="toy-eval", inputs={"m": "best"}, when="best.metrics['eval_loss'] < 0.5")
    result = p.run()
    assert statuses(result) == {
        "base": "ran",
        "early": "ran",
        "sft[rank=8]": "ran",
        "sft[rank=16]": "ran",
        "evaluate": "ran",
        "best": "ran",
        "yes": "ran",
        "no": "skipped (condition)",
    }
    plan = p.plan()
    manifest = plan.store.manifest("best", result["best"]["artifact_id"])  # read from the bucket
    assert manifest["decisions"]["select"]["checkpoint"]["chosen"] == "sft[rank=16]"
    assert plan.store.manifest("yes", result["yes"]["artifact_id"])["decisions"]["when"]["result"] is True
    assert plan.store.manifest("early", result["early"]["artifact_id"])["parents"][0]["stage"] == "base@1"
    assert plan.store.is_complete("base@1", result["base"]["artifact_id"])
    assert plan.status()["no"]["state"] == "skipped (condition)"  # the record is in the bucket


# --------------------------------------------------------------------------- real stages

# One device and LLVM -O0 in the children, as the test process compiles (tests/conftest.py): the
# fastest compile.
ONE_DEVICE = {"kind": "local", "env": {"XLA_FLAGS": child_xla_flags()}}
COLOURS = ["red", "green", "blue"]


def real_sweep(store: Path, base: Path, data: Path, seeds: list[int]) -> Pipeline:
    """A real sft sweep (data order x steps) over the tiny model, fanned into one evaluate.
    Neither key changes the compiled step (a constant schedule keeps `steps` out of it): every
    point after the first loads it from the JAX compilation cache."""
    p = Pipeline("realsweep", store=store)
    p.stage("base", task="test-checkpoint-copy", config={"path": str(base)})
    p.stage(
        "sft",
        task="sft",
        inputs={"checkpoint": "base"},
        launcher=ONE_DEVICE,
        matrix={"data.seed": seeds, "steps": [2, 3]},
        max_parallel=2,
        config={
            "data": {"path": str(data), "seq_len": 32, "batch_size": 4},
            "optimizer": {"learning_rate": 1e-2},
            "schedule": {"kind": "constant"},
            "log_every": 1,
        },
    )
    p.stage("evaluate", task="evaluate", inputs={"models": "sft[*]"}, launcher=ONE_DEVICE)
    return p


def test_a_real_sft_sweep_fans_into_one_evaluate_and_a_grown_grid_trains_only_its_new_points(
    prefect_server, base, tmp_path
):
    data = tmp_path / "colours.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"colour {i % 3}:", "completion": f" {COLOURS[i % 3]}"}) + "\n" for i in range(12)
        )
    )
    store = tmp_path / "store"
    first = real_sweep(store, base, data, [0]).run()
    points = [f"sft[seed=0,steps={steps}]" for steps in (2, 3)]
    assert statuses(first) == {"base": "ran", **dict.fromkeys(points, "ran"), "evaluate": "ran"}
    # A point's folder has no glob characters (Orbax globs in a checkpoint's step directory).
    assert Path(first["sft[seed=0,steps=2]"]["path"]).parent == store / "sft(seed=0,steps=2)"

    grown = real_sweep(store, base, data, [0, 1]).run()
    new = [f"sft[seed=1,steps={steps}]" for steps in (2, 3)]
    assert statuses(grown) == {
        "base": "skipped",
        **dict.fromkeys(points, "skipped"),
        **dict.fromkeys(new, "ran"),
        "evaluate": "ran",
    }
    # The two points it had are the first run's artifacts.
    assert {p: grown[p]["artifact_id"] for p in points} == {p: first[p]["artifact_id"] for p in points}
    # The evaluate's report has every point, each at the step its own config trained to.
    evaluate = Path(grown["evaluate"]["path"])
    report = json.loads((evaluate / "report.json").read_text())
    want = {f"models[{p[4:-1]}]": int(p[-2]) for p in points + new}
    assert {name: metrics["step"] for name, metrics in report["models"].items()} == want
    rows = read_manifest(evaluate)["decisions"]["sweep"]["models"]
    assert [row["point"] for row in rows] == [f"sft[seed={seed},steps={s}]" for seed in (0, 1) for s in (2, 3)]
