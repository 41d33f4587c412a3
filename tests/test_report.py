"""The evaluation report: what each metric was measured on, equal columns merged, samples
right and wrong with their reference, and its plots looked at as images (sizes, panels)."""

import json

import pytest
from PIL import Image

from engine.evaluate.config import EvalConfig
from engine.evaluate.report import (
    chosen_samples,
    equal_columns,
    headline_metrics,
    loss_curves_figure,
    markdown_table,
    metrics_figure,
    panel_keys,
    training_curve,
    write_report,
)

MODELS = {
    "pretrain": {
        "eval_loss": 0.772,
        "eval_perplexity": 2.164,
        "arithmetic/accuracy": 0.0,
        "arithmetic/pass@1": 0.0,
        "arithmetic/reward/correct": 0.0,
        "arithmetic/prompts": 4,
    },
    "sft[learning_rate=0.001,lora.rank=16]": {
        "eval_loss": 2.114,
        "eval_perplexity": 8.28,
        "arithmetic/accuracy": 0.5,
        "arithmetic/pass@1": 0.5,
        "arithmetic/reward/correct": 0.5,
        "arithmetic/prompts": 4,
    },
    "grpo": {
        "eval_loss": 2.13,
        "eval_perplexity": 8.417,
        "arithmetic/accuracy": 0.75,
        "arithmetic/pass@1": 0.75,
        "arithmetic/reward/correct": 0.75,
        "arithmetic/prompts": 4,
    },
}


def test_grpo_stages_plot_their_reward_and_others_their_loss():
    grpo = [{"step": 1, "reward": 0.25, "loss": 0.004}, {"step": 2, "reward": 0.5, "loss": -0.01}]
    pretrain = [{"step": 25, "loss": 3.0}, {"step": 25, "eval_loss": 2.9}, {"step": 50, "loss": 2.0}]
    assert training_curve(grpo) == ("mean reward", [(1, 0.25), (2, 0.5)])
    assert training_curve(pretrain) == ("training loss", [(25, 3.0), (50, 2.0)])


def test_a_metric_equal_to_an_earlier_one_for_every_model_gets_no_second_panel():
    models = {
        "sft": {
            "eval_loss": 2.1,
            "eval_perplexity": 8.2,
            "arithmetic/accuracy": 0.5,
            "arithmetic/pass@1": 0.5,
            "arithmetic/reward/correct": 0.5,
            "arithmetic/reward/length": 0.1,
        },
        "grpo": {
            "eval_loss": 2.2,
            "eval_perplexity": 8.6,
            "arithmetic/accuracy": 0.57,
            "arithmetic/pass@1": 0.57,
            "arithmetic/reward/correct": 0.57,
            "arithmetic/reward/length": 0.2,
        },
    }
    assert panel_keys(models) == ["eval_loss", "arithmetic/accuracy", "arithmetic/reward/length"]
    models["grpo"]["arithmetic/pass@1"] = 0.6  # differs for one model: it gets its panel
    assert "arithmetic/pass@1" in panel_keys(models)


def test_tensorboard_tags_are_grouped_and_metrics_jsonl_keeps_its_keys(tmp_path):
    import tensorflow as tf

    from engine.train.metrics import MetricsWriter, read_metrics

    writer = MetricsWriter(tmp_path)
    writer.write(
        5,
        {
            "loss": 2.0,
            "eval_loss": 2.5,
            "tokens_per_second": 900.0,
            "reward": 0.5,
            "reward/correct/mean": 0.5,
            "completion_length": 4.0,
            "rollout_seconds": 0.6,
            "clip_ratio": 0.0,
        },
    )
    writer.close()
    assert set(read_metrics(tmp_path)[0]) == {
        "step",
        "loss",
        "eval_loss",
        "tokens_per_second",
        "reward",
        "reward/correct/mean",
        "completion_length",
        "rollout_seconds",
        "clip_ratio",
    }
    tags = {
        value.tag
        for path in (tmp_path / "tensorboard").iterdir()
        for event in tf.compat.v1.train.summary_iterator(str(path))
        for value in event.summary.value
    }
    assert tags == {
        "train/loss",
        "eval/loss",
        "perf/tokens_per_second",
        "reward/reward",
        "reward/correct/mean",
        "rollout/completion_length",
        "perf/rollout_seconds",
        "train/clip_ratio",
    }


