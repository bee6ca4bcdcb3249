"""The ``gradfuse`` command line: ``python -m gradfuse demo``, ``python -m gradfuse bench ...``
and ``--version``."""

from __future__ import annotations

import argparse
import sys

import gradfuse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradfuse",
        description="Fused gradient ops for PyTorch: multi-tensor norm, clipping, AMP unscale, accumulation.",
    )
    parser.add_argument("--version", action="version", version=f"gradfuse {gradfuse.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    from . import demo
    from .bench import add_arguments

    demo.add_arguments(
        commands.add_parser(
            "demo",
            help="train a small character-level transformer end to end (about a minute on 2 CPU cores)",
            description="Train a small character-level transformer on the Python standard library's own source "
            "with gradfuse.Trainer: progress bar, metrics (JSON lines), a checkpoint and a chart of the loss, "
            "gradient norm and learning rate under --out.",
        )
    )
    bench = commands.add_parser(
        "bench",
        help="compare gradfuse with torch on this machine",
        description="Time gradfuse against torch (and apex / TransformerEngine when importable) on "
        "gradient clipping, AMP unscale+clip and accumulation workloads; print a table of medians "
        "and speedups and write JSON and markdown records.",
    )
    add_arguments(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_usage(sys.stderr)
        print("gradfuse: error: a command is required (available: demo, bench)", file=sys.stderr)
        return 2
    if args.command == "demo":
        from .demo import run

        try:
            return run(args)
        except KeyboardInterrupt:  # Ctrl-C before training started (during it, the demo saves and says so)
            print("\ngradfuse demo: interrupted", file=sys.stderr)
            return 130
    from .bench import BenchError, bench

    command = ["gradfuse", *(sys.argv[1:] if argv is None else argv)]
    try:
        return bench(args, command)
    except BenchError as err:
        print(f"gradfuse bench: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
