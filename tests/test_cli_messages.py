"""What a newcomer's mistakes print: one sentence about what is wrong, nothing else.

Every command is driven with bad arguments, missing and wrong-kind paths, a file as the store,
an unreachable and a credential-less bucket and a closed stdout: each answers exit 2 (bad
input) or 1 (a check failed) with exactly one line on stderr and no traceback, and every
code the command uses is in docs/pipelines.md's table. In-process (`main`) where that is the
same behaviour; subprocesses only where the process matters (a closed pipe, a bucket's SDK
reading its environment). The store is made of the toy stage kinds of tests/sweep_toys.py
and tests/pipeline_toys.py (no JAX, no Prefect)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import tests.pipeline_toys  # noqa: F401  (toy-source, toy-sum)
import tests.sweep_toys  # noqa: F401  (toy-train, toy-eval)
from flows import cli
from flows.cli import main
from flows.spec import load_plan
from tasks.registry import StageHooks
from tasks.runner import execute_stage
from tasks.store.base import ArtifactStore
from tasks.store.records import ArtifactError

REPO = Path(__file__).resolve().parents[1]


def run_quietly(plan, name: str) -> None:
    execute_stage(plan.resolve(name), plan.store, StageHooks(log=lambda line: None))


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, str]:
    """Placeholders -> paths: a store holding a complete checkpoint, an eval_report and a failed
    checkpoint; the pipeline that made them; a plain file; a missing path; a plain directory."""
    root = tmp_path_factory.mktemp("cli")
    store = root / "store"
    pipeline = root / "p.yaml"
    spec = {
        "name": "p",
        "store": str(store),
        "imports": ["tests.sweep_toys", "tests.pipeline_toys"],
        "stages": {
            "train": {"task": "toy-train", "config": {"steps": 2}},
            "evaluate": {"task": "toy-eval", "inputs": {"model": "train"}},
            "source": {"task": "toy-source"},
            "broken": {"task": "toy-sum", "inputs": {"a": "source"}, "config": {"fail_times": 99}},
        },
    }
    spec["stages"]["broken"]["config"]["trace"] = str(root / "trace")
    pipeline.write_text(yaml.safe_dump(spec))
    plan = load_plan(pipeline)
    for name in ("train", "evaluate", "source"):
        run_quietly(plan, name)
    with pytest.raises(RuntimeError, match="planned failure"):
        run_quietly(plan, "broken")
    (root / "afile").write_text("not a store\n")
    (root / "plain").mkdir()
    located = {name: str(plan.store.artifact_dir(name, p.job.artifact_id)) for name, p in plan.stages.items()}
    return {
        "STORE": str(store),
        "PIPE": str(pipeline),
        "FILE": str(root / "afile"),
        "MISSING": str(root / "nowhere"),
        "PLAIN": str(root / "plain"),
        "CKPT": located["train"],
        "EVAL": located["evaluate"],
        "FAILED": located["broken"],
    }


def answer(argv: list[str], capsys) -> tuple[int, str]:
    """(exit code, stderr) of one in-process command; argparse's errors exit through SystemExit."""
    try:
        code = main(argv)
    except SystemExit as stopped:
        code = stopped.code
    return code, capsys.readouterr().err


