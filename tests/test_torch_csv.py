"""torch.distributed.pipelining's schedule CSV in and out (`pdcompile.schedules.from_torch_csv`,
`to_torch_csv`).

torch's own schedule classes compute their `pipeline_order` on stand-in stages (no process
group; the single-stage ones for every rank at once); each is dumped as torch does (`_dump_csv`,
or its format for the single-stage classes, which have none), imported, checked action for
action, validated, and trained equal to single-process gradient accumulation on the local
executor, two of them on 2 gloo ranks. torch's `Schedule1F1B.pipeline_order` (a picture only:
its `step` does not run it) skips microbatch 0 on the last rank and is refused. pdcompile's
`1f1b`, `interleaved-1f1b`, `zb-v` and `dualpipev` orders are exported, read back by torch's
`_load_csv` and compared with torch's orders for the same schedules.
"""

from __future__ import annotations

import csv
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as ts
from spawn import run_ranks
from test_schedule_conformance import (
    _mlp_costs,
    assert_trained,
    check_local_training,
    train_mlp_on_rank,
)

import pdcompile
from pdcompile import ScheduleError
from pdcompile.runtime import validate_schedule
from pdcompile.runtime.distributed import init_process_group
from pdcompile.scheduling import build_schedule, get_schedule
from pdcompile.scheduling.registry import SCHEDULES
from pdcompile.scheduling.torch_csv import TorchCsvSchedule

P, M = 2, 4  # ranks, microbatches: the MLP has 4 layers, so at most 4 stages


def round_robin(stage: int, p: int) -> int:
    return stage % p


def v_shape(stage: int, p: int) -> int:
    return stage if stage < p else 2 * p - 1 - stage


# torch's class, stages per rank, its placement
TORCH = {
    "ScheduleGPipe": (ts.ScheduleGPipe, 1, round_robin),
    "ScheduleInterleaved1F1B": (ts.ScheduleInterleaved1F1B, 2, round_robin),
    "ScheduleLoopedBFS": (ts.ScheduleLoopedBFS, 2, round_robin),
    "ScheduleInterleavedZeroBubble": (ts.ScheduleInterleavedZeroBubble, 2, round_robin),
    "ScheduleZBVZeroBubble": (ts.ScheduleZBVZeroBubble, 2, v_shape),
    "ScheduleDualPipeV": (ts.ScheduleDualPipeV, 2, v_shape),
}


@pytest.fixture(autouse=True)
def _unregister() -> Iterator[None]:
    """The kinds a test loads leave the registry with it (other tests list the kinds)."""
    before = set(SCHEDULES)
    yield
    for name in set(SCHEDULES) - before:
        del SCHEDULES._items[name]


def stand_in(rank: int, p: int, stages: int, index: int) -> SimpleNamespace:
    """What torch's constructors read of a stage: sizes, rank, no module."""
    return SimpleNamespace(group_size=p, group_rank=rank, num_stages=stages, submod=None,
                           stage_index=index, is_first=index == 0,
                           is_last=index == stages - 1)  # fmt: skip


def torch_schedules(cls: type, v: int, place: Callable[[int, int], int], p: int, m: int) -> list:
    """Each rank's torch schedule object (one for all ranks of a single-stage class)."""
    if issubclass(cls, ts.PipelineScheduleSingle):
        return [cls(stand_in(0, p, p, 0), m)]
    return [
        cls([stand_in(r, p, p * v, s) for s in range(p * v) if place(s, p) == r], m)
        for r in range(p)
    ]


def dump(name: str, path: Path, p: int = P, m: int = M, comms: bool = False) -> dict[int, list]:
    """torch's order of class `name` on p ranks for m microbatches, written by torch
    (`_dump_csv`; a single-stage class: its rows, as `_dump_csv` writes them); its actions per
    rank."""
    cls, v, place = TORCH[name]
    objects = torch_schedules(cls, v, place, p, m)
    order = {r: objects[r if len(objects) > 1 else 0].pipeline_order[r] for r in range(p)}
    if len(objects) > 1:  # every object holds every rank's order: rank 0's writes them
        assert all(o.pipeline_order == objects[0].pipeline_order for o in objects)
        if comms:
            objects[0]._dump_csv(str(path), format="compute_comms")
        else:
            ts.PipelineScheduleMulti._dump_csv(objects[0], str(path))
    else:
        with path.open("w", newline="") as handle:
            csv.writer(handle).writerows(order[r] for r in range(p))
    return order


def compute_cells(actions: list) -> list[str]:
    """torch's compute actions of one rank, as written (no idle steps, no REDUCE_GRAD)."""
    return [str(a) for a in actions if a is not None and a.is_compute_op]


def chain(stages: int) -> dict[tuple[int, int], bool]:
    return {(s, s + 1): True for s in range(stages - 1)}


