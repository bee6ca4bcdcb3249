"""Run test scenarios on several ranks of a real ``torch.distributed`` process group (gloo, on
this machine only: a ``file://`` rendezvous in a temporary folder).

Starting processes costs seconds (each imports torch), so one start runs a whole list of
scenarios: every rank runs them in order, in one process group, and reports per scenario
either ``None`` or the formatted exception. A scenario that raises on one rank while the other
waits in a collective would hang it; gloo's own timeout (``TIMEOUT``) turns that into an error,
and the parent kills whatever is still running after ``deadline`` seconds: a hang is a test
failure, never a wait.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import inspect
import os
import pickle
import sys
import tempfile
import traceback
from pathlib import Path

import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=30)


def _worker(rank: int, world: int, init_file: str, out_dir: str, module: str, names: list[str], path: list[str]):
    sys.path[:0] = [p for p in path if p not in sys.path]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=TIMEOUT)
    scenarios = importlib.import_module(module)
    results = {}
    out = Path(out_dir, f"rank{rank}.pkl")
    try:
        for name in names:
            torch.manual_seed(1234 + rank)
            try:
                getattr(scenarios, name)(rank, world)
                results[name] = None
            except BaseException:
                results[name] = traceback.format_exc()
            out.write_bytes(pickle.dumps(results))  # kept even if a later scenario hangs
            dist.barrier()  # the next scenario starts together on every rank
    finally:
        out.write_bytes(pickle.dumps(results))
        gc.collect()  # DDP reducers and GradBuckets (reference cycles) release the group first
        dist.destroy_process_group()


def run(module: str, names: list[str], world: int = 2, deadline: float = 240) -> dict[str, dict[int, str | None]]:
    """Runs scenario functions ``module.name(rank, world)`` on ``world`` ranks; returns, per
    scenario, each rank's error (or None). Scenarios not finished when a rank died or the
    deadline passed are reported as errors too."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(
            _worker,
            args=(world, init_file, tmp, module, names, list(sys.path)),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        start = datetime.datetime.now()
        failure = None
        try:
            while not ctx.join(timeout=5):
                if (datetime.datetime.now() - start).total_seconds() > deadline:
                    failure = f"ranks still running after {deadline} s (a hang)"
                    break
        except mp.ProcessRaisedException as err:  # a rank died (a scenario's error is caught: this is worse)
            failure = str(err)
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
        per_rank = []
        for r in range(world):
            path = Path(tmp, f"rank{r}.pkl")
            per_rank.append(pickle.loads(path.read_bytes()) if path.exists() else {})
    missing = f"not run or not finished ({failure})" if failure else "not run"
    return {name: {r: per_rank[r].get(name, missing) for r in range(world)} for name in names}


def scenarios_in(module) -> set[str]:
    """The scenario functions a module defines: those taking ``(rank, world)``."""
    return {
        name
        for name, fn in vars(module).items()
        if inspect.isfunction(fn)
        and fn.__module__ == module.__name__
        and list(inspect.signature(fn).parameters) == ["rank", "world"]
    }


def assert_passed(per_rank: dict[int, str | None]) -> None:
    """Fails with every rank's traceback unless the scenario passed on all of them."""
    errors = {rank: err for rank, err in per_rank.items() if err is not None}
    assert not errors, "\n".join(f"--- rank {rank}:\n{err}" for rank, err in errors.items())