# (argv with placeholders, exit code, what the one line must contain)
CASES = [
    # bad arguments
    (["stauts", "PIPE"], 2, "unknown command 'stauts' (did you mean 'status'?)"),
    (["status", "PIPE", "--jsn"], 2, "trainflow status: error: unrecognized option '--jsn' (did you mean '--json'?)"),
    (["gc", "--keep-step", "1", "--dry-runn"], 2, "unrecognized option '--dry-runn' (did you mean '--dry-run'?)"),
    (["ls", "extra"], 2, "unrecognized argument 'extra'"),
    (["status", "PIPE", "steps"], 2, "override 'steps' is not of the form key=value"),
    (["run", "PIPE", "--max-parallel", "two"], 2, "argument --max-parallel: invalid int value: 'two'"),
    (["run", "PIPE", "--max-parallel", "-3"], 2, "--max-parallel: -3 stages at once: give a whole number of 1"),
    (["run", "PIPE", "--max-parallel", "0"], 2, "argument --max-parallel: 0 stages at once: give a whole number of 1"),
    (["status"], 2, "the following arguments are required: pipeline; see `trainflow status --help`"),
    (["convert", "PLAIN", "--dtype", "float16"], 2, "argument --dtype: invalid choice"),
    (["serve", "PIPE", "--cron", "bad cron"], 2, "--cron 'bad cron' is not a cron schedule"),
    (["gc", "--keep-steps", "0", "--store", "STORE"], 2, "keep at least the newest step"),
    # a file, or a missing directory, as the store
    (["run", "PIPE", "--store", "FILE"], 2, "artifact store FILE is a file, not a directory"),
    (["status", "PIPE", "--store", "FILE"], 2, "artifact store FILE is a file"),
    (["status", "PIPE", "--store", "FILE/sub"], 2, "artifact store FILE/sub lies under FILE, a file"),
    (["ls", "--store", "FILE"], 2, "artifact store FILE is a file"),
    (["gc", "--store", "FILE", "--keep", "PIPE"], 2, "artifact store FILE is a file"),
    (["lineage", "0123abcd", "--store", "FILE"], 2, "artifact store FILE is a file"),
    (["convert", "PLAIN", "--store", "FILE"], 2, "artifact store FILE is a file"),
    (["status", "PIPE", "--store", "MISSING"], 2, "no artifact store at MISSING (the directory does not exist"),
    (["ls", "--store", "MISSING"], 2, "no artifact store at MISSING"),
    (["verify", "0123abcd", "--store", "MISSING"], 2, "no artifact store at MISSING"),
    (["gc", "--store", "MISSING", "--dry-run"], 2, "gc: store MISSING does not exist"),
    # a store path that is not UTF-8 (bytes a file system allows): Prefect's traceback in `run`
    (["run", "PIPE", "--store", "MISSING/st\udcff"], 2, "/st\\xff is not a UTF-8 path (manifests and Prefect"),
    (["ls", "--store", "MISSING/st\udcff"], 2, "/st\\xff is not a UTF-8 path"),
    # missing paths, unknown ids, what is no artifact
    (["status", "MISSING/p.yaml"], 2, "config file not found: MISSING/p.yaml"),
    (["lineage", "MISSING/pretrain/0123"], 2, "no artifact directory at MISSING/pretrain/0123"),
    (["verify", "MISSING/pretrain/0123"], 2, "no artifact directory at MISSING/pretrain/0123"),
    (["diff", "MISSING/a/0123", "CKPT"], 2, "no artifact directory at MISSING/a/0123"),
    (["export", "MISSING/a/0123"], 2, "no artifact directory at MISSING/a/0123"),
    (["generate", "MISSING/a/0123", "--prompt", "hi"], 2, "no artifact directory at MISSING/a/0123"),
    (["lineage", "0123abcd", "--store", "STORE"], 2, "no artifact with id '0123abcd' in store STORE"),
    (["verify", "PLAIN"], 2, "PLAIN is not an artifact (no readable artifact.json)"),
    (["diff", "PLAIN", "CKPT"], 2, "PLAIN is not an artifact"),
    (["lineage", "FILE"], 2, "FILE is a file, not an artifact directory"),
    # artifacts of the wrong kind, or not complete: refused before any work
    (["export", "EVAL"], 2, "EVAL is a eval_report artifact; `trainflow export` takes a checkpoint, adapter or "),
    (["generate", "EVAL", "--prompt", "hi"], 2, "EVAL is a eval_report artifact; `trainflow generate` takes a "),
    (["convert", "PLAIN", "--base", "EVAL"], 2, "EVAL is a eval_report artifact; `trainflow convert --base` takes"),
    (["export", "FAILED"], 2, "FAILED is failed, not complete"),
    # a check that fails
    (["verify", "TAMPERED"], 1, "TAMPERED does not match its manifest: checkpoint/2/weights.json: size"),
    (["generate", "TAMPERED", "--prompt", "hi"], 1, "changed since it was finished: checkpoint/2/weights.json: size"),
]


