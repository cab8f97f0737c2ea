"""Every registered schedule against the contract, the one place that names no kind.

For each name in `pdcompile.schedules()` (read when this file is imported: the built-ins and
any registered before): its orders build and validate on every layout it accepts (its own
placement of v stages per rank for each chunk count it plans with, one stage per rank with
replicas, channels that skip stages); its closed forms, where it gives them, equal simulating
its own actions on equal stages (step time, every rank's bubble, the microbatches in flight);
the memory the solvers charge (closed forms or walked orders) is what the simulator holds on a
straight pipeline and bounds it on replicated layouts; and a synchronous kind trains equal to
single-process gradient accumulation on the local executor and on 2 gloo ranks (one spawned
group for every kind). `tests/test_schedule_from_test_file.py` runs the same checks on a
schedule a test file defines.
"""

from __future__ import annotations

import copy
import functools
import importlib
import itertools
import pathlib
from collections.abc import Iterator, Sequence

import pytest
import torch
import torch.distributed as dist
from pipeline_support import OPTIMIZERS, accumulate_reference, mlp_case, stage_parameters
from spawn import run_ranks
from test_solvers import skeleton
from test_split_memory_budget import BYTES, CLUSTER, REPLICAS, charged, warmups
from test_split_memory_budget import chain as kept_chain

import pdcompile
from pdcompile import Cluster, PartitionError, Plan, ScheduleError, Stage, evaluate
from pdcompile.core.registry import Registry
from pdcompile.passes.planning.plans import consecutive_ranks
from pdcompile.runtime import validate_schedule
from pdcompile.runtime.distributed import init_process_group
from pdcompile.runtime.executor import DistributedPipeline
from pdcompile.runtime.local import LocalPipeline
from pdcompile.scheduling import build_schedule, get_schedule
from pdcompile.scheduling.action_kinds import SPLIT, is_compute, ways

# random replica layouts give splits the warning is about (tests/test_replica_balance.py)
pytestmark = pytest.mark.filterwarnings("ignore::pdcompile.core.errors.PlanWarning")

KINDS = sorted(pdcompile.schedules())
ACT, PARAM, GRAD, WEIGHT = 100, 10, 10, 30  # bytes per stage (a W pending keeps all of ACT)
FAST = 1e30  # bytes/s: transfers take no time
# (F, I, W) seconds per microbatch and stage: the simulator's even split, and two uneven ones
TIMES = [(1.0, 1.0, 1.0), (0.7, 1.3, 0.4), (2.0, 0.5, 0.9)]
REPLICATED = [(2,), (2, 1), (1, 2), (2, 2), (1, 2, 1)]
# ranks running several stages, not as any chunk count places them (a hand-made plan)
STACKED = [((0,), (0,), (1,)), ((0,), (1,), (1,)), ((0,), (0,), (0,), (1,)), ((0, 1), (0,), (1,))]


def chain(stages: int) -> dict[tuple[int, int], bool]:
    return {(s, s + 1): True for s in range(stages - 1)}


def chunks_of(kind: str) -> list[int]:
    """The stages per rank `kind` is planned with: one, its default and `auto`'s, and, for a
    kind of several, one more."""
    rules = get_schedule(kind)
    chunks = {1, rules.default_chunks, *rules.auto_chunks}
    return sorted(chunks | ({max(chunks) + 1} if max(chunks) > 1 else set()))


def placements(
    kind: str, most: int = 4, chunks: Sequence[int] | None = None
) -> Iterator[tuple[tuple[tuple[int, ...], ...], int]]:
    """(ranks per stage, stages per rank): `kind`'s own placement of v stages on each of p <=
    `most` ranks for every v of `chunks` (None: those it plans with; `chunk_rank`), then one
    stage per rank with replicas."""
    rules = get_schedule(kind)
    for p, v in itertools.product(range(1, most + 1), chunks or chunks_of(kind)):
        try:
            ranks = tuple((rules.chunk_rank(i, p, v),) for i in range(p * v))
        except ScheduleError:
            continue  # a chunk count the kind does not run
        yield ranks, v
    for replicas in REPLICATED:
        yield tuple(consecutive_ranks(list(replicas))), 1


