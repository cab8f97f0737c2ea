"""The cluster a job runs on, measured by the job: `compile(cluster="auto")`, also what
`compile` does without `cluster=` in a job of two or more ranks.

Every rank of an initialised process group calls `measure_cluster`; it returns the same
`Cluster` on every rank (rank 0's figures, broadcast):

1. hosts: each rank says where it runs (`host_name`: the host name, and torchrun's node,
   `GROUP_RANK`, so two agents on one machine are two hosts); ranks are grouped by host;
2. the cache: a cluster measured for the same hosts, ranks, torch version and device type less
   than `MAX_AGE_S` ago is used as it is (`measured-cluster-<key>.json` in the profile cache
   directory, `$PDCOMPILE_CACHE_DIR`) once its slowest link, timed again over a few round
   trips, still runs within `LINK_CHANGE` of its cached bandwidth; a stale one, or one whose
   link changed, is measured again; a file that cannot be read is a `PartitionError` naming it;
3. speeds: every rank at once (as in the run) multiplies 256x256 matrices (2048 on CUDA) for
   `SPEED_PROBE_S`, `SPEED_ROUNDS` times; a rank's speed is its fastest round's rate over rank
   0's (the rank that profiles): a passing load slows some rounds, a CPU quota or another job
   on the rank's core every one. Speeds within `SPEED_SPREAD` of each other are taken as equal (the
   probe's own spread on an idle 2-core machine was below 5%), the others kept to 2 digits;
4. the runtime's costs and the first level's link: `runtime.calibration.calibrate` on a pair
   of ranks sharing a host (a pair across hosts when every host has one rank);
5. each level's link, both directions: the fastest round trip of a 4 MiB message answered by a tiny
   one against the fastest of a tiny one gives the bandwidth (less packing, which the simulator
   prices apart), half the tiny round trip less the host's send and receive costs the
   latency; up to `PAIRS_PER_LEVEL` pairs per level, and the slowest pair and direction sets
   the level (within a host: pairs of each of the first hosts; between hosts: neighbouring
   hosts' first ranks). An all-reduce over the level's ranks is timed too and recorded;
6. memory: each rank's device memory (`memory="auto"`'s figure); the smallest is the cluster's.

Ranks laid out host by host, the same number on each, give one level per host and one across
hosts (`k@<within>,H@<between>`; a level of one rank per host is left out); any other layout
gives one flat level at the slowest link measured, and a note saying so. `Cluster.measured`
records how (`Cluster.describe_measurement`). On two network-namespace hosts of this machine
the whole measurement took a few seconds; docs/multihost.md has the figures.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pdcompile.core.cluster import Cluster
from pdcompile.core.errors import PartitionError
from pdcompile.core.regular_file import read_regular_text
from pdcompile.runtime.calibration import (
    PROBE,
    PROBE_BYTES,
    Calibration,
    all_reduce_seconds,
    calibrate,
    timed,
)
from pdcompile.runtime.distributed import DistributedComm

log = logging.getLogger(__name__)

FORMAT = "pdcompile.measured-cluster"
VERSION = 1
MAX_AGE_S = 24 * 3600.0  # a cached measurement older than this is taken again
HOST_ENV = "PDCOMPILE_HOST"  # debug knob: this process's host, whatever the machine says
SPEED_PROBE_S = 0.3  # several scheduler periods (100 ms), so a CPU quota shows in the rate
SPEED_ROUNDS = 3
SPEED_SPREAD = 0.15
PAIRS_PER_LEVEL = 2
LINK_CHANGE = 1.5  # a cached link measured again this much faster or slower is re-measured
REPEATS = 10
# the bandwidth is the rate of a stream of probes lasting about this long: a link's burst
# allowance (a token bucket, a switch's buffer) then adds little to it
STREAM_S = 0.05
STREAM_MAX = 64  # probes in the stream at most (256 MiB)


def host_name() -> str:
    """Where this process runs: `$PDCOMPILE_HOST` if set, else the host name, with torchrun's
    node (`GROUP_RANK`) when torchrun started it."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    node = os.environ.get("GROUP_RANK")
    return socket.gethostname() + (f"/node{node}" if node is not None else "")