@pytest.mark.parametrize("argv, code, expected", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_every_mistake_is_one_line_and_its_exit_code(world, argv, code, expected, tmp_path, capsys):
    if "TAMPERED" in argv:  # a copy of the checkpoint with one weight file grown
        tampered = tmp_path / "store" / "train" / Path(world["CKPT"]).name
        shutil.copytree(world["CKPT"], tampered)
        with open(tampered / "checkpoint" / "2" / "weights.json", "a") as f:
            f.write(" ")
        world = {**world, "TAMPERED": str(tampered)}
    names = sorted(world, key=len, reverse=True)

    def fill(text: str) -> str:
        return re.sub("|".join(names), lambda m: world[m.group(0)], text)

    before = set(Path(world["STORE"]).rglob("*"))
    got, err = answer([fill(a) for a in argv], capsys)
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert fill(expected) in err, err
    assert got == code, err
    assert got in cli.EXIT_CODES
    assert set(Path(world["STORE"]).rglob("*")) == before  # nothing written, no failed artifact left


def test_a_path_with_dots_or_through_a_symlink_is_answered_as_the_place_it_leads_to(world, tmp_path, capsys):
    """Store, pipeline and artifact arguments are resolved (`..`, symlinks) before use: each
    command answers as for the real path (tests/test_hf_stages.py: export, convert, lineage,
    verify and diff on a real checkpoint)."""
    for name in ("STORE", "PIPE", "EVAL"):
        (tmp_path / name).symlink_to(world[name])
    forms = {
        "STORE": [f"{world['STORE']}/train/..", str(tmp_path / "STORE")],
        "PIPE": [f"{world['STORE']}/../{Path(world['PIPE']).name}", str(tmp_path / "PIPE")],
        "EVAL": [f"{world['EVAL']}/../{Path(world['EVAL']).name}", str(tmp_path / "EVAL")],
    }
    commands = [
        (["status", "PIPE", "--store", "STORE", "--json"], "STORE"),
        (["status", "PIPE", "--json"], "PIPE"),
        (["ls", "--store", "STORE", "--json"], "STORE"),
        (["gc", "--store", "STORE", "--keep", "PIPE", "--dry-run"], "STORE"),
        (["gc", "--store", "STORE", "--keep", "PIPE", "--dry-run"], "PIPE"),
        (["lineage", "EVAL", "--json"], "EVAL"),
        (["generate", "EVAL", "--prompt", "hi"], "EVAL"),  # refused, naming the artifact
        (["export", "EVAL"], "EVAL"),
    ]

    def outcome(argv: list[str]) -> tuple[int, str, str]:
        try:
            code = main(argv)
        except SystemExit as stopped:
            code = stopped.code
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    for argv, varied in commands:
        want = outcome([world.get(a, a) for a in argv])
        for form in forms[varied]:
            assert outcome([form if a == varied else world.get(a, a) for a in argv]) == want, (argv, form)


def test_a_complete_artifact_whose_files_were_truncated_is_refused_not_skipped(world, tmp_path):
    """`run` skipped a complete artifact whose files had been cut short (a partial copy): the
    skip now checks each file's size (a stat each) and refuses in one sentence."""
    store = tmp_path / "store"
    shutil.copytree(world["STORE"], store)
    plan = load_plan(world["PIPE"], store=str(store))
    weights = store / "train" / Path(world["CKPT"]).name / "checkpoint" / "2" / "weights.json"
    weights.write_bytes(weights.read_bytes()[:3])
    with pytest.raises(ArtifactError) as refused:
        run_quietly(plan, "train")
    message = str(refused.value)
    assert len(message.splitlines()) == 1 and "checkpoint/2/weights.json: size 3 != recorded" in message, message
    assert "trainflow verify" in message, message
    run_quietly(plan, "source")  # an intact complete artifact is still skipped


MAKES_ONE_STAGE = """
import sys
import tests.pipeline_toys
from flows.spec import load_plan
from tasks.registry import StageHooks
from tasks.runner import execute_stage
from tasks.store.records import ArtifactError
plan = load_plan(sys.argv[1], store=sys.argv[2])
try:
    execute_stage(plan.resolve("source"), plan.store, StageHooks(log=lambda line: None))
except ArtifactError as e:
    print(f"error: {e}", file=sys.stderr)
"""


def test_a_read_only_store_is_one_sentence(world, tmp_path):
    """A store on a read-only file system (a tmpfs mounted `ro` in a user and mount namespace:
    root writes through permissions, not through that): the stage's first write fails with one
    sentence naming the path, not retried; it was an OSError with its tracebacks."""
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no user namespaces here (unshare -rm): cannot mount a read-only file system")
    store = tmp_path / "ro"
    store.mkdir()
    command = f'mount -t tmpfs -o ro tmpfs {store} && exec {sys.executable} -c "$0" {world["PIPE"]} {store}'
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", command, MAKES_ONE_STAGE], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stderr.splitlines() == [
        f"error: stage 'source': cannot write {store}/source (Read-only file system); the artifact store must be "
        "writable: pass another --store, or make it writable"
    ], proc.stderr


