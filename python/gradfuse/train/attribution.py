"""Non-finite attribution: on a step whose gradients hold inf or NaN, which parameters, and on
which ranks.

Nothing here runs on a finite step beyond host-side records, only where a recompute may be
needed: references to the step's micro-batches, each with the states of torch's random
generators as its forward began (after the batch was fetched: a DataLoader starting an epoch,
or data that augments in this process, draws from them too); everything else runs only on a
flagged step, which every rank knows alike (the overflow flag is taken after the reduction).

Where the gradients come from decides how the ranks are found:

- **One process**: the gradients are the step's own; the offending parameters are read from them
  (``multi_tensor_stats``, one pass), rank 0.
- **Sharded gradients** (DTensor: FSDP2, tensor parallel): each rank holds its shard after the
  reduce-scatter; the non-finite counts of the local shards are all-gathered (one collective):
  the ranks named are those whose *shards* hold the inf/NaN (the reduce-scatter summed every
  rank's contribution first, so the rank that produced it is not known).
- **Data parallel** (DDP): the all-reduce has mixed the ranks, and the local gradients are gone.
  The step's micro-batches are run again on each rank alone (``no_sync``, and DDP's buffer
  broadcast off: no communication, except DDP's one-time bucket rebuild when the flagged step is
  the first, which every rank runs alike), each from the random state its forward began with,
  and with the step's loss scale (the scaler has not updated yet); the local non-finite counts
  are all-gathered with a flag saying whether the recompute reproduced the step's loss, bit for
  bit. Afterwards every parameter and buffer of the model is put back by name (the tensor the
  module held, even where forward replaced it, e.g. ``self.ema = 0.9 * self.ema + ...``, with
  the values it had), and so are torch's CPU and CUDA generators, Python's ``random`` and
  numpy's global generator (each micro-batch's forward also starts from the states of all
  three that it began with) and DDP's buffer-sync flag; the gradients are cleared. With
  ``TrainConfig(nonfinite_rerun=False)`` nothing is re-run (nor kept on a finite step): the row
  names the parameters, and no rank.

The row gains ``nonfinite_grads`` (the parameters whose step gradient held inf/NaN),
``nonfinite_ranks`` (``{name: [ranks]}``, or None when the ranks could not be found) and, when
there is something to say, ``nonfinite_note``.

What a recompute costs and where it can be wrong (it runs only on a flagged step): one more
forward and backward of the step's micro-batches, and a copy of the parameters and buffers
while it runs (on their device: the model's size once more; if that copy does not fit, nothing
is re-run and the row says so). What it cannot put back is what lives outside the model's
parameters and buffers and the three global generators: forward hooks and ``loss_fn`` run
again and see the extra calls (a counter of calls counts them), plain Python attributes a
forward changes (``self.calls += 1``), generators of your own (``torch.Generator`` objects),
files or logs written in forward. The buffers are those after the step, not before it
(BatchNorm in training mode does not read them; a forward that reads a buffer it changes would
differ). A recompute whose loss differs from the step's on any rank, that raises, or whose
non-finite gradients are not among the step's is reported as not reproduced, and no rank is
named.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from ..distributed import is_dtensor
from ..ops import multi_tensor_stats

Tensor = torch.Tensor
NamedGrads = Iterable[tuple[str, Tensor | None]]


def _local(grad: Tensor | None) -> Tensor | None:
    return grad.to_local() if is_dtensor(grad) else grad


def nonfinite_counts(grads: Sequence[Tensor | None]) -> Tensor:
    """Each gradient's count of inf/NaN elements on this rank (int64, ``(len(grads),)``): a
    DTensor's local shard, 0 for None or an empty tensor. One fused read per device and dtype
    family (``multi_tensor_stats``); torch's own ops for what the fused pass does not take
    (sparse, complex). On the first gradient's device (the CPU when there is none)."""
    local = [_local(g) for g in grads]
    device = next((g.device for g in local if g is not None), torch.device("cpu"))
    counts = torch.zeros(len(local), dtype=torch.int64, device=device)
    fused: dict[torch.device, list[int]] = {}
    for i, g in enumerate(local):
        if g is None or g.numel() == 0:
            continue
        if g.layout != torch.strided or g.is_complex() or not g.is_floating_point():
            values = g.coalesce().values() if g.is_sparse else g
            counts[i] = (~torch.isfinite(values)).sum().to(device)
        else:
            fused.setdefault(g.device, []).append(i)
    for index in fused.values():
        found = multi_tensor_stats([local[i] for i in index]).nonfinite
        counts[torch.tensor(index, device=device)] = found.to(device)
    return counts


