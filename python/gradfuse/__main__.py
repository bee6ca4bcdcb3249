"""The ``gradfuse`` command line: ``python -m gradfuse bench ...`` and ``--version``."""

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
    from .bench import add_arguments

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
        print("gradfuse: error: a command is required (available: bench)", file=sys.stderr)
        return 2
    from .bench import BenchError, bench

    command = ["gradfuse", *(sys.argv[1:] if argv is None else argv)]
    try:
        return bench(args, command)
    except BenchError as err:
        print(f"gradfuse bench: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
