"""EleutherAI's lm-evaluation-harness on a jdp model: `lm_eval --model jdp --model_args run=RUN_DIR[,step=N]`,
`jdp eval RUN --tasks a,b`, and `train.eval_tasks` inside training (docs/evaluation.md).

`JdpLM` is the harness's model (an `lm_eval.api.model.TemplateLM`, as its `hf` model is): the harness builds the
requests, jdp answers them, the harness scores them. It tokenizes as the `hf` model does on jdp's export of the same
run (no special tokens added; an empty context is the tokenizer's BOS, else its end-of-text), so the two give the
same log-likelihood for every request (tests/test_harness.py).

Data parallel: every process of a job runs the whole harness on every request (each builds the same requests), and
the answering is split. Log-likelihoods: the rows of each global batch over every device of every process, through
the strategy's own per-row eval step (the parameters as the run lays them out: replicated, or split under fsdp),
every row answered once and every answer gathered back to every process. Generation: the requests split over the
processes, each process's share decoded as one batch with the KV cache, its rows split over that process's devices,
the texts gathered back. So every process holds every result; process 0 writes them.

The harness itself is imported only here, and only when asked for (pip install -e ".[eval]").
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdp import decode, hf, parallel
from jdp.callbacks import Loop, Periodic
from jdp.config import Config, ConfigError
from jdp.log import logger

__all__ = ["HarnessEval", "JdpLM", "check_tasks", "evaluate", "metrics_of", "run", "task_list", "task_manager"]  # noqa: F822  (JdpLM: made on first use)

log = logger("jdp.harness")
_MIN_COLUMNS = 16  # rows are padded to a power of two of columns from here (capped at max_seq_len): few compiles
_INSTALL = 'pip install -e ".[eval]" (lm-eval)'


def _lm_eval():
    try:
        import lm_eval
        from lm_eval.api.model import TemplateLM
    except ImportError as e:
        raise ConfigError(f"the evaluation harness is not installed ({e}); {_INSTALL}") from None
    return lm_eval, TemplateLM


# ---- the answers: log-likelihoods over every device, generations over every process -----------------------------


def _row_scores(n_vocab: int):
    """(model, rows) -> each row's summed log-probability of its weighted targets, and whether every weighted target
    is the argmax: the per-row function the strategy's eval step runs on each device's rows."""

    def scores(model, batch):
        logits_BxTxV = model(batch["inputs"])[..., :n_vocab].astype(jnp.float32)
        logp_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
        targets_BxT, weights_BxT = batch["targets"], batch["weights"]
        picked_BxT = jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
        greedy_BxT = jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT
        return {"logp": jnp.sum(picked_BxT * weights_BxT, axis=-1),
                "greedy": jnp.all(greedy_BxT | (weights_BxT == 0), axis=-1)}  # fmt: skip

    return scores


class Scorer:
    """Scores rows (token ids, how many trailing targets count) in global batches of `rows` rows, split over the
    mesh's devices (every process passes the same rows; each materialises its own devices' share)."""

    def __init__(self, graphdef, state, mesh, strategy: str, n_vocab: int, rows: int, max_len: int):
        self.state, self.mesh, self.max_len = state, mesh, max_len
        n = mesh.devices.size
        self.rows = -(-max(rows, 1) // n) * n  # a multiple of the devices
        self.step = parallel.make_strategy_eval_step(graphdef, _row_scores(n_vocab), mesh, strategy, per_row=True)

    def columns(self, longest: int) -> int:
        return min(max(_MIN_COLUMNS, 1 << max(longest - 1, 0).bit_length()), self.max_len)

    def __call__(self, rows: Sequence[tuple[Sequence[int], int]]) -> list[tuple[float, bool]]:
        """(summed log-probability, greedy) of each row: row (ids, k) scores ids[-k:] given what precedes them."""
        from jax.experimental import multihost_utils

        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # like lengths share a batch's columns
        out: list[Any] = [None] * len(rows)
        take = parallel.process_rows(self.rows, self.mesh)
        for start in range(0, len(order), self.rows):
            chunk = order[start : start + self.rows]
            T = self.columns(max(len(rows[i][0]) - 1 for i in chunk))
            inputs, targets = np.zeros((self.rows, T), np.int32), np.zeros((self.rows, T), np.int32)
            weights = np.zeros((self.rows, T), np.float32)
            for r, i in enumerate(chunk):
                ids, k = rows[i]
                n = len(ids) - 1
                inputs[r, :n], targets[r, :n] = ids[:-1], ids[1:]
                weights[r, n - k : n] = 1.0
            local = {"inputs": inputs[take], "targets": targets[take], "weights": weights[take]}
            got = self.step(self.state, parallel.shard_batch(local, self.mesh, self.rows))
            got = jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), got)
            for r, i in enumerate(chunk):
                out[i] = (float(got["logp"][r]), bool(got["greedy"][r]))
        return out


def _gather_texts(mine: list[str]) -> list[list[str]]:
    """Every process's list of texts, on every process (UTF-8 bytes through one all-gather of padded arrays)."""
    if jax.process_count() == 1:
        return [mine]
    from jax.experimental import multihost_utils

    blob = json.dumps(mine).encode()
    lengths = np.asarray(multihost_utils.process_allgather(np.int64(len(blob)))).ravel()
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: len(blob)] = np.frombuffer(blob, np.uint8)
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(every, lengths, strict=True)]


