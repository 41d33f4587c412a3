"""The tokenizer of a tokenize stage: train a byte-level BPE, or load an existing one; save it.

A trained tokenizer is byte-level BPE (Hugging Face `tokenizers`): text is split with the
GPT-4 / Llama-3 pre-tokenization regex, mapped to bytes, and merged. Every byte has a token,
so nothing is ever unknown and decode(encode(text)) == text.

Whatever its origin, the tokenizer is saved as a Hugging Face tokenizer directory
(tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja) that
`transformers.PreTrainedTokenizerFast.from_pretrained` loads as is; writing it needs only
`tokenizers`. Loading a SentencePiece `.model` uses the `transformers` converter.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field, model_validator
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from engine.config import ConfigError, Strict

# GPT-4 (cl100k) / Llama-3 split: contractions, words, numbers of up to 3 digits, punctuation
# runs, newlines, other whitespace. Keeps merges inside these pieces; code splits well.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TRAINED_DEFAULTS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
DEFAULT_CHAT_ROLES = ["system", "user", "assistant"]
BYTE_ALPHABET_SIZE = 256


class TokenizerConfig(Strict):
    """Train a byte-level BPE tokenizer on the corpus, or load an existing one (`path`)."""

    path: str | None = None
    """Load this tokenizer instead of training one: a tokenizer.json file, a Hugging Face
    tokenizer directory, or a SentencePiece .model file."""
    vocab_size: int = Field(32768, gt=0)
    """Training: vocabulary size, the 256 byte tokens and the special tokens included."""
    min_frequency: int = Field(2, ge=1)
    """Training: a pair of tokens is merged only if it occurs at least this often."""
    train_max_mb: float = Field(256.0, gt=0)
    """Training: at most this much text (MB of UTF-8) is read to learn the merges, shared
    among the sources in proportion to weight x size."""
    bos_token: str | None = None
    """Beginning-of-document token. None: `<|bos|>` for a trained tokenizer, the loaded
    tokenizer's own otherwise. A token a loaded vocabulary lacks is added as a special token."""
    eos_token: str | None = None
    """End-of-document token (required: every document ends with it). None as for bos_token."""
    pad_token: str | None = None
    """Padding token. None as for bos_token."""
    chat_roles: list[str] | None = None
    """Chat roles that get a special token `<|role|>`. None: system, user, assistant for a
    trained tokenizer, none for a loaded one."""
    chat_template: str | None = None
    """Jinja chat template saved with the tokenizer. None: the loaded tokenizer's own; for a
    trained tokenizer with chat roles, `<|role|>content<eos>` per message."""

    @model_validator(mode="after")
    def _check(self) -> TokenizerConfig:
        for name in ("bos_token", "eos_token", "pad_token"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} must not be empty (use null for the default)")
        for role in self.chat_roles or []:
            if not role or not role.replace("_", "").isalnum():
                raise ValueError(f"chat role {role!r} must be a non-empty word (letters, digits, _)")
        return self


@dataclass
class TokenizerBundle:
    """A `tokenizers.Tokenizer` plus what a Hugging Face tokenizer directory says about it."""

    tokenizer: Tokenizer
    eos_token: str
    bos_token: str | None = None
    pad_token: str | None = None
    extra_special_tokens: list[str] = field(default_factory=list)
    chat_template: str | None = None

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self.token_id(self.bos_token)

    @property
    def eos_id(self) -> int:
        eos = self.tokenizer.token_to_id(self.eos_token)
        assert eos is not None, "load_tokenizer adds the end-of-document token to the vocabulary"
        return eos

    @property
    def pad_id(self) -> int | None:
        return self.token_id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        """Largest id + 1: the embedding rows a model needs (ids may have holes)."""
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1


# --------------------------------------------------------------------------- training


def role_token(role: str) -> str:
    return f"<|{role}|>"


def default_chat_template(roles: list[str], *, add_bos: bool) -> str:
    """`<|role|>content<eos>` per message; `<|assistant|>` opens the reply to generate."""
    allowed = ", ".join(repr(r) for r in roles)
    opener = "{{ bos_token }}" if add_bos else ""
    reply = "{% if add_generation_prompt %}<|assistant|>{% endif %}" if "assistant" in roles else ""
    return (
        opener
        + "{% for message in messages %}"
        + f"{{% if message['role'] not in [{allowed}] %}}"
        + "{{ raise_exception('unknown chat role: ' + message['role']) }}{% endif %}"
        + "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
        + "{% endfor %}"
        + reply
    )


