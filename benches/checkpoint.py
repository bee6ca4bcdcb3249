"""The cost of the Trainer's checkpoint checksums on a GPT-2-size checkpoint.

A checkpoint is a zip archive written by ``torch.save``; each record carries the CRC-32 of its
bytes, computed while it is written (``gradfuse.train.checkpoint`` forces it on), and checked
by ``verify_checksums`` before a checkpoint is loaded. This times, interleaved over reps:

* ``save``: ``torch.save`` + flush + fsync with the CRC-32 computed, as the Trainer writes;
* ``save_no_crc``: the same with ``torch.utils.serialization.config.save.compute_crc32 = False``
  (the difference is the checksum's cost when writing);
* ``verify``: ``verify_checksums`` (every record read back and its CRC-32 compared);
* ``load``: ``torch.load(weights_only=True)``, what a resume does after the check.

With ``--sharded``, the Trainer's two kinds of checkpoint of the same model and AdamW state, in
one process (the sharded one without a process group, as ``parallel="fsdp"`` writes it alone):

* ``file_save`` / ``file_load``: ``checkpoint.save_checkpoint`` / ``load_checkpoint`` (one
  file: atomic write, CRC-32, checked read);
* ``sharded_save`` / ``sharded_load``: ``sharded_checkpoint.save`` / ``load`` (a folder through
  ``torch.distributed.checkpoint``: shards, rank file, CRC-32 of every file, one rename; the
  load checks the folder whole, then DCP reads into the model's and optimizer's state dicts).

The state is GPT-2 124M's (12 layers, width 768, vocab 50257, context 1024) in fp32 with
AdamW's two moments: 3 x 124M values, ~1.5 GB (``--quick``: width 64, vocab 1024, ~9 MB).

Usage: python benches/checkpoint.py [--quick] [--sharded] [--reps N] [--dir DIR]
(DIR: where the file goes; default: a temporary folder. Put it on the disk checkpoints use.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gradfuse.train import checkpoint, sharded_checkpoint
from gradfuse.train.checkpoint import verify_checksums


def gpt2_state(width: int, vocab: int, ctx: int = 1024, layers: int = 12) -> dict:
    shapes = [(vocab, width), (ctx, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,)]
        shapes += [(width,), (width,), (4 * width, width), (4 * width,), (width, 4 * width), (width,)]
    shapes += [(width,), (width,)]
    gen = torch.Generator().manual_seed(0)
    model = {f"p{i}": torch.randn(s, generator=gen) for i, s in enumerate(shapes)}
    moments = {
        i: {
            "step": torch.tensor(10.0),
            "exp_avg": torch.randn(s, generator=gen),
            "exp_avg_sq": torch.rand(s, generator=gen),
        }
        for i, s in enumerate(shapes)
    }
    return {"model": model, "optimizer": {"state": moments, "param_groups": [{"lr": 1e-3, "params": list(moments)}]}}


def as_module(state: dict) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``state``'s tensors as a module's parameters and an AdamW's moments (shared, not copied)."""
    module = torch.nn.Module()
    for name, value in state["model"].items():
        module.register_parameter(name, torch.nn.Parameter(value))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    for i, param in enumerate(module.parameters()):
        optimizer.state[param] = state["optimizer"]["state"][i]
    return module, optimizer


def time_trainer_checkpoints(state: dict, folder: Path, reps: int) -> dict[str, list[float]]:
    """The single-file and the sharded checkpoint of the same state, interleaved over reps."""
    module, optimizer = as_module(state)
    whole = {"model": module.state_dict(), "optimizer": optimizer.state_dict()}
    times: dict[str, list[float]] = {"file_save": [], "file_load": [], "sharded_save": [], "sharded_load": []}
    for rep in range(reps + 1):  # the first round warms the page cache and the allocator: untimed
        timed = {}
        start = time.perf_counter()
        path = checkpoint.save_checkpoint(folder / "file", rep, whole, keep_last=1)
        timed["file_save"] = time.perf_counter() - start
        start = time.perf_counter()
        checkpoint.load_checkpoint(path)
        timed["file_load"] = time.perf_counter() - start
        start = time.perf_counter()
        path = sharded_checkpoint.save(folder / "sharded", rep, module, optimizer, keep_last=1)
        timed["sharded_save"] = time.perf_counter() - start
        start = time.perf_counter()
        sharded_checkpoint.load(path, module, optimizer)
        timed["sharded_load"] = time.perf_counter() - start
        if rep:
            for name, seconds in timed.items():
                times[name].append(seconds)
    return times


def _save(state: dict, path: Path, crc: bool) -> None:
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    config.save.compute_crc32 = crc
    try:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    finally:
        config.save.compute_crc32 = before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small state (~9 MB), 3 reps")
    parser.add_argument("--sharded", action="store_true", help="also the Trainer's file vs sharded checkpoints")
    parser.add_argument("--reps", type=int, default=None, help="timed reps per operation (default: 5, quick 3)")
    parser.add_argument("--dir", type=Path, default=None, help="folder for the file (default: a temporary one)")
    args = parser.parse_args(argv)
    reps = args.reps or (3 if args.quick else 5)
    state = gpt2_state(64, 1024) if args.quick else gpt2_state(768, 50257)
    values = sum(t.numel() for t in state["model"].values()) * 3
    if args.dir is not None:
        os.makedirs(args.dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = Path(folder, "checkpoint.pt")
        times: dict[str, list[float]] = {"save": [], "save_no_crc": [], "verify": [], "load": []}
        for rep in range(reps + 1):  # the first round warms the page cache and the allocator: untimed
            order = [("save", True), ("save_no_crc", False)]
            for name, crc in order if rep % 2 else order[::-1]:
                start = time.perf_counter()
                _save(state, path, crc)
                if rep:
                    times[name].append(time.perf_counter() - start)
            _save(state, path, True)
            start = time.perf_counter()
            verify_checksums(path)
            verify = time.perf_counter() - start
            start = time.perf_counter()
            torch.load(path, weights_only=True)
            if rep:
                times["verify"].append(verify)
                times["load"].append(time.perf_counter() - start)
        size = path.stat().st_size
        if args.sharded:
            times.update(time_trainer_checkpoints(state, Path(folder), reps))
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"checkpoint of {values / 1e6:.0f}M fp32 values ({size / 2**30:.2f} GiB), {reps} reps, medians:")
    for name, seconds in medians.items():
        print(f"  {name:12s} {seconds * 1e3:9.1f} ms  ({size / seconds / 1e9:5.2f} GB/s)")
    crc_cost = medians["save"] - medians["save_no_crc"]
    print(
        f"checksum when writing: {crc_cost * 1e3:+.1f} ms ({crc_cost / medians['save_no_crc']:+.1%} of the write); "
        f"verify on load: {medians['verify'] * 1e3:.1f} ms ({medians['verify'] / medians['load']:.0%} of torch.load)"
    )
    record = {"size_bytes": size, "values": values, "reps": reps, "median_s": medians, "torch": torch.__version__}
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
