"""The cluster a job measures for itself (`runtime/cluster_measure.py`, `compile(cluster="auto")`).

On spawned gloo ranks of this machine: hosts made by `PDCOMPILE_HOST` give two levels; every
rank gets the same cluster; the cache is used, measured again when stale, and a bad cache file is
a named error on every rank; `compile` without `cluster=` plans on the measured cluster and says
so. A rank held to half a CPU by a cgroup is measured at about half the speed and gets the
smaller stage. Two real hosts over a shaped link: tests/test_multihost.py.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch
from cpu_quota import QuotaUnavailable, cpu_quota
from spawn import run_ranks

import pdcompile
from pdcompile import Cluster, CostGraph
from pdcompile.core.errors import PartitionError

HOSTS = ["a", "a", "b", "b"]


def _measure_and_cache(rank, world_size, init_file, cache):
    """Fresh, cached, a link that changed, stale; `compile` without a cluster; a bad cache
    file."""
    import torch.distributed as dist

    from pdcompile.runtime.cluster_measure import measure_cluster
    from pdcompile.runtime.distributed import init_process_group

    os.environ["PDCOMPILE_HOST"] = HOSTS[rank]
    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=120)
    fresh = measure_cluster(rank, world_size, device, cache=cache)
    # on a loaded 2-core machine loopback's speed varies more than a real link's: not rechecked
    cached = measure_cluster(rank, world_size, device, cache=cache, recheck=False)
    (path,) = Path(cache).glob("measured-cluster-*.json")
    dist.barrier()
    if rank == 0:  # the cached links 10^4 times faster than they run: measured again
        doc = json.loads(path.read_text())
        for level in doc["cluster"]["measured"]["levels"]:
            level["bandwidth"] *= 1e4
        path.write_text(json.dumps(doc))
    dist.barrier()
    changed = measure_cluster(rank, world_size, device, cache=cache)
    dist.barrier()
    if rank == 0:  # two days old
        doc = json.loads(path.read_text())
        old = datetime.now(timezone.utc) - timedelta(days=2)
        doc["cluster"]["measured"]["at"] = old.isoformat(timespec="seconds")
        path.write_text(json.dumps(doc))
    dist.barrier()
    stale = measure_cluster(rank, world_size, device, cache=cache)
    os.environ["PDCOMPILE_CACHE_DIR"] = cache  # compile finds the measurement just taken
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    pipe = pdcompile.compile(
        model, (torch.randn(4, 8),), loss_fn=torch.nn.functional.cross_entropy,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), startup_timeout=120,
    )  # fmt: skip
    dist.barrier()
    if rank == 0:
        path.write_text("{not json")
    dist.barrier()
    try:
        measure_cluster(rank, world_size, device, cache=cache)
        bad = None
    except PartitionError as exc:
        bad = str(exc)
    clusters = (fresh.to_json(), cached.to_json(), stale.to_json(), changed.to_json())
    return (*clusters, bad, str(path), pipe.plan.cluster.to_json(), pipe.explain())


def test_the_measured_cluster_is_every_ranks_cached_and_measured_again_when_stale(tmp_path):
    results = run_ranks(_measure_and_cache, 4, str(tmp_path), timeout_s=280)
    assert len({json.dumps(r[:6]) for r in results}) == 1  # every rank agrees on everything
    fresh, cached, stale, changed, bad, path, plan, explained = results[0]
    fresh, cached, stale, changed = (Cluster.from_json(c) for c in (fresh, cached, stale, changed))
    assert [lv.count for lv in fresh.levels] == [2, 2]  # two hosts of two ranks
    assert [lv["name"] for lv in fresh.measured["levels"]] == ["within a host", "between hosts"]
    assert fresh.measured["hosts"] == [["a", [0, 1]], ["b", [2, 3]]]
    assert all(lv.bandwidth > 0 for lv in fresh.levels) and fresh.memory > 0
    assert not fresh.measured.get("from_cache")
    assert cached.measured["from_cache"] and cached.measured["cache"] == path
    assert cached.levels == fresh.levels and cached.measured["at"] == fresh.measured["at"]
    assert not changed.measured.get("from_cache") and changed.levels[1].bandwidth < 1e12
    assert not stale.measured.get("from_cache") and stale.measured["at"] != cached.measured["at"]
    assert path in bad and "delete it" in bad
    # compile without cluster= plans on the measured cluster (the cache's, unless loopback's
    # speed moved past LINK_CHANGE meanwhile) and says so
    planned = Cluster.from_json(plan)
    assert planned.measured and [lv.count for lv in planned.levels] == [2, 2]
    assert "between hosts" in explained and "cluster 2@" in explained


def test_auto_measures_nothing_in_one_process_and_plan_cannot_measure():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    pipe = pdcompile.compile(
        model, (torch.randn(4, 8),), cluster="auto", profile=False,
        loss_fn=torch.nn.functional.cross_entropy, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    )  # fmt: skip
    assert pipe.plan.cluster.measured is None and pipe.plan.cluster.num_devices == 1
    with pytest.raises(PartitionError, match="measured by a running job"):
        Cluster.coerce("auto")


def test_a_measured_cluster_round_trips_and_prints_how_it_was_measured():
    measured = {
        "at": "2026-11-27T10:00:00+00:00", "seconds": 2.5,
        "hosts": [["a", [0, 1]], ["b", [2, 3]]],
        "levels": [{"name": "between hosts", "pairs": [[0, 2]], "bandwidth": 1.56e8,
                    "latency": 1e-4, "allreduce_bandwidth": 1.4e8}],
        "speed": "equal within 15%", "memory": None, "notes": [],
    }  # fmt: skip
    cluster = Cluster([(2, 1e10), (2, 1.56e8, 1e-4)], measured=measured)
    assert Cluster.from_json(cluster.to_json()) == cluster
    assert Cluster.parse(str(cluster)).levels == cluster.levels  # its text is a written cluster
    text = "\n".join(cluster.describe_measurement())
    assert "2 hosts: a (ranks 0-1), b (ranks 2-3)" in text and "156MB/s" in text
    interleaved = Cluster(
        [(4, 1e9)], measured={**measured, "hosts": [["a", [0, 2]], ["b", [1, 3]]]}
    )
    assert "a (ranks 0, 2), b (ranks 1, 3)" in "\n".join(interleaved.describe_measurement())


def _speeds(rank, world_size, init_file, throttle):
    from pdcompile.runtime.cluster_measure import measure_cluster
    from pdcompile.runtime.distributed import init_process_group

    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=120)
    if rank != 1:
        return measure_cluster(rank, world_size, device, cache=False).to_json()
    try:
        with cpu_quota(os.getpid(), 0.5):
            return measure_cluster(rank, world_size, device, cache=False).to_json()
    except QuotaUnavailable as exc:  # every rank still measures: the others wait for this one
        if not throttle:
            raise
        measure_cluster(rank, world_size, device, cache=False)
        return f"unavailable: {exc}"


def test_a_rank_held_to_half_a_cpu_is_measured_slower_and_given_less_work():
    first, second = run_ranks(_speeds, 2, True, timeout_s=200)
    if second.startswith("unavailable"):
        pytest.skip(f"no CPU quota can be set here ({second}); needs root and cgroups")
    cluster = Cluster.from_json(first)
    assert first == second
    assert cluster.speed is not None and cluster.speed[0] == 1.0
    assert 0.3 <= cluster.speed[1] <= 0.8, cluster.measured["speed"]
    # a chain of equal layers: the slow rank's stage holds fewer of them
    costs = CostGraph(batch_size=8)
    previous = None
    for i in range(12):
        costs.add_node(f"n{i}", forward_s=1e-3, backward_s=2e-3, param_bytes=4096,
                       output_bytes=64)  # fmt: skip
        if previous:
            costs.add_edge(previous, f"n{i}", bytes=64)
        previous = f"n{i}"
    plan = pdcompile.plan(costs, Cluster([(2, 1e10)], speed=cluster.speed), num_microbatches=8)
    by_rank = {s.ranks[0]: len(s.nodes) for s in plan.stages}
    assert len(plan.stages) == 2 and by_rank[1] < by_rank[0], str(plan)