def host_groups(hosts: list[str]) -> list[tuple[str, list[int]]]:
    """`(host, its ranks)` in the order of each host's first rank."""
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(host, []).append(rank)
    return list(groups.items())


def uniform_hosts(groups: list[tuple[str, list[int]]]) -> int | None:
    """Ranks per host when hosts hold consecutive ranks, the same number each; else None."""
    per_host = len(groups[0][1])
    expected = 0
    for _, ranks in groups:
        if ranks != list(range(expected, expected + per_host)):
            return None
        expected += per_host
    return per_host


def measure_cluster(
    rank: int,
    world_size: int,
    device: torch.device,
    *,
    cache: bool | str | os.PathLike = True,
    max_age_s: float = MAX_AGE_S,
    timeout_s: float = 60.0,
    recheck: bool = True,
) -> Cluster:
    """The cluster this job runs on, the same on every rank (see the module).

    Args:
        rank, world_size: this rank and the job's size (the default process group's).
        device: where this rank computes (`compile`'s device).
        cache: True (the profile cache directory), a directory, or False (always measure).
        max_age_s: how old a cached measurement may be.
        timeout_s: the longest any wait of the measurement may last.
        recheck: time the cached cluster's slowest link again before using it.

    Raises:
        PartitionError: the cached measurement for these hosts cannot be read (naming the file).
    """
    start = time.monotonic()
    from pdcompile.runtime.memory_probe import device_memory

    mine = (host_name(), device_memory("auto", device, world_size))
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    groups = host_groups([host for host, _ in everyone])
    path = _cache_path(cache, groups, device) if cache is not False else None
    shared: list[Any] = [None]
    if rank == 0 and path is not None:
        try:
            shared = [("cached", _read_cache(path, max_age_s))]
        except PartitionError as exc:
            shared = [("error", str(exc))]
    dist.broadcast_object_list(shared, src=0)
    if shared[0] is not None:
        kind, value = shared[0]
        if kind == "error":
            raise PartitionError(value)
        if value is not None and (not recheck or _still_holds(rank, device, value, timeout_s)):
            return Cluster.from_dict(value)
    cluster = _measure(rank, world_size, device, groups, [m for _, m in everyone], timeout_s)
    measured = {**cluster.measured, "seconds": round(time.monotonic() - start, 2)}
    shared = [{**cluster.to_dict(), "measured": measured}]
    dist.broadcast_object_list(shared, src=0)  # rank 0's figures (its clock, its speed probe)
    cluster = Cluster.from_dict(shared[0])
    if rank == 0 and path is not None:
        _write_cache(path, cluster)
    return cluster