def new_byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(cfg: TokenizerConfig, texts: Iterable[str], *, add_bos: bool) -> TokenizerBundle:
    """Learn byte-level BPE merges from `texts` (deterministic for the same texts in order)."""
    names = {key: getattr(cfg, key) or default for key, default in TRAINED_DEFAULTS.items()}
    roles = DEFAULT_CHAT_ROLES if cfg.chat_roles is None else cfg.chat_roles
    specials = list(dict.fromkeys([*names.values(), *(role_token(r) for r in roles)]))
    smallest = BYTE_ALPHABET_SIZE + len(specials)
    if cfg.vocab_size < smallest:
        raise ConfigError(
            f"tokenizer.vocab_size ({cfg.vocab_size}) must be at least {smallest} "
            f"({BYTE_ALPHABET_SIZE} byte tokens + {len(specials)} special tokens)"
        )
    tok = new_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=specials,  # ids 0..len-1, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # `tokenizer(text)` in transformers then frames text the way the shards do (bos first).
    bos = names["bos_token"]
    tok.post_processor = (
        processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
        if add_bos
        else processors.ByteLevel(trim_offsets=False)
    )
    template = cfg.chat_template
    if template is None and roles:
        template = default_chat_template(roles, add_bos=add_bos)
    return TokenizerBundle(
        tok,
        eos_token=names["eos_token"],
        bos_token=names["bos_token"],
        pad_token=names["pad_token"],
        extra_special_tokens=[role_token(r) for r in roles],
        chat_template=template,
    )


# --------------------------------------------------------------------------- loading


def _token_text(value) -> str | None:
    """tokenizer_config.json stores a token as a string or as a serialised AddedToken."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"tokenizer.path: cannot read {path}: {e}") from None


def _hf_directory(directory: Path) -> tuple[Tokenizer, dict]:
    """A Hugging Face tokenizer directory -> (tokenizer, {bos_token, ..., chat_template})."""
    settings: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        if (directory / name).is_file():
            data = _read_json(directory / name)
            for key in ("bos_token", "eos_token", "pad_token"):
                if _token_text(data.get(key)):
                    settings[key] = _token_text(data[key])
            extra = data.get("extra_special_tokens") or data.get("additional_special_tokens") or []
            if isinstance(extra, dict):  # transformers 5 also allows named extra tokens
                extra = list(extra.values())
            if isinstance(extra, list) and extra:
                settings["extra_special_tokens"] = [t for t in map(_token_text, extra) if t]
            if data.get("chat_template"):
                settings["chat_template"] = data["chat_template"]
    if (directory / "chat_template.jinja").is_file():
        settings["chat_template"] = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    elif (directory / "chat_template.json").is_file():
        settings["chat_template"] = _read_json(directory / "chat_template.json").get("chat_template")
    template = settings.get("chat_template")
    if isinstance(template, list):  # [{name, template}, ...]: keep the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        settings["chat_template"] = named.get("default") or next(iter(named.values()), None)

    if (directory / "tokenizer.json").is_file():
        return _tokenizer_file(directory / "tokenizer.json"), settings
    if (directory / "tokenizer.model").is_file():
        tok, spm_settings = _sentencepiece(directory / "tokenizer.model")
        return tok, {**spm_settings, **settings}
    try:  # a slow-only directory (vocab.json + merges.txt, ...): let transformers convert it
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(
            f"tokenizer.path: {directory} has no tokenizer.json or tokenizer.model "
            "(install transformers to convert other tokenizer formats)"
        ) from None
    try:
        hf = AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:  # noqa: BLE001 - any failure here is a bad directory
        raise ConfigError(f"tokenizer.path: transformers cannot load {directory}: {e}") from None
    return hf.backend_tokenizer, settings


def _tokenizer_file(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise ConfigError(f"tokenizer.path: {path} is not a valid tokenizer.json: {e}") from None


def _sentencepiece(path: Path) -> tuple[Tokenizer, dict]:
    """A SentencePiece model, converted with transformers' converter (needs protobuf)."""
    try:
        from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

        model_pb2 = import_protobuf()
    except ImportError:
        raise ConfigError(
            f"tokenizer.path: loading the SentencePiece model {path} needs transformers and protobuf"
        ) from None
    proto = model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as e:  # noqa: BLE001 - protobuf DecodeError
        raise ConfigError(f"tokenizer.path: {path} is not a SentencePiece model: {e}") from None
    pieces = [(p.piece, p.score) for p in proto.pieces]
    if not pieces:
        raise ConfigError(f"tokenizer.path: {path} is not a SentencePiece model (no pieces)")
    model_type = proto.trainer_spec.model_type  # 1 unigram, 2 bpe, 3 word, 4 char
    vocab: list[tuple[str, float]] | dict[str, int]
    if model_type == 1:
        vocab = pieces
    elif model_type == 2:
        vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
    else:
        raise ConfigError(f"tokenizer.path: {path} is a SentencePiece word/char model; only unigram and BPE load")
    tok = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    spec = proto.trainer_spec
    settings = {}
    for key, index in (("bos_token", spec.bos_id), ("eos_token", spec.eos_id), ("pad_token", spec.pad_id)):
        if 0 <= index < len(pieces):
            settings[key] = pieces[index][0]
    return tok, settings