EVAL_CFG = EvalConfig.model_validate(
    {
        "data_path": "/store/tokenize/1f0da58d/data",
        "loss_batches": 4,
        "tasks": [
            {
                "name": "arithmetic",
                "path": "/store/problems/0c472657/eval.jsonl",
                "max_new_tokens": 6,
                "rewards": [{"function": "exact_match", "name": "correct"}],
            }
        ],
    }
)
ABOUT = {
    "data": "dataset tokenize/1f0da58d (sources: arithmetic), held out from the text that pretrain trained on",
    "data_label": "tokenize:validation",
    "paths": {"/store/problems/0c472657": "problems/0c472657"},
}


def test_equal_columns_are_shown_once_and_each_metric_names_its_data():
    columns = equal_columns(MODELS, headline_metrics(MODELS))
    assert columns == {
        "eval_loss": [],
        "eval_perplexity": [],
        "arithmetic/accuracy": ["arithmetic/pass@1", "arithmetic/reward/correct"],
    }
    header = markdown_table(MODELS, columns, "tokenize:validation").splitlines()[0]
    assert header == (
        "| model | eval_loss (tokenize:validation) | eval_perplexity (tokenize:validation) "
        "| arithmetic/accuracy (= pass@1 = reward/correct) |"
    )


def _sample(prompt: str, answer: str, completion: str) -> dict:
    right = completion.strip() == answer
    return {
        "task": "arithmetic",
        "prompt": prompt,
        "completion": completion,
        "rewards": {"correct": float(right)},
        "correct": right,
        "reference": {"answer": answer},
    }


SAMPLES = [
    _sample("Q: 1+1=? A:", "2", " 3"),
    _sample("Q: 2+2=? A:", "4", " 5"),
    _sample("Q: 3+3=? A:", "6", " 7"),
    _sample("Q: 4+4=? A:", "8", " 8"),
]


def test_samples_show_right_and_wrong_answers_with_the_reference(tmp_path):
    # The first three are wrong: the first three shown must still include the right one.
    assert [s["correct"] for s in chosen_samples(SAMPLES, 3)] == [False, True, False]
    assert [s["correct"] for s in chosen_samples(SAMPLES[:3], 2)] == [False, False]  # none right: all wrong

    report = write_report(tmp_path, EVAL_CFG, MODELS, {"grpo": SAMPLES}, {}, {}, about=ABOUT)
    text = (tmp_path / "report.md").read_text()
    assert "## Samples: grpo (1 of 4 completions right)" in text
    assert "**right** (arithmetic; reference answer: 8;" in text and "Q: 4+4=? A: 8" in text
    assert "**wrong** (arithmetic; reference answer: 2;" in text
    # What each metric was measured on, in the report and its JSON.
    assert report["measured_on"] == {
        "eval_loss, eval_perplexity": "next-token loss on 4 batches of 8 x 128 tokens of the `validation` split of "
        + ABOUT["data"],
        "arithmetic/*": "4 prompts of problems/0c472657/eval.jsonl, 1 completion(s) each (greedy, at most 6 new "
        "tokens); correct: reward `correct` >= 1",
    }
    assert f"- `eval_loss, eval_perplexity`: {report['measured_on']['eval_loss, eval_perplexity']}" in text
    assert "- `arithmetic/pass@1`, `arithmetic/reward/correct`: equal to `arithmetic/accuracy`" in text
    assert json.loads((tmp_path / "report.json").read_text())["equal_columns"] == {
        "arithmetic/accuracy": ["arithmetic/pass@1", "arithmetic/reward/correct"]
    }