def _gather(row: Tensor, group) -> Tensor:
    """``row`` from every rank of ``group``, stacked (world, len): one all-gather, of a CUDA
    tensor under NCCL and of a CPU one otherwise (counts of CPU-offloaded gradients, gloo)."""
    world = dist.get_world_size(group)
    nccl = "nccl" in str(dist.get_backend(group)).lower()
    row = row.to(torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu"))
    out = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(out, row.contiguous(), group=group)
    return torch.stack(out)


def _group_world(group) -> tuple[object, int]:
    """(the group to gather over or None for this process alone, its size)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 1
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    return (group, world) if world > 1 else (None, 1)


def _ranks_by_name(names: Sequence[str], per_rank: Sequence[Sequence[int]]) -> dict[str, list[int]]:
    """``{name: [ranks whose count is > 0]}`` for every name some rank counts."""
    out = {}
    for j, name in enumerate(names):
        ranks = [r for r, counts in enumerate(per_rank) if counts[j] > 0]
        if ranks:
            out[name] = ranks
    return out


def nonfinite_report(named_grads: NamedGrads, group=None) -> dict[str, list[int]]:
    """``{parameter name: [ranks]}`` for each gradient that holds inf or NaN on some rank, from
    this rank's gradients (a DTensor's local shard: the ranks are those whose shards hold it).

    ``named_grads``: ``(name, gradient or None)`` pairs, the same names in the same order on
    every rank, e.g. ``[(n, p.grad) for n, p in model.named_parameters()]``. ``group``: the
    ranks to ask (default: the default process group when one exists, else this process
    alone, reported as rank 0). A collective: every rank of ``group`` must call it; it costs one
    read of the gradients and one all-gather of a count per gradient, and nothing is changed."""
    pairs = list(named_grads)
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"nonfinite_report: named_grads must be (name, gradient) pairs, got {item!r}")
        if item[1] is not None and not isinstance(item[1], Tensor):
            raise TypeError(
                f"nonfinite_report: the gradient of {item[0]!r} is a {type(item[1]).__name__}, not a tensor"
            )
    names = [n for n, _ in pairs]
    counts = nonfinite_counts([g for _, g in pairs])
    group, world = _group_world(group)
    per_rank = _gather(counts, group).tolist() if world > 1 else [counts.tolist()]
    return _ranks_by_name(names, per_rank)


# --- the Trainer's attribution ------------------------------------------------------------------


RngStates = tuple  # (torch CPU, CUDA or None, Python's random, numpy's or None)


def _rng_states(device: torch.device) -> RngStates:
    # All host-side copies: the CPU generator's state, a CUDA generator's seed and Philox offset
    # (kept on the host by torch), Python's and numpy's (only if the program imported numpy);
    # none waits for the device.
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    numpy = sys.modules.get("numpy")
    return torch.get_rng_state(), cuda, random.getstate(), numpy.random.get_state() if numpy is not None else None


def _set_rng_states(states: RngStates, device: torch.device) -> None:
    cpu, cuda, python, numpy = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
    random.setstate(python)
    if numpy is not None:
        sys.modules["numpy"].random.set_state(numpy)


class _ModelState:
    """Every parameter and buffer of a model, by the module that holds it and its name: the
    tensor itself and a copy of its values, to put both back after a recompute (a forward may
    write a buffer in place, or replace it: ``self.ema = 0.9 * self.ema + ...``)."""

    def __init__(self, model: torch.nn.Module):
        self.kept = []
        with torch.no_grad():
            for module in model.modules():
                for table in (module._parameters, module._buffers):
                    names = list(table)
                    saved = [(t, None if t is None else t.detach().clone()) for t in table.values()]
                    self.kept.append((table, names, saved))

    def restore(self) -> None:
        with torch.no_grad():
            for table, names, saved in self.kept:
                for name in [n for n in table if n not in names]:  # registered by the recompute
                    del table[name]
                for name, (tensor, values) in zip(names, saved, strict=True):
                    table[name] = tensor
                    if tensor is not None:
                        tensor.copy_(values)


class NonfiniteAttribution:
    """The Trainer's attribution of a flagged step (module docs), for ``model`` (after any
    wrapping: FSDP2's parameters are DTensors by then) training on ``device`` in ``group`` of
    ``world_size`` ranks (None, 1: one process)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, group, world_size: int, rerun: bool = True):
        self.model = model
        self.device = device
        self.group = group
        self.world_size = world_size
        # Several ranks and plain (replicated, reduced) parameters: DDP, whose gradients must be
        # recomputed to tell the ranks apart; DTensor parameters are sharded, their shards tell.
        self.data_parallel = world_size > 1 and not any(is_dtensor(p) for p in model.parameters())
        self.recompute = self.data_parallel and rerun  # TrainConfig.nonfinite_rerun
        self.named = [(n, p) for n, p in model.named_parameters()]
        # (micro-batch, the random states its forward began with), for a recompute of this step.
        self._kept: list[tuple[object, RngStates]] = []
        self.step_loss: Tensor | None = None  # this rank's summed micro-losses, as backpropagated

    # --- what a finite step records (host only) -----------------------------------------------

    def start_step(self) -> None:
        self._kept, self.step_loss = [], None

    def keep(self, batch) -> None:
        """A micro-batch of this step, as the data gave it (before it was moved to the device),
        called after it was fetched and before its forward: the random states are taken here."""
        if self.recompute:
            self._kept.append((batch, _rng_states(self.device)))

    def end_step(self) -> None:
        self._kept, self.step_loss = [], None

    def _replay(self):
        """The kept micro-batches, each yielded once the random states are those its forward
        began with (the rerun fetches the next batch right before its forward)."""
        for batch, states in self._kept:
            _set_rng_states(states, self.device)
            yield batch

    # --- a flagged step ----------------------------------------------------------------------------

    def report(self, step: int, rerun: Callable[[Iterable], Tensor] | None = None, module=None) -> dict:
        """The row's ``nonfinite_*`` fields for ``step``. ``rerun(batches)`` runs the micro-steps
        on this rank alone, each right after taking its batch from the iterable ``batches``
        (which sets the random states), and returns its summed loss (the Trainer's; needed when
        ``self.recompute``); ``module`` is what forward calls go through (DDP's wrapper). Every
        rank calls it on the same step. Under a recompute the gradients are cleared (set to
        None) afterwards: the step's reduced ones are gone by then."""
        names = [n for n, _ in self.named]
        step_counts = nonfinite_counts([p.grad for _, p in self.named])
        if self.data_parallel and not self.recompute:  # TrainConfig.nonfinite_rerun=False
            return {
                "nonfinite_grads": [n for n, c in zip(names, step_counts.tolist(), strict=True) if c > 0],
                "nonfinite_ranks": None,
                "nonfinite_note": "ranks not looked for (TrainConfig.nonfinite_rerun=False)",
            }
        if not self.recompute:  # one process, or DTensor shards: the gradients at hand tell
            sharded = any(is_dtensor(p.grad) for _, p in self.named)
            group, world = (self.group, self.world_size) if sharded else (None, 1)
            per_rank = _gather(step_counts, group).tolist() if world > 1 else [step_counts.tolist()]
            ranks = _ranks_by_name(names, per_rank)
            row = {"nonfinite_grads": list(ranks), "nonfinite_ranks": ranks}
            if sharded:
                row["nonfinite_note"] = (
                    "ranks whose gradient shards hold inf/NaN (the reduce-scatter summed every rank's gradient "
                    "first: the rank that produced it is not known)"
                )
            return row
        # Data parallel: the step's gradients are the reduced ones, alike on every rank.
        flagged = [n for n, c in zip(names, step_counts.tolist(), strict=True) if c > 0]
        local, reproduced, error = self._recompute(rerun, module)
        gathered = _gather(torch.cat([local, reproduced.reshape(1)]), self.group).tolist()
        row = {"nonfinite_grads": flagged}
        failed = [r for r, g in enumerate(gathered) if g[-1] == 0]
        ranks = _ranks_by_name(names, [g[:-1] for g in gathered])
        stray = sorted(set(ranks) - set(flagged))
        if failed or stray:
            why = error or (
                f"its non-finite gradients ({', '.join(stray)}) are not the step's" if stray else "its loss differed"
            )
            on = f" on rank {', '.join(map(str, failed))}" if failed else ""
            row["nonfinite_ranks"] = None
            row["nonfinite_note"] = (
                f"the recompute of step {step} on each rank alone did not reproduce it{on} ({why}): a "
                "non-deterministic forward, or a loss_fn/model that depends on state the recompute does not restore; "
                "ranks not named"
            )
            return row
        row["nonfinite_ranks"] = {n: ranks.get(n, []) for n in flagged}
        unowned = [n for n in flagged if n not in ranks]
        if unowned:
            row["nonfinite_note"] = (
                f"no rank's own gradient of {', '.join(unowned)} held inf/NaN in the recompute: the sum across ranks "
                "overflowed, or the inf/NaN came from state the recompute does not restore"
            )
        return row

    def _clear_grads(self) -> None:
        # Every parameter's, not only the optimizer's: a recompute must start from nothing.
        for _, p in self.named:
            p.grad = None

    def _recompute(self, rerun, module) -> tuple[Tensor, Tensor, str | None]:
        """(this rank's local non-finite counts, 1 if the recompute reproduced the step's loss
        else 0, the error if it raised). Leaves the parameters and buffers, the random states and
        DDP's buffer sync as they were, and the gradients cleared. Never raises: the other ranks
        are waiting in the all-gather."""
        n = len(self.named)
        counts = torch.zeros(n, dtype=torch.int64, device=self.device)
        now = _rng_states(self.device)
        sync = getattr(module, "require_forward_param_sync", None)  # DDP: whether the next forward syncs buffers
        error = None
        reproduced = False
        kept = None
        try:
            if not self._kept or self.step_loss is None:
                raise RuntimeError("the step's micro-batches were not recorded")
            kept = _ModelState(self.model)  # inside: a copy that does not fit is reported, not raised
            self._clear_grads()
            if sync is not None:  # no buffer broadcast in the recompute: it stays local
                module.require_forward_param_sync = False
            loss = rerun(self._replay())
            counts = nonfinite_counts([p.grad for _, p in self.named]).to(self.device)
            reproduced = bool(torch.equal(loss, self.step_loss))
        except Exception as err:  # reported in the row, on every rank
            error = f"it raised {type(err).__name__}: {err}"
        finally:
            if kept is not None:
                kept.restore()
            _set_rng_states(now, self.device)
            if sync is not None:
                module.require_forward_param_sync = sync
            self._clear_grads()
        return counts, torch.tensor(float(reproduced), device=self.device).long(), error


def describe(row: dict) -> str:
    """The row's non-finite parameters for a log line: ``"a.weight (rank 1), b (ranks 0, 1)"``."""
    names = row["nonfinite_grads"]
    ranks = row.get("nonfinite_ranks")

    def one(name: str) -> str:
        if not ranks or name not in ranks:
            return name
        r = ranks[name]
        if not r:
            return f"{name} (no rank alone)"
        return f"{name} ({'rank' if len(r) == 1 else 'ranks'} {', '.join(map(str, r))})"

    shown = ", ".join(one(n) for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return shown or "no parameter (found_inf set, but no gradient element is inf/NaN)"
