"""`jdp train`: the language-model task. jdp's model, GPT or Llama (fresh, or imported from Hugging Face), the LM
loss and the text pipeline, handed to the trainer; everything else (the loop, checkpoints, faults) is trainer.py's."""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np
from flax import nnx

from jdp import harness, hf, live, peft, preference
from jdp.build import comm_hook, run_model
from jdp.config import Config, ConfigError, Derived, check
from jdp.data.dataset import Source
from jdp.data.pipeline import Data, load_data
from jdp.data.tokens import documents
from jdp.job.world import World
from jdp.log import logger
from jdp.memory import check_memory
from jdp.metrics import flops_per_token
from jdp.models.common import lm_loss
from jdp.models.config import ModelConfig
from jdp.optim import make_optimizer
from jdp.trainer import Trainer

__all__ = ["LanguageModel", "Text", "checked_import", "no_model_to_fine_tune", "train"]

log = logger("jdp.lm")


def train(cfg: Config, world: World | None = None, explicit: frozenset[str] = frozenset()) -> dict:
    """Train the configured model; returns the last train and eval metrics (and the final state). `explicit`: the
    keys the user set on the command line (`model.d_model`, ...), which an import must agree with."""
    if cfg.train.live:  # each process one member of torchft's quorum, not one part of a JAX job (live.py)
        return live.train(cfg)
    if problem := no_model_to_fine_tune(cfg, explicit):
        raise ConfigError(problem)
    cfg, adopted = checked_import(cfg, explicit) if cfg.train.init_from or cfg.train.init_adapter else (cfg, [])
    return LanguageModel(cfg, world, adopted).fit()


class LanguageModel(Trainer):
    """The trainer for jdp's models (model.arch) on text: the model, the loss and the data are the only things it adds."""

    unit = "tokens"

    def __init__(self, cfg: Config, world: World | None = None, adopted: list[str] = (), handle_signals=True):
        check(cfg)  # before the optimizer is built from it
        optimizer, schedule = make_optimizer(cfg.optim, cfg.train.steps)
        super().__init__(None, objective_loss(cfg), optimizer, None, cfg, schedule=schedule, world=world,
                         comm_hook=comm_hook(cfg.parallel, cfg.train.seed), handle_signals=handle_signals)  # fmt: skip
        self.adopted, self.imported = list(adopted), None
        if cfg.train.eval_tasks:  # the harness's tasks found (or refused) now, before any compute
            self.callbacks.append(harness.HarnessEval(cfg, harness.check_tasks(cfg)))
        self.pairs = cfg.train.objective != "lm"  # the loss weight counts pairs (data.format=preference)
        self.unit = "pairs" if self.pairs else "tokens"

    def check(self, mesh: jax.sharding.Mesh) -> Derived:
        derived = Trainer.check(self, mesh)
        per_row = 1 if self.pairs else self.cfg.data.seq_len
        derived = dataclasses.replace(derived, tokens_per_step=self.cfg.train.batch_size * per_row, unit=self.unit)
        check_memory(self.cfg, derived, mesh)  # before anything is allocated: a run too large is refused here
        return derived

    def load_data(self, rows: slice):
        cfg = self.cfg
        data = load_data(cfg.data, cfg.model.vocab_size, cfg.train.batch_size, cfg.train.seed, rows,
                         jax.process_index(), jax.process_count())  # fmt: skip
        if (valid := cfg.model.vocab_valid) and data.tokenizer.vocab_size > valid:
            raise ConfigError(
                f"data.tokenizer={cfg.data.tokenizer} has {data.tokenizer.vocab_size} tokens but the model knows "
                f"{valid} (model.vocab_valid); use the model's own tokenizer"
            )
        return Text(data, cfg), (Text(data, cfg) if cfg.data.val_tokens > 0 else None)

    @property
    def model_phase(self) -> str:
        return f"reading {self.cfg.train.init_from}" if self.cfg.train.init_from else "building the model"

    def make_model(self) -> nnx.Module:
        model, self.imported = run_model(self.cfg)
        return with_reference(model, self.cfg)

    def model_factory(self):
        if self.cfg.train.init_from or self.cfg.train.init_adapter:
            return None  # an import's host tensors are placed row by row (OptLayout.place)
        return lambda: with_reference(run_model(self.cfg)[0], self.cfg)

    def describe_model(self, n_params: int, peak: float, peak_source: str) -> str:
        m = self.cfg.model
        trained = f"model {n_params:,} parameters"
        if m.lora_rank:
            trained = (f"model: LoRA rank {m.lora_rank} on {m.lora_targets} ({n_params:,} parameters train; the base "
                       f"is frozen{f', in {m.base_dtype}' if m.base_dtype else ''})")  # fmt: skip
        return f"{trained} | {flops_per_token(self.cfg) / 1e6:.1f} MFLOPs/token | MFU peak: {peak / 1e12:.3g} TFLOP/s, {peak_source}"

    def flops_per_unit(self) -> float:
        # a pair: its two sequences trained (the reference's forward, where there is one, is not counted)
        per_pair = preference.sequences_per_row(self.cfg.train.objective) * self.cfg.data.seq_len
        return flops_per_token(self.cfg) * (per_pair if self.pairs else 1)

    def prepare(self, run_dir, steps, state, resumed_from: int | None, data) -> None:
        """train.precompute_reference: every pair's reference log-probabilities, computed by the starting model
        (a fresh run) and kept in RUN_DIR/reference_logps.npz, or read back from there (a resumed one)."""
        if not (preference.needs_reference(self.cfg.train.objective) and self.cfg.train.precompute_reference):
            return
        pairs, path = data.data.train, run_dir.reference_logps
        if resumed_from is None:
            t0 = time.perf_counter()
            logps = preference.reference_logps(steps.graphdef, state, steps.mesh, steps.strategy,
                                               pairs.every_pair(data.data.rows), self.cfg.train.batch_size)  # fmt: skip
            if jax.process_index() == 0:
                tmp = path.with_name(f"{path.stem}.tmp.npz")
                np.savez(tmp, **logps)
                os.replace(tmp, path)
            log.info(f"train.precompute_reference: the reference's log-probabilities of {len(logps['train']):,} "
                     f"training and {len(logps['val']):,} validation pairs in {time.perf_counter() - t0:.1f} s, kept "
                     f"in {path}")  # fmt: skip
        elif not path.exists():
            raise ConfigError(f"train.precompute_reference=true: resuming from step {resumed_from}, but {path} "
                              f"(the reference's log-probabilities, computed at the run's start) is gone; the "
                              f"trained model cannot give them again: start the run over (train.resume=false)")  # fmt: skip
        else:
            with np.load(path) as z:
                logps = {k: z[k] for k in ("train", "val")}
        pairs.use_reference(logps)

    def announce(self, resumed_from: int | None) -> None:
        if self.imported:
            log.info(self.imported.describe() if resumed_from is None else "train.init_from not used: resuming")
        for change in self.adopted:  # what the import took from config.json
            log.info(change)