def test_each_command_s_options_say_what_they_do():
    parser = cli.build_parser()
    for name, command in parser.commands.items():
        for action in command._actions:
            assert action.help, f"trainflow {name} {action.option_strings or action.dest}: no help"
        store = next(a for a in command._actions if "--store" in a.option_strings)
        takes_pipeline = any(a.dest == "pipeline" for a in command._actions)
        assert ("pipeline" in store.help) == takes_pipeline or name == "gc", (name, store.help)


def test_the_exit_code_table_lists_every_code_the_command_uses():
    text = (REPO / "docs" / "pipelines.md").read_text()
    table = text.split("### Exit codes", 1)[1].split("\n\n#", 1)[0]
    documented = {int(m) for m in re.findall(r"^\| (\d+) \|", table, re.M)}
    assert documented == set(cli.EXIT_CODES)
    assert "docs/pipelines.md#exit-codes" in (REPO / "README.md").read_text()


def test_the_fault_table_says_what_lineage_of_a_non_artifact_prints_and_exits(world, capsys):
    """docs/pipelines.md's "What happens when" row for `trainflow lineage DIR` on a plain
    directory: its line and exit code are the command's (bad input: 2, as the exit-code table)."""
    text = (REPO / "docs" / "pipelines.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `trainflow lineage DIR`"))
    shown, code = re.search(r"`error: DIR (is not an artifact[^`;]*)[^`]*`; exit (\d)", row).groups()
    got, err = answer(["lineage", world["PLAIN"]], capsys)
    assert (got, err.startswith(f"error: {world['PLAIN']} {shown}")) == (int(code), True), (row, err)


def subprocess_cli(*argv: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *argv], cwd=REPO, env=full_env, text=True, timeout=120, **kwargs
    )