def _curves(tmp_path) -> dict:
    """A quickstart with a 4-point SFT sweep: 7 training stages, loss, held-out loss, reward."""
    curves = {}
    stages = ["pretrain", *(f"sft[learning_rate={lr}]" for lr in ("1e-4", "3e-4", "1e-3", "3e-3")), "grpo", "grpo2"]
    for i, stage in enumerate(stages):
        path = tmp_path / f"{i}.jsonl"
        records = []
        for step in range(5, 305, 5):
            if stage.startswith("grpo"):
                records.append({"step": step, "loss": 0.01, "reward": 0.5 + 0.2 * ((step * 7919) % 11) / 11})
            else:
                records.append({"step": step, "loss": 3.0 / (1 + step / 50) + 0.1 * i})
                if step % 50 == 0:
                    records.append({"step": step, "eval_loss": 3.2 / (1 + step / 50) + 0.1 * i})
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        curves[stage] = str(path)
    return curves


def test_loss_curves_share_a_panel_per_metric_in_a_grid_of_sane_aspect(tmp_path):
    from engine.evaluate.report import curve_series

    series = curve_series(_curves(tmp_path))
    fig = loss_curves_figure(series)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["loss", "mean reward"]  # not one panel per stage
    loss, reward = panels
    labels = [line.get_label() for line in loss.get_lines()]
    assert "pretrain training" in labels and "pretrain held-out" in labels  # train and held-out, shared axes
    assert sum(label.startswith("sft[") for label in labels) == 8  # the sweep's points overlaid
    raw = [line for line in reward.get_lines() if line.get_alpha() == 0.25]
    smooth = [line for line in reward.get_lines() if line.get_label() == "grpo (EMA)"]
    assert len(raw) == 2 and len(smooth) == 1  # each GRPO stage: raw faint, an EMA over it
    assert max(smooth[0].get_ydata()) - min(smooth[0].get_ydata()) < max(raw[0].get_ydata()) - min(raw[0].get_ydata())

    write_report(tmp_path / "out", EVAL_CFG, MODELS, {}, {}, _curves(tmp_path), about=ABOUT)
    width, height = Image.open(tmp_path / "out" / "loss_curves.png").size
    assert 1.0 <= width / height <= 3.0 and width <= 1600, (width, height)  # was 3234 x 352 for 7 stages


def test_metrics_bars_carry_their_values_and_long_labels_stay_whole(tmp_path):
    models = {
        **MODELS,
        "harness-only": {"harness/colours/acc": 0.333},
    }
    columns = equal_columns(models, headline_metrics(models))
    fig = metrics_figure(models, columns)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 3  # eval_loss, accuracy (pass@1 and reward/correct merged into it), harness
    accuracy = panels[1]
    assert [t.get_text() for t in accuracy.texts] == ["0.0000", "0.5000", "0.7500", "n/a"]
    assert "(= pass@1 = reward/correct)" in accuracy.get_title().replace("\n", " ")
    fig.canvas.draw()
    box = fig.get_tightbbox(fig.canvas.get_renderer())  # savefig(bbox_inches="tight") keeps all of it
    for label in accuracy.get_xticklabels():
        extent = label.get_window_extent().transformed(fig.dpi_scale_trans.inverted())
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and box.y0 <= extent.y0

    write_report(tmp_path, EVAL_CFG, models, {}, {}, {})
    width, height = Image.open(tmp_path / "metrics.png").size
    assert 1.0 <= width / height <= 4.0, (width, height)
    assert set(panel_keys(models)) == {"eval_loss", "arithmetic/accuracy", "harness/colours/acc"}


@pytest.mark.parametrize("count", [1, 2, 3])
def test_chosen_samples_never_exceed_the_count(count):
    assert len(chosen_samples(SAMPLES, count)) == count


def test_a_sweeps_plot_is_a_grid_of_labelled_bars(tmp_path):
    import io

    from flows.sweep_report import plot_png, sweep_figure

    rows = [
        {"point": f"sft[lr={lr},rank={rank}]", "lr": lr, "rank": rank, **{f"metric_{i}": i * lr for i in range(7)}}
        for lr in (1e-4, 3e-4, 1e-3, 3e-3)
        for rank in (8, 16)
    ]
    fig = sweep_figure(rows, ["lr", "rank"])
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 7 and len(fig.axes) == 9  # 3 x 3, not 7 in a row
    assert [t.get_text() for t in panels[1].texts][:2] == ["0.0001", "0.0001"]
    width, height = Image.open(io.BytesIO(plot_png(rows, ["lr", "rank"]))).size
    assert 0.8 <= width / height <= 3.0, (width, height)
