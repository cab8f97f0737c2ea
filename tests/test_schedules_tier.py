"""The schedules tier (marker `schedules`, run by .ci/run): every registered synchronous
schedule, on its own placement (`chunk_rank`, its default chunks per rank), trains the MLP,
the residual CNN and the GPT with tied weights, with SGD with momentum and with Adam, on 2 and
on 4 spawned gloo ranks (one group per size, every configuration in it), equal to
single-process gradient accumulation over the same microbatches. It reads the registry, so a
new built-in kind is in it with no line here; the default run's conformance test
(tests/test_schedule_conformance.py) trains the MLP with SGD on 2 ranks only.

    python -m pytest tests/test_schedules_tier.py -m schedules
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
from pipeline_support import OPTIMIZERS, accumulate_reference, stage_parameters
from spawn import run_ranks
from test_schedules_modern import CASES, SOLVER, assert_comparable

import pdcompile
from pdcompile import Cluster, PartitionError, Plan
from pdcompile.passes.planning.planner import chunk_layout
from pdcompile.runtime.distributed import init_process_group
from pdcompile.runtime.executor import DistributedPipeline
from pdcompile.scheduling import get_schedule

pytestmark = pytest.mark.schedules
STEPS = 3
# Adam divides each step by the root of the squared gradient, so a near-zero gradient summed in
# another order (looped-bfs runs the backwards newest first, as torch's ScheduleLoopedBFS does)
# moves by up to its learning rate: the GPT's first MLP weight by 1.2e-5 after 3 steps
ATOL = {"sgd": 1e-5, "adam": 5e-5}
# every built-in synchronous kind: the tier's run collects tests/ whole, and kinds other test
# files register (test_schedule_plugins' 1f1b-deep) exist only in this parent process
KINDS = sorted(
    k for k in pdcompile.schedules()
    if get_schedule(k).synchronous and type(get_schedule(k)).__module__.startswith("pdcompile.")
)  # fmt: skip


@functools.cache
def _program(case: str, ranks: tuple[tuple[int], ...]) -> pdcompile.StagedProgram | None:
    """The case's model cut into one stage per entry of `ranks` (None: it has too few nodes
    with parameters for so many stages)."""
    model, x, _, _ = CASES[case]()
    gm = pdcompile.trace(model, (x,))
    costs = pdcompile.analyze(gm, (x,), profile=False)
    try:
        cut = pdcompile.plan(costs, str(len(ranks)), solver=SOLVER.get(case, "uniform"),
                             replica_counts=[1])  # fmt: skip
    except PartitionError:
        return None
    if cut.num_stages != len(ranks):
        return None
    stages = tuple(dataclasses.replace(s, ranks=ranks[s.index]) for s in cut.stages)
    devices = len({r for rs in ranks for r in rs})
    try:
        return pdcompile.codegen(gm, Plan(stages=stages, cluster=Cluster.parse(str(devices))))
    except PartitionError:  # a stage without parameters
        return None


def _configs(world_size: int) -> list[tuple[str, str, str, tuple, int]]:
    """(kind, case, optimizer, ranks, M) for every kind whose placement the case can fill."""
    found = []
    for kind in KINDS:
        rules = get_schedule(kind)
        ranks, m = chunk_layout(rules, world_size, rules.default_chunks)
        ranks = tuple(ranks)
        for case in CASES:
            if _program(case, ranks) is None:
                continue
            found += [(kind, case, opt, ranks, m) for opt in OPTIMIZERS]
    return found


def _train(rank: int, world_size: int, init_file: str, configs: list) -> list[dict]:
    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=120)
    torch.set_num_threads(1)
    results = []
    for kind, case, opt, ranks, m in configs:
        _, x, y, loss_fn = CASES[case]()
        pipeline = DistributedPipeline(
            copy.deepcopy(_program(case, ranks)), rank=rank, schedule=kind, num_microbatches=m,
            loss_fn=loss_fn, optimizer=OPTIMIZERS[opt], device=device, timeout_s=120,
        )  # fmt: skip
        for _ in range(STEPS):
            pipeline.train_step((x,), y)
        results.append(stage_parameters(pipeline))
    dist.destroy_process_group()
    return results


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_synchronous_kind_equals_gradient_accumulation(world_size: int) -> None:
    configs = _configs(world_size)
    assert {c[0] for c in configs} == set(KINDS), "a kind no case could fill"
    per_rank = run_ranks(_train, world_size, configs, timeout_s=3000)
    for i, (kind, case, opt, ranks, m) in enumerate(configs):
        model, x, y, loss_fn = CASES[case]()
        ref, _ = accumulate_reference(model, x, y, loss_fn, OPTIMIZERS[opt], m, STEPS)
        expected = dict(ref.named_parameters(remove_duplicate=False))
        trained = {n: t for rank in per_rank for n, t in rank[i].items()}
        what = f"{kind} on {world_size} ranks ({len(ranks)} stages, M={m}), {case}, {opt}"
        assert_comparable(trained, expected, what, atol=ATOL[opt])
