"""Training, loading and saving the tokenize stage's tokenizer; parity with transformers and
SentencePiece."""

from __future__ import annotations

import glob
import sysconfig
from pathlib import Path

import pytest
from test_tokenize import documents, records, run_stage, write_lines

from engine.config import ConfigError
from engine.data.shards import read_meta
from engine.data.tokenizer import TokenizerConfig, load_tokenizer, train_tokenizer
from tests.deps import need

STDLIB_TEXTS = [
    Path(f).read_text(encoding="utf-8") for f in sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/json/*.py"))
]


def test_training_is_deterministic_and_specials_come_first():
    cfg = TokenizerConfig(vocab_size=500, min_frequency=2)
    a = train_tokenizer(cfg, STDLIB_TEXTS, add_bos=True)
    b = train_tokenizer(cfg, iter(STDLIB_TEXTS), add_bos=True)
    assert a.tokenizer.to_str() == b.tokenizer.to_str()
    assert (a.bos_id, a.eos_id, a.pad_id) == (0, 1, 2)
    assert [a.tokenizer.token_to_id(f"<|{r}|>") for r in ("system", "user", "assistant")] == [3, 4, 5]
    assert a.vocab_size == 500
    text = "def f(x):\n    return x  # ünïcödé ✓\n"
    assert a.tokenizer.decode(a.tokenizer.encode(text, add_special_tokens=False).ids) == text


def test_min_frequency_limits_merges():
    rare = train_tokenizer(TokenizerConfig(vocab_size=1000, min_frequency=200), STDLIB_TEXTS, add_bos=True)
    common = train_tokenizer(TokenizerConfig(vocab_size=1000, min_frequency=2), STDLIB_TEXTS, add_bos=True)
    assert rare.vocab_size < common.vocab_size == 1000


def test_vocab_smaller_than_bytes_plus_specials_is_an_error():
    with pytest.raises(
        ConfigError, match=r"tokenizer\.vocab_size \(200\) must be at least 262 \(256 byte tokens \+ 6 special"
    ):
        train_tokenizer(TokenizerConfig(vocab_size=200), STDLIB_TEXTS, add_bos=True)


def test_saved_tokenizer_loads_in_transformers_with_its_chat_template(tmp_path):
    from transformers import PreTrainedTokenizerFast

    out = tmp_path / "out"
    run_stage(out, {"sources": [{"format": "text", "path": "{stdlib}/json/*.py"}]}, validation_fraction=0)
    files = sorted(p.name for p in (out / "tokenizer").iterdir())
    assert files == ["chat_template.jinja", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]

    hf = PreTrainedTokenizerFast.from_pretrained(out / "tokenizer")
    meta = read_meta(out / "data")
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (meta["bos_id"], meta["eos_id"], meta["pad_id"])
    # transformers frames text as the shards do (bos first; eos is the shards' document end).
    assert hf(STDLIB_TEXTS[0])["input_ids"] == records(out, "train")[0][:-1].tolist()

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|user|>"}]
    text = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|system|>Be brief.<|eos|><|user|>Hi <|user|><|eos|><|assistant|>"
    ids = hf(text, add_special_tokens=False)["input_ids"]  # each role marker is one token
    assert ids[:2] == [hf.bos_token_id, hf.convert_tokens_to_ids("<|system|>")]
    with pytest.raises(Exception, match="unknown chat role: robot"):
        hf.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_loading_a_hugging_face_directory_keeps_it_unchanged(tmp_path):
    from transformers import PreTrainedTokenizerFast

    base = train_tokenizer(TokenizerConfig(vocab_size=400, chat_roles=[]), STDLIB_TEXTS, add_bos=False)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    PreTrainedTokenizerFast(
        tokenizer_object=base.tokenizer, eos_token="<|eos|>", bos_token="<|bos|>", chat_template=template
    ).save_pretrained(tmp_path / "hf")
    out = tmp_path / "out"
    run_stage(
        out,
        {"sources": [{"format": "text", "path": "{stdlib}/json/*.py"}], "tokenizer": {"path": str(tmp_path / "hf")}},
        validation_fraction=0,
        add_bos=False,
    )
    before = PreTrainedTokenizerFast.from_pretrained(tmp_path / "hf")
    after = PreTrainedTokenizerFast.from_pretrained(out / "tokenizer")
    assert after.chat_template == before.chat_template == template
    for text in STDLIB_TEXTS:
        assert after(text)["input_ids"] == before(text)["input_ids"]
    assert (after.eos_token, after.bos_token, after.pad_token) == ("<|eos|>", "<|bos|>", None)
    assert records(out, "train")[0][0] != after.bos_token_id  # add_bos: false


def test_bare_tokenizer_json_needs_an_eos_and_gains_missing_specials(tmp_path):
    bundle = train_tokenizer(TokenizerConfig(vocab_size=400, chat_roles=[]), STDLIB_TEXTS, add_bos=True)
    bundle.tokenizer.save(str(tmp_path / "bare.json"))
    with pytest.raises(
        ConfigError,
        match=r"tokenizer\.eos_token: .*bare\.json does not say which token ends a "
        r"document; .*\(its special tokens: <\|bos\|>, <\|eos\|>, <\|pad\|>\)",
    ):
        load_tokenizer(TokenizerConfig(path=str(tmp_path / "bare.json")))
    loaded = load_tokenizer(
        TokenizerConfig(path=str(tmp_path / "bare.json"), eos_token="<|eos|>", pad_token="<pad>", chat_roles=["user"])
    )
    assert loaded.eos_id == bundle.eos_id and loaded.pad_id == 400  # added after the vocabulary
    assert loaded.tokenizer.token_to_id("<|user|>") == 401 and loaded.vocab_size == 402
    with pytest.raises(ConfigError, match=r"tokenizer\.path: .*missing\.json does not exist"):
        load_tokenizer(TokenizerConfig(path=str(tmp_path / "missing.json")))


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_sentencepiece_model_matches_sentencepiece(tmp_path, model_type):
    spm = need("sentencepiece")
    corpus = write_lines(tmp_path / "corpus.txt", [l for t in STDLIB_TEXTS for l in t.splitlines() if l.strip()])
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=300, model_type=model_type, minloglevel=2
    )
    reference = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    lines = corpus.read_text().splitlines()[:200]

    out = tmp_path / "out"
    run_stage(
        out,
        {
            "sources": [{"format": "text", "path": str(corpus), "unit": "line"}],
            "tokenizer": {"path": str(tmp_path / "sp.model")},
        },
        validation_fraction=0,
    )
    meta = read_meta(out / "data")
    assert (meta["bos_id"], meta["eos_id"]) == (reference.bos_id(), reference.eos_id())
    assert meta["vocab_size"] == reference.get_piece_size()
    for line, record in zip(lines, records(out, "train")):
        assert record[1:-1].tolist() == reference.encode(line)
    assert documents(out)[:3] == [reference.decode(reference.encode(l)) for l in lines[:3]]


def test_a_resumed_run_reuses_the_tokenizer_it_saved(tmp_path, monkeypatch):
    from tokenizers import Tokenizer

    import engine.data.tokenize

    source = {"format": "text", "path": str(write_lines(tmp_path / "a.txt", ["alpha beta", "gamma"])), "unit": "line"}
    out = tmp_path / "out"

    def killed(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.data.tokenize._Encoder, "run", killed)
    with pytest.raises(KeyboardInterrupt):
        run_stage(out, {"sources": [source]})
    monkeypatch.undo()
    staged = out / ".work" / "tokenizer" / "tokenizer.json"
    marked = Tokenizer.from_file(str(staged))
    marked.add_special_tokens(["<|marker|>"])  # a retrained tokenizer would not have it
    marked.save(str(staged))
    run_stage(out, {"sources": [source]})
    assert Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json")).token_to_id("<|marker|>") is not None
