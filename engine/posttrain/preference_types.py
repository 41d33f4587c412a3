"""The names of the preference losses (engine/posttrain/preference_loss.py defines them) and
which of them need what, kept free of JAX so that validating a pipeline does not import it."""

from __future__ import annotations

from typing import Literal, get_args

LossType = Literal[
    "sigmoid",
    "robust",
    "hinge",
    "ipo",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "sigmoid_norm",
    "simpo",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "aot",
    "aot_unpaired",
    "discopop",
    "orpo",
    "sft",
]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
REFERENCE_FREE = ("simpo", "orpo", "sft")
"""Terms that read no reference model; a run whose every term is one of them loads none."""
MEAN_LOGP = ("simpo", "orpo")
"""Terms over the mean log-prob per completion token; each stands alone (not in a list), and
its implicit rewards are beta x that mean (trl's CPO and ORPO)."""
LABEL_SMOOTHING = ("robust", "simpo", "exo_pair", "aot", "aot_unpaired")
"""The terms that read label_smoothing (TRL's sigmoid ignores it)."""
SORTED = ("aot", "aot_unpaired")
"""Terms that sort over the pairs of a micro-batch."""