# ---- what the harness's model answers with ------------------------------------------------------------------------


class Source(SimpleNamespace):
    """A model for JdpLM: cfg, tokenizer, graphdef and state (laid out by `strategy` on `mesh`), `local()` (the model
    whole on every device of this process, for generation; an error where the strategy splits the parameters),
    `step` (None: a Hugging Face directory) and `rows`, the output rows the softmax runs over."""


def _offline(path: str, step: int | None) -> Source:
    """A run's checkpoint (or a Hugging Face directory), replicated over every device of every process."""
    from jdp.saved import load

    _join_job()
    cfg, model, tokenizer, at = load(path, step)
    if hasattr(model, "eval"):
        model.eval()
    mesh = parallel.make_mesh()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = SimpleNamespace(params=_everywhere(params, mesh), rest=_everywhere(rest, mesh), shapes=None)
    rows = (cfg.model.vocab_valid or cfg.model.vocab_size) if at is None else hf.output_rows(cfg, tokenizer)
    local = _on_local_devices(graphdef, params, rest)
    return Source(cfg=cfg, tokenizer=tokenizer, graphdef=graphdef, state=state, mesh=mesh, strategy="ddp",
                  local=lambda: local, step=at, rows=rows)  # fmt: skip


def _everywhere(tree, mesh):
    """One process's copy of a model's variables (on one of its devices) placed whole on every device of every
    process, through the host (each process holds the same values: the checkpoint every one of them read)."""
    sharding = parallel.replicated(mesh)

    def put(x):
        if not isinstance(x, jax.Array):
            return x
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = jax.device_put(np.asarray(jax.random.key_data(x)), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.device_put(np.asarray(x), sharding)

    return jax.tree.map(put, tree)


def _local_rows():
    """The batch's rows split over this process's devices (generation's layout)."""
    mesh = jax.sharding.Mesh(np.asarray(jax.local_devices()), (parallel.AXIS,))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(parallel.AXIS))


def _on_local_devices(graphdef, params, rest):
    """The model whole on every device of this process (from any one copy of it this process holds)."""
    whole = jax.sharding.NamedSharding(_local_rows().mesh, jax.sharding.PartitionSpec())

    def put(x):
        if not isinstance(x, jax.Array):
            return x
        return jax.device_put(x.addressable_data(0), whole)  # this process's devices only: no transfer between hosts

    return nnx.merge(graphdef, jax.tree.map(put, params), jax.tree.map(put, rest))


