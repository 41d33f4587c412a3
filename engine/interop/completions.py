"""An OpenAI-compatible inference server's /v1/completions (vLLM's), as token ids in and out.

CompletionsClient: JSON over HTTP with retries on a failed connection; completion_rows lays
its answers out as the engine's sampler does. GRPO's vLLM sampler (engine/posttrain/
vllm_rollout.py) and the bucket loader beside a remote server (bucket_weights.py) use it.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class RolloutServerError(RuntimeError):
    """The rollout server could not be reached or refused a request; one sentence naming its URL."""


# Failures worth another try: the connection (refused, reset, dropped mid-answer, timed out)
# and a proxy's or a starting server's 502/503/504. Anything else is the request's fault.
RETRY_STATUS = (502, 503, 504)
CONNECTION_ERRORS = (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout, TimeoutError)


class CompletionsClient:
    """JSON over HTTP to an OpenAI-compatible server, each request retried `retries` times
    (waits retry_seconds, 2x, 4x, ...) when its connection fails; then RolloutServerError."""

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        timeout_seconds: float = 600.0,
        retries: int = 3,
        retry_seconds: float = 2.0,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.url = url.rstrip("/")
        self.timeout_seconds, self.retries, self.retry_seconds, self.sleep = (
            timeout_seconds,
            retries,
            retry_seconds,
            sleep,
        )
        self._model = model

    def request(self, path: str, body: dict | None = None, *, method: str | None = None) -> Any:
        """The decoded JSON answer to `body` at `path` (None for an empty one; the text of one
        that is not JSON, as vLLM's /v1/load_lora_adapter answers)."""
        where = f"{self.url}{path}"
        data = None if body is None else json.dumps(body).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.sleep(self.retry_seconds * 2 ** (attempt - 1))
            req = urllib.request.Request(where, data=data, method=method or ("GET" if data is None else "POST"))
            req.add_header("Content-Type", "application/json")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_seconds) as answer:
                    text = answer.read()
                if not text.strip():
                    return None
                try:
                    return json.loads(text)
                except ValueError:
                    return text.decode(errors="replace")
            except urllib.error.HTTPError as e:  # the server answered, with an error
                detail = e.read().decode(errors="replace").strip().replace("\n", " ")[:300]
                if e.code not in RETRY_STATUS:
                    raise RolloutServerError(
                        f"the rollout server at {where} refused the request: {e.code} {detail}"
                    ) from None
                last = f"{e.code} {detail}"
            except CONNECTION_ERRORS as e:
                last = str(getattr(e, "reason", e)) or type(e).__name__
        raise RolloutServerError(
            f"the rollout server at {where} did not answer after {self.retries + 1} tries ({last}); "
            f"start it (docs/post-training.md, vLLM rollouts) or set rollout.url to where it listens"
        )

    @property
    def model(self) -> str:
        """The served model's name (the first /v1/models lists, unless given)."""
        if self._model is None:
            listed = self.request("/v1/models").get("data") or []
            if not listed:
                raise RolloutServerError(f"the rollout server at {self.url} serves no model (/v1/models is empty)")
            self._model = listed[0]["id"]
        return self._model

    def max_model_len(self) -> int | None:
        """The served model's context length, where the server says it (vLLM does)."""
        for entry in self.request("/v1/models").get("data") or []:
            if entry.get("id") == self.model:
                return entry.get("max_model_len")
        return None

    def complete(
        self,
        prompt_ids: Sequence[int],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        model: str | None = None,
        routed_experts: bool = False,
    ) -> list[tuple]:
        """`n` completions of one prompt: (token ids, the log-prob each was sampled with), in
        the order the server numbers them. Stop tokens are kept, as the engine's sampler keeps EOS.
        `model`: a LoRA adapter the server has loaded; None: the served model. `routed_experts`:
        each also carries the choice's `routed_experts` (vLLM's base64 routes, None where the
        server returned none; engine/interop/vllm_server.py decodes them)."""
        body = {
            "model": model or self.model,
            "prompt": [int(t) for t in prompt_ids],
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k if top_k > 0 else -1,
            "seed": seed,
            "stop_token_ids": [int(t) for t in stop_token_ids],
            "logprobs": 0,  # the sampled token's own log-prob, no alternatives
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        choices = sorted(self.request("/v1/completions", body)["choices"], key=lambda c: c["index"])
        if len(choices) != n:
            raise RolloutServerError(f"the rollout server at {self.url} returned {len(choices)} completions, not {n}")
        rows = [(list(c["token_ids"]), list(c["logprobs"]["token_logprobs"])) for c in choices]
        if routed_experts:
            return [(*row, c.get("routed_experts")) for row, c in zip(rows, choices)]
        return rows

    def prompt_logprobs(self, token_ids: Sequence[int], *, model: str | None = None) -> np.ndarray:
        """log p(token t | tokens < t) for t = 1 .. len - 1 under the served weights (float64,
        NaN-free): a fixed sequence scored, e.g. to check the weights the server holds. `model`:
        a loaded LoRA adapter (base + adapter); None: the served model."""
        body = {
            "model": model or self.model,
            "prompt": [int(t) for t in token_ids],
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "temperature": 1.0,
        }
        scored = self.request("/v1/completions", body)["choices"][0]["prompt_logprobs"][1:]
        return np.array([entry[str(int(t))]["logprob"] for entry, t in zip(scored, token_ids[1:])], np.float64)


def completion_rows(
    completions: Sequence[tuple[list[int], list[float]]], max_new_tokens: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens_bn int32, logprobs_bn float32, mask_bn bool) as the engine's sampler lays them
    out: each completion from column 0, pad_id and log-prob 0 after it, at most max_new_tokens."""
    rows = len(completions)
    tokens = np.full((rows, max_new_tokens), pad_id, np.int32)
    logprobs = np.zeros((rows, max_new_tokens), np.float32)
    mask = np.zeros((rows, max_new_tokens), bool)
    for r, (ids, lps) in enumerate(completions):
        assert len(ids) == len(lps), (len(ids), len(lps))
        k = min(len(ids), max_new_tokens)
        tokens[r, :k], logprobs[r, :k], mask[r, :k] = ids[:k], lps[:k], True
    return tokens, logprobs, mask
