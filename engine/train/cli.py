"""`python -m <entry point> CONFIG.yaml [key=value ...]`: the one CLI of every training
entry point (pretrain, SFT, GRPO), with the exit codes of engine/contract.py."""

from __future__ import annotations

import faulthandler
import json
import signal
import sys
from collections.abc import Callable

from pydantic import BaseModel

from engine.config import ConfigError, load_config, parse_yaml
from engine.contract import EXIT_CONFIG_ERROR, EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED
from engine.data import urls
from engine.parallel.distributed import maybe_initialize_distributed
from engine.train.checkpoint import CheckpointWriteError
from engine.train.trainer import Preempted, TrainingError


def usage(module: str, schema: type[BaseModel], plan: bool = False) -> str:
    """The help text: the command line, then each config section or key with its first doc line."""
    command = f"python -m {module} CONFIG.yaml [key=value ...]" + (" [--plan [--target TARGET]]" if plan else "")
    lines = [
        f"usage: {command}",
        "",
        (schema.__doc__ or "").strip().splitlines()[0],
        "",
        "Config sections and keys (override any with a dotted key=value, e.g. steps=200 model.num_layers=4):",
    ]
    for name, field in schema.model_fields.items():
        section = next(
            (
                a
                for a in getattr(field.annotation, "__args__", (field.annotation,))
                if isinstance(a, type) and issubclass(a, BaseModel)
            ),
            None,
        )
        doc = field.description or (section.__doc__ if section else "") or ""
        default = (
            "" if section or field.is_required() else f" (default {field.get_default(call_default_factory=True)!r})"
        )
        lines.append(
            f"  {name + ('.*' if section else ''):<18} {doc.strip().splitlines()[0] if doc.strip() else ''}{default}"
        )
    lines += [
        "",
        f"Exit codes: {EXIT_OK} success, {EXIT_CONFIG_ERROR} bad config or input (one line), "
        f"{EXIT_FAILED} the run failed, {EXIT_PREEMPTED} stopped by SIGTERM after saving a checkpoint.",
        'The last stdout line is {"result": {...final metrics...}}.',
    ]
    if plan:
        lines += [
            "--plan: compile one training step for TARGET (a TPU slice such as v5e-16, a GPU host such as "
            "h100x8, or local, the default) and print its memory per device, FLOPs and roofline; exit "
            f"{EXIT_FAILED} if it does not fit."
        ]
    return "\n".join(lines)


def plan_arguments(argv: list[str]) -> tuple[list[str], str | None]:
    """(argv without `--plan [--target NAME]`, the target to plan for, or None without --plan)."""
    if "--plan" not in argv:
        return argv, None
    rest, target, i = [], "local", 0
    while i < len(argv):
        if argv[i] == "--target" and i + 1 < len(argv):
            target, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith("--target="):
            target = argv[i].partition("=")[2]
        elif argv[i] != "--plan":
            rest.append(argv[i])
        i += 1
    return rest, target


def run_cli(
    argv: list[str] | None,
    module: str,
    schema: type[BaseModel],
    run: Callable,
    failures: tuple = (),
    plan: Callable | None = None,
) -> int:
    """Load CONFIG.yaml with overrides, join a multi-process run if launched as one, run.

    With `--plan [--target NAME]`, `plan(cfg, NAME)` runs instead: the preflight, which exits
    EXIT_FAILED when the step does not fit (engine/train/plan.py).
    Exit codes (the launchers rely on them): engine.contract.EXIT_*. The final stdout line is
    {"result": metrics}.
    """
    argv = sys.argv[1:] if argv is None else argv
    # `kill -USR1 PID` prints every thread's stack to stderr, as `trainflow` does: where a stage waits.
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__ or sys.stderr, all_threads=True)
    except (ValueError, OSError, AttributeError):  # no descriptor (an embedding host), or no SIGUSR1
        pass
    if argv and argv[0] in ("-h", "--help"):
        print(usage(module, schema, plan is not None))
        return EXIT_OK
    if plan is not None:
        argv, target = plan_arguments(argv)
        if target is not None:
            run = lambda cfg: plan(cfg, target)  # noqa: E731
    if not argv:
        print(usage(module, schema, plan is not None).splitlines()[0], file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        if urls.is_url(argv[0]):  # a stage on a bucket store: every rank reads its config there
            tree = parse_yaml(urls.read_text(argv[0]), argv[0])
            cfg = load_config(None, argv[1:], tree, schema=schema, source=argv[0])
        else:
            cfg = load_config(argv[0], argv[1:], schema=schema)
        maybe_initialize_distributed()
        result = run(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except (TrainingError, CheckpointWriteError, *failures) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except Preempted as e:
        print(str(e), file=sys.stderr)
        return EXIT_PREEMPTED
    print(json.dumps({"result": result}))
    return EXIT_OK
