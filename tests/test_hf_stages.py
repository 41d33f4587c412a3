"""The convert and export stage kinds, through `trainflow convert` / `trainflow export`:
artifacts with manifests and lineage, skipped when done, and wired in pipelines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from flows.cli import main  # noqa: E402
from flows.spec import build_plan, parse_spec  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    config = transformers.Qwen3Config(
        vocab_size=37,
        hidden_size=30,
        intermediate_size=26,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
    )
    out = tmp_path_factory.mktemp("qwen3") / "hf"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    (out / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    return out


def last_json(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory) -> tuple[Path, dict, str]:
    """One `trainflow convert` of the model into a store, shared by the tests below (each
    export of it is an artifact of its own), and what it printed to stderr."""
    import contextlib
    import io

    store = tmp_path_factory.mktemp("converted") / "store"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(["convert", str(hf_dir), "--store", str(store), "--json"]) == 0
    return store, last_json(out.getvalue()), err.getvalue()


def test_convert_then_export_records_lineage_and_skips_when_done(hf_dir, converted, tmp_path, capsys):
    store, converted, log = converted
    assert converted["status"] == "ran" and converted["metrics"]["architecture"] == "Qwen3ForCausalLM"
    # The engine's own lines, and no library's warning among them (Orbax's absl WARNING
    # about a registry without a jax.Array handler was one).
    assert "convert: read " in log and "WARNING" not in log, log
    path = Path(converted["path"])
    manifest = json.loads((path / "artifact.json").read_text())
    assert manifest["kind"] == "checkpoint" and manifest["status"] == "complete"
    assert manifest["config"]["source"] == str(hf_dir.absolute())
    assert (path / "tokenizer" / "tokenizer_config.json").is_file() and (path / "model.yaml").is_file()
    assert any(name.startswith("checkpoint/") for name in manifest["files"])

    assert main(["convert", str(hf_dir), "--store", str(store), "--json"]) == 0  # same source: nothing to do
    assert last_json(capsys.readouterr().out)["status"] == "skipped"

    assert main(["export", str(path), "--out", str(tmp_path / "hf_out"), "--json"]) == 0
    exported = last_json(capsys.readouterr().out)
    export_manifest = json.loads((Path(exported["path"]) / "artifact.json").read_text())
    assert export_manifest["kind"] == "hf_model"
    assert export_manifest["parents"] == [
        {
            "input": "checkpoint",
            "stage": "convert",
            "id": converted["artifact_id"],
            "kind": "checkpoint",
            "path": f"convert/{converted['artifact_id']}",
        }
    ]
    assert transformers.AutoConfig.from_pretrained(tmp_path / "hf_out").model_type == "qwen3"
    assert (tmp_path / "hf_out" / "tokenizer_config.json").is_file()


def test_export_out_refuses_an_occupied_folder_and_overwrite_replaces_its_weights(hf_dir, converted, tmp_path, capsys):
    (store, converted, _), out = converted, tmp_path / "hf_out"
    path = converted["path"]
    exports = sorted((store / "export").glob("*"))  # those of other tests
    out.mkdir()
    stale = ["model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json"]
    for name in stale:
        (out / name).write_text("an earlier model")

    assert main(["export", path, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out} is not empty") and "--overwrite" in err
    assert sorted((store / "export").glob("*")) == exports  # refused before the stage ran
    assert sorted(p.name for p in out.iterdir()) == sorted(stale)

    assert main(["export", path, "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, weight in transformers.AutoModelForCausalLM.from_pretrained(hf_dir).state_dict().items():
        torch.testing.assert_close(loaded[name], weight, rtol=0, atol=0, msg=name)


def test_a_bad_source_is_rejected_before_anything_runs(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "missing"), "--store", str(tmp_path / "store")]) == 2
    assert "is not a Hugging Face model directory" in capsys.readouterr().err
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text(
        '{"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}'
    )
    assert main(["convert", str(tmp_path / "t5"), "--store", str(tmp_path / "store")]) == 2
    assert "unsupported architecture 'T5ForConditionalGeneration'" in capsys.readouterr().err


def test_pipelines_wire_convert_into_training_and_export(hf_dir):
    spec = parse_spec(
        {
            "name": "finetune",
            "stages": {
                "base": {"task": "convert", "config": {"source": str(hf_dir), "dtype": "bfloat16"}},
                "release": {"task": "export", "inputs": {"checkpoint": "base"}},
                "wrong": {"task": "export", "inputs": {"checkpoint": "release"}},
            },
        },
        "finetune.yaml",
    )
    with pytest.raises(Exception, match=r"stage 'release' \(export\) produces a hf_model, but input 'checkpoint'"):
        build_plan(spec, "finetune.yaml")


def test_a_path_with_dots_or_through_a_symlink_names_the_artifact_it_leads_to(hf_dir, converted, tmp_path, capsys):
    """`ART/checkpoint/..` and a symlink to ART are ART, in ART's store, for every command that
    takes an artifact path (an export of `ART/checkpoint/..` once took ART itself for the store
    and wrote export/<id>/.lock into it), and for convert's source and --base."""
    peft = need("peft")
    store, converted, _ = converted
    art = Path(converted["path"])
    links = tmp_path / "links"
    links.mkdir()
    (links / art.name).symlink_to(art)
    (links / "hf").symlink_to(hf_dir)

    def forms(path: Path) -> list[str]:
        return [f"{path}/tokenizer/..", str(links / path.name)]

    assert main(["export", str(art), "--json"]) == 0
    exported = Path(last_json(capsys.readouterr().out)["path"])
    (links / exported.name).symlink_to(exported)
    for form in forms(art):
        assert main(["export", form, "--json"]) == 0
        again = last_json(capsys.readouterr().out)
        assert again["status"] == "skipped" and again["path"] == str(exported), again
    for form in [f"{exported}/hf/..", str(links / exported.name)]:
        for command in (["lineage", "--json"], ["verify"], ["diff", str(exported), "--json"]):
            assert main([command[0], str(exported), *command[1:]]) == 0
            want = capsys.readouterr().out
            assert main([command[0], form, *command[1:]]) == 0
            assert capsys.readouterr().out == want, (command, form)
    assert json.loads(want)["lineage"] == []  # the export's ancestors, found in its own store

    model = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(hf_dir), peft.LoraConfig(r=2, target_modules=["q_proj"])
    )
    model.save_pretrained(tmp_path / "peft")
    assert main(["convert", str(tmp_path / "peft"), "--base", str(art), "--json"]) == 0
    adapter = last_json(capsys.readouterr().out)["path"]
    for form in forms(art):
        assert main(["convert", str(tmp_path / "peft"), "--base", form, "--json"]) == 0
        again = last_json(capsys.readouterr().out)
        assert again["status"] == "skipped" and again["path"] == adapter, again
    for form in [f"{hf_dir}/../hf", str(links / "hf")]:
        assert main(["convert", form, "--store", str(store), "--json"]) == 0
        assert last_json(capsys.readouterr().out)["path"] == str(art)

    assert not (art / "export").exists() and not (art / "convert").exists()
    assert main(["verify", str(art)]) == 0  # nothing was written into the input artifact
    capsys.readouterr()
    assert main(["export", str(art), "--out", f"{links}/{art.name}/hf"]) == 2
    assert f"{links}/{art.name}/hf lies inside the artifact {art}" in capsys.readouterr().err