def _from_training(loop: Loop, tokenizer) -> Source:
    """The training state as it is after `loop.done` steps, laid out as the strategy keeps it."""
    run, cfg = loop.run, loop.run.cfg
    splits = parallel.opt_layout(cfg.parallel.strategy, run.mesh).splits_parameters
    graphdef = _in_eval_mode(run.graphdef, loop.state)

    def local():
        state = source.state
        if splits:  # HarnessEval.begin refused such tasks before the first step
            raise ConfigError(
                f"generation needs the model whole, which parallel.strategy={cfg.parallel.strategy} splits"
            )
        return _on_local_devices(graphdef, state.params, state.rest)

    source = Source(cfg=cfg, tokenizer=tokenizer, graphdef=graphdef, state=loop.state, mesh=run.mesh,
                    strategy=cfg.parallel.strategy, local=local, step=loop.done, rows=hf.output_rows(cfg, tokenizer))  # fmt: skip
    return source


def _in_eval_mode(graphdef, state):
    """The training graphdef after model.eval() (LoRA's dropout off, as for eval_loss), from shapes alone."""
    shapes = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    model = nnx.merge(graphdef, shapes(state.params), shapes(state.rest))
    model.eval()
    return nnx.graphdef(model)


def _join_job() -> None:
    """Join the job the environment describes (jdp launch, torchrun, SLURM), as `jdp train` does; nothing for one
    process."""
    if jax.distributed.is_initialized():
        return
    from jdp.job.join import initialize
    from jdp.job.process import watch_launcher
    from jdp.job.world import WorldError, resolve_world
    from jdp.log import set_rank

    watch_launcher()
    try:
        world = resolve_world()
    except WorldError as e:
        raise ConfigError(str(e)) from e
    initialize(world)
    set_rank(jax.process_index())


def _token_id(tokenizer, text: str) -> int | None:
    """A Hugging Face tokenizer's id of the token `text` (None if it has none)."""
    tok = getattr(tokenizer, "_tok", None)
    if tok is None:
        return None
    found = tok.token_to_id(text) if hasattr(tok, "token_to_id") else tok.convert_tokens_to_ids(text)
    return None if found is None or found == getattr(tok, "unk_token_id", -1) else int(found)


def _bos_id(cfg: Config, tokenizer) -> int:
    """The hf model's prefix for an empty context: the tokenizer's BOS, else its end-of-text (jdp's eod)."""
    if cfg.data.tokenizer == "byte":
        return tokenizer.eod_id  # the export's tokenizer_config.json names <|endoftext|> as bos and eos
    from jdp.data.chat import special_tokens

    bos = special_tokens(cfg.data).get("bos_token")
    found = _token_id(tokenizer, bos) if bos else None
    return tokenizer.eod_id if found is None else found


def _eos_text(tokenizer) -> str:
    """The end-of-text token as text: a stop sequence of every generation, as the hf model adds it."""
    tok = getattr(tokenizer, "_tok", None)
    if tok is None:
        return "<|endoftext|>"
    return (
        tok.id_to_token(tokenizer.eod_id)
        if hasattr(tok, "id_to_token")
        else tok.convert_ids_to_tokens(tokenizer.eod_id)
    )


def _template(cfg: Config):
    from jdp.data.chat import ChatTemplate

    return ChatTemplate.load(cfg.data)