def load_tokenizer(cfg: TokenizerConfig) -> TokenizerBundle:
    """Load `cfg.path`; the config's special tokens override (or extend) the loaded ones."""
    assert cfg.path is not None  # a tokenizer to load (a trained one has none: tokenize trains it)
    path = Path(os.path.expanduser(cfg.path))
    if path.is_dir():
        tok, settings = _hf_directory(path)
    elif path.suffix == ".model" and path.is_file():
        tok, settings = _sentencepiece(path)
    elif path.is_file():
        tok, settings = _tokenizer_file(path), {}
        if (path.parent / "tokenizer_config.json").is_file() and path.name == "tokenizer.json":
            settings = _hf_directory(path.parent)[1]
    else:
        raise ConfigError(f"tokenizer.path: {path} does not exist")

    chosen = {key: getattr(cfg, key) or settings.get(key) for key in TRAINED_DEFAULTS}
    if not chosen["eos_token"]:
        specials = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
        raise ConfigError(
            f"tokenizer.eos_token: {path} does not say which token ends a document; set "
            f"tokenizer.eos_token (its special tokens: {', '.join(specials) or 'none'})"
        )
    roles = [role_token(r) for r in cfg.chat_roles or []]
    extra = list(dict.fromkeys([*settings.get("extra_special_tokens", []), *roles]))
    missing = [t for t in [*chosen.values(), *extra] if t and tok.token_to_id(t) is None]
    if missing:
        tok.add_special_tokens(list(dict.fromkeys(missing)))
    return TokenizerBundle(
        tok,
        eos_token=chosen["eos_token"],
        bos_token=chosen["bos_token"],
        pad_token=chosen["pad_token"],
        extra_special_tokens=extra,
        chat_template=cfg.chat_template or settings.get("chat_template"),
    )


def build_tokenizer(cfg: TokenizerConfig, texts: Iterable[str] | None, *, add_bos: bool) -> TokenizerBundle:
    return load_tokenizer(cfg) if cfg.path else train_tokenizer(cfg, texts or [], add_bos=add_bos)


# --------------------------------------------------------------------------- saving


def save_tokenizer(bundle: TokenizerBundle, directory: str | Path) -> None:
    """A Hugging Face tokenizer directory, written to a temporary name and renamed."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    bundle.tokenizer.save(str(tmp / "tokenizer.json"), pretty=True)
    special = {key: getattr(bundle, key) for key in ("bos_token", "eos_token", "pad_token") if getattr(bundle, key)}
    if bundle.extra_special_tokens:
        special["additional_special_tokens"] = bundle.extra_special_tokens
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "extra_special_tokens": bundle.extra_special_tokens,  # transformers >= 5 spelling
        # Byte-level BPE is lossless: never "clean up" spaces when decoding.
        "clean_up_tokenization_spaces": False,
    }
    if bundle.chat_template:
        config["chat_template"] = bundle.chat_template  # read by older transformers
        (tmp / "chat_template.jinja").write_text(bundle.chat_template, encoding="utf-8")
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (tmp / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n")
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)


def load_saved(directory: str | Path) -> TokenizerBundle:
    """Reload a directory written by `save_tokenizer` (no config overrides)."""
    tok, settings = _hf_directory(Path(directory))
    return TokenizerBundle(
        tok,
        eos_token=settings["eos_token"],
        bos_token=settings.get("bos_token"),
        pad_token=settings.get("pad_token"),
        extra_special_tokens=settings.get("extra_special_tokens", []),
        chat_template=settings.get("chat_template"),
    )