def counts(kind: str, ranks: Sequence[Sequence[int]], v: int) -> list[int]:
    """Microbatch counts `kind` accepts on `ranks`, among the few that matter around p."""
    rules, p = get_schedule(kind), len({r for rs in ranks for r in rs})
    tried = sorted({1, 2, 3, p, 2 * p - 1, 2 * p, p * v + 1, 2 * p * v + 1, 3 * p * v} - {0})
    accepted = []
    for m in tried:
        try:
            rules.check([len(r) for r in ranks], m)
            rules.check_layout(ranks, m)
        except ScheduleError:
            continue
        accepted.append(m)
    return accepted


def equal_plan(ranks: Sequence[Sequence[int]], f: float, i: float, w: float) -> Plan:
    """Stages of F, I and W seconds on `ranks`, each receiving 1000 bytes from the one before,
    on a cluster whose transfers take no time."""
    stages = tuple(
        Stage(index=s, nodes=(f"n{s}",), replicas=len(r), ranks=tuple(r), forward_s=f,
              backward_s=i + w, backward_input_s=i, backward_weight_s=w,
              recv_bytes=((s - 1, 1000),) if s else (), activation_bytes=ACT, param_bytes=PARAM,
              grad_bytes=GRAD, weight_bytes=WEIGHT)
        for s, r in enumerate(ranks)
    )  # fmt: skip
    devices = len({r for rs in ranks for r in rs})
    return Plan(stages=stages, cluster=Cluster([(devices, FAST)]))


# -- the checks (also run by tests/test_schedule_from_test_file.py) -------------------------


def check_orders(kind: str) -> int:
    """Build and validate `kind` on every layout it accepts (also ranks running several stages
    as a hand-made plan places them); returns how many."""
    rules, built = get_schedule(kind), 0
    stacked = [(ranks, 1) for ranks in STACKED]
    for ranks, v in [*placements(kind, chunks=sorted({1, 2, *chunks_of(kind)})), *stacked]:
        shared = len({r for rs in ranks for r in rs}) < sum(len(rs) for rs in ranks)
        if shared and rules.streaming:
            continue  # streams run one stage per rank (the builder refuses)
        stages = len(ranks)
        skip = {**chain(stages), (0, stages - 1): False} if stages > 2 else chain(stages)
        for m, edges in itertools.product(counts(kind, ranks, v), (chain(stages), skip)):
            steps = 2 if rules.streaming else 1
            schedule = build_schedule(kind, ranks, edges, m, num_steps=steps)
            validate_schedule(schedule)
            work: dict[tuple[int, int], list[str]] = {}  # per (stage, microbatch), its kinds
            for a in (a for acts in schedule.actions.values() for a in acts):
                if is_compute(a.kind):
                    work.setdefault((a.stage, a.microbatch), []).append(a.kind)
            done = [sorted(way) for way in ways(rules.compute_kinds)]  # F, B or F, I, W
            assert len(work) == stages * m * steps, (ranks, m)
            assert all(sorted(kinds) in done for kinds in work.values()), (ranks, m)
            built += 1
    assert built, f"{kind} accepts none of the layouts tried"
    return built


def check_closed_forms(kind: str) -> int:
    """`kind`'s closed forms against simulating its actions on equal stages; returns how many
    layouts were compared (0 for a kind without closed forms)."""
    rules, compared = get_schedule(kind), 0
    if rules.closed_forms is None:
        with pytest.raises(ScheduleError, match="gives no closed form"):
            rules.step_time(2, 4, 1.0, 2.0)
        return 0
    for (ranks, v), (f, i, w) in itertools.product(placements(kind), TIMES):
        if any(len(r) > 1 for r in ranks):
            continue  # the forms are for one replica per stage
        stages, p = len(ranks), len(ranks) // v
        for m in counts(kind, ranks, v):
            sim = pdcompile.simulate(equal_plan(ranks, f, i, w), schedule=kind, num_microbatches=m)
            step = rules.step_time(stages, m, f, i + w, weight_s=w, chunks=v)
            assert sim.time_per_step == pytest.approx(step, rel=1e-9), (ranks, m, f, i, w)
            bubble = rules.bubble(stages, m, f, i + w, weight_s=w, chunks=v)
            assert sim.bubble_fraction == pytest.approx([bubble] * p, rel=1e-9, abs=1e-12)
            for rank in range(p):
                held = rules.in_flight_bound([1] * stages, rank, m, chunks=v)
                if rules.synchronous:  # its stages' weights, activations and gradients
                    held_bytes = sim.schedule_memory[rank] - v * (WEIGHT - GRAD)
                    activations, grads = divmod(held_bytes, ACT)
                    assert activations == held, (ranks, m, rank)
                    assert grads in range(0, v * GRAD + 1, GRAD), (ranks, m, rank)
                else:  # a stream: at most, and exactly in the steady state of M >= S
                    versions = rules.stashed_versions_bound([1] * stages, rank, m)
                    bound = WEIGHT + held * ACT + versions * PARAM
                    assert sim.schedule_memory[rank] <= bound, (ranks, m, rank)
            compared += 1
    assert compared, f"{kind} gives closed forms but no layout was compared"
    return compared


