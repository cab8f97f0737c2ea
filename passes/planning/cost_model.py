"""The cost model: what one pipeline stage costs on a cluster, one formula for every solver.
Torch-free.

A `CostModel` prices a stage from its parts; solvers, `evaluate` and `explain()` call it
instead of writing the formula again. Its methods take floats or numpy arrays alike (the
solvers price many candidate stages at once). The default (`"pdcompile"`) is PipeDream's
(docs/cost_model.md): for stage s with r_s replicas,

    compute_s   = (forward + backward [+ the loss, on the stage holding the output]) / speed
    comm_s      = 2 * cut_s / bandwidth / r_s                 (activations in, gradients out)
    allreduce_s = 2 (r_s - 1) / r_s * grad_bytes / bandwidth / u_s
                  (u_s: microbatches per update of the stage, the schedule's `round_size`)
    update_s    = optimizer_s / speed / u_s                  (one optimizer step per update)
    time_s      = compute_s / r_s + comm_s + allreduce_s + update_s   (nothing overlapped)

A researcher swaps it like a solver: `@register_cost_model("mine")` on a subclass, then
`plan(..., cost_model="mine")`. The solvers price stages through these methods only; the fast
ones (`dp`'s bisection, `cpsat`) read coefficients off them, so a model for those must stay
linear in seconds and bytes and keep the all-reduce's (r - 1) / r shape. Step time and memory
are not priced here: they are simulated from the schedule's actions (`pdcompile.simulate`), the
one set of numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pdcompile.core.cluster import Cluster
from pdcompile.core.errors import PartitionError
from pdcompile.core.registry import Registry
from pdcompile.scheduling import PipelineSchedule, get_schedule


class CostModel:
    """PipeDream's stage cost (the default). Every method accepts floats or numpy arrays."""

    def transfer_s(self, cut_bytes: Any, bandwidth: Any, replicas: Any) -> Any:
        """Seconds per microbatch a stage spends receiving its inputs and sending their
        gradients back over a link of `bandwidth`, shared by its `replicas`."""
        return 2 * cut_bytes / bandwidth / replicas

    def ring_s(self, grad_bytes: Any, replicas: Any, bandwidth: Any) -> Any:
        """Seconds of one ring all-reduce of `grad_bytes` among `replicas` (0 for one)."""
        return 2 * (replicas - 1) / replicas * grad_bytes / bandwidth

    def ring_limit_s(self, grad_bytes: Any, bandwidth: Any) -> Any:
        """`ring_s` as replicas grow (ring_s = (r - 1) / r * this): twice its value for two
        replicas. CP-SAT and the bisection's closed forms take the factor (r - 1) / r apart."""
        return 2 * self.ring_s(grad_bytes, 2, bandwidth)

    def updates_every(self, rules: PipelineSchedule, replicas: int, num_microbatches: int) -> int:
        """Microbatches of a stage with `replicas` per update (and per all-reduce) under the
        schedule `rules`."""
        return rules.round_size((replicas,), 0, num_microbatches)

    def allreduce_s(self, grad_bytes: Any, replicas: Any, bandwidth: Any, every: Any) -> Any:
        """A stage's share of its all-reduce per microbatch: one ring per `every` microbatches
        (`updates_every`)."""
        return self.ring_s(grad_bytes, replicas, bandwidth) / every

    def update_s(self, optimizer_s: Any, every: Any) -> Any:
        """A stage's share of its optimizer step per microbatch: one step of `optimizer_s`
        (every replica steps its own copy, at once) per `every` microbatches."""
        return optimizer_s / every

    def stage_time(
        self, compute_s: Any, replicas: Any, comm_s: Any, allreduce_s: Any, update_s: Any = 0.0
    ) -> Any:
        """Steady-state seconds per microbatch of a stage: its compute shared by its replicas,
        plus its transfers, its share of the all-reduce and of the optimizer step
        (`update_s`; the solvers leave it out: docs/cost_model.md)."""
        return compute_s / replicas + comm_s + allreduce_s + update_s

    def data_parallel_time(
        self,
        compute_s: Any,
        grad_bytes: Any,
        replicas: Any,
        bandwidth: Any,
        every: Any,
        optimizer_s: Any = 0.0,
    ) -> Any:
        """`stage_time` of the whole model as one stage on `replicas` (no transfers)."""
        allreduce = self.allreduce_s(grad_bytes, replicas, bandwidth, every)
        return self.stage_time(
            compute_s, replicas, 0.0, allreduce, self.update_s(optimizer_s, every)
        )


COST_MODELS: Registry[CostModel] = Registry(
    "cost model", (), PartitionError, package="pdcompile.passes.planning.cost_models"
)
COST_MODELS.add("pdcompile", CostModel())


def register_cost_model(name: str) -> Callable[[type[CostModel]], type[CostModel]]:
    """Register a `CostModel` subclass under `name`."""

    def decorate(cls: type[CostModel]) -> type[CostModel]:
        COST_MODELS.add(name, cls())
        return cls

    return decorate


def cost_models() -> list[str]:
    """Registered cost model names."""
    return list(COST_MODELS)


def get_cost_model(name: str | CostModel = "pdcompile") -> CostModel:
    """The registered cost model called `name` (a CostModel is returned as it is)."""
    return name if isinstance(name, CostModel) else COST_MODELS.get(name)


@dataclass(frozen=True)
class Pricing:
    """What a solver prices candidate stages with: the cluster, the schedule's rules, the cost
    model and the microbatches it searches with. Unpacks in that order."""

    cluster: Cluster
    rules: PipelineSchedule
    prices: CostModel
    microbatches: int

    @classmethod
    def of(cls, cluster: Cluster, options: dict[str, Any]) -> Pricing:
        """From a solver's `options` (`schedule`, `num_microbatches`, optional `cost_model`).

        `plan()` hands solvers a `Cluster` and a `PipelineSchedule`, resolved once; spellings
        (a cluster's text, a schedule's name) are resolved here for a solver called directly.
        """
        rules = options["schedule"]
        if not isinstance(rules, PipelineSchedule):
            rules = get_schedule(rules)
        if not isinstance(cluster, Cluster):
            cluster = Cluster.coerce(cluster)
        prices = get_cost_model(options.get("cost_model", "pdcompile"))
        return cls(cluster, rules, prices, options["num_microbatches"])

    def __iter__(self) -> Iterator[Any]:
        return iter((self.cluster, self.rules, self.prices, self.microbatches))
