"""The evaluation report: what each panel plots, and that nothing missing is drawn as 0."""

from engine.evaluate.report import panel_keys, training_curve


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
