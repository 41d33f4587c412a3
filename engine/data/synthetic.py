"""Synthetic arithmetic word problems with verifiable answers (the quickstart's data).

Deterministic for a seed. Every problem is identified by its template and numbers, and a
hash of that identity decides its split, so train and evaluation never share a problem
whatever the counts asked for.

Output directory:

    pretrain.txt   one worked problem per line, in narrative form (the pretraining corpus)
    sft.jsonl      {"prompt", "completion", "answer"}: the question/answer format
    rl.jsonl       {"prompt", "answer"}: prompts for GRPO, disjoint from sft.jsonl
    eval.jsonl     {"prompt", "answer"}: held out from everything above
    prefs.jsonl    {"prompt", "chosen", "rejected", "answer"}: with preference_pairs > 0, RL
                   problems as preference pairs, the right answer over a near miss
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
from pydantic import Field

from engine.config import Strict

NAMES = ["Ana", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Max", "Nia"]
THINGS = ["apples", "books", "coins", "shells", "stamps", "pens", "cards", "marbles", "beads", "rocks"]

# (operation, question template, narrative template). {a} and {b} are the numbers.
TEMPLATES = [
    (
        "add",
        "{n} has {a} {t} and finds {b} more. How many {t} does {n} have now?",
        "{n} has {a} {t} and finds {b} more, so {n} has {r} {t}.",
    ),
    (
        "add",
        "{n} had {a} {t}. A friend gave {n} {b} {t}. How many {t} does {n} have?",
        "{n} had {a} {t} and got {b} more from a friend, making {r} {t}.",
    ),
    (
        "sub",
        "{n} has {a} {t} and gives away {b}. How many {t} are left?",
        "{n} has {a} {t} and gives away {b}, leaving {r} {t}.",
    ),
    (
        "sub",
        "There are {a} {t} in a box. {n} takes out {b}. How many {t} are in the box?",
        "There were {a} {t} in a box and {n} took out {b}, so {r} {t} remain.",
    ),
]

ANSWER_PREFIX = "Answer:"  # the answer follows as " 19": a space-prefixed number, as in the corpus


class ArithmeticConfig(Strict):
    """How many problems of each kind, and how hard."""

    seed: int = 0
    max_number: int = Field(20, ge=2, le=10_000)
    """Operands are drawn from 0..max_number (subtraction never goes below zero)."""
    pretrain_problems: int = Field(20_000, ge=1)
    sft_problems: int = Field(2_000, ge=1)
    rl_problems: int = Field(2_000, ge=1)
    eval_problems: int = Field(500, ge=1)
    preference_pairs: int = Field(0, ge=0)
    """Also write prefs.jsonl: this many of the RL problems as preference pairs (TRL's
    prompt/chosen/rejected), the right answer chosen over a near miss (off by 1 to 3)."""


def _identity(template: int, name: str, thing: str, a: int, b: int) -> str:
    return f"{template}|{name}|{thing}|{a}|{b}"


def _split_of(identity: str, seed: int) -> str:
    """pretrain 70%, sft 10%, rl 10%, eval 10%, by a hash of the problem (order-free)."""
    bucket = int.from_bytes(hashlib.sha256(f"{seed}:{identity}".encode()).digest()[:4], "little") % 10
    return "pretrain" if bucket < 7 else ("sft", "rl", "eval")[bucket - 7]


def make_problem(template: int, name: str, thing: str, a: int, b: int) -> dict:
    op, question, narrative = TEMPLATES[template]
    result = a + b if op == "add" else a - b
    fields = dict(n=name, t=thing, a=a, b=b, r=result)
    return {
        "question": question.format(**fields),
        "narrative": narrative.format(**fields),
        "answer": str(result),
    }


def format_prompt(question: str) -> str:
    return f"Question: {question}\n{ANSWER_PREFIX}"


def generate(cfg: ArithmeticConfig) -> dict[str, list[dict]]:
    """Problems per split: sample identities with the seed until each split is full."""
    rng = np.random.default_rng(cfg.seed)
    want = {
        "pretrain": cfg.pretrain_problems,
        "sft": cfg.sft_problems,
        "rl": cfg.rl_problems,
        "eval": cfg.eval_problems,
    }
    out: dict[str, list[dict]] = {k: [] for k in want}
    seen: set[str] = set()
    space = len(TEMPLATES) * len(NAMES) * len(THINGS) * (cfg.max_number + 1) ** 2
    attempts = 0
    while any(len(out[k]) < want[k] for k in want):
        attempts += 1
        if attempts > 20 * space + 1000:
            raise ValueError(f"max_number={cfg.max_number} allows too few distinct problems for the counts asked")
        template = int(rng.integers(len(TEMPLATES)))
        a, b = (int(x) for x in rng.integers(0, cfg.max_number + 1, 2))
        if TEMPLATES[template][0] == "sub" and b > a:
            a, b = b, a
        name, thing = NAMES[int(rng.integers(len(NAMES)))], THINGS[int(rng.integers(len(THINGS)))]
        identity = _identity(template, name, thing, a, b)
        split = _split_of(identity, cfg.seed)
        if split == "pretrain":
            # Pretraining text may repeat a problem (a corpus does); the others are distinct.
            if len(out["pretrain"]) < want["pretrain"]:
                out["pretrain"].append(make_problem(template, name, thing, a, b))
            continue
        if identity in seen or len(out[split]) >= want[split]:
            continue
        seen.add(identity)
        out[split].append(make_problem(template, name, thing, a, b))
    return out


def write_arithmetic(cfg: ArithmeticConfig, out_dir: str | Path) -> dict:
    """Write the four files (each atomically); returns counts."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    problems = generate(cfg)

    def write(name: str, lines: list[str]) -> None:
        tmp = out_dir / f"{name}.tmp"
        tmp.write_text("".join(line + "\n" for line in lines))
        os.replace(tmp, out_dir / name)

    write("pretrain.txt", [p["narrative"] for p in problems["pretrain"]])
    write(
        "sft.jsonl",
        [
            json.dumps(
                {"prompt": format_prompt(p["question"]), "completion": " " + p["answer"] + "\n", "answer": p["answer"]}
            )
            for p in problems["sft"]
        ],
    )
    for split in ("rl", "eval"):
        write(
            f"{split}.jsonl",
            [json.dumps({"prompt": format_prompt(p["question"]), "answer": p["answer"]}) for p in problems[split]],
        )
    counts = {f"{split}_problems": len(items) for split, items in problems.items()}
    if cfg.preference_pairs:
        pairs = preference_pairs(problems["rl"][: cfg.preference_pairs], cfg.seed)
        write("prefs.jsonl", [json.dumps(pair) for pair in pairs])
        counts["preference_pairs"] = len(pairs)
    return counts


def preference_pairs(problems: list[dict], seed: int) -> list[dict]:
    """The right answer chosen over a near miss, off by 1 to 3 (never below zero)."""
    rng = np.random.default_rng([seed, 1])
    pairs = []
    for p in problems:
        right = int(p["answer"])
        wrong = right + int(rng.choice([-3, -2, -1, 1, 2, 3]))
        wrong = wrong if wrong >= 0 else right + abs(wrong - right)
        pairs.append(
            {
                "prompt": format_prompt(p["question"]),
                "chosen": f" {right}\n",
                "rejected": f" {wrong}\n",
                "answer": p["answer"],
            }
        )
    return pairs
