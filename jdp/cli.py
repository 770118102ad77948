"""The `jdp` command line: parses arguments and dispatches; no training logic lives here."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import sys
import threading
from pathlib import Path

from jdp.config import ConfigError, split_config_args
from jdp.hardware import DEFAULT_MFU, GPUS, INTERCONNECTS
from jdp.log import PLAIN, install, logger, speaks

__all__ = ["COMMANDS", "build_parser", "main"]

log = logger("jdp.cli")  # not __name__: `python -m jdp.cli` (how `jdp launch` starts workers) names it __main__


def generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", help="a run directory written by jdp train, or a Hugging Face model directory"
    )
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the text to continue")
    prompt.add_argument(
        "--prompt-file",
        metavar="FILE",
        help="continue each line of FILE (blank lines skipped), in one batch; prints one JSON line per prompt",
    )
    parser.add_argument("--max-new-tokens", type=_at_least(1), default=200, help="tokens to generate at most (default 200)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default 0.8)")
    parser.add_argument("--top-k", type=_at_least(0), default=40, help="sample from the k likeliest tokens; 0: all (default 40)")
    parser.add_argument("--seed", type=int, default=0, help="the same seed gives the same text (default 0)")
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="re-run the model over the whole context for every token instead of using a KV cache (the reference: "
        "equal greedy tokens, slower)",
    )


def plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("args", nargs="*", metavar="[CONFIG] [section.key=value ...]")
    parser.add_argument("--devices", type=_at_least(1), required=True, help="the number of GPUs to plan for")
    parser.add_argument("--gpu", default="H100", help=f"one of {', '.join(GPUS)} (default H100)")
    link = parser.add_mutually_exclusive_group()
    link.add_argument("--interconnect", help=f"all-reduce over this link for every N: {', '.join(INTERCONNECTS)}")
    link.add_argument("--bandwidth", type=float, metavar="GBPS", help="all-reduce bus bandwidth in GB/s, every N")
    mfu = parser.add_mutually_exclusive_group()
    mfu.add_argument("--mfu", type=float, help=f"assumed model FLOPs utilisation (default {DEFAULT_MFU})")
    mfu.add_argument("--calibrate", metavar="RUN_DIR", help="use the median MFU measured in a run's metrics.jsonl")
    parser.add_argument("--json", action="store_true", help="also print the plan as one JSON line")
    parser.add_argument("--slow-link", type=_slow_link, metavar="GBPS,MS", help="a slow link between groups of the "
                        "devices (bandwidth in GB/s, one-way latency in ms): ddp across it against DiLoCo "
                        "(parallel.sync, parallel.groups: default 2)")  # fmt: skip


def _slow_link(text: str) -> tuple[float, float]:
    try:
        gbs, ms = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give GBPS,MS, e.g. 1,20 (1 GB/s, 20 ms one way)") from None
    if not (gbs > 0 and ms >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: the bandwidth must be positive and the latency >= 0")
    return gbs, ms


def _at_least(minimum: int):
    """An argparse type: an integer >= minimum (argparse's own int takes -2 devices)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: give {minimum} or more")
        return value

    parse.__name__ = "int"  # argparse names the type in its own errors
    return parse


def _device_ids(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _train(args: argparse.Namespace) -> int:
    from jdp.config import check, explicit_keys, load_config
    from jdp.job.join import JoinError
    from jdp.job.process import watch_launcher
    from jdp.job.world import WorldError, resolve_world

    watch_launcher()  # a worker of `jdp launch` never outlives it
    config, overrides = split_config_args(args.args)
    cfg = load_config(config, overrides)
    check(cfg)  # a typo is one line, before anything is built from it
    from jdp.parallel import strategies

    strategies.get(cfg.parallel.strategy).set_xla_flags(cfg.parallel.bucket_mb)  # before JAX touches a device
    try:
        world = resolve_world(args.coordinator, args.num_processes, args.process_id, args.local_device_ids)
    except WorldError as e:
        raise ConfigError(str(e)) from e
    from jdp.job.coordination import leave_job
    from jdp.lm import train
    from jdp.trainer import RunError

    try:
        train(cfg, world, explicit_keys(overrides))
    except JoinError as e:  # never joined: there is no job to leave
        log.error(str(e))
        return 1
    except (RunError, ConfigError) as e:
        if (interrupt := interrupt_in(e)) is not None:  # what the interrupt broke (an import, a compile), not why
            raise interrupt from None
        log.error(str(e))
        code = 1 if isinstance(e, RunError) else 2
        if world.num_processes > 1:
            leave_job(code)  # not through JAX's shutdown barrier, where peers that are gone would be awaited
        return code
    return 0


def exit_despite_threads(code: int, grace_s: float = 10.0) -> None:
    """After a failed command (the process's own: `jdp ...`, not main() called from Python), make sure the process
    ends: Python's exit joins every non-daemon thread, and a library's
    may never end (orbax's wait for the signals of a save that failed: a read-only or full disk hung `jdp train`
    after its error). A daemon timer ends the process `grace_s` later if the exit has not (the normal exit, with
    its atexit handlers and the executors' shutdown, is not cut short when it takes less)."""

    def end() -> None:
        stuck = [t.name for t in threading.enumerate() if t.is_alive() and not t.daemon and t is not threading.main_thread()]
        log.warning(f"{len(stuck)} thread(s) still running {grace_s:g} s after the error ({', '.join(stuck[:3])}); "
                    f"exiting without them")  # fmt: skip
        logging.shutdown()
        os._exit(code)

    timer = threading.Timer(grace_s, end)
    timer.daemon = True
    timer.start()


def _allreduce(args: argparse.Namespace) -> int:
    if args.devices:  # a simulated N-device CPU job, to inspect the N-device program on any machine
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
        ).strip()
    from jdp.config import check, load_config
    from jdp.hlo import all_reduce_report, compression_report

    config, overrides = split_config_args(args.args)
    cfg = load_config(config, overrides)
    check(cfg)
    from jdp.parallel import strategies

    strategies.get(cfg.parallel.strategy).set_xla_flags(cfg.parallel.bucket_mb)
    text, numbers = (compression_report if cfg.parallel.compression != "none" else all_reduce_report)(cfg)
    print(text)
    if args.json:
        print(json.dumps(numbers))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from jdp import plot

    return plot.run(args)


def _generate(args: argparse.Namespace) -> int:
    from jdp import generate

    return generate.run(args)


def _export(args: argparse.Namespace) -> int:
    from jdp import generate

    return generate.export(args)


def export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by jdp train")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the directory to write (must not exist, or be empty)")
    p.add_argument("--step", type=_at_least(0), help="the checkpoint at this step (default: the newest that restores)")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run's adapters alone, in PEFT's format (adapter_model.safetensors, adapter_config.json)")