def check_memory_counts(kind: str) -> int:
    """What the solvers charge (`memory_counts`: closed forms or walked orders) against the
    simulated memory: exactly on a straight pipeline (a stream's at M >= S: a call of fewer
    microbatches holds less), at most on replicated layouts of one stage per rank (cpsat's
    counts for the layout's own warm-ups and dp's `memory_bounds`, W keeping some, none or all
    of the activations); returns how many layouts were compared."""
    rules, compared = get_schedule(kind), 0
    for stages in range(1, 6):
        ranks = tuple((s,) for s in range(stages))
        for m in counts(kind, ranks, 1):
            sim = pdcompile.simulate(equal_plan(ranks, 1.0, 1.0, 1.0), schedule=kind,
                                     num_microbatches=m)  # fmt: skip
            for s in range(stages):
                got = rules.memory_counts(stages - s, stages - 1 - s, m, stages - 1)
                replicas = [1] * stages
                in_flight = rules.in_flight_bound(replicas, s, m)
                versions = rules.stashed_versions_bound(replicas, s, m)
                assert (got.in_flight + got.deferred, got.versions) == (in_flight, versions)
                exact = max(got.charges(WEIGHT, GRAD, PARAM, ACT, ACT))
                if rules.synchronous or m >= stages:
                    assert sim.schedule_memory[s] == exact, (stages, m, s, got)
                else:
                    assert sim.schedule_memory[s] <= exact, (stages, m, s, got)
            compared += 1
    for replicas, bytes_, least in itertools.product(REPLICAS, BYTES, (1, 5, 9)):
        acts, kept = zip(*bytes_[: len(replicas)], strict=True)
        g = kept_chain(list(acts), list(kept))
        m = next((m for m in range(least, least + 8) if rules.accepts(replicas, m)), None)
        if m is None:
            continue  # replica counts this schedule does not run
        cuts = tuple(range(1, len(replicas)))
        try:
            plan = evaluate(skeleton(g, Cluster.parse(CLUSTER), cuts, replicas, kind, m), g)
        except PartitionError:
            continue  # a layout this schedule does not run (zb-v: a V only)
        w = warmups(replicas)
        for s, stage in enumerate(plan.stages):
            exact = rules.memory_counts(len(replicas) - s, w[s], m, max(w))
            bound = rules.memory_bounds(4 - sum(replicas[:s]), replicas[s], m, 4)  # as dp
            assert stage.memory_bytes <= charged(stage, exact) <= charged(stage, bound), (
                replicas, m, s, exact, bound,
            )  # fmt: skip
            # exactly for the kinds whose forms count the W's a split backward leaves pending
            split = rules.compute_kinds == SPLIT and rules.closed_forms is not None
            if split and len(replicas) == 4:
                assert stage.memory_bytes == charged(stage, exact), (replicas, m, s, exact)
        compared += 1
    return compared


SGD = OPTIMIZERS["sgd"]
STEPS = 3


@functools.cache
def _mlp_costs() -> tuple[torch.fx.GraphModule, pdcompile.CostGraph]:
    model, x, _, _ = mlp_case()
    gm = pdcompile.trace(model, (x,))
    return gm, pdcompile.analyze(gm, (x,), profile=False)


