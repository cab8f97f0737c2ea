"""Two hosts on this machine (tests/netns_hosts.py): `torchrun --nnodes 2 --nproc-per-node 2` in
two network namespaces joined by a shaped veth pair, c10d rendezvous across it.

- One launch (module fixture `linked`): `pipedream` then `1f1b` for the cluster
  "2@10GB/s,2@100Mbit/s", equal to the weight-stashing replay and to gradient accumulation, with
  host A's ranks 0-1 and host B's 2-3 where the plan put them; then the link is cut and host A's
  ranks must stop with a named error within the step timeout.
- One launch with `--max-restarts 1` and `compile(checkpoint_dir=)`: host B (agent and ranks) is
  killed after step 2, host A's ranks stop with a named error, host B comes back, every rank
  resumes from the newest valid checkpoint (a torn newer one skipped with a warning) and the
  job ends equal to an uninterrupted run.
- The harness's promises: nothing is left behind when the body fails; without root the tier is
  skipped with the reason.

The `multihost` tier (`pytest tests/test_multihost.py -m multihost`, run by .ci/run after the
README's command; `PDCOMPILE_MULTIHOST=1` runs it in any run). It needs root;
elsewhere it is skipped with the reason. Every wait is bounded; the harness kills every process
it started and deletes the namespaces, whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import netns_hosts
import pytest
import torch
import torch.nn.functional as F
from multihost_worker import MICROBATCHES, OPTIMIZER, batch, example, model
from netns_hosts import IP, HostsUnavailable, TwoHosts
from pipeline_support import microbatches, one_thread, pipedream_reference

import pdcompile
from pdcompile import Cluster, Plan

pytestmark = pytest.mark.multihost

WORKER = str(Path(__file__).resolve().parent / "multihost_worker.py")
CLUSTER_WORKER = str(Path(__file__).resolve().parent / "cluster_worker.py")
MEASURED_LINK = 31.25e6  # bytes/s: 250 Mbit/s, the link the measuring test shapes
CLUSTER = "2@10GB/s,2@100Mbit/s"  # ranks 0-1 on host A, 2-3 on host B
LINK = 12.5e6  # bytes/s: the cluster's outer level, what the veth pair is shaped to
TIMEOUT = 6  # compile(timeout=): seconds any wait of a step may last (a loaded VM needs slack)
# a bound on how late after the cut the error may come, beyond the timeout: it catches a hang,
# not a slow machine (a loaded 2-core VM takes a few seconds)
MARGIN = 30
NAMED = ("PipelineTimeoutError", "StageCommError")
STEPS = 4


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """`TwoHosts`, or the test skipped with the reason they cannot be made here."""
    try:
        with TwoHosts() as hosts:
            yield hosts
    except HostsUnavailable as exc:
        pytest.skip(f"two hosts cannot be made here: {exc}")


@pytest.fixture
def hosts() -> Iterator[TwoHosts]:
    with two_hosts() as made:
        yield made


def reports(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("report-*.json"))]


def logs(out: Path, tail: int = 3000) -> str:
    """The agents' logs (their workers' output included), the last `tail` characters of each,
    without c10d's socket warnings."""
    texts = []
    for path in sorted(out.glob("*.log")):
        lines = [line for line in path.read_text().splitlines() if "socket.cpp" not in line]
        texts.append(f"--- {path.name}\n" + "\n".join(lines)[-tail:])
    return "\n".join(texts)


def wait(until: Callable[[], bool], seconds: float, out: Path, what: str, agents=()) -> None:
    """Poll `until` for `seconds`; fail with the logs when it does not come, or when an agent
    of `agents` exits first."""
    deadline = time.monotonic() + seconds
    while not until():
        ended = [a.returncode for a in agents if a.poll() is not None]
        if ended or time.monotonic() > deadline:
            why = f"an agent exited ({ended})" if ended else f"not within {seconds} s"
            pytest.fail(f"{what}: {why}\n{logs(out)}")
        time.sleep(0.1)


def paused(out: Path) -> bool:
    return len(list(out.glob("paused-rank*"))) == 4


def host_a_reported(out: Path) -> bool:
    return {0, 1} <= {r["rank"] for r in reports(out)}