def objective_loss(cfg: Config):
    """train.objective's loss: the next-token loss (lm), or a preference objective's on pairs (preference.py)."""
    t = cfg.train
    if t.objective == "lm":
        return lm_loss
    return preference.make_loss(t.objective, t.beta, t.label_smoothing, t.simpo_gamma, t.orpo_lambda)


def with_reference(model: nnx.Module, cfg: Config) -> nnx.Module:
    """The model, holding a frozen copy of its starting weights where the objective compares with one and no LoRA
    adapter can be switched off for it (preference.py)."""
    return preference.with_reference(model) if preference.holds_copy(cfg) else model


class Text(Source):
    """The text pipeline as the trainer's loaders: training windows in the global order, validation windows."""

    def __init__(self, data: Data, cfg: Config):
        self.data, self.train = data, data.train
        self.steps = cfg.train.steps  # a mixture's banner lines say each source's epochs after them
        within = cfg.data.within_documents
        eod = data.tokenizer.eod_id
        self.documents = (lambda batch: documents(batch, eod)) if within else (lambda batch: batch)

    def local_batch(self, step: int) -> dict[str, np.ndarray]:
        return self.documents(self.data.local_batch(step))

    def position(self):
        """Where a streaming loader stands; None for map-style windows, whose position is the step."""
        return self.data.position()

    def load_position(self, position: dict) -> None:
        self.train.load_position(position)

    def epoch(self, step: int) -> float:
        return self.train.epoch(step)

    def describe(self) -> str:
        return self.data.describe()

    def describe_sources(self) -> list[str]:
        """A mixture's sources, one line each (none for one source)."""
        return self.train.describe_sources(self.steps)

    def stats(self, step: int) -> dict:
        """A mixture's per-source tokens and epochs after `step` steps, for metrics.jsonl ({} for one source)."""
        return self.train.stats(step)

    def summary(self, step: int) -> dict:
        """summary.json's per-source account after `step` steps ({} for one source)."""
        return self.train.summary(step)

    def state(self) -> dict | None:
        """What the checkpoint record keeps of the data besides the step: a mixture's schedule."""
        return self.train.state()

    def restore(self, saved: dict, step: int) -> str:
        return self.train.restore(saved, step)

    def fingerprint(self) -> dict[str, dict] | None:
        """Each source's token streams (or a stream's files), by label: what a resume checks has not changed."""
        return self.data.fingerprint()

    def eval_sets(self) -> list[tuple[str, object]]:
        """The validation sets (a mixture's: one per source with validation windows), each (label, its batches)."""
        return [(label, map(self.documents, batches)) for label, batches in self.data.eval_sets()]