def mlp_program(kind: str, chunks: int | None = None) -> tuple[pdcompile.StagedProgram, int]:
    """The MLP planned for `kind` on 2 ranks (its own placement, `chunks` stages per rank:
    None, its default), and the first microbatch count from 4 on that it accepts (the batch
    has 12 rows); a fresh copy (a pipeline trains its program's modules in place)."""
    gm, costs = _mlp_costs()
    gm = copy.deepcopy(gm)
    for m in range(4, 13):
        try:
            plan = pdcompile.plan(costs, "2", solver="uniform", schedule=kind, num_microbatches=m,
                                  chunks=chunks)  # fmt: skip
        except PartitionError:
            continue
        return pdcompile.codegen(gm, plan), m
    raise AssertionError(f"{kind} plans the MLP on 2 ranks with no count from 4 to 12")


def reference(m: int) -> dict[str, torch.Tensor]:
    model, x, y, loss_fn = mlp_case()
    ref, _ = accumulate_reference(model, x, y, loss_fn, SGD, m, STEPS)
    return dict(ref.named_parameters(remove_duplicate=False))


def assert_trained(params: dict[str, torch.Tensor], m: int, what: str) -> None:
    expected = reference(m)
    assert params and params.keys() == expected.keys(), what
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], msg=f"{what}: {name}")


def check_local_training(kind: str, chunks: int | None = None) -> None:
    """A synchronous kind trains the MLP equal to gradient accumulation on the local
    executor (`chunks` stages per rank: None, its default), its plan's step time and memory
    the simulator's; the plan's own orders (`Plan.rules`: a `synth` plan's fitted ones)."""
    program, m = mlp_program(kind, chunks)
    sim = pdcompile.simulate(program.plan)
    assert program.plan.step_time == sim.time_per_step
    assert program.plan.rank_memory == tuple(sim.peak_memory)
    _, x, y, loss_fn = mlp_case()
    pipeline = LocalPipeline(program, schedule=program.plan.rules, num_microbatches=m,
                             loss_fn=loss_fn, optimizer=SGD)  # fmt: skip
    for _ in range(STEPS):
        pipeline.train_step((x,), y)
    params = {n: p for st in pipeline.stage_modules().values()
              for n, p in st.named_parameters(remove_duplicate=False)}  # fmt: skip
    assert_trained(params, m, kind)


def train_mlp_on_rank(
    rank: int, device: torch.device, kind: str, chunks: int | None = None
) -> tuple[int, dict]:
    """The MLP planned for `kind` (`mlp_program`) trained `STEPS` steps on this rank of a
    spawned group, from a fresh model, under the plan's own orders: (M, this rank's stage
    parameters)."""
    program, m = mlp_program(kind, chunks)
    _, x, y, loss_fn = mlp_case()
    pipeline = DistributedPipeline(
        program, rank=rank, schedule=program.plan.rules, num_microbatches=m, loss_fn=loss_fn,
        optimizer=SGD, device=device, timeout_s=60,
    )  # fmt: skip
    for _ in range(STEPS):
        pipeline.train_step((x,), y)
    return m, stage_parameters(pipeline)


def _train_on_ranks(rank: int, world_size: int, init_file: str, configs: list) -> list[tuple]:
    """Every (kind, module that registers it, chunks) in one spawned group."""
    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=60)
    torch.set_num_threads(1)
    results = []
    for kind, module, chunks in configs:
        importlib.import_module(module)  # a kind a test file registers: registered here too
        results.append(train_mlp_on_rank(rank, device, kind, chunks))
    dist.destroy_process_group()
    return results


def check_gloo_training(kinds: Sequence[str | tuple[str, int]]) -> None:
    """The synchronous `kinds` (or (kind, chunks per rank)) train the MLP equal to gradient
    accumulation on 2 spawned gloo ranks, all in one group."""
    pairs = [(k, None) if isinstance(k, str) else k for k in kinds]
    configs = [(kind, type(get_schedule(kind)).__module__, chunks) for kind, chunks in pairs]
    per_rank = run_ranks(_train_on_ranks, 2, configs, timeout_s=120)
    for i, (kind, chunks) in enumerate(pairs):
        (m, first), (_, second) = per_rank[0][i], per_rank[1][i]
        assert_trained({**first, **second}, m, f"{kind} (chunks {chunks}) on gloo ranks")


# -- every registered schedule ----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_orders_build_and_validate(kind: str) -> None:
    check_orders(kind)


@pytest.mark.parametrize("kind", KINDS)
def test_closed_forms_equal_the_simulated_actions(kind: str) -> None:
    check_closed_forms(kind)


