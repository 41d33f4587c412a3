"""`python -m engine.evaluate JOB.yaml OUT_DIR`: evaluate checkpoints, write the report."""

import json
import sys

from engine.config import ConfigError, load_yaml, validate
from engine.contract import EXIT_CONFIG_ERROR, EXIT_OK
from engine.evaluate.config import EvalConfig
from engine.evaluate.evaluate import run_evaluate
from engine.parallel.distributed import maybe_initialize_distributed


def main(argv: list[str] | None = None) -> int:
    """python -m engine.evaluate JOB.yaml OUT_DIR

    JOB.yaml: {config: EvalConfig, checkpoints: {name: checkpoint dir}, curves: {stage: metrics.jsonl},
    about: what the inputs are (optional; engine.evaluate.report.measured_on)}.
    """
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m engine.evaluate JOB.yaml OUT_DIR"
    if argv and argv[0] in ("-h", "--help"):
        print(
            f"{usage}\n\nJOB.yaml: {{config: EvalConfig, checkpoints: {{name: checkpoint dir}}, "
            "curves: {stage: metrics.jsonl}}"
        )
        return EXIT_OK
    if len(argv) != 2:
        print(usage, file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        job = load_yaml(argv[0])
        unknown = set(job) - {"config", "checkpoints", "curves", "about"}
        if unknown:
            raise ConfigError(
                f"{argv[0]}: unknown key(s) {', '.join(sorted(unknown))}; expected config, checkpoints, curves, about"
            )
        cfg = validate(EvalConfig, job.get("config") or {}, f"{argv[0]}: config")
        maybe_initialize_distributed()  # under a multi-process launcher: one evaluation, its ranks joined
        report = run_evaluate(
            cfg, job.get("checkpoints") or {}, argv[1], curves=job.get("curves") or {}, about=job.get("about") or {}
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(
        json.dumps(
            {
                "result": {
                    f"{m}/{k}": v
                    for m, metrics in report["models"].items()
                    for k, v in metrics.items()
                    if isinstance(v, (int, float))
                }
            }
        )
    )
    return EXIT_OK


sys.exit(main())
