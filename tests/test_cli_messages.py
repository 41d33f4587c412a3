"""What a newcomer's first mistakes print: one sentence about what is wrong, nothing else.
No Prefect, no JAX: the commands below fail before either loads."""

from __future__ import annotations

import json

import pytest

from flows.cli import main


def test_a_bare_command_names_only_the_missing_pipeline(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["status"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert "the following arguments are required: pipeline\n" in err and "key=value is" not in err, err


def test_verify_of_a_missing_path_says_path_not_id(tmp_path, capsys):
    missing = tmp_path / "artifacts/pretrain/0123456789abcdef"
    assert main(["verify", str(missing), "--store", str(tmp_path / "artifacts")]) == 1
    err = capsys.readouterr().err
    assert f"no artifact directory at {missing}" in err and "no artifact with id" not in err, err
    # An id is still looked up as one.
    assert main(["verify", "0123abcd", "--store", str(tmp_path / "artifacts")]) == 1
    assert "no artifact with id '0123abcd' in store" in capsys.readouterr().err


def test_ls_shows_an_evaluation_s_accuracies(tmp_path, capsys):
    directory = tmp_path / "artifacts/evaluate/c609c3cd47ec17a7"
    directory.mkdir(parents=True)
    metrics = {
        f"{model}/{key}": value
        for model, accuracy in (("pretrain", 0.0), ("sft", 0.5), ("grpo", 0.576))
        for key, value in (("eval_loss", 2.1), ("eval_perplexity", 8.2), ("arithmetic/accuracy", accuracy))
    }
    manifest = {"id": directory.name, "kind": "eval_report", "stage": "evaluate", "status": "complete"}
    (directory / "artifact.json").write_text(json.dumps({**manifest, "metrics": metrics}))
    assert main(["ls", "--store", str(tmp_path / "artifacts")]) == 0
    out = capsys.readouterr().out
    for model, accuracy in (("pretrain", "0"), ("sft", "0.5"), ("grpo", "0.576")):
        assert f"{model}/arithmetic/accuracy={accuracy}" in out, out