class _Answers:
    """JdpLM's methods (JdpLM is this and lm_eval's TemplateLM, made on first use). A jdp run (or a Hugging Face
    directory jdp reads) as the harness's model: `run=RUN_DIR[,step=N]`;
    `batch_size`: rows per forward over all devices (rounded up to a multiple of them; default 16 a device);
    `max_gen_toks`: generate_until's default length (the harness's 256)."""

    def __init__(self, run: str = "", step: int | str | None = None, batch_size: int | str | None = None,
                 max_gen_toks: int = 256, source: Source | None = None, **_harness_args):  # fmt: skip
        super().__init__()
        if source is None:
            if not run:
                raise ConfigError("--model jdp needs --model_args run=RUN_DIR (a jdp run directory)")
            source = _offline(run, None if step in (None, "", "None") else int(step))
        self.source, self.step, self._max_gen_toks = source, source.step, int(max_gen_toks)
        n = source.mesh.devices.size
        per_call = 16 * n if batch_size in (None, "") or str(batch_size).startswith("auto") else int(batch_size)
        self._scorer = Scorer(source.graphdef, source.state, source.mesh, source.strategy, source.rows,
                              per_call, self.max_length)  # fmt: skip
        self._bos = _bos_id(source.cfg, source.tokenizer)

    # -- the tokenizer, read as the hf model reads the export's (no special tokens added)
    @property
    def eot_token_id(self) -> int:
        return int(self.source.tokenizer.eod_id)

    @property
    def prefix_token_id(self) -> int:
        return self._bos

    @property
    def max_length(self) -> int:
        return int(self.source.cfg.model.max_seq_len)

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return [int(i) for i in self.source.tokenizer.encode_batch([string])[0]]

    def tok_decode(self, tokens) -> str:
        return self.source.tokenizer.decode([int(t) for t in tokens if int(t) != self.eot_token_id])

    @property
    def tokenizer_name(self) -> str:
        return self.source.tokenizer.name.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return _template(self.source.cfg).source if chat_template is not False else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return _template(self.source.cfg).render(chat_history, add_generation_prompt, "a harness request")

    # -- the three kinds of request
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        rows = []
        for _, context, continuation in requests:
            ids = (list(context) + list(continuation))[-(self.max_length + 1) :]  # the hf model's window
            rows.append((ids, min(len(continuation), len(ids) - 1)))
        out = self._scorer(rows)
        for (key, _, _), answer in zip(requests, out, strict=True):
            if key is not None:
                self._cached("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils

        windows, owner = [], []
        for i, req in enumerate(requests):
            rolling = utils.get_rolling_token_windows(token_list=self.tok_encode(req.args[0]),
                                                      prefix_token=self.prefix_token_id,
                                                      max_seq_len=self.max_length, context_len=1)  # fmt: skip
            for context, target in map(utils.make_disjoint_window, rolling):
                windows.append((None, context, target))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows), strict=True):
            totals[i] += logp
        for req, total in zip(requests, totals, strict=True):
            self._cached("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        P, p = jax.process_count(), jax.process_index()
        mine = list(range(p, len(requests), P))  # each process its share: every request answered once
        groups: dict[str, list[int]] = {}  # requests with the same settings decode as one batch
        for i in mine:
            groups.setdefault(json.dumps(requests[i].args[1], sort_keys=True, default=str), []).append(i)
        texts: dict[int, str] = {}
        for members in groups.values():
            contexts = [requests[i].args[0] for i in members]
            texts.update(zip(members, self._generate(contexts, requests[members[0]].args[1]), strict=True))
        out: list[str] = [""] * len(requests)
        for q, theirs in enumerate(_gather_texts([texts[i] for i in mine])):
            for i, text in zip(range(q, len(requests), P), theirs, strict=True):
                out[i] = text
        for req, text in zip(requests, out, strict=True):
            self._cached("generate_until", req.args, text)
        return out

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        """Requests with the same settings, as the hf model answers each: the context's last max_length -
        max_gen_toks tokens, greedy (sampled with do_sample and a temperature), cut at the first stop sequence
        or the end-of-text; decoded together, each row as it would be alone (jdp/decode.py)."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        kwargs = normalize_gen_kwargs(copy.deepcopy(gen_kwargs), self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=_eos_text(self.source.tokenizer))
        n = int(kwargs.pop("max_gen_toks"))
        if n >= self.max_length:
            raise ConfigError(f"generate_until: max_gen_toks={n} must be less than the model's context "
                              f"(model.max_seq_len={self.max_length})")  # fmt: skip
        sampled = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature") or 0.0) > 0
        if sampled and kwargs.get("top_p") not in (None, 1, 1.0):
            raise ConfigError(f"generate_until: top_p={kwargs['top_p']} is not supported by jdp's sampler "
                              f"(temperature and top_k are); leave it out or decode greedily")  # fmt: skip
        temperature = float(kwargs["temperature"]) if sampled else 0.0
        prompts = [self.tok_encode(c)[-(self.max_length - n) :] or [self.prefix_token_id] for c in contexts]
        k = len(jax.local_devices())
        filled = prompts + [prompts[0]] * (-len(prompts) % k)  # a row for each device (the copies dropped)
        new = decode.sample(self.source.local(), filled, n, temperature, int(kwargs.get("top_k") or 0),
                            int(kwargs.get("seed") or 0), n_vocab=self.source.rows, eod=self.eot_token_id,
                            rows=_local_rows())  # fmt: skip
        return [postprocess_generated_text(self.tok_decode(ids), until, None) for ids in new[: len(prompts)]]

    def use(self, state, step: int) -> None:
        """Answer from `state` (the training state after `step` steps) from now on."""
        self.source.state = self._scorer.state = state
        self.source.step = self.step = step

    def _cached(self, kind: str, key, answer) -> None:
        if getattr(self, "cache_hook", None) is not None:
            self.cache_hook.add_partial(kind, key, answer)


def _make_class():
    _, TemplateLM = _lm_eval()
    return type("JdpLM", (_Answers, TemplateLM), {"__module__": __name__, "__doc__": _Answers.__doc__})


_CLASS = None


def __getattr__(name: str):
    """`jdp.harness.JdpLM`, made (and registered as the harness's `jdp` model) on first use: lm_eval's entry point
    `jdp = "jdp.harness:JdpLM"` loads it so, and `import jdp` never imports the harness."""
    global _CLASS
    if name != "JdpLM":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _CLASS is None:
        _CLASS = _make_class()
        from lm_eval.api.registry import register_model

        with contextlib.suppress(ValueError):  # a release that already holds the entry point's placeholder for it
            register_model("jdp")(_CLASS)
    return _CLASS


# ---- tasks and one evaluation ---------------------------------------------------------------------------------------


def task_list(spec: str | Sequence[str]) -> list[str]:
    return [t.strip() for t in (spec.split(",") if isinstance(spec, str) else spec) if t.strip()]


def example_tasks() -> Path:
    """jdp's example tasks (configs/tasks: the `jdp_stdlib` tag, over local files), found with every task name."""
    here = Path(__file__).resolve().parent
    return next((p for p in (here.parent / "configs" / "tasks", here / "_configs" / "tasks") if p.is_dir()), here)


def task_manager(tasks: Sequence[str], include_path: str = "", where: str = "--tasks"):
    """The harness's TaskManager for `tasks`: jdp's example tasks and the task YAMLs under include_path alone when
    they hold every task asked for (indexing the harness's own thousands of tasks takes ~20 s), else those and the
    harness's. A name found in none is refused, before any compute."""
    _lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path and not Path(include_path).expanduser().is_dir():
        raise ConfigError(f"{where}: the task directory {include_path} does not exist (give a directory of task YAMLs)")
    paths = [str(example_tasks())] + ([str(Path(include_path).expanduser())] if include_path else [])
    with _quiet_and_seeded_apart():
        own = TaskManager(include_path=paths, include_defaults=False)
        if all(own.match_tasks([t]) for t in tasks):
            return own
        manager = TaskManager(include_path=paths)
    if missing := [t for t in tasks if not manager.match_tasks([t])]:
        where_from = (
            f"{include_path}, jdp's examples or the harness's own"
            if include_path
            else "jdp's examples or the harness's own tasks"
        )
        raise ConfigError(
            f"{where}: no task named {', '.join(missing)} in {where_from}; list them with `lm_eval ls tasks"
            f"{f' --include_path {include_path}' if include_path else ''}`, or give a directory of task YAMLs over "
            f"local files (docs/evaluation.md)"
        )
    return manager


# What the harness and its imports print on their own that says nothing about the run: progress bars, a `git` call
# outside a repository, transformers without torch, the harness's notes on task YAMLs.
_NOISE = ("it/s]", "s/it]", "examples/s]", "fatal: not a git repository", "PyTorch was not found", "WARNING:lm_eval",
          "higher_is_better", "is defined, but aggregation", "Custom kwargs can be passed", "For example --metadata")  # fmt: skip


@contextlib.contextmanager
def _quiet_and_seeded_apart(capture: bool = False):
    """The harness's INFO lines off, and the global random states it seeds put back after. capture: what it writes
    to stderr (file descriptor 2, a subprocess's too) is held, and what is not _NOISE is written out after."""
    loggers = [logging.getLogger(n) for n in ("lm_eval", "lm-eval")]
    levels = [lg.level for lg in loggers]
    states = random.getstate(), np.random.get_state()
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    held = tempfile.TemporaryFile() if capture else None
    if held is not None:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
        random.setstate(states[0])
        np.random.set_state(states[1])
        if held is not None:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").replace("\r", "\n").splitlines()
            held.close()
            if kept := [line for line in lines if line.strip() and not any(n in line for n in _NOISE)]:
                sys.stderr.write("\n".join(kept) + "\n")


def output_types(tasks: Sequence[str], manager) -> dict[str, str]:
    """Each task's kind of request (multiple_choice, loglikelihood, loglikelihood_rolling, generate_until), a group's
    tasks one by one."""
    from lm_eval.tasks import get_task_dict

    out: dict[str, str] = {}

    def walk(tree) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value)
            elif value is not None:
                out[getattr(value.config, "task", None) or str(key)] = value.OUTPUT_TYPE

    with _quiet_and_seeded_apart(capture=True):
        walk(get_task_dict(list(tasks), manager))
    return out


def evaluate(lm, tasks: Sequence[str], manager, limit: float | None = None, num_fewshot: int | None = None,
             log_samples: bool = False, apply_chat_template: bool = False, bootstrap_iters: int = 100000) -> dict:  # fmt: skip
    """One harness evaluation of `lm` (every process runs it; every process gets the results)."""
    lm_eval, _ = _lm_eval()
    return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                   num_fewshot=num_fewshot, log_samples=log_samples,
                                   apply_chat_template=apply_chat_template, bootstrap_iters=bootstrap_iters)  # fmt: skip


