"""The `jdp` command line: parses arguments and dispatches; no training logic lives here."""

from __future__ import annotations

import argparse
import sys

from jdp.config import ConfigError

DEFAULT_CONFIG = "tiny"


def _train(args: argparse.Namespace) -> int:
    from jdp.config import load_config
    from jdp.train import train

    config, overrides = DEFAULT_CONFIG, list(args.args)
    if overrides and "=" not in overrides[0]:
        config = overrides.pop(0)
    cfg = load_config(config, overrides)
    train(cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jdp", description="Data-parallel training of Flax models with JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "train",
        help="train a model",
        description="Train. CONFIG is a YAML path or a name in configs/ (default: tiny).",
        epilog="example: jdp train configs/tiny.yaml train.steps=100 optim.lr=3e-4",
    )
    p.add_argument("args", nargs="*", metavar="[CONFIG] [section.key=value ...]")
    p.set_defaults(func=_train)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"jdp: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