@pytest.mark.parametrize("name", sorted(TORCH))
def test_torchs_orders_import_validate_and_train(name: str, tmp_path: Path) -> None:
    order = dump(name, tmp_path / f"{name}.csv")
    rules = pdcompile.schedules.from_torch_csv(tmp_path / f"{name}.csv")
    assert rules.name == f"csv:{name}" and name in repr(rules)
    assert rules.num_microbatches == M and len(rules.orders) == P
    cls, v, place = TORCH[name]
    assert rules.stage_rank == tuple(place(s, P) for s in range(P * v))
    ranks = [(r,) for r in rules.stage_rank]
    validate_schedule(build_schedule(rules, ranks, chain(P * v), M))
    pdcompile.schedules.to_torch_csv(rules, tmp_path / "back.csv", ranks, M)
    with (tmp_path / "back.csv").open(newline="") as handle:
        assert list(csv.reader(handle)) == [compute_cells(order[r]) for r in range(P)]
    check_local_training(rules.name)  # plan (its placement), simulate, LocalPipeline


def test_the_comms_format_reads_as_its_compute(tmp_path: Path) -> None:
    """Sends, receives, UNSHARD, RESHARD and REDUCE_GRAD are skipped."""
    dump("ScheduleZBVZeroBubble", tmp_path / "comms.csv", comms=True)
    dump("ScheduleZBVZeroBubble", tmp_path / "compute.csv")
    assert "RECV_F" in (tmp_path / "comms.csv").read_text()
    comms = pdcompile.schedules.from_torch_csv(tmp_path / "comms.csv")
    compute = pdcompile.schedules.from_torch_csv(tmp_path / "compute.csv")
    assert comms.orders == compute.orders


def test_torchs_1f1b_picture_skips_a_microbatch_and_is_refused(tmp_path: Path) -> None:
    """torch's `Schedule1F1B._get_pipeline_order` (for pictures; `step` runs its own loop) has
    the last rank forward microbatches 1 to M, not 0 to M - 1."""
    cls = ts.Schedule1F1B
    order = cls(stand_in(0, P, P, 0), M).pipeline_order
    assert compute_cells(order[P - 1])[0] == f"{P - 1}F1"
    with (tmp_path / "1f1b.csv").open("w", newline="") as handle:
        csv.writer(handle).writerows(order[r] for r in range(P))
    with pytest.raises(ScheduleError, match="1f1b.csv.*microbatch .* runs"):
        pdcompile.schedules.from_torch_csv(tmp_path / "1f1b.csv")


def test_a_loaded_kind_accepts_only_what_the_file_fixes(tmp_path: Path) -> None:
    dump("ScheduleInterleaved1F1B", tmp_path / "i.csv")
    rules = pdcompile.schedules.from_torch_csv(tmp_path / "i.csv", name="mine")
    assert get_schedule("mine") is rules and "mine" in pdcompile.schedules()
    assert rules.default_chunks == 2 and rules.items_per_microbatch == 2
    _, costs = _mlp_costs()
    planned = pdcompile.plan(costs, "2", solver="uniform", schedule=rules, num_microbatches=M)
    assert planned.schedule == "mine" and planned.rules is rules
    assert [s.ranks for s in planned.stages] == [(0,), (1,), (0,), (1,)]
    for wrong, why in [
        ({"num_microbatches": 6}, "fixes 4 stages on 2 ranks .* and 4 microbatches"),
        ({"num_microbatches": 4, "chunks": 1}, "fixes 4 stages"),
    ]:
        with pytest.raises(pdcompile.PartitionError, match=f"i.csv' {why}"):
            pdcompile.plan(costs, "2", solver="uniform", schedule=rules, **wrong)
    with pytest.raises(ScheduleError, match="i.csv' fixes"):
        build_schedule(rules, [(0,), (1,), (1,), (0,)], chain(4), M)


def test_bad_files_are_refused(tmp_path: Path) -> None:
    bad = {
        "cell.csv": "0F0,0X1\n", "nothing.csv": "0F0,0B0\n,\n", "shared.csv": "0F0,0B0\n0F1,0B1\n",
        "missing.csv": "0F0,0F1,0B0\n",
    }  # fmt: skip
    why = {"cell.csv": "rank 0, step 1: '0X1' is no torch action",
           "nothing.csv": "rank 1 .* computes nothing", "shared.csv": "stages on several ranks",
           "missing.csv": "stage 0 microbatch 1 runs \\['F'\\]"}  # fmt: skip
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ScheduleError, match=why[name]):
            pdcompile.schedules.from_torch_csv(tmp_path / name)
    with pytest.raises(ScheduleError, match="cannot read"):
        pdcompile.schedules.from_torch_csv(tmp_path / "absent.csv")


# pdcompile's kind, its stages per rank, torch's class of the same schedule
EXPORTED = [
    ("1f1b", 1, ts.Schedule1F1B),
    ("interleaved-1f1b", 2, ts.ScheduleInterleaved1F1B),
    ("zb-v", 2, ts.ScheduleZBVZeroBubble),
    ("dualpipev", 2, ts.ScheduleDualPipeV),
]