def metrics_of(results: dict) -> dict[str, float]:
    """The harness's numbers as metrics.jsonl keys beside eval_loss: `eval_<task>/<metric>` (a filter other than
    the default appended: `eval_gsm8k/exact_match/strict-match`); standard errors left out."""
    out = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if not filt or metric.endswith("_stderr") or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            out[f"eval_{task}/{metric if filt == 'none' else f'{metric}/{filt}'}"] = float(value)
    return out


def write_results(results: dict, path: Path) -> None:
    """The harness's results JSON (its samples, if logged, as one JSON line each beside it)."""
    from lm_eval.utils import handle_non_serializable

    path.parent.mkdir(parents=True, exist_ok=True)
    samples = results.pop("samples", None)
    path.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n")
    if samples:
        with open(path.with_suffix(".samples.jsonl"), "w") as f:
            for task, rows in samples.items():
                for row in rows:
                    f.write(
                        json.dumps({"task": task, **row}, default=handle_non_serializable, ensure_ascii=False) + "\n"
                    )
        results["samples"] = samples


# ---- inside training --------------------------------------------------------------------------------------------


def check_tasks(cfg: Config):
    """train.eval_tasks: the harness installed and every task found, before any compute; its TaskManager."""
    t = cfg.train
    return task_manager(task_list(t.eval_tasks), t.eval_tasks_path, f"train.eval_tasks={t.eval_tasks}")


