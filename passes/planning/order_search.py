"""`plan(..., schedule="synth")`: the order synthesised for the plan at hand. Torch-free.

A layer of the planner (`planner.SEARCHES`, inside the microbatch count's, around
recomputation's): once the stages are cut (under the kind's walked memory counts), placed and
their recomputation chosen, the order is fitted to the plan (`pdcompile/scheduling/synth.py`):
its stages' F, I and W seconds, the time of a message into each stage (half its `comm_s`, which
carries the inputs in and the gradients back), and each rank's activation budget (the memory
limit less the rank's weights, gradients and optimizer state; without a limit, 1F1B's
activations on the rank holding most), scaled by the knobs. Every `KNOBS` setting of the list
scheduler is simulated, then the split orders are descended from ZB-H1's, `BUDGET` candidates
in all (a count, not seconds: the plan does not depend on the machine's load). The shortest
step whose every rank holds at most its limit is kept (the memory limit; without one, the peak
of the kind's own order, 1F1B's counts, so synth needs no more memory than 1F1B; none within:
the least memory), its fitting and recipe in `options["synth"]`, from which `Plan.rules`
rebuilds its orders.
"""

from __future__ import annotations

import itertools
import time

from pdcompile.core.cost_graph import CostGraph
from pdcompile.core.errors import PartitionError
from pdcompile.passes.planning.evaluation import simulated
from pdcompile.passes.planning.plan_config import PlanConfig, Planner
from pdcompile.passes.planning.plans import Plan
from pdcompile.scheduling import get_schedule, schedules
from pdcompile.scheduling.synth import OPTION, Fitting, Knobs, Recipe, Split, Synthesised

# the list scheduler's settings tried: I or F first, W's filling every wait or only longer
# ones, forwards held beyond 1F1B's count per stage (None: the budget alone), the budgets as
# given or grown (the simulator says what fits)
KNOBS = tuple(
    Knobs(forward_first=first, fill=fill, cap=cap, scale=scale)
    for scale, cap, first, fill in itertools.product(
        (1.0, 1.5, 2.0), (0, 1, None), (False, True), (0.0, 1.0)
    )
)
# candidates simulated per plan at most: a count, not seconds, so that a plan does not depend
# on the machine's load (schedule="auto" with global_batch_size fits a plan per candidate
# layout and count)
BUDGET = 60


def plan_orders(inner: Planner, cost_graph: CostGraph, config: PlanConfig) -> Plan:
    """With a schedule fitted to each plan (`Synthesised`), `inner`'s plan with its order
    fitted (`fitted_orders`); else `inner`'s plan."""
    if config.auto or not isinstance(config.rules, Synthesised):
        return inner(cost_graph, config)
    return fitted_orders(inner(cost_graph, config), config.rules)


def refinements(plan: Plan) -> list[Plan]:
    """`plan`'s stages under each registered kind that fits its orders to a plan (`synth`),
    fitted; a synchronous `plan` only (none where it cannot run them)."""
    if not plan.rules.synchronous:
        return []
    found = []
    for name in schedules():
        rules = get_schedule(name)
        if isinstance(rules, Synthesised):
            try:
                found.append(fitted_orders(plan.with_(schedule=name), rules))
            except PartitionError:
                continue
    return found


def fitting_of(plan: Plan) -> Fitting:
    """What `plan`'s order is fitted to (the module says how)."""
    stages = plan.stages
    memory = plan.cluster.memory
    budget = {}
    if memory is not None:
        for rank in {r for s in stages for r in s.ranks}:
            fixed = sum(s.weight_bytes for s in stages if rank in s.ranks)
            budget[rank] = max(0.0, memory - fixed)
    return Fitting(
        times=tuple((s.forward_s, s.backward_input_s, s.backward_weight_s) for s in stages),
        message_s=tuple(s.comm_s / 2 for s in stages),
        held=tuple(
            (float(s.activation_bytes), float(s.weight_grad_activation_bytes)) for s in stages
        ),  # fmt: skip
        budget=budget,
    )