@pytest.mark.parametrize("kind, v, cls", EXPORTED)
@pytest.mark.parametrize("p, m", [(2, 4), (3, 6), (4, 8)])
def test_pdcompile_orders_export_and_torch_reads_them(
    kind: str, v: int, cls: type, p: int, m: int, tmp_path: Path
) -> None:
    """Equal to torch's orders, except torch's 1F1B picture's last rank (its forwards'
    microbatches one higher: `test_torchs_1f1b_picture_skips_a_microbatch_and_is_refused`)."""
    rules = get_schedule(kind)
    ranks = [(rules.chunk_rank(s, p, v),) for s in range(p * v)]
    built = build_schedule(kind, ranks, chain(p * v), m)
    path = pdcompile.schedules.to_torch_csv(built, tmp_path / f"{kind}.csv")
    with path.open(newline="") as handle:
        ours = list(csv.reader(handle))
    place = functools.partial(rules.chunk_rank, chunks=v)
    objects = torch_schedules(cls, v, place, p, m)
    theirs = [compute_cells(objects[0].pipeline_order[r]) for r in range(p)]
    if kind == "1f1b":
        shifted = [c.replace(f"F{c.split('F')[-1]}", f"F{int(c.split('F')[-1]) + 1}")
                   if "F" in c else c for c in ours.pop()]  # fmt: skip
        assert theirs.pop() == shifted
    assert ours == theirs
    reader = ts.ScheduleInterleaved1F1B if cls is ts.Schedule1F1B else cls
    loaded = torch_schedules(reader, v, place, p, m)[0]
    loaded._load_csv(str(path))  # torch's parser and its checks of the orders
    assert {s: r for s, (r,) in enumerate(ranks)} == loaded.stage_index_to_group_rank
    assert from_csv_equals(path, built)


def from_csv_equals(path: Path, built: pdcompile.scheduling.Schedule) -> bool:
    """The exported file imports as the orders it was written from."""
    rules = pdcompile.schedules.from_torch_csv(path)
    assert isinstance(rules, TorchCsvSchedule)
    rebuilt = build_schedule(rules, built.ranks, chain(built.num_stages), built.num_microbatches)
    return rebuilt.actions == built.actions


def test_asynchronous_and_replicated_schedules_are_refused(tmp_path: Path) -> None:
    for kind in ("pipedream", "2bw"):
        with pytest.raises(ScheduleError, match=f"{kind} is asynchronous"):
            pdcompile.schedules.to_torch_csv(kind, tmp_path / "a.csv", [(0,), (1,)], 4)
    with pytest.raises(ScheduleError, match="replicas \\[2, 1\\]"):
        pdcompile.schedules.to_torch_csv("1f1b", tmp_path / "r.csv", [(0, 1), (2,)], 4)
    with pytest.raises(ScheduleError, match="give the layout"):
        pdcompile.schedules.to_torch_csv("1f1b", tmp_path / "r.csv")
    assert "1f1b" in pdcompile.schedules()


def _train_loaded(rank: int, world_size: int, init_file: str, paths: list[str]) -> list:
    """Each file loaded on this rank too (a plan names its kind), trained from a fresh MLP."""
    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=60)
    torch.set_num_threads(1)
    results = [
        train_mlp_on_rank(rank, device, pdcompile.schedules.from_torch_csv(path).name)
        for path in paths
    ]
    dist.destroy_process_group()
    return results


def test_torchs_orders_train_on_two_gloo_ranks(tmp_path: Path) -> None:
    names = ["ScheduleInterleavedZeroBubble", "ScheduleDualPipeV"]
    paths = []
    for name in names:
        dump(name, tmp_path / f"{name}.csv")
        paths.append(str(tmp_path / f"{name}.csv"))
    per_rank = run_ranks(_train_loaded, 2, paths, timeout_s=120)
    for i, name in enumerate(names):
        (m, first), (_, second) = per_rank[0][i], per_rank[1][i]
        assert_trained({**first, **second}, m, f"torch's {name} on gloo ranks")


def test_a_one_stage_per_rank_file_plans_with_the_default_solver(tmp_path) -> None:
    """dynprog may replicate a stage; a file's kind runs one replica per stage, so the planner
    leaves those counts out instead of failing to settle a count for them."""
    from test_solvers import chain

    path = tmp_path / "gpipe.csv"
    pdcompile.schedules.to_torch_csv("gpipe", str(path), ranks=[(0,), (1,)], num_microbatches=4)
    loaded = pdcompile.schedules.from_torch_csv(str(path))
    costs = chain([1.0] * 4, [10] * 4, [10] * 4, [10] * 4)  # cheap links: replicas would pay
    plan = pdcompile.plan(costs, "2", solver="dynprog", schedule=loaded)
    assert [s.replicas for s in plan.stages] == [1, 1] and plan.num_microbatches == 4