def _eval(args: argparse.Namespace) -> int:
    from jdp import harness

    return harness.run(args)


def eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by jdp train (or a Hugging Face model directory)")
    p.add_argument("--tasks", required=True, help="the harness's task names, comma-separated (e.g. hellaswag,arc_easy)")
    p.add_argument("--step", type=_at_least(0), help="the checkpoint at this step (default: the newest that restores)")
    p.add_argument("--include-path", metavar="DIR", help="a directory of task YAMLs (tasks over local files)")
    p.add_argument("--limit", type=float, help="the first N documents of each task (a fraction below 1: that share)")
    p.add_argument("--num-fewshot", type=_at_least(0), help="examples in each prompt (default: the task's)")
    p.add_argument("--batch-size", default="auto", help="rows per forward over all devices (default 16 a device)")
    p.add_argument("--max-gen-toks", type=_at_least(1), default=256, help="generate_until's tokens at most (default 256)")
    p.add_argument("--apply-chat-template", action="store_true", help="prompts through the run's chat template")
    p.add_argument("--log-samples", action="store_true", help="every request and answer, beside the results JSON")
    p.add_argument("--bootstrap-iters", type=_at_least(0), default=100000, help="for standard errors (0: none)")
    p.add_argument("-o", "--output", help="the results JSON (default: RUN_DIR/eval/step_N-TIME.json)")