def fitted_orders(plan: Plan, rules: Synthesised, budget: int = BUDGET) -> Plan:
    """`plan` under `rules` fitted to it (the module says how), with `options["synth"]`
    recording the fitting, the recipe and the candidates tried.

    Raises:
        PartitionError: no recipe gives an order the plan runs.
    """
    search = _Search(plan, rules, fitting_of(plan), _limits(plan), budget)
    for knobs in KNOBS:
        search.score(knobs)
    if (
        plan.stages
        and all(len(set(s.ranks)) == len(s.ranks) for s in plan.stages)
        and (len({r for s in plan.stages for r in s.ranks}) == sum(s.replicas for s in plan.stages))
    ):  # one stage per rank: the split orders, each stage's warm-up and deferral descended
        search.descend(_zero_bubble(plan))
    return search.best()


def _zero_bubble(plan: Plan) -> Split:
    """ZB-H1's split orders on `plan`'s stages: PipeDream's warm-ups, the deepest less each
    deferred."""
    replicas = [s.replicas for s in plan.stages]
    warmups = tuple((sum(replicas[s:]) - 1) // r for s, r in enumerate(replicas))
    return Split(warmups, tuple(max(warmups) - w for w in warmups))


class _Search:
    """The candidates of one plan, scored by the simulator, the best kept (docs in the
    module)."""

    def __init__(
        self, plan: Plan, rules: Synthesised, fitting: Fitting, limits: list[float], budget: int
    ) -> None:
        self.plan, self.rules, self.fitting, self.limits = plan, rules, fitting, limits
        self.left = budget
        self.start = time.perf_counter()
        self.tried: list[dict] = []
        self.scored: dict[Recipe, tuple] = {}
        self.found: tuple[tuple, Plan] | None = None
        self.failure = ""

    def score(self, recipe: Recipe) -> tuple | None:
        """The key of `recipe`'s simulated plan (lower is better; None: it does not run, or
        the budget is spent), remembered."""
        if recipe in self.scored:
            return self.scored[recipe]
        if self.left <= 0:
            return None
        self.left -= 1
        saved = {"fitting": self.fitting.to_json(), "recipe": recipe.to_json()}
        candidate = self.plan.with_(options={**self.plan.options, OPTION: saved})
        try:
            candidate = simulated(candidate, self.rules.fitted(self.fitting, recipe))
        except PartitionError as exc:
            self.failure = self.failure or str(exc)
            self.scored[recipe] = None
            return None
        peak = max(candidate.rank_memory, default=0)
        within = all(b <= self.limits[r] for r, b in enumerate(candidate.rank_memory))
        key = (0, candidate.step_time, peak) if within else (1, peak, candidate.step_time)
        self.tried.append({**recipe.to_json(), "step_time": candidate.step_time,
                           "peak_memory": peak, "fits_memory": within})  # fmt: skip
        self.scored[recipe] = key
        if self.found is None or key < self.found[0]:
            self.found = key, candidate
        return key

    def descend(self, split: Split) -> None:
        """From `split`, one stage's warm-up or deferral a step up or down at a time, while
        that shortens the step within the limits (warm-ups non-increasing along the stages: a
        larger one after a smaller waits forever)."""
        current = self.score(split)
        improved = current is not None
        while improved:
            improved = False
            for neighbour in _neighbours(split):
                key = self.score(neighbour)
                if key is not None and key < current:
                    split, current, improved = neighbour, key, True
                    break

    def best(self) -> Plan:
        if self.found is None:
            raise PartitionError(f"synth found no order that runs this plan: {self.failure}")
        plan = self.found[1]
        options = {**plan.options, OPTION: {**plan.options[OPTION], "tried": self.tried}}
        seconds = time.perf_counter() - self.start
        return plan.with_(options=options, solve_time_s=self.plan.solve_time_s + seconds)


def _neighbours(split: Split) -> list[Split]:
    """`split` with one stage's warm-up or deferral one more or one less."""
    found = []
    for s in range(len(split.warmups)):
        for step in (1, -1):
            w = list(split.warmups)
            w[s] += step
            if w[s] >= 0 and all(a >= b for a, b in itertools.pairwise(w)):
                found.append(Split(tuple(w), split.defers))
            d = list(split.defers)
            d[s] += step
            if d[s] >= 0:
                found.append(Split(split.warmups, tuple(d)))
    return found


def _limits(plan: Plan) -> list[float]:
    """Per rank, the most memory a fitted order may hold: the cluster's limit, else the peak
    of the kind's own order (`plan`'s, simulated: 1F1B's counts), as ZB-H1 holds on every
    rank what 1F1B holds on the first."""
    memory = plan.cluster.memory
    peak = max(plan.rank_memory, default=0)
    return [memory if memory is not None else peak for _ in plan.rank_memory]
