"""Many exported models scored by vLLM's offline engine in one process (run with vLLM's python).

    VLLM_PYTHON -P tests/vllm_offline.py JOBS.json RESULTS.jsonl

JOBS.json: [{"name", "model": DIR, "reload": DIR, "tokens": [ids], "dtype"}]. For each job in
turn: vLLM's LLM over `model` (eager, 32 positions, no tokenizer), the prompt log-probs of
`tokens` (log p(token t | < t), t >= 1); then the worker's reload_weights from `reload` (the call
GRPO's push makes on a server, /collective_rpc) and the log-probs again; then `model` reloaded
once more ("restored": where it differs from "served", vLLM's reload itself is off for this
model, whatever was pushed). One line per job is appended to RESULTS.jsonl: {"name", "served",
"reloaded", "restored", "seconds"}; "reload_error" in place of the last ones where the reload
failed; {"name", "error"} (the exception's last line) where vLLM refused the model.

One process for all (the import and the platform's start-up once: a server per model costs a
minute or more of start-up each on 2 cores). After a failure it exits with AGAIN (3), for the
caller to start another; jobs already in RESULTS.jsonl are skipped, so it goes on from the next.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

AGAIN = 3  # exit status: jobs are left, run again


def prompt_logprobs(llm, tokens: list[int]) -> list[float]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    out = llm.generate({"prompt_token_ids": tokens}, params, use_tqdm=False)[0]
    return [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], tokens[1:])]


def score(job: dict) -> dict:
    from vllm import LLM

    start = time.monotonic()
    llm = LLM(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        max_model_len=32,
        enforce_eager=True,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        logprobs_mode="processed_logprobs",
        kv_cache_memory_bytes=32 << 20,
        seed=0,
    )
    row = {}
    try:
        row["served"] = prompt_logprobs(llm, job["tokens"])
        try:
            for key, path in (("reloaded", job["reload"]), ("restored", job["model"])):
                llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
                row[key] = prompt_logprobs(llm, job["tokens"])
        except Exception as e:  # served, but the reload failed: its reason
            row["reload_error"] = last_line(e)
            traceback.print_exc()
    finally:
        del llm
        release()
    return {**row, "seconds": round(time.monotonic() - start, 1)}


def last_line(e: Exception) -> str:
    """The exception's reason in one line: pydantic's "Value error, ..." line (vLLM's config
    checks), else its last line."""
    lines = [line.strip() for line in str(e).strip().splitlines()] or [""]
    reason = next((line for line in lines if line.startswith("Value error, ")), lines[-1])
    return f"{type(e).__name__}: {reason}"[:500]


def release() -> None:
    """What an LLM leaves behind in this process (its parallel groups), before the next one."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()


def main() -> None:
    jobs_path, results_path = sys.argv[1:3]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: no start-up per model
    done = set()
    if os.path.exists(results_path):
        with open(results_path) as f:
            done = {json.loads(line)["name"] for line in f if line.strip()}
    for job in json.load(open(jobs_path)):
        if job["name"] in done:
            continue
        try:
            row = {"name": job["name"], **score(job)}
        except Exception as e:  # vLLM refused this model: its reason, then a fresh process for the next
            row = {"name": job["name"], "error": last_line(e)}
            traceback.print_exc()
        with open(results_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        outcome = row.get("error") or row.get("reload_error") or f"{row['seconds']} s"
        print(f"vllm_offline: {row['name']}: {outcome}", flush=True)
        if "served" not in row or "reload_error" in row:
            # What a failed start or reload left half-built (its parallel groups, torn down when the
            # collector gets to it) breaks the next LLM of this process: the caller starts another.
            sys.exit(AGAIN)


if __name__ == "__main__":
    main()