def _plan(args: argparse.Namespace) -> int:
    # The planner only traces shapes: keep JAX off the GPUs (and their memory) of the machine it runs on.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jdp import plan

    return plan.run(args)


def _launch(args: argparse.Namespace) -> int:
    from jdp.job.launch import LaunchError, launch, say
    from jdp.job.members import launch_live

    try:
        return (launch_live if args.live else launch)(args, args.command)
    except LaunchError as e:
        say(str(e), logging.ERROR, prefix="jdp launch: error: ")
        return 2


def train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs="*", metavar="[CONFIG] [section.key=value ...]")
    p.add_argument("--coordinator", help="HOST:PORT of process 0, for a multi-process job")
    p.add_argument("--num-processes", type=int, help="number of processes in the job")
    p.add_argument("--process-id", type=int, help="this process's id, 0 .. num-processes-1")
    p.add_argument("--local-device-ids", type=_device_ids, help="this process's GPUs, e.g. 0,1")


def allreduce_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs="*", metavar="[CONFIG] [section.key=value ...]")
    p.add_argument("--devices", type=_at_least(1), help="compile for N simulated CPU devices instead of this machine's")
    p.add_argument("--json", action="store_true", help="also print the numbers as one JSON line")


def plot_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    p.add_argument("-o", "--out", type=Path, help="the PNG to write (default: RUN_DIR/plot.png of the first run)")


