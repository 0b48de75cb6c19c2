"""Multi-node layouts with `torchrun` on this machine: two simulated nodes of 2 gloo ranks each (two torchrun agents
meeting at a c10d rendezvous on localhost), HSDP replicating across them. A checkpoint written by the 2-node job is
resumed by a 1-node job, and a rank that dies mid-job is restarted by torchrun from the last checkpoint. Each job's
ranks compare their parameters with one device's uninterrupted run (multinode_worker.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from spawning import free_port

WORKER = Path(__file__).resolve().parent / "multinode_worker.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
JOB_TIMEOUT_S = 300
# A restarted job takes ~15 s here. Beyond the restart this test is about, a job on one 2-core machine can still lose a
# race of its own now and then (a port that get_free_port handed out taken before its owner binds it): a restarted job
# that hangs past this or fails runs once more from scratch, and only a second failure fails the test.
RESTART_JOB_TIMEOUT_S = 120
AGENT_STOP_S = 30
PER_NODE = 2


class JobFailed(AssertionError):
    """An agent of a job exited with an error."""


def _job(nodes: int, checkpoints: Path, steps: int, max_restarts: int = 0, fail_at: int | None = None,
         timeout_s: int = JOB_TIMEOUT_S) -> list[str]:
    """One torchrun agent per node, all on this machine; raises JobFailed unless every agent exits cleanly. Returns
    the agents' output. Raises subprocess.TimeoutExpired past `timeout_s` (a hung rendezvous or collective), after
    killing every agent with its ranks."""
    endpoint = f"127.0.0.1:{free_port()}"
    command = [*TORCHRUN, f"--nnodes={nodes}", f"--nproc-per-node={PER_NODE}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={endpoint}", "--rdzv-id=muon-test", f"--max-restarts={max_restarts}",
               "--monitor-interval=0.5", str(WORKER), "--checkpoints", str(checkpoints), "--steps", str(steps)]
    if fail_at is not None:
        command += ["--fail-at", str(fail_at)]
    # One store per rendezvous round. torchrun's default shares its rendezvous store with the ranks across restarts and
    # leaves them to tell attempts apart by TORCHELASTIC_RESTART_COUNT, which each agent counts for itself: an agent
    # whose ranks failed restarts as attempt 1, one restarted because the other left as attempt 0, and the two halves
    # then read each other's dead addresses ("Connection refused") or wait for keys that never come (a hang).
    # pytorch/pytorch#135712; the README's multi-node recipe sets the same variable.
    env = os.environ | {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agents = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
              for _ in range(nodes)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=timeout_s)[0])
    finally:
        # SIGTERM first: the agent then stops its ranks, which run in sessions of their own (a hung rank outlived a
        # SIGKILLed agent).
        for agent in agents:
            if agent.poll() is None:
                agent.terminate()
        for agent in agents:
            try:
                agent.wait(timeout=AGENT_STOP_S)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
    failed = [(index, agent.returncode) for index, agent in enumerate(agents) if agent.returncode != 0]
    if failed:
        raise JobFailed(f"agents {failed} failed:\n" + "\n".join(output[-4000:] for output in outputs))
    return outputs


def test_hsdp_checkpoint_of_two_nodes_resumes_on_one(tmp_path: Path) -> None:
    _job(nodes=2, checkpoints=tmp_path, steps=2)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-1", "step-2"]
    _job(nodes=1, checkpoints=tmp_path, steps=4)  # mesh (1, 2): the same shards, no replica
    assert (tmp_path / "step-4" / ".metadata").exists()


def test_a_rank_that_dies_is_restarted_from_the_last_checkpoint_and_loses_no_step(tmp_path: Path) -> None:
    for attempt in ("first", "second"):  # see RESTART_JOB_TIMEOUT_S
        checkpoints = tmp_path / attempt
        checkpoints.mkdir()
        try:
            outputs = _job(nodes=2, checkpoints=checkpoints, steps=4, max_restarts=1, fail_at=2,
                           timeout_s=RESTART_JOB_TIMEOUT_S)
            break
        except (subprocess.TimeoutExpired, JobFailed):
            if attempt == "second":
                raise
    # The killed rank is the only failure: the healthy node's ranks, restarted for the new round, start cleanly.
    assert re.findall(r"failed \(exitcode: (-?\d+)\)", "".join(outputs)) == ["17"]
    assert sorted(path.name for path in checkpoints.iterdir()) == ["a-rank-died", "step-1", "step-2", "step-3",
                                                                    "step-4"]
