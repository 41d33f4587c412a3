"""lm-evaluation-harness over the engine: the `trainflow` model of lm-eval (the `eval` extra).

`TrainflowLM` answers lm-eval's three request types with the engine's own pieces, batched on
a device mesh (params sharded as in training, rows over the data axes):

    loglikelihood          (context, continuation) -> (sum log p(continuation), is it greedy)
    loglikelihood_rolling  a document -> sum log p, in disjoint windows of max_length tokens
    generate_until         (context, gen_kwargs) -> text, from the KV-cache Sampler

Tokenization, the empty-context prefix, truncation and the rolling windows are lm-eval's own
(TemplateLM, lm_eval.utils) and follow its `hf` model token for token, so a checkpoint scores
what its Hugging Face export scores (tests/test_harness.py: within 1e-4). Scoring rows are
right-padded to a length bucket (engine/inference/sample.py: length_bucket), so one
compilation serves every batch of a bucket; padding is a segment of its own (id 0) that no
real token attends to.

Every process of a multi-process run is lm-eval's rank 0 of 1: each holds all requests and
the mesh computes each batch once, jointly. `run_harness` is what the evaluate stage calls
(engine/evaluate/evaluate.py: `harness:`); from the shell lm-eval 0.4 finds no plug-in models
(its registry reads no entry points), so `python -m engine.evaluate.harness_cli` is lm-eval's
own command line with `trainflow` registered first.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

from engine.config import ConfigError
from engine.data import urls
from engine.data.tokenizer import TokenizerBundle, load_saved
from engine.evaluate.config import HarnessConfig
from engine.inference.sample import Sampler, checkpoint_in, left_pad, length_bucket, tokenizer_dir_for
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.params import abstract_model_params, apply_model, graphdef_of
from engine.ops.cross_entropy import log_z_and_target
from engine.ops.partitioning import use_mesh
from engine.parallel.config import MeshConfig, unsplittable
from engine.parallel.mesh import batch_sharding, batch_shards, global_array, make_mesh, to_host
from engine.train.checkpoint import load_params, stored_configs

MODEL_NAME = "trainflow"
"""The name lm-eval knows the adapter by: `--model trainflow`."""


@dataclass
class LoadedModel:
    """A model ready to score: its configs, params on `mesh` (or one device when None), its tokenizer."""

    model_cfg: ModelConfig
    compute: ComputeConfig
    params: Any
    bundle: TokenizerBundle
    mesh: Any = None
    param_shardings: Any = None
    step: int = 0


def load_model(
    checkpoint: str | Path,
    tokenizer: str | Path | None = None,
    *,
    mesh: MeshConfig | None = None,
    step: int | None = None,
    dtype: str | None = None,
) -> LoadedModel:
    """A checkpoint (or a checkpoint artifact holding checkpoint/) placed on a mesh, with the
    tokenizer beside it (or `tokenizer`); `dtype` overrides the stored compute dtypes."""
    checkpoint = checkpoint_in(checkpoint)
    tokenizer_dir = urls.existing_folder(tokenizer) if tokenizer else tokenizer_dir_for(checkpoint)
    if tokenizer_dir is None:
        raise ConfigError(f"no tokenizer next to {checkpoint}; pass the model argument tokenizer=DIR")
    model_cfg, compute = stored_configs(checkpoint, step)
    if dtype is not None:
        if dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"model argument dtype={dtype}: expected float32 or bfloat16")
        compute = compute.model_copy(update={"dtype": dtype, "param_dtype": dtype})
    device_mesh = make_mesh(mesh or MeshConfig())
    abstract = abstract_model_params(model_cfg, compute, device_mesh)
    _, params, step = load_params(checkpoint, abstract, step)
    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    return LoadedModel(model_cfg, compute, params, load_saved(tokenizer_dir), device_mesh, shardings, step)


def continuation_scores(graphdef, params, tokens_bt, targets_bt, segment_ids_bt, score_mask_bt):
    """(sum of log p(target) over the scored positions, whether each scored target is the
    argmax) per row: teacher forcing over right-padded rows."""
    positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    logits_btv = apply_model(graphdef, params, tokens_bt, positions_bt, segment_ids_bt)
    log_z_bt, target_bt = log_z_and_target(logits_btv, targets_bt)
    mask_bt = score_mask_bt.astype(bool)
    logprob_b = jnp.sum(jnp.where(mask_bt, target_bt - log_z_bt, 0.0), axis=1)
    # Greedy: the target's logit is the largest (a tie counts as greedy; HF's argmax picks one).
    top_bt = jnp.max(logits_btv, axis=-1).astype(jnp.float32)
    greedy_b = jnp.all(~mask_bt | (target_bt >= top_bt), axis=1)
    return logprob_b, greedy_b


@register_model(MODEL_NAME)
class TrainflowLM(TemplateLM):
    """lm-eval's `trainflow` model: `--model_args checkpoint=DIR[,tokenizer=DIR,step=N,
    batch_size=16,max_length=N,max_gen_toks=256,dtype=float32,seed=0,data=-1,fsdp=1,tensor=1,
    expert=1,context=1]` (the last five: the mesh's axis sizes)."""

    MESH_AXES = tuple(MeshConfig.model_fields)

    def __init__(
        self,
        checkpoint: str | None = None,
        tokenizer: str | None = None,
        step: int | None = None,
        batch_size: int | str = 16,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        dtype: str | None = None,
        seed: int = 0,
        *,
        loaded: LoadedModel | None = None,
        progress: bool = True,
        **kwargs,
    ):
        super().__init__()
        mesh_sizes = {axis: kwargs.pop(axis) for axis in self.MESH_AXES if axis in kwargs}
        kwargs.pop("device", None)  # lm-eval passes its --device and --max_batch_size to every model
        kwargs.pop("max_batch_size", None)
        if kwargs:
            valid = ["checkpoint", "tokenizer", "step", "batch_size", "max_length", "max_gen_toks", "dtype", "seed"]
            name = sorted(kwargs)[0]
            close = difflib.get_close_matches(name, valid + list(self.MESH_AXES), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid: {', '.join(valid + list(self.MESH_AXES))}"
            raise ConfigError(f"model argument '{name}' is not one of the trainflow model's{hint}")
        if loaded is None:
            if not checkpoint:
                raise ConfigError("the trainflow model needs checkpoint=DIR (a checkpoint or a checkpoint artifact)")
            loaded = load_model(checkpoint, tokenizer, mesh=MeshConfig(**mesh_sizes), step=step, dtype=dtype)
        if batch_size == "auto" or (isinstance(batch_size, str) and batch_size.startswith("auto")):
            batch_size = 16  # no probing: batches are bucketed, so one size serves every length
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ConfigError(f"model argument batch_size={batch_size}: must be >= 1")
        self.loaded = loaded
        self.bundle = loaded.bundle
        self.model_cfg = loaded.model_cfg
        self._max_length = int(max_length or self.model_cfg.max_seq_len)
        if self._max_length > self.model_cfg.max_seq_len:
            raise ConfigError(
                f"model argument max_length={self._max_length} exceeds the model's max_seq_len "
                f"({self.model_cfg.max_seq_len})"
            )
        self.max_gen_toks, self.seed, self.progress = int(max_gen_toks), int(seed), progress
        compute = loaded.compute.model_copy(update={"remat": "none"})  # no backward pass here
        self._graphdef = graphdef_of(self.model_cfg, compute)
        self._score = self._jit_score(loaded.mesh, loaded.param_shardings)
        self._sampler = Sampler(self.model_cfg, compute, loaded.mesh, loaded.param_shardings)
        self._shards = 1 if loaded.mesh is None else batch_shards(loaded.mesh)
        self._context = 1 if loaded.mesh is None else loaded.mesh.shape["context"]

    # lm-eval passes its own --batch_size (default 1), --max_batch_size and --device beside
    # the --model_args to every model, as keywords: a batch_size in both would be given twice
    # (a TypeError for every lm-eval model, `hf` included). Here the model's own arguments win.
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> TrainflowLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> TrainflowLM:
        given = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**given, **arg_dict})

    def _jit_score(self, mesh, param_shardings):
        fn = lambda params, *rows: continuation_scores(self._graphdef, params, *rows)
        if mesh is None:
            return jax.jit(fn)
        rows = batch_sharding(mesh)
        return jax.jit(
            fn, in_shardings=(param_shardings, rows, rows, rows, rows), out_shardings=batch_sharding(mesh, 1)
        )

    # -- what TemplateLM asks of a model
    @property
    def eot_token_id(self) -> int:
        return self.bundle.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is: BOS, else EOS (as lm-eval's hf model)."""
        return self.bundle.bos_id if self.bundle.bos_id is not None else self.bundle.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return f"trainflow-{self.bundle.vocab_size}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The tokenizer's framing (its BOS) unless asked otherwise or the text already starts with BOS."""
        if add_special_tokens is None:
            bos = self.bundle.bos_token
            add_special_tokens = not (bos and string.startswith(bos))
        return self.bundle.tokenizer.encode(string, add_special_tokens=add_special_tokens).ids

    def tok_decode(self, tokens: Sequence[int] | int, skip_special_tokens: bool = True) -> str:
        tokens = [tokens] if isinstance(tokens, int) else list(tokens)
        return self.bundle.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # -- scoring
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) or None, context ids, continuation ids). Over-long
        rows keep their last max_length + 1 tokens, as lm-eval's hf model does."""
        rows = []
        for _, context_ids, continuation_ids in requests:
            assert context_ids and continuation_ids and len(continuation_ids) <= self.max_length
            whole = (list(context_ids) + list(continuation_ids))[-(self.max_length + 1) :]
            rows.append((whole[:-1], whole[1:], len(continuation_ids)))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # similar lengths share a batch
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            logprobs, greedy = self._score_rows([rows[i] for i in chunk])
            for i, logprob, is_greedy in zip(chunk, logprobs, greedy):
                results[i] = (float(logprob), bool(is_greedy))
        for (pair, _, _), result in zip(requests, results):
            if pair is not None:
                self.cache_hook.add_partial("loglikelihood", pair, result)
        return results

    def _score_rows(self, rows: list[tuple[list[int], list[int], int]]) -> tuple[np.ndarray, np.ndarray]:
        """(logprob, greedy) of (inputs, targets, scored tail length) rows, right-padded to a
        length bucket."""
        longest = max(len(inputs) for inputs, _, _ in rows)
        length = min(length_bucket(longest), max(longest, self.model_cfg.max_seq_len))
        length += -length % self._context
        if unsplittable(length, self._context, "a scored row"):
            raise ConfigError(unsplittable(length, self._context, "a scored row"))
        # Every batch has batch_size rows (rounded up to the mesh's row shards), so one compilation
        # per length bucket serves them all; the extra rows are all padding, score 0 and are dropped.
        n = max(len(rows), self.batch_size)
        n += -n % self._shards
        tokens, targets, segments, scored = (np.zeros((n, length), np.int32) for _ in range(4))
        for r, (inputs, row_targets, tail) in enumerate(rows):
            tokens[r, : len(inputs)], targets[r, : len(inputs)], segments[r, : len(inputs)] = inputs, row_targets, 1
            scored[r, len(inputs) - tail : len(inputs)] = 1
        arrays: tuple = (tokens, targets, segments, scored)
        if self.loaded.mesh is not None:  # global arrays: any process layout (every process holds all rows)
            arrays = tuple(global_array(a, batch_sharding(self.loaded.mesh)) for a in arrays)
        with use_mesh(self.loaded.mesh):
            logprob_b, greedy_b = self._score(self.loaded.params, *arrays)
        return to_host(logprob_b)[: len(rows)], to_host(greedy_b)[: len(rows)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document in disjoint windows of up to max_length predicted tokens (the first
        predicted from the prefix token), summed: lm-eval's hf model's windows."""
        windows, owners = [], []
        for index, (string,) in enumerate(request.args for request in requests):
            for context_ids, continuation_ids in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context_ids, continuation_ids))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Completions from the KV-cache sampler, cut at the first stop string. Decoding stops
        at EOS or max_gen_toks (stop strings are applied to the text afterwards)."""
        results: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):  # one sampler setting per group of equal gen_kwargs
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        eos_text = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(requests[members[0]].args[1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            if max_gen_toks >= self.max_length:
                raise ConfigError(
                    f"max_gen_toks ({max_gen_toks}) must be below the model's max_length ({self.max_length})"
                )
            temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
            top_k, top_p = int(kwargs.get("top_k") or 0), float(kwargs.get("top_p") or 1.0)
            budget = self.max_length - max_gen_toks  # the context keeps its last tokens
            encoded = {i: self.tok_encode(requests[i].args[0])[-budget:] for i in members}
            members = sorted(members, key=lambda i: -len(encoded[i]))
            for start in range(0, len(members), self.batch_size):
                chunk = members[start : start + self.batch_size]
                pad = self.bundle.pad_id if self.bundle.pad_id is not None else self.eot_token_id
                # A short last batch is filled with copies of its last prompt (dropped below), so
                # every batch has the same rows and the sampler compiles once per length bucket.
                prompts = [encoded[i] for i in chunk] + [encoded[chunk[-1]]] * (self.batch_size - len(chunk))
                tokens, mask = left_pad(prompts, pad_id=pad)
                output = self._sampler(
                    self.loaded.params,
                    tokens,
                    mask,
                    seed=self.seed + start,
                    max_new_tokens=max_gen_toks,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    eos_ids=(self.eot_token_id,),
                    pad_id=pad,
                )
                for i, row, row_mask in zip(chunk, output.tokens, output.mask):
                    text = self.tok_decode(row[row_mask].tolist())
                    results[i] = postprocess_generated_text(text, until, None)
                    self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
        return results


# --------------------------------------------------------------------------- the evaluate stage's hook


@dataclass
class HarnessTasks:
    """Harness tasks resolved once for every model of an evaluation: the task manager
    (its index of task YAMLs) and the task names it matched."""

    cfg: HarnessConfig
    manager: Any
    names: list[str]


def prepare_harness(cfg: HarnessConfig) -> HarnessTasks:
    """Check the include path and every task name before any model is loaded."""
    from lm_eval.tasks import TaskManager  # indexing lm-eval's tasks imports `datasets`: only when asked

    if cfg.include_path is not None and not Path(cfg.include_path).is_dir():
        raise ConfigError(f"harness.include_path: {cfg.include_path} is not a directory (of lm-eval task YAMLs)")
    if cfg.include_path is None and not cfg.builtin_tasks:
        raise ConfigError("harness.builtin_tasks is false and there is no harness.include_path: no tasks to run")
    _quiet_lm_eval()
    manager = TaskManager(include_path=cfg.include_path, include_defaults=cfg.builtin_tasks)
    for name in cfg.tasks:
        if not manager.match_tasks([name]):
            close = difflib.get_close_matches(name, manager.all_tasks, n=1)
            where = {
                (True, False): "lm-eval's own tasks",
                (False, True): f"the tasks under {cfg.include_path}",
                (True, True): f"lm-eval's own tasks or those under {cfg.include_path}",
            }[cfg.builtin_tasks, cfg.include_path is not None]
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"harness.tasks: '{name}' is not among {where}{hint}")
    return HarnessTasks(cfg, manager, list(cfg.tasks))


def _quiet_lm_eval() -> None:
    """lm-eval logs every request batch and task config at INFO; a stage log wants its warnings."""
    logger = logging.getLogger("lm_eval")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)


def harness_metrics(results: dict) -> dict[str, float]:
    """lm-eval's results as flat metrics: `harness/<task>/<metric>` (`<metric>/<filter>` for a
    filter other than `none`), their standard errors, and the documents each task scored."""
    metrics: dict[str, float] = {}
    for task, values in {**results.get("results", {}), **results.get("groups", {})}.items():
        for key, value in values.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # "alias", and "N/A" standard errors
            metric, _, filter_name = key.partition(",")
            name = metric if filter_name == "none" else f"{metric}/{filter_name}"
            if math.isfinite(value):
                metrics[f"harness/{task}/{name}"] = float(value)
    for task, counts in results.get("n-samples", {}).items():
        metrics[f"harness/{task}/samples"] = int(counts.get("effective", 0))
    return metrics


def run_harness(tasks: HarnessTasks, loaded: LoadedModel, log: Callable[[str], None]) -> dict[str, float]:
    """The harness tasks on one loaded model; their metrics (harness_metrics)."""
    from lm_eval.evaluator import simple_evaluate  # as prepare_harness: imports `datasets`

    cfg = tasks.cfg
    lm = TrainflowLM(
        loaded=loaded,
        batch_size=cfg.batch_size,
        max_length=cfg.max_length,
        max_gen_toks=cfg.max_gen_toks,
        seed=cfg.seed,
        progress=False,
    )
    # Bootstrapped standard errors in this process: lm-eval's default forks a pool, and a fork
    # of a process running JAX's threads can deadlock.
    previous = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        results = simple_evaluate(
            model=lm,
            tasks=tasks.names,
            num_fewshot=cfg.num_fewshot,
            limit=cfg.limit,
            bootstrap_iters=cfg.bootstrap_iters,
            task_manager=tasks.manager,
            log_samples=False,
            random_seed=cfg.seed,
            numpy_random_seed=cfg.seed,
            torch_random_seed=None,  # no torch here
            fewshot_random_seed=cfg.seed,
        )
    finally:
        if previous is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = previous
    metrics = harness_metrics(results or {})
    log(f"evaluate: harness: {', '.join(tasks.names)}: {len(metrics)} metrics")
    return metrics