@pytest.mark.parametrize("kind", KINDS)
def test_the_charged_memory_is_the_simulated_memory(kind: str) -> None:
    if not check_memory_counts(kind):  # a kind that runs no stage alone on its ranks (zb-v)
        with pytest.raises(ScheduleError):
            get_schedule(kind).check_layout([(0,), (1,)], 4)


SYNCHRONOUS = [kind for kind in KINDS if get_schedule(kind).synchronous]


@pytest.mark.parametrize("kind", SYNCHRONOUS)
def test_synchronous_kinds_equal_gradient_accumulation_locally(kind: str) -> None:
    check_local_training(kind)


def test_synchronous_kinds_equal_gradient_accumulation_on_two_gloo_ranks() -> None:
    check_gloo_training(SYNCHRONOUS)


def test_a_kind_without_its_orders_is_refused_by_name() -> None:
    """The required core: a schedule that gives no `rank_orders` is refused when registered,
    naming it; one that sets a weight rule outside its policy is refused when defined."""
    with pytest.raises(ScheduleError, match="does not define rank_orders, the required core"):

        @pdcompile.register_schedule("no-orders")
        class NoOrders(pdcompile.PipelineSchedule):
            """Nothing but a name."""

    assert "no-orders" not in pdcompile.schedules()
    with pytest.raises(ScheduleError, match="defines streaming: .* weight policy"):

        class Streams(pdcompile.PipelineSchedule):
            streaming = True


def test_closed_forms_are_a_kinds_own() -> None:
    """A subclass of a kind with closed forms gives its own or none: 1F1B's order with a deeper
    warm-up is charged what its walked order holds, not 1F1B's formula."""
    one = get_schedule("1f1b")

    class Deeper(type(one)):
        def warmup(self, replicas, stage, num_microbatches):  # noqa: ANN001, ANN201
            return super().warmup(replicas, stage, num_microbatches) + 1

    assert one.closed_forms is not None and Deeper.closed_forms is None
    deeper = Deeper()
    assert [one.in_flight_bound([1] * 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [deeper.in_flight_bound([1] * 4, s, 8) for s in range(4)] == [5, 4, 3, 2]
    assert deeper.memory_counts(4, 3, 8, 3).in_flight == 5
    with pytest.raises(ScheduleError, match="gives no closed form of its step time"):
        deeper.step_time(4, 8, 1.0, 2.0)


def test_orders_that_skip_a_microbatch_are_refused() -> None:
    """The builder checks every rank's order against its stages' work."""

    class Skips(type(get_schedule("1f1b"))):
        def rank_orders(self, placement):  # noqa: ANN001, ANN201
            orders = super().rank_orders(placement)
            return {rank: list(orders[rank])[:-1] for rank in orders}

    with pytest.raises(ScheduleError, match="does not run each microbatch of its stages"):
        build_schedule(Skips(), [(0,), (1,)], chain(2), 3)


def test_registered_kinds_are_found_by_listing_the_package() -> None:
    """No registry line names a built-in schedule or solver: their packages are listed."""
    from pdcompile.passes.planning.solver_kit import SOLVERS
    from pdcompile.scheduling.registry import SCHEDULES

    modules = {type(get_schedule(kind)).__module__ for kind in KINDS}
    assert {m for m in modules if m.startswith("pdcompile.scheduling.")} <= set(SCHEDULES.builtins)
    assert {"pdcompile.scheduling.zb_v", "pdcompile.scheduling.action_kinds"} <= set(
        SCHEDULES.builtins
    )
    assert (
        "pdcompile.passes.planning.solvers.reach" in SOLVERS.builtins
    )  # listed, though it registers none


def test_a_new_file_in_a_registrys_package_registers_itself(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file added to the package registers what it defines on first use, in no list."""
    package = tmp_path / "found_plugins"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("first", "second"):
        (package / f"{name}.py").write_text(
            f"import sys\nsys.modules['found_plugins'].REGISTRY.add({name!r}, {name!r})\n"
        )
    monkeypatch.syspath_prepend(str(tmp_path))
    imported = importlib.import_module("found_plugins")
    imported.REGISTRY = Registry("plugin", (), ScheduleError, package="found_plugins")
    assert list(imported.REGISTRY) == ["first", "second"]
    assert imported.REGISTRY.builtins == ("found_plugins.first", "found_plugins.second")