def host(stage: pdcompile.passes.planning.plans.Stage) -> str:
    """The host of a stage's ranks (ranks 0-1 are host A's, 2-3 host B's)."""
    labels = {"ab"[rank // 2] for rank in stage.ranks}
    assert len(labels) == 1, f"stage {stage.index} spans the link: ranks {stage.ranks}"
    return labels.pop()


def parameters(out: Path, schedule: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for rank in range(4):
        merged.update(torch.load(out / f"{schedule}-rank{rank}.pt"))
    return merged


@one_thread()
def accumulated(steps: int) -> dict[str, torch.Tensor]:
    """Single-process gradient accumulation over `batch(step)` for every step, as 1f1b runs."""
    reference = model()
    optimizer = OPTIMIZER(list(reference.parameters()))
    for step in range(steps):
        for a, b, share in microbatches(*batch(step), MICROBATCHES):
            (F.cross_entropy(reference(a), b) * share).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {n: p.detach() for n, p in reference.named_parameters()}


@one_thread()
def stashed(plan: Plan, steps: int) -> dict[str, torch.Tensor]:
    """PipeDream's weight-stashing replay of `plan` over `batch(step)` for every step."""
    program = pdcompile.codegen(pdcompile.trace(model(), (example(),)), plan)
    data = [batch(step) for step in range(steps)]
    stages = pipedream_reference(program, None, None, F.cross_entropy, OPTIMIZER, MICROBATCHES,
                                 steps, data=data)  # fmt: skip
    return {n: p.detach() for stage in stages for n, p in stage.named_parameters()}


@dataclass
class Linked:
    out: Path
    cut_at: float  # wall-clock time the link went down


@pytest.fixture(scope="module")
def linked(tmp_path_factory: pytest.TempPathFactory) -> Linked:
    """One launch: both schedules trained, parameters written, then the link cut before one
    more 1f1b step."""
    out = tmp_path_factory.mktemp("linked")
    args = ["--out", str(out), "--schedules", "pipedream,1f1b", "--steps", str(STEPS),
            "--cluster", CLUSTER, "--timeout", str(TIMEOUT),
            "--pause-after", f"1f1b:{STEPS}"]  # fmt: skip
    with two_hosts() as hosts:
        hosts.shape(LINK)
        agents = [hosts.torchrun(h, WORKER, args, log=out / f"{h}.log") for h in "ab"]
        wait(lambda: paused(out), 150, out, "both schedules on both hosts", agents)
        hosts.link(up=False)
        cut_at = time.time()
        (out / "cut").write_text(repr(cut_at))  # for a reader of the folder
        (out / "go").touch()
        wait(lambda: host_a_reported(out), TIMEOUT + MARGIN, out, "host A's ranks' errors")
    return Linked(out, cut_at)


@pytest.mark.timeout(240)
def test_two_hosts_train_like_the_references_where_the_plan_put_the_stages(linked) -> None:
    ranks = {r["rank"]: r for r in reports(linked.out)}
    assert {r: ranks[r]["host"] for r in (0, 1)} == {0: "a", 1: "a"}  # torchrun's node order
    for schedule in ("pipedream", "1f1b"):
        plan = Plan.from_json(ranks[0]["runs"][schedule]["plan"])
        assert plan.cluster == Cluster.parse(CLUSTER) and plan.num_devices_used == 4, plan
        # the planner crosses the slow link with the 16-feature bottleneck only
        program = pdcompile.codegen(pdcompile.trace(model(), (example(),)), plan)
        where = [(host(plan.stages[c.src_stage]), host(plan.stages[c.dst_stage]), c)
                 for c in program.channels]  # fmt: skip
        crossing = [c for src, dst, c in where if src != dst]
        assert crossing and all(c.shape[1:] == (16,) for c in crossing), crossing
        for rank in (0, 1):  # the ranks ran the stages the plan gave them
            (stage,) = [s.index for s in plan.stages if rank in s.ranks]
            assert ranks[rank]["runs"][schedule]["stage"] == stage
        expected = stashed(plan, STEPS) if schedule == "pipedream" else accumulated(STEPS)
        got = parameters(linked.out, schedule)
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, msg=f"{schedule}: {name}")
        losses = [ranks[r]["runs"][schedule]["losses"] for r in (0, 1)]
        assert len(losses[0]) == STEPS and losses[0] == losses[1]


@pytest.mark.timeout(240)
def test_a_cut_link_stops_the_other_host_with_a_named_error(linked) -> None:
    errors = {r["rank"]: r["error"] for r in reports(linked.out) if r["host"] == "a"}
    assert set(errors) == {0, 1}, errors
    for error in errors.values():
        assert error["type"] in NAMED, error
        assert error["time"] - linked.cut_at < TIMEOUT + MARGIN, error
    # rank 1 sends to host B's stage and waits for its gradient, which never comes
    assert errors[1]["type"] == "PipelineTimeoutError", errors[1]
    assert "with rank 2" in errors[1]["message"] and f"timeout {TIMEOUT} s" in errors[1]["message"]


@pytest.mark.timeout(300)
def test_a_lost_host_rejoins_and_the_job_resumes_from_its_checkpoint(hosts, tmp_path) -> None:
    steps, every, lost_after = 8, 2, 2
    out, directory = tmp_path, tmp_path / "checkpoints"
    args = ["--out", str(out), "--steps", str(steps), "--cluster", CLUSTER,
            "--timeout", str(TIMEOUT), "--checkpoint-dir", str(directory),
            "--checkpoint-every", str(every), "--pause-after", f"1f1b:{lost_after}"]  # fmt: skip
    agent_a = hosts.torchrun("a", WORKER, args, log=out / "a.log", max_restarts=1)
    agent_b = hosts.torchrun("b", WORKER, args, log=out / "b.log", max_restarts=1)
    wait(lambda: paused(out), 150, out, "step 2 on both hosts", [agent_a, agent_b])
    hosts.kill("b")  # host B is lost: its agent and both its ranks
    lost_at = time.time()
    (out / "go").touch()
    wait(lambda: host_a_reported(out), TIMEOUT + MARGIN, out, "host A's ranks' errors")
    for report in reports(out):
        assert report["host"] == "a" and report["error"]["type"] in NAMED, report
        assert report["error"]["time"] - lost_at < TIMEOUT + MARGIN, report
    # a newer checkpoint, torn (a file of it lost): resuming must skip it, saying so
    torn = directory / "step-999999"
    shutil.copytree(directory / f"step-{lost_after:06d}", torn)
    os.remove(next(torn.glob("*.distcp")))
    agent_b = hosts.torchrun("b", WORKER, args, log=out / "b-back.log")  # host B returns
    for agent in (agent_a, agent_b):
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(timeout=150)
    if not agent_a.returncode == agent_b.returncode == 0:
        pytest.fail(f"the resumed job: agents ended {agent_a.returncode}, {agent_b.returncode}\n"
                    + logs(out))  # fmt: skip
    resumed = [r for r in reports(out) if "error" not in r]
    assert sorted(r["rank"] for r in resumed) == [0, 1, 2, 3]
    assert {r["rank"] for r in resumed if r["restart"] == 1} == {0, 1}  # host A's agent restarted
    for report in resumed:
        run = report["runs"]["1f1b"]
        assert run["resumed_from"] == str(directory / f"step-{lost_after:06d}"), report
        assert run["first_step"] == lost_after and len(run["losses"]) == steps - lost_after
    assert f"skipping checkpoint {torn}" in logs(out, tail=10**7)
    # saved at 4, 6, 8; the newest 3 valid ones kept, the torn one left alone
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) == [
        "step-000004", "step-000006", "step-000008", "step-999999"
    ]  # fmt: skip
    expected, got = accumulated(steps), parameters(out, "1f1b")
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, msg=name)


