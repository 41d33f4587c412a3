"""The GRPO benchmarks' task: tests/test_grpo.py's copy task ('d=' -> 'd' over a character
tokenizer of the ten digits, '=', <pad> and <eos>) beside an initial checkpoint of a model.

    write_copy_task(out, cfg)           # the model's params from Transformer's initialiser
    write_copy_task(out, cfg, params)   # or these
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from engine.data.tokenizer import TokenizerBundle, save_tokenizer
from engine.models.config import ModelConfig
from engine.models.transformer import Transformer
from engine.train.checkpoint import Checkpointer

DIGITS = [str(d) for d in range(10)]
EOS_ID, EQUALS_ID = 1, 12


def write_copy_task(out: Path, cfg: ModelConfig, params: dict | None = None) -> Path:
    """`out`/tokenizer, `out`/checkpoint (step 0: `params`, else the model's own initial
    weights, seed 0) and `out`/prompts.jsonl (one prompt per digit); returns `out`."""
    vocab = {"<pad>": 0, "<eos>": EOS_ID, **{d: i + 2 for i, d in enumerate(DIGITS)}, "=": EQUALS_ID}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<pad>", "<eos>"])
    save_tokenizer(TokenizerBundle(tok, eos_token="<eos>", pad_token="<pad>"), out / "tokenizer")
    if params is None:
        params = nnx.to_pure_dict(nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1])
    ckpt = Checkpointer(out / "checkpoint", async_save=False)
    ckpt.save(0, params, {"unused": np.zeros((), np.int32)}, {"step": 0, "model": cfg.model_dump(mode="json")}, {})
    ckpt.close()
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{d}=", "answer": d}) + "\n" for d in DIGITS))
    return out
