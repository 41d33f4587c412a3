"""MiniMax-M2's speculative layers after the decoder's (tensors under
model.layers.{num_hidden_layers + i}., which vLLM's and SGLang's decoders skip): no upstream
code defines what they hold (a third-party vLLM plugin reads them as DeepSeek-V3's), so
conversion skips them with a message and the converted model is the checkpoint's decoder, bit
for bit. (The modules SGLang's drafter defines, model.mtp_layers.{k}., are converted:
tests/test_hf_n62_mmmtp.py.)"""

from __future__ import annotations

import json

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from tests.deps import need

torch = need("torch")
transformers = need("transformers")

from engine.interop.hf.convert import convert_hf  # noqa: E402
from engine.train.checkpoint import load_params  # noqa: E402
from tests.test_hf_moe_families import random_hf_model  # noqa: E402


def test_the_mtp_modules_are_skipped_with_a_message(tmp_path):
    model = random_hf_model("minimax_m2")
    model.save_pretrained(tmp_path / "plain")
    convert_hf(tmp_path / "plain", tmp_path / "plain_converted")
    layers = model.config.num_hidden_layers
    # The published layout: two more layers after the decoder's, each one of its layers' kind
    # plus DeepSeek-style projections, and the config keys that announce them.
    weights = load_file(tmp_path / "plain" / "model.safetensors")
    for i in range(2):
        prefix = f"model.layers.{layers + i}."
        for name, tensor in list(weights.items()):
            if name.startswith("model.layers.0."):
                weights[prefix + name[len("model.layers.0.") :]] = tensor + 1
        weights[prefix + "eh_proj.weight"] = np.ones((model.config.hidden_size, 2 * model.config.hidden_size), "f4")
        weights[prefix + "enorm.weight"] = np.ones((model.config.hidden_size,), "f4")
    (tmp_path / "mtp").mkdir()
    save_file(weights, tmp_path / "mtp" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    (tmp_path / "mtp" / "config.json").write_text(
        json.dumps({**config, "use_mtp": True, "num_mtp_modules": 2, "mtp_transformer_layers": 1})
    )
    messages: list[str] = []
    convert_hf(tmp_path / "mtp", tmp_path / "converted", log=messages.append)
    skipped = [m for m in messages if "modules the engine does not run" in m]
    assert skipped and f"model.layers.{layers}, model.layers.{layers + 1}" in skipped[0], messages
    plain = load_params(tmp_path / "plain_converted" / "checkpoint")
    ours = load_params(tmp_path / "converted" / "checkpoint")
    assert ours[0] == plain[0]
    for a, b in zip(jax.tree.leaves(ours[1]), jax.tree.leaves(plain[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