def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.timeout(240)
def test_the_job_measures_two_levels_with_the_shaped_link_outside(hosts, tmp_path) -> None:
    """`compile`'s measured cluster (`cluster="auto"`) on two hosts of two ranks each, the link
    shaped to `MEASURED_LINK`: hosts A and B are the outer level, at the link's rate."""
    hosts.shape(MEASURED_LINK)
    agents = [hosts.torchrun(h, CLUSTER_WORKER, ["--out", str(tmp_path)], log=tmp_path / f"{h}.log")
              for h in "ab"]  # fmt: skip
    wait(lambda: len(list(tmp_path.glob("cluster-rank*.json"))) == 4, 150, tmp_path,
         "every rank's measured cluster", agents)  # fmt: skip
    texts = {p.read_text() for p in tmp_path.glob("cluster-rank*.json")}
    assert len(texts) == 1, "the ranks measured different clusters"
    cluster = Cluster.from_json(texts.pop())
    within, between = cluster.levels
    assert (within.count, between.count) == (2, 2), str(cluster)
    assert [len(ranks) for _, ranks in cluster.measured["hosts"]] == [2, 2]
    # tbf holds the rate within a few percent; TCP/IP headers take ~4.5% of it
    assert 0.6 * MEASURED_LINK <= between.bandwidth <= 1.1 * MEASURED_LINK, str(cluster)
    assert within.bandwidth > 3 * between.bandwidth, str(cluster)


def test_the_harness_leaves_nothing_behind_even_on_failure(tmp_path) -> None:
    """Processes in sessions of their own (as torchrun's workers) are killed, the namespaces
    and the veth pair deleted, when the body raises."""
    started: list[int] = []
    with pytest.raises(RuntimeError, match="the body failed"), two_hosts() as hosts:
        for label in "ab":
            hosts.start(label, ["sh", "-c", "setsid sleep 300 & exec sleep 300"],
                        env=dict(os.environ), log=tmp_path / f"{label}.log")  # fmt: skip
        wait(lambda: all(len(hosts.pids(h)) == 2 for h in "ab"), 10, tmp_path, "the sleepers")
        started = hosts.pids("a") + hosts.pids("b")
        names = [hosts[h].netns for h in "ab"]
        raise RuntimeError("the body failed")
    assert len(started) == 4 and all(_gone(pid) for pid in started), started
    listed = subprocess.run([IP, "netns", "list"], capture_output=True, text=True, timeout=10)
    assert not set(names) & set(listed.stdout.split()), listed.stdout
    links = subprocess.run([IP, "-o", "link"], capture_output=True, text=True, timeout=10)
    assert not any(name in links.stdout for name in names), links.stdout


def test_where_namespaces_cannot_be_made_the_tier_is_skipped_saying_why(monkeypatch) -> None:
    monkeypatch.setattr(netns_hosts.os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception, match="network namespaces need root"), two_hosts():
        pass