def test_a_closed_stdout_ends_the_command_quietly(world, capsys, monkeypatch):
    """`trainflow ls | head`: once the reader is gone, exit 141 (128 + SIGPIPE, as coreutils)
    and nothing on stderr: no BrokenPipeError traceback, no 'Exception ignored' at exit."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess_cli("ls", "--store", world["STORE"], stdout=write, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (cli.EXIT_PIPE, "")
    # The same in-process for the other commands that print much (stdout a closed pipe).
    for argv in (["status", world["PIPE"], "--json"], ["lineage", world["EVAL"]], ["lineage", world["EVAL"], "--json"]):
        read, write = os.pipe()
        os.close(read)
        with os.fdopen(write, "w") as closed:
            monkeypatch.setattr(sys, "stdout", closed)
            assert main(argv) == cli.EXIT_PIPE
            monkeypatch.undo()
        assert capsys.readouterr().err == ""


def test_a_corpus_that_cannot_be_tokenized_is_one_line_per_stage_without_a_traceback(tmp_path):
    """`trainflow run` of three tokenize stages with retries 0: an empty corpus, a malformed
    JSONL line and a binary file as text. Each fails with one line naming its file (and line),
    exit 1; Prefect logged ~25 lines of traceback for each."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    (tmp_path / "blob.txt").write_bytes(bytes(range(256)) * 4)
    sources = {"empty": ("text", "empty.txt"), "bad": ("jsonl", "bad.jsonl"), "blob": ("text", "blob.txt")}
    stages = {
        name: {"task": "tokenize", "config": {"sources": [{"format": fmt, "path": str(tmp_path / file)}]}}
        for name, (fmt, file) in sources.items()
    }
    spec = {"name": "corpora", "store": str(tmp_path / "store"), "defaults": {"retries": 0}, "stages": stages}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(spec))
    env = {"PREFECT_API_URL": "", "PREFECT_HOME": str(tmp_path / "prefect")}
    proc = subprocess_cli("run", str(tmp_path / "p.yaml"), env=env, capture_output=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    errors = sorted(line for line in proc.stderr.splitlines() if line.startswith("error: "))
    assert len(errors) == 3, proc.stderr
    bad, blob, empty = errors
    assert bad.startswith(f"error: stage 'bad': {tmp_path / 'bad.jsonl'}, line 2: not valid JSON"), bad
    assert blob.startswith(f"error: stage 'blob': {tmp_path / 'blob.txt'}: binary data (a NUL byte), not text"), blob
    assert empty.startswith(f"error: stage 'empty': the corpus ({tmp_path / 'empty.txt'}) has no usable docum"), empty


@pytest.mark.filterwarnings("ignore:Logger 'prefect.task_runs' attempted to send logs")  # no flow run: no API
def test_prefect_logs_a_traceback_only_for_a_failure_that_is_not_one_sentence():
    """The task-run logger's filter (flows/pipeline.py): a run that cannot fit (the engine's
    "fewer than one batch", exit 2) and a full disk are their line alone; a crash keeps its
    traceback, the clue to a bug."""
    import logging

    import flows.pipeline  # noqa: F401  (installs the filter)
    from tasks.launch.spec import DiskFull, StageConfigError

    logger, lines = logging.getLogger("prefect.task_runs"), []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(logging.Formatter().format(record))  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        for error in (
            StageConfigError("stage 'pretrain': data.path: the 'train' split holds 68 tokens, fewer than one batch"),
            DiskFull("stage 'pretrain': checkpoint step 2: No space left on device writing ckpt (exit 1)"),
            RuntimeError("a crash"),
        ):
            try:
                raise error
            except Exception as e:
                logger.error(f"Task run failed with exception: {e!r}", exc_info=True)
    finally:
        logger.removeHandler(handler)
    assert ["Traceback" in line for line in lines] == [False, False, True], lines


def test_buckets_that_cannot_be_used_are_one_line_at_once(tmp_path):
    """An S3 endpoint that refuses connections, and a gs:// store without credentials (no
    GOOGLE_APPLICATION_CREDENTIALS, no gcloud login, the metadata server a closed local port,
    nothing reaching the internet): one line naming the URL, exit 2. gcsfs on its own went on
    anonymously and retried for 49 s, then printed its tracebacks."""
    closed_port = "http://127.0.0.1:9"
    s3 = {"AWS_ENDPOINT_URL": closed_port, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"}
    proc = subprocess_cli(
        "ls", "--store", "s3://unreachable/x", env={**s3, "AWS_MAX_ATTEMPTS": "1"}, capture_output=True
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: artifact store s3://unreachable/x: cannot reach the bucket"), proc.stderr

    gcs = {
        "GOOGLE_APPLICATION_CREDENTIALS": "",
        "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"),
        "HOME": str(tmp_path),
        "STORAGE_EMULATOR_HOST": "",
        "GCE_METADATA_HOST": "127.0.0.1:9",
        "GCE_METADATA_IP": "127.0.0.1:9",
    }
    proc = subprocess_cli("ls", "--store", "gs://some-bucket/x", env=gcs, capture_output=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.strip() == (
        "error: artifact store gs://some-bucket/x: no credentials found for gs:// "
        "(set GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth application-default login`)"
    )


def test_a_single_stage_command_says_what_it_wrote_where(tmp_path, capsys):
    """convert and export print a sentence (what, where, seconds rounded); --json the record."""
    store = ArtifactStore(tmp_path / "store")
    assert cli._run_one_stage("toy-source", {"value": 3}, {}, store) is not None
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(rf"toy-source: wrote a dataset artifact to {tmp_path}/store/toy-source/\w+ in \d+\.\d s", line)
    cli._run_one_stage("toy-source", {"value": 3}, {}, store, as_json=True)
    record = json.loads(capsys.readouterr().out)
    assert record["status"] == "skipped" and record["seconds"] == round(record["seconds"], 2)
    assert record["path"] == line.split(" to ")[1].split(" in ")[0]


def test_plan_offers_an_adapter_only_to_a_stage_that_starts_from_a_model(tmp_path):
    from tasks.plan import plan_pipeline  # JAX: this test only

    plan = load_plan(REPO / "configs" / "pipelines" / "quickstart.yaml", store=tmp_path)
    to_fit = {p.stage: p.to_fit for p in plan_pipeline(plan, "h100x8")[0]}
    assert "lora" not in to_fit["pretrain"], to_fit["pretrain"]  # from random weights: nothing to adapt
    assert "lora: {rank: 16}" in to_fit["sft"] and "lora.base_dtype" in to_fit["sft"]


def test_ls_shows_an_evaluation_s_accuracies(tmp_path, capsys):
    directory = tmp_path / "artifacts/evaluate/922e4ee894f31038"
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
