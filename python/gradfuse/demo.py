"""``python -m gradfuse demo``: train a small character-level transformer end to end.

The text is the Python standard library's own source (present wherever Python is; nothing
is downloaded), read as bytes: a vocabulary of 256. The model is a GPT in miniature (4
layers, width 128, context 128, ~0.8M parameters) trained with ``gradfuse.Trainer``:
AdamW (fused), warmup + cosine schedule, clipping folded into the optimizer, a progress bar,
metrics as JSON lines, a checkpoint, and a chart of the loss, gradient norm and learning rate.
About a minute on 2 CPU cores at the default ``--steps``. Under ``torchrun`` it trains
data-parallel (each rank on its share of the text, ``DistributedSampler``): through DDP, or with
``--parallel fsdp`` sharded by FSDP2, each transformer block a unit of its own.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .train import (
    CheckpointError,
    CheckpointFolderInUse,
    CheckpointFolderTaken,
    TrainConfig,
    Trainer,
    TrainingInterrupted,
    latest_checkpoint,
)

TEXT_BYTES = 4 * 2**20  # how much of the standard library to read
HELD_OUT_EVERY = 20  # every 20th window is held out for evaluation (256 of them are used)


# --- data ----------------------------------------------------------------------------------


def stdlib_text(limit: int = TEXT_BYTES) -> torch.Tensor:
    """The first ``limit`` bytes of the standard library's ``.py`` files, in sorted path order
    (the same bytes on every run with the same Python), as a uint8 tensor."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    if size < 100_000:
        raise RuntimeError(
            f"found only {size} bytes of Python source under {root}; the demo needs the standard library"
        )
    text = b"".join(chunks)[:limit]
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


class Windows(torch.utils.data.Dataset):
    """Consecutive windows of ``ctx + 1`` bytes: ``input_ids`` and the next byte at each place."""

    def __init__(self, text: torch.Tensor, ctx: int):
        self.text, self.ctx = text, ctx

    def __len__(self) -> int:
        return (len(self.text) - 1) // self.ctx

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.text[i * self.ctx : (i + 1) * self.ctx + 1].long()
        return {"input_ids": window[:-1], "labels": window[1:]}


# --- model ---------------------------------------------------------------------------------


@dataclass
class GPTConfig:
    vocab: int = 256
    ctx: int = 128
    width: int = 128
    layers: int = 4
    heads: int = 4


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln_1 = nn.LayerNorm(cfg.width)
        self.attn = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln_2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(), nn.Linear(4 * cfg.width, cfg.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in self.attn(self.ln_1(x)).split(c, 2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class LMOutput(NamedTuple):
    """The model's output, ``.loss`` as the Trainer reads it. A NamedTuple, not a dataclass: FSDP2
    puts its backward hooks on the output's tensors, and torch 2.11's finds them only in containers
    that torch's pytree knows (a dataclass output there fails in backward, or is silently wrong)."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class GPT(nn.Module):
    """A GPT-2-shaped language model in miniature (learned positions, pre-norm blocks, tied head)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.width)
        self.wpe = nn.Embedding(cfg.ctx, cfg.width)
        self.blocks = nn.Sequential(*(Block(cfg) for _ in range(cfg.layers)))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's initialisation; residual projections scaled by depth
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> LMOutput:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        logits = self.head(self.ln_f(self.blocks(self.wte(input_ids) + self.wpe(positions))))
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return LMOutput(logits, loss)

    @torch.no_grad()
    def generate(self, prompt: bytes, length: int, temperature: float = 0.8, seed: int = 0) -> bytes:
        device = self.wte.weight.device
        ids = torch.tensor(list(prompt), device=device).unsqueeze(0)
        gen = torch.Generator(device=device).manual_seed(seed)
        for _ in range(length):
            logits = self(ids[:, -self.cfg.ctx :]).logits[0, -1].float() / temperature
            ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=gen).unsqueeze(0)], 1)
        return bytes(ids[0, len(prompt) :].tolist())