def no_model_to_fine_tune(cfg: Config, explicit: frozenset[str] = frozenset()) -> str:
    """Why a fine-tuning config (hf-finetune, sft-chat: windows as long as a published model's, and no model shape
    of their own, which config.json gives) cannot run without train.init_from ("" when it can): without one it would
    build jdp's default model, and the first error would be data.seq_len against that model's positions."""
    default = ModelConfig().max_seq_len
    if cfg.train.init_from or cfg.data.seq_len <= cfg.model.max_seq_len or cfg.model.max_seq_len != default:
        return ""
    if explicit & {"data.seq_len", "model.max_seq_len"}:
        return ""  # the command line asked for these windows: validate's own words about them
    data = {"chat": "conversations", "prompt": "prompts and completions"}.get(cfg.data.format, "text")
    return (f"this config fine-tunes a model on {data} (data.seq_len={cfg.data.seq_len}, no model shape: it comes from "
            f"the model's config.json): give train.init_from=DIR data.tokenizer=DIR (a Hugging Face model directory "
            f"and its tokenizer, e.g. one downloaded with `hf download`), and data.source=YOUR_DATA. To train a model "
            f"from scratch instead, set its shape (model.max_seq_len={cfg.data.seq_len}, model.d_model, ...)")  # fmt: skip


def checked_import(cfg: Config, explicit: frozenset[str] = frozenset()) -> tuple[Config, list[str]]:
    """The config with train.init_from's model and train.init_adapter's model.lora_* (PEFT's adapter_config.json):
    (config, what the imports changed, to print at start)."""
    cfg, changes = _checked_base(cfg, explicit) if cfg.train.init_from else (cfg, [])
    if not cfg.train.init_adapter:
        return cfg, changes
    m, adapter_changes, conflicts = peft.adopted(cfg.model, cfg.train.init_adapter, explicit)
    if conflicts:
        raise ConfigError(
            f"train.init_adapter={cfg.train.init_adapter}: the command line contradicts its adapter:\n  "
            + "\n  ".join(conflicts) + "\nLeave these keys out (the import takes the adapter's) or set them to agree"
        )  # fmt: skip
    return dataclasses.replace(cfg, model=m), changes + adapter_changes


def _checked_base(cfg: Config, explicit: frozenset[str]) -> tuple[Config, list[str]]:
    """The config with train.init_from's model: (config, what the import changed, to print at start).

    The model's keys come from the directory's config.json, and data.seq_len is lowered to its positions, except
    where the command line set them (`explicit`): those must agree, and all that do not are one error."""
    path = cfg.train.init_from
    hf.read_config(path, "train.init_from")  # the directory before what else the run needs of it (its tokenizer)
    if cfg.data.tokenizer == "byte":
        raise ConfigError(
            f"train.init_from={path} with data.tokenizer=byte: the imported model's ids are its own "
            f"tokenizer's; set data.tokenizer to it (e.g. data.tokenizer={path})"
        )
    adopted = hf.adopt(cfg.model, path, explicit)
    changes, conflicts, data = list(adopted.changes), list(adopted.conflicts), cfg.data
    positions = adopted.read["max_seq_len"]
    if data.seq_len > positions:
        if "data.seq_len" in explicit:
            conflicts.append(f"data.seq_len={data.seq_len} (config.json's model has {positions} positions)")
        else:
            changes.append(f"data.seq_len {data.seq_len} -> {positions} (the model's positions, from config.json)")
            data = dataclasses.replace(data, seq_len=positions)
    if conflicts:
        raise ConfigError(
            f"train.init_from={path}: the command line contradicts its {hf.CONFIG}:\n  " + "\n  ".join(conflicts)
            + f"\nLeave these keys out (the import takes {hf.CONFIG}'s values) or set them to agree"
        )  # fmt: skip
    return dataclasses.replace(cfg, model=adopted.model, data=data), changes
