"""Apertus 1.5 (Apertus1p5TextForCausalLM, model_type apertus1p5_text; swiss-ai/Apertus-v1.5-8B):
Apertus (families/apertus.py) over a vocabulary that also holds image and audio tokens, with
an LM head that may predict only the first output_vocab_size of them.

The embedding has vocab_size rows; the released checkpoints prune the head to the text
tokens (`output_vocab_size`, ModelConfig.output_vocab_size; untied embeddings), so the logits
are output_vocab_size wide. They are published as Apertus1p5ForConditionalGeneration (model
type apertus1p5): the decoder under `model.language_model.`, the head `lm_head.`, beside a
vision tokenizer and a WavTokenizer audio encoder, which conversion skips (the text decoder
reads their codebook indices as ordinary token ids).
"""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.families.apertus import Apertus
from engine.models.families.base import Multimodal, register_family


@register_family
class Apertus1p5Text(Apertus):
    name = "apertus1p5_text"
    architecture = "Apertus1p5TextForCausalLM"
    model_type = "apertus1p5_text"
    multimodal = Multimodal(
        architecture="Apertus1p5ForConditionalGeneration",
        model_type="apertus1p5",
        prefixes=(("model.", "model.language_model."), ("lm_head.", "lm_head.")),
        text_model_type="apertus1p5_text",
    )

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        rows = hf.get("output_vocab_size")
        return {"output_vocab_size": None if rows in (None, hf["vocab_size"]) else rows}

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"output_vocab_size": cfg.head.vocab_size}