# --- the command ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--steps", type=int, default=400, help="optimizer steps (default: 400, about a minute on 2 cores)"
    )
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32", help="default: fp32")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="CHECKPOINT",
        help="continue from a checkpoint (a file, or a sharded folder), or (no value) from the newest under --out",
    )
    parser.add_argument(
        "--start-over",
        action="store_true",
        help="delete the checkpoints an earlier run left under --out and train from step 0",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--out", type=Path, default=Path("gradfuse-demo"), help="output folder (default: ./gradfuse-demo)"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="sequences of 128 bytes per step (default: 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--parallel",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="under torchrun: ddp (replicated model) or fsdp (FSDP2, the model sharded per block); default: ddp",
    )


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        print(f"gradfuse demo: error: --steps must be at least 1, got {args.steps}", file=sys.stderr)
        return 2
    if args.start_over and args.resume:
        print("gradfuse demo: error: --resume continues a run, --start-over deletes it: give one", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        print("gradfuse demo: error: --device cuda, but torch sees no CUDA GPU; use --device cpu", file=sys.stderr)
        return 2
    out: Path = args.out
    if out.exists() and not out.is_dir():
        print(f"gradfuse demo: error: --out {out} is a file; give a folder (made if missing)", file=sys.stderr)
        return 2
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(f"gradfuse demo: error: --out {out} cannot be made: {err.strerror or err}", file=sys.stderr)
        return 2
    # Under torchrun each rank trains on its own share of the windows; rank 0 reports.
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    say = functools.partial(print, file=sys.stderr) if rank == 0 else lambda *args: None
    torch.manual_seed(args.seed)
    gpt = GPTConfig()
    text = stdlib_text()
    windows = Windows(text, gpt.ctx)
    held_out = [i for i in range(len(windows)) if i % HELD_OUT_EVERY == 0]
    train_windows = torch.utils.data.Subset(windows, [i for i in range(len(windows)) if i % HELD_OUT_EVERY])
    if world > 1:
        sampler = torch.utils.data.DistributedSampler(train_windows, world, rank, shuffle=True, seed=args.seed)
        train = torch.utils.data.DataLoader(train_windows, batch_size=args.batch_size, sampler=sampler)
    else:
        train = torch.utils.data.DataLoader(train_windows, batch_size=args.batch_size, shuffle=True)
    eval_windows = torch.utils.data.Subset(windows, held_out[:: max(1, len(held_out) // 256)][:256][rank::world])
    eval_batches = list(torch.utils.data.DataLoader(eval_windows, batch_size=64))

    model = GPT(gpt)
    sharded = args.parallel == "fsdp" and world > 1  # one process trains the plain model (train/fsdp.py)
    fused = torch.device(device).type in ("cpu", "cuda")
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.95),
        fused=fused,
    )
    config = TrainConfig(
        max_steps=args.steps,
        precision=args.precision,
        max_grad_norm=1.0,
        lr=3e-3,
        lr_schedule="cosine",
        warmup_steps=min(50, args.steps // 10),
        min_lr_ratio=0.1,
        checkpoint_dir=out / "checkpoints",  # under FSDP2: sharded folders (train/sharded_checkpoint.py)
        save_every=max(1, args.steps // 2),
        keep_last=2,
        log_every=10,
        # Per-block gradient norms in the rows (and the chart): blocks.0, wte, ... (under FSDP2 from
        # each rank's shards, combined across the ranks on log steps).
        log_grad_norms=2,
        metrics_path=out / "metrics.jsonl",
        eval_every=max(10, args.steps // 5),
        seed=args.seed,
        device=device,
        parallel=args.parallel,
        fsdp_units=["Block"] if args.parallel == "fsdp" else [],
    )
    where = f"{device}" if world == 1 else f"{world} ranks ({device}, {args.parallel})"
    say(
        f"gradfuse demo: a {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter character-level "
        f"transformer on {len(text) / 2**20:.1f} MiB of the Python standard library's source, {args.steps} steps "
        f"of {args.batch_size * world}x{gpt.ctx} bytes, {args.precision} on {where}"
    )
    try:
        trainer = Trainer(
            model, optimizer, train, config, eval_data=eval_batches, resume=args.resume, start_over=args.start_over
        )
    except CheckpointFolderTaken:
        print(
            f"gradfuse demo: error: {config.checkpoint_dir} holds the checkpoints of an earlier run: continue it with "
            f"--resume, or delete them and start over with --start-over (or give another --out)",
            file=sys.stderr,
        )
        return 2
    except (CheckpointError, CheckpointFolderInUse, FileNotFoundError, OSError) as err:
        print(f"gradfuse demo: error: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        trainer.fit()
    except TrainingInterrupted as stop:
        say(
            f"\ngradfuse demo: stopped by {stop.signal} after step {stop.step}; checkpoint {stop.checkpoint} written. "
            f"Continue with: python -m gradfuse demo --out {out} --steps {args.steps} --resume"
        )
        return 130  # the shell's status for a run stopped by Ctrl-C
    elapsed = time.perf_counter() - start
    # Under FSDP2 every forward gathers the shards from every rank: all ranks generate the sample.
    sample = model.generate(b"def ", 120, seed=args.seed) if rank == 0 or sharded else b""
    if rank != 0:
        return 0

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    chart = write_chart(out / "curves.png", rows, config.max_grad_norm)
    sample = sample.decode("utf-8", errors="replace")
    first, last = rows[0], rows[-1]
    say(
        f"\nloss {first['loss']:.3f} (step {first['step']}) -> {last['loss']:.3f} (step {last['step']}), "
        f"held-out loss {last.get('eval_loss', math.nan):.3f} (uniform guessing: {math.log(256):.3f}); "
        f"{elapsed:.0f} s\n\nsample:\ndef {sample}\n"
    )
    written = [out / "metrics.jsonl"]
    if config.checkpoint_dir is not None:
        written.append(latest_checkpoint(config.checkpoint_dir))
    if chart is not None:
        written.append(chart)
    say("wrote " + ", ".join(str(p) for p in written))
    return 0


def write_chart(path: Path, rows: list[dict], max_grad_norm: float | None = None) -> Path | None:
    """Loss (train and held-out), gradient norms (the total and, when logged, per module) and
    learning rate against the step, as a PNG; None, with a message, when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("gradfuse demo: matplotlib is not installed, so no chart (pip install matplotlib)", file=sys.stderr)
        return None

    def series(key: str) -> list[float]:
        return [math.nan if r.get(key) is None else r[key] for r in rows]  # null: not finite

    steps = series("step")
    fig, (ax_loss, ax_norm, ax_lr) = plt.subplots(3, 1, figsize=(7, 7.5), sharex=True)
    ax_loss.plot(steps, series("loss"), label="train")
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    if evals:
        ax_loss.plot(*zip(*evals, strict=True), "o-", label="held out")
    ax_loss.set_ylabel("loss (nats/byte)")
    ax_loss.legend()
    ax_norm.plot(steps, series("grad_norm"), color="black", label="total")
    for key in sorted({k for r in rows for k in r if k.startswith("grad_norm/")}):  # log_grad_norms
        ax_norm.plot(steps, series(key), linewidth=0.8, alpha=0.8, label=key.split("/", 1)[1])
    if max_grad_norm is not None:
        ax_norm.axhline(max_grad_norm, color="grey", linestyle="--", linewidth=0.8, label="clipped above")
    ax_norm.legend(fontsize=6, ncol=3)
    ax_norm.set_yscale("log")
    ax_norm.set_ylabel("grad norm (before clipping)")
    ax_lr.plot(steps, series("lr"))
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    for ax in (ax_loss, ax_norm, ax_lr):
        ax.grid(True, alpha=0.3)
    fig.suptitle("gradfuse demo: character-level transformer on the Python standard library", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