def _measure(
    rank: int,
    world_size: int,
    device: torch.device,
    groups: list[tuple[str, list[int]]],
    memories: list[float],
    timeout_s: float,
) -> Cluster:
    speeds, speed_text = _speeds(rank, world_size, device)
    per_host = uniform_hosts(groups)
    within = [ranks[:2] for _, ranks in groups if len(ranks) > 1][:PAIRS_PER_LEVEL]
    leaders = [ranks[0] for _, ranks in groups]
    across = list(zip(leaders, leaders[1:], strict=False))[:PAIRS_PER_LEVEL]
    specs = []  # (name, count, pairs, the ranks an all-reduce of the level spans)
    if within:
        specs.append(("within a host", per_host, within, tuple(groups[0][1])))
    if across:
        specs.append(("between hosts", len(groups), across, tuple(leaders)))
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731 - the runtime's step
    calibration = calibrate(rank, device, sgd, repeats=REPEATS, timeout_s=timeout_s,
                            pair=tuple(within[0] if within else across[0]))  # fmt: skip
    pairs = [tuple(p) for _, _, level_pairs, _ in specs for p in level_pairs]
    comm = DistributedComm(rank, [*pairs, *(s[3] for s in specs)], timeout_s=timeout_s,
                           device=device)  # fmt: skip
    try:
        levels = [_level(comm, rank, spec, calibration) for spec in specs]
    finally:
        comm.close()
    notes = []
    if per_host is None:
        notes.append("hosts hold unequal or interleaved ranks: one flat level at the slowest "
                     "link measured")  # fmt: skip
        slowest = min(levels, key=lambda lv: lv["bandwidth"])
        shape = [(world_size, slowest["bandwidth"], max(lv["latency"] for lv in levels))]
    else:
        shape = [(spec[1], lv["bandwidth"], lv["latency"])
                 for spec, lv in zip(specs, levels, strict=True) if spec[1] > 1]  # fmt: skip
    known = [m for m in memories if m is not None]
    measured = {
        "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": 0.0,
        "hosts": [[host, ranks] for host, ranks in groups],
        "levels": levels,
        "speed": speed_text,
        "memory": (f"{min(known) / 2**30:.1f} GiB per rank (the smallest rank's memory='auto')")
        if known
        else None,  # fmt: skip
        "notes": notes,
    }
    return Cluster(shape, min(known) if known else None, speeds, calibration.runtime, measured)


def _still_holds(rank: int, device: torch.device, cached: dict[str, Any], timeout_s: float) -> bool:
    """Whether the cached cluster's slowest link still runs at its bandwidth (within
    `LINK_CHANGE`): one pair, one way, a few round trips. A link shaped, upgraded or rerouted
    since is measured again."""
    cluster = Cluster.from_dict(cached)
    level = min(cluster.measured["levels"], key=lambda lv: lv["bandwidth"])
    src, dst = level["pairs"][0]
    comm = DistributedComm(rank, [(src, dst)], timeout_s=timeout_s, device=device)
    try:
        runtime = cluster.runtime
        _, now = _link(
            comm, rank, src, dst, runtime.cache_bandwidth, runtime.sent_s + runtime.message_s, 3
        )
    finally:
        comm.close()
    holds = 1 / LINK_CHANGE <= now / level["bandwidth"] <= LINK_CHANGE
    if not holds:
        log.info("the cached cluster's link %d->%d ran at %.3g B/s, cached %.3g B/s: measuring "
                 "again", src, dst, now, level["bandwidth"])  # fmt: skip
    return holds


