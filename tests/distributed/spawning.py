"""Runs named cases in N gloo processes, once per world size, and reports each case's outcome per rank.

A hang fails instead of blocking the suite: the parent waits with a deadline and kills the workers past it, and
collectives themselves time out (a rank that died leaves the others erroring, not waiting forever).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60
_SHARED_DIR_VARIABLE = "DISTRIBUTED_CASES_SHARED_DIR"


def shared_dir() -> Path:
    """A folder that outlives one spawn (given to run_cases), e.g. for a checkpoint one world size saves and
    another loads."""
    return Path(os.environ[_SHARED_DIR_VARIABLE])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, cases_module: str, names: list[str],
            shared: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{_SHARED_DIR_VARIABLE: shared})
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    outcomes: dict[str, str] = {}
    result_file = Path(out_dir) / f"rank{rank}.json"
    try:
        cases: dict[str, Callable[[], None]] = __import__(cases_module).cases_for(world)
        for name in names:
            try:
                cases[name]()
                outcomes[name] = "ok"
            except Exception:  # recorded for the parent's per-case test, which fails with it
                outcomes[name] = traceback.format_exc()
            result_file.write_text(json.dumps(outcomes))  # after every case: a later hang keeps earlier results
            if _failed_somewhere(outcomes[name] != "ok"):
                break  # ranks that left a case early are out of step: later collectives would pair up wrongly
    finally:
        dist.destroy_process_group()


def _failed_somewhere(failed_here: bool) -> bool:
    flag = torch.tensor([float(failed_here)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def run_cases(world: int, cases_module: str, names: list[str], out_dir: Path, deadline_s: float,
              shared: Path | None = None) -> dict[str, str]:
    """Each case name -> "ok", or the failures of the ranks where it did not pass (tracebacks, or why not run).
    `shared` (default: out_dir) is what the cases' `shared_dir()` returns."""
    context = mp.start_processes(_worker, args=(world, free_port(), str(out_dir), cases_module, names,
                                                str(shared or out_dir)),
                                 nprocs=world, join=False, start_method="spawn")
    ended_in_time = _join_with_deadline(context, deadline_s)
    per_rank = []
    for rank in range(world):
        path = out_dir / f"rank{rank}.json"
        per_rank.append(json.loads(path.read_text()) if path.exists() else {})
    summary = {}
    for name in names:
        missing = "not run (an earlier case failed, or the worker died or hung)"
        failures = [f"rank {rank}: {outcomes.get(name, missing)}"
                    for rank, outcomes in enumerate(per_rank) if outcomes.get(name) != "ok"]
        if failures and not ended_in_time:
            failures.append(f"workers killed after the {deadline_s:.0f} s deadline")
        summary[name] = "ok" if not failures else "\n".join(failures)
    return summary


def _join_with_deadline(context: mp.ProcessContext, deadline_s: float) -> bool:
    """Whether the workers ended before the deadline; any still alive afterwards are killed."""
    end = time.monotonic() + deadline_s
    in_time = True
    try:
        while not context.join(timeout=max(0.1, end - time.monotonic())):
            if time.monotonic() >= end:
                in_time = False
                break
    except (mp.ProcessRaisedException, mp.ProcessExitedException):  # its missing results say which cases
        pass
    for process in context.processes:
        if process.is_alive():
            process.kill()
    return in_time