class HarnessEval(Periodic):
    """Every train.eval_tasks_every steps and after the last: the harness's tasks on the model as it is, answered by
    every device (the strategy's layout), the metrics written beside eval_loss and the results JSON into
    RUN_DIR/eval/; its time is evaluation in the goodput account."""

    name, account, pause_watchdog = "evaluating the harness's tasks", "eval_s", True

    def __init__(self, cfg: Config, manager):
        t = cfg.train
        super().__init__(t.eval_tasks_every)
        self.tasks, self.manager, self.limit = task_list(t.eval_tasks), manager, t.eval_tasks_limit or None
        self.lm = None

    def begin(self, loop: Loop) -> None:
        """Before the first step: a task that generates text needs the model whole on a device, which a strategy
        that splits the parameters never has; refused by name now rather than at the first evaluation."""
        cfg = loop.run.cfg
        if not parallel.opt_layout(cfg.parallel.strategy, loop.run.mesh).splits_parameters:
            return
        if generating := [
            name for name, kind in output_types(self.tasks, self.manager).items() if kind == "generate_until"
        ]:
            raise ConfigError(
                f"train.eval_tasks: {', '.join(generating)} generate text (generate_until), which runs on one "
                f"device's whole model, and parallel.strategy={cfg.parallel.strategy} splits the parameters over the "
                f"devices; keep train.eval_tasks to log-likelihood tasks under it and run the others after training "
                f"(`jdp eval RUN --tasks ...`)"
            )

    def run(self, loop: Loop, step: int) -> None:
        from jdp.data.tokens import load_tokenizer

        if self.lm is None:  # made once: its compiled eval step serves every evaluation
            self.lm = __getattr__("JdpLM")(source=_from_training(loop, load_tokenizer(loop.run.cfg.data.tokenizer)))
        self.lm.use(loop.state, step)
        with _quiet_and_seeded_apart(capture=True):
            results = evaluate(self.lm, self.tasks, self.manager, self.limit, bootstrap_iters=0)
        if results is None or not loop.is_main:  # the harness returns them where LOCAL_RANK is 0 (process 0 does)
            loop.not_training()
            return
        found = metrics_of(results)
        loop.write({"step": step, **found})
        write_results(results, loop.run.run_dir.eval_dir / f"step_{step}.json")
        shown = ", ".join(f"{k.removeprefix('eval_')} {v:.4g}" for k, v in found.items())
        loop.say(f"step {step}: harness: {shown}")
        loop.not_training()

    def end(self, loop: Loop, preempted: bool) -> None:
        if not preempted:
            with self.phase(loop, loop.done):
                self.run(loop, loop.done)