def _level(
    comm: DistributedComm,
    rank: int,
    spec: tuple[str, int, list[list[int]], tuple[int, ...]],
    calibration: Calibration,
) -> dict[str, Any]:
    """A level's figures: the slowest pair and direction, and its all-reduce."""
    name, _, pairs, group = spec
    directions = [(src, dst) for a, b in pairs for src, dst in ((a, b), (b, a))]
    host_s = calibration.send_s + calibration.recv_s
    links = [_link(comm, rank, src, dst, calibration.cache_bandwidth, host_s, REPEATS)
             for src, dst in directions]  # fmt: skip
    small = all_reduce_seconds(comm, rank, group, REPEATS, 2)
    large = all_reduce_seconds(comm, rank, group, max(3, REPEATS // 4), PROBE_BYTES // 8)
    n = len(group)  # a ring all-reduce moves 2 (n - 1) / n of the bytes each way
    moved = 2 * (n - 1) / n * PROBE_BYTES
    return {
        "name": name,
        "pairs": [list(p) for p in pairs],
        "bandwidth": _digits(min(bw for _, bw in links)),
        "latency": _digits(max(lat for lat, _ in links)),
        "directions": [
            [src, dst, round(bw)] for (src, dst), (_, bw) in zip(directions, links, strict=True)
        ],
        "allreduce_bandwidth": moved / (large - small) if large > small else None,
    }


def _link(
    comm: DistributedComm,
    rank: int,
    src: int,
    dst: int,
    cache_bandwidth: float | None,
    host_s: float,
    repeats: int,
) -> tuple[float, float]:
    """(latency, bandwidth) from `src` to `dst`, as every rank learns it from `src`; packing
    runs at `cache_bandwidth`, a send and a receive cost `host_s` on the hosts."""
    tiny = _round_trip(comm, rank, src, dst, 1, repeats)
    large = _round_trip(comm, rank, src, dst, PROBE_BYTES // 4, max(3, repeats // 2))
    extra = PROBE_BYTES - 4
    packing = 2 * extra / cache_bandwidth if cache_bandwidth else 0.0  # and unpacking
    moving = large - tiny - packing
    bandwidth = extra / moving if moving > 0 else PROBE_BYTES / large
    # one probe may fit in the link's burst allowance: a stream of them shows the sustained rate
    count = min(STREAM_MAX, math.ceil(STREAM_S * bandwidth / PROBE_BYTES))
    if count > 1:
        streamed = _stream(comm, rank, src, dst, PROBE_BYTES // 4, count)
        moving = streamed - tiny - count * packing
        bandwidth = count * extra / moving if moving > 0 else bandwidth
    return max(tiny / 2 - host_s, 0.0), bandwidth


def _digits(value: float) -> float:
    """`value` to 3 significant digits: what the probes can tell apart, and what prints."""
    return float(f"{value:.3g}")


def _round_trip(
    comm: DistributedComm, rank: int, src: int, dst: int, rows: int, repeats: int
) -> float:
    """Fastest seconds from `src` sending `rows` float32 values to `dst` until `dst`'s one-value
    answer is back, on every rank (interference only adds time: the fastest repeat is the link
    alone)."""
    payload, answer = [torch.zeros(rows, device=comm.device)], [torch.zeros(1, device=comm.device)]
    trips = []
    for i in range(repeats + 1):  # one untimed round first
        out, back = ("act", i, src, dst), ("grad", i, dst, src)
        if rank == src:
            comm.expect(dst, back, [PROBE], 1)
        elif rank == dst:
            comm.expect(src, out, [PROBE], rows)
        dist.barrier()
        start = time.perf_counter()
        if rank == src:
            comm.send(dst, out, payload, [PROBE], rows)
            comm.recv(dst, back, [PROBE], 1)
            trips.append(time.perf_counter() - start)
        elif rank == dst:
            comm.recv(src, out, [PROBE], rows)
            comm.send(src, back, answer, [PROBE], 1)
        comm.flush()
    fastest = torch.tensor([min(trips[1:]) if trips else 0.0],
                           dtype=torch.float64, device=comm.device)  # fmt: skip
    dist.broadcast(fastest, src)
    return float(fastest[0])


def _stream(comm: DistributedComm, rank: int, src: int, dst: int, rows: int, count: int) -> float:
    """Seconds from `src` sending `count` messages of `rows` float32 values back to back to
    `dst` until `dst`'s one-value answer to the last is back, on every rank."""
    payload, answer = [torch.zeros(rows, device=comm.device)], [torch.zeros(1, device=comm.device)]
    first = 1000  # keys apart from the round trips' (microbatch numbers from 0)
    outs = [("act", first + i, src, dst) for i in range(count)]
    back = ("grad", first, dst, src)
    if rank == src:
        comm.expect(dst, back, [PROBE], 1)
    elif rank == dst:
        for key in outs:
            comm.expect(src, key, [PROBE], rows)
    dist.barrier()
    start = time.perf_counter()
    if rank == src:
        for key in outs:
            comm.send(dst, key, payload, [PROBE], rows)
        comm.recv(dst, back, [PROBE], 1)
    elif rank == dst:
        for key in outs:
            comm.recv(src, key, [PROBE], rows)
        comm.send(src, back, answer, [PROBE], 1)
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=comm.device)
    comm.flush()
    dist.broadcast(seconds, src)
    return float(seconds[0])


def _speeds(
    rank: int, world_size: int, device: torch.device
) -> tuple[tuple[float, ...] | None, str]:
    """Every rank's speed relative to rank 0 (None: all equal within `SPEED_SPREAD`) and how it
    was measured."""
    size = 2048 if device.type == "cuda" else 256
    a = torch.ones(size, size, device=device)
    rates = []
    for _ in range(SPEED_ROUNDS):
        dist.barrier()
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < SPEED_PROBE_S:
            timed(device, lambda: a @ a)
            count += 1
        rates.append(count / (time.perf_counter() - start))
    # the fastest round: a passing load slows some rounds, a quota or a lasting job every one
    mine = torch.tensor([max(rates), (max(rates) - min(rates)) / max(rates)],
                        dtype=torch.float64, device=device)  # fmt: skip
    everyone = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    medians = [float(t[0]) for t in everyone]
    spread = max(float(t[1]) for t in everyone)
    relative = [m / medians[0] for m in medians]
    how = (f"{size}x{size} matrix products on every rank at once, {SPEED_ROUNDS} x "
           f"{SPEED_PROBE_S} s; rounds spread up to {spread:.0%}")  # fmt: skip
    if max(relative) <= (1 + SPEED_SPREAD) * min(relative):
        return None, f"equal within {SPEED_SPREAD:.0%} ({how})"
    speeds = tuple(round(r, 2) for r in relative)
    return speeds, f"{', '.join(f'{s:g}' for s in speeds)} relative to rank 0 ({how})"


def _cache_path(
    cache: bool | str | os.PathLike, groups: list[tuple[str, list[int]]], device: torch.device
) -> Path:
    from pdcompile.passes.profile_cache import default_cache_dir

    directory = default_cache_dir() if cache is True else Path(cache)
    key = json.dumps([groups, torch.__version__, device.type, dist.get_backend()])
    return directory / f"measured-cluster-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _read_cache(path: Path, max_age_s: float) -> dict[str, Any] | None:
    """The cached cluster's dict, marked as coming from `path`; None when there is none or it
    is older than `max_age_s`."""
    if not path.exists():
        return None
    bad = (f"the measured-cluster cache file {path} is not valid ({{}}); delete it to measure "
           "the cluster again, or pass cluster= to compile")  # fmt: skip
    if not path.is_file():
        raise PartitionError(bad.format("not a regular file"))
    try:
        doc = json.loads(read_regular_text(path))
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            found = f"format {doc.get('format')!r} version {doc.get('version')!r}"
            raise PartitionError(bad.format(f"{found}, not {FORMAT!r} version {VERSION}"))
        cluster = Cluster.from_dict(doc["cluster"])
        at = datetime.fromisoformat(cluster.measured["at"])
    except PartitionError as exc:
        if str(path) in str(exc):
            raise
        raise PartitionError(bad.format(str(exc))) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PartitionError(bad.format(f"{type(exc).__name__}: {exc}")) from None
    age = (datetime.now(timezone.utc) - at).total_seconds()
    if age > max_age_s:
        log.info("the measured cluster in %s is %.0f s old: measuring again", path, age)
        return None
    data = cluster.to_dict()
    data["measured"] = {**cluster.measured, "from_cache": True, "cache": str(path)}
    return data


def _write_cache(path: Path, cluster: Cluster) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".tmp-{os.getpid()}")
        doc = {"format": FORMAT, "version": VERSION, "cluster": cluster.to_dict()}
        temporary.write_text(json.dumps(doc, indent=1), encoding="utf-8")
        os.replace(temporary, path)
    except OSError as exc:
        log.warning("could not cache the measured cluster in %s: %s", path, exc)