def launch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=int, required=True, help="workers on this node")
    p.add_argument("--nnodes", help="nodes in the job (default 1; under srun: its tasks); MIN:MAX: elastic (needs "
                   "--rdzv-dir)")  # fmt: skip
    p.add_argument("--node-rank", type=int, help="this node's rank, 0 .. nnodes-1 (default 0; under srun: SLURM_PROCID)")
    p.add_argument("--coordinator", help="HOST:PORT on node 0 (default on one node: 127.0.0.1 and a free port; under "
                   "srun: the step's first node, JAX's port for the job id)")  # fmt: skip
    p.add_argument(
        "--coordinator-bind",
        metavar="HOST[:PORT]",
        help="where node 0's coordination service listens (default: the --coordinator address only; 0.0.0.0: all)",
    )
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart the whole group up to K times (--live: replace a failed member, K times on this node)")
    p.add_argument("--rdzv-dir", help="elastic jobs: a directory every node sees, where the nodes agree who is in")
    p.add_argument(
        "--rdzv-timeout", type=float, default=30.0, help="elastic jobs: seconds to wait for more nodes once MIN are in"
    )
    p.add_argument("--local-addr", help="this node's address for the others (default: the one toward --coordinator)")
    p.add_argument("--devices-per-proc", type=int, default=1, help="simulated CPU devices per worker (no GPUs)")
    p.add_argument(
        "--no-pin-cpus",
        dest="pin_cpus",
        action="store_false",
        help="CPU-only workers: do not give each worker its own share of this node's cores",
    )
    p.add_argument("--grace-s", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL when stopping")
    p.add_argument(
        "--live",
        action="store_true",
        help="live membership (docs/live.md): each worker a member of torchft's quorum; a failed one is replaced "
        "(--max-restarts times on this node) while the others go on; node 0 starts the Lighthouse at --coordinator",
    )
    p.add_argument("--min-members", type=int, help="--live: members a step needs (default: a majority of the job's)")
    p.add_argument("--lighthouse", help="--live: a Lighthouse already running (URL); then no node starts one")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the jdp command to run, e.g. -- train CONFIG")


# name: (what it runs, its arguments, one-line help, description, example)
COMMANDS = {
    "train": (
        _train,
        train_arguments,
        "train a model",
        "Train. CONFIG is a YAML path or a name in configs/ (default: tiny). The job to join comes from these "
        "options, else JAX_* variables, else torchrun's, else SLURM's or Open MPI's.",
        "jdp train configs/tiny.yaml train.steps=100 optim.lr=3e-4",
    ),
    "allreduce": (
        _allreduce,
        allreduce_arguments,
        "list the all-reduces of the compiled train step for a config",
        "Compile the train step of CONFIG (no data, no training) and print each all-reduce XLA kept: bytes, "
        "operand, whether it sits in a loop, and which gradients it carries. The gradient all-reduces add up to "
        "the parameter bytes (half of them with parallel.reduce_dtype=bfloat16).",
        "jdp allreduce configs/gpt2-small.yaml parallel.bucket_mb=25 --devices 8",
    ),
    "plot": (
        _plot,
        plot_arguments,
        "plot loss and throughput of one run or several",
        "Training and validation loss against steps and against tokens, and tokens/s, from each RUN_DIR's "
        "metrics.jsonl; several runs are overlaid.",
        "jdp plot runs/a runs/b -o compare.png",
    ),
    "generate": (
        _generate,
        generate_arguments,
        "continue a prompt with a run's latest checkpoint",
        "Load RUN_DIR's newest checkpoint (or a Hugging Face model directory: config.json + model.safetensors + "
        "tokenizer.json) on one device and print the prompt and a sampled continuation, drawn with a KV cache; the "
        "same seed gives the same text.",
        "jdp generate runs/tiny-20260101-120000 --prompt 'def main():' --temperature 0.7",
    ),
    "export": (
        _export,
        export_arguments,
        "write a checkpoint as a Hugging Face model (config.json + model.safetensors)",
        "Restore RUN_DIR's newest checkpoint (or --step N) on one device, read-only, and write it in the names and "
        "shapes of its family's Hugging Face architecture (GPT-2 for model.arch=gpt; Llama, or Qwen2 with q/k/v "
        "biases, or the architecture it was imported from, for model.arch=llama), with the run's tokenizer files "
        "if it used a Hugging Face tokenizer: "
        "transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR) loads it unchanged.",
        "jdp export runs/gpt2-ft exported/gpt2-ft --step 1000",
    ),
    "eval": (
        _eval,
        eval_arguments,
        "run lm-evaluation-harness tasks on a run's checkpoint, over every device",
        "Restore RUN_DIR's newest checkpoint (or --step N) and answer the harness's requests for --tasks with jdp's "
        "forward and KV-cache decoder, the log-likelihoods split over every device of every process (under jdp "
        "launch, torchrun or SLURM as for training); print the harness's table and write its results JSON into "
        "RUN_DIR/eval/. Needs pip install -e \".[eval]\" (docs/evaluation.md).",
        "jdp eval runs/tiny --tasks hellaswag --limit 100",
    ),
    "plan": (
        _plan,
        plan_arguments,
        "memory, step time and scaling of a config on N GPUs, before paying for them",
        "Predict, on any machine, memory per device, the step split into compute and gradient all-reduce, and "
        "tokens/s and scaling efficiency for N = 1 .. 1024 GPUs (docs/planning.md).",
        "jdp plan gpt2-small --devices 64 --gpu H100 --interconnect ib-ndr",
    ),
    "launch": (
        _launch,
        launch_arguments,
        "start the workers of this node (torchrun-style)",
        "Start --nproc-per-node workers on this node, each with its own GPUs (or CPU devices), prefix their "
        "output with their rank, forward signals, and stop them all if one fails.",
        "jdp launch --nproc-per-node 2 -- train configs/tiny.yaml train.steps=100",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """Every command's arguments; building it imports nothing heavy (no JAX), so `jdp --help` is instant."""
    from jdp import __version__

    parser = argparse.ArgumentParser(prog="jdp", description="Data-parallel training of Flax models with JAX.")
    parser.add_argument("--version", action="version", version=f"jdp {__version__}")
    sub = parser.add_subparsers(dest="command_name", required=True)
    for name, (run, arguments, summary, description, example) in COMMANDS.items():
        p = sub.add_parser(name, help=summary, description=description, epilog=f"example: {example}")
        arguments(p)
        p.set_defaults(func=run)
    return parser


def interrupt_in(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C behind an error (an ImportError a C extension raised for it, a RunError around that), if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def main(argv: list[str] | None = None) -> int:
    """The `jdp` command: its exit code. Run as the process's command (argv None: `jdp ...`, `python -m jdp.cli`),
    a failure's exit is not held by a library's threads (exit_despite_threads); called from Python with argv, the
    process is the caller's and is left alone."""
    code = _command(argv)
    if argv is None:
        # The process ends next: Python's final collections walk every object JAX, flax and datasets made (~2 s
        # on a 2-core CPU, 6.8 s while it was loaded; 1.0 s frozen), a cost paid again by every worker and restart.
        gc.freeze()
        if code:
            exit_despite_threads(code)
    return code


def _command(argv: list[str] | None) -> int:
    from jdp.job.process import INTERRUPTED_EXIT, StartupInterrupts, flush_every_line, tolerate_broken_pipes

    flush_every_line()  # each line reaches a file when printed, even if the process is then killed
    tolerate_broken_pipes()  # output to a reader that is gone is dropped; the command goes on
    install()  # jdp's records in the command's look: `jdp | ...` on stdout, `jdp: warning: ...` on stderr
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "args") and not any(x.startswith("-") for x in extra):
        args.args += extra  # overrides given after an option: jdp allreduce tiny --devices 4 parallel.bucket_mb=1
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # Ctrl-C from the first line (importing JAX, joining the job) until `jdp train`'s loop takes the signals over, or
    # the command ends: one line and exit 130, never dropped (job/process.py). `jdp launch` handles its own.
    name = args.command_name
    if name == "train":
        # Before any thread starts (the interrupt watch below, the launcher's watch): a thread that has called
        # malloc has an arena of its own, which XLA's workers can then take and which returns memory to the OS
        # every step (~100k page faults a step, 20% slower, on llama-tiny under `jdp launch`: docs/performance.md).
        from jdp.job.xla import keep_scratch_memory

        keep_scratch_memory()
    own = name == "launch" or threading.current_thread() is not threading.main_thread()
    phase = "starting" if name == "train" else f"running jdp {name}"  # the trainer names its phases from here on
    interrupts = contextlib.nullcontext() if own else StartupInterrupts(lambda: phase, check_on_exit=False)
    try:
        with interrupts:
            return args.func(args)
    except ConfigError as e:
        log.error(str(e))
        return 2
    except (AssertionError, RuntimeError) as e:  # JAX_PLATFORMS naming a platform this jaxlib cannot start
        from jdp.job.xla import platform_problem

        if (problem := platform_problem(e)) is None:
            raise
        log.error(problem)
        return 2
    except ImportError as e:  # a C extension's initialization interrupted by Ctrl-C fails as "initialization failed"
        if (interrupt := interrupt_in(e)) is None:
            raise
        if speaks():
            log.info(f"interrupted while {getattr(interrupt, 'phase', 'starting')}", extra=PLAIN)
        return INTERRUPTED_EXIT
    except KeyboardInterrupt as e:  # Ctrl-C before the loop took the signals over (it stops at a step and saves)
        if speaks():  # rank 0 says it for the job (a worker of jdp launch knows its rank before it joins)
            log.info(f"interrupted while {getattr(e, 'phase', 'starting')}", extra=PLAIN)
        return INTERRUPTED_EXIT


if __name__ == "__main__":
    sys.exit(main())