# ---- `jdp eval` ----------------------------------------------------------------------------------------------------


def run(args) -> int:
    """`jdp eval RUN --tasks a,b`: the harness on a run's checkpoint over every device of the job; the table printed
    and the results JSON written into RUN_DIR/eval/ by process 0."""
    tasks = task_list(args.tasks)
    if not tasks:
        raise ConfigError("--tasks names no task (give a comma-separated list, e.g. --tasks hellaswag,arc_easy)")
    manager = task_manager(tasks, args.include_path or "")
    lm = __getattr__("JdpLM")(run=str(args.run_dir), step=args.step, batch_size=args.batch_size,
                              max_gen_toks=args.max_gen_toks)  # fmt: skip
    with _quiet_and_seeded_apart(capture=True) if jax.process_index() else contextlib.nullcontext():  # one says it
        results = evaluate(lm, tasks, manager, args.limit, args.num_fewshot, args.log_samples,
                           args.apply_chat_template, args.bootstrap_iters)  # fmt: skip
    if jax.process_index() != 0:
        return 0
    from lm_eval.utils import make_table

    print(make_table(results))
    if args.output or lm.step is not None:  # a Hugging Face directory is written into only when asked
        from jdp.rundir import RunDir

        out = (
            Path(args.output)
            if args.output
            else RunDir(args.run_dir).eval_dir / f"step_{lm.step}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        )
        write_results(results, out)
        log.info(f"results -> {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m jdp.harness ...`: lm_eval's own command with jdp's model registered (`--model jdp`), for the
    harness releases that do not yet load models from the `lm_eval.models` entry points."""
    import sys

    __getattr__("JdpLM")
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
