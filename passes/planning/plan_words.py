"""A plan in plain words: the sentence `str(plan)` and `explain()` open with. Torch-free.

`describe(plan)` says what the plan is (data parallelism, a pipeline of how many stages over
how many ranks), how it compares with data parallelism, and, for a data-parallel plan, why a
pipeline lost and how to get one anyway. It reads what `evaluation.price` records in
`plan.options`: the model's largest node (`LARGEST`) and, for a plan of one stage on several
ranks, the pipeline it was compared with (`ALTERNATIVE`: one stage per rank balanced by time,
the `blocks` solver's plan). `step_warning` is `explain()`'s check of measured against
predicted step times.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pdcompile.core.text import human_seconds

if TYPE_CHECKING:
    from pdcompile.core.cost_graph import CostGraph
    from pdcompile.passes.planning.plans import Plan

LARGEST = "largest_node"  # plan.options: [node, seconds of its forward + backward per microbatch]
ALTERNATIVE = "pipeline_alternative"  # plan.options, data-parallel plans: the pipeline it beat
BOUNDING = 0.9  # the largest node bounds a stage holding at least this share of its compute
MISMATCH = 1.5  # explain() warns when measured and predicted steps differ by more than this
FORCE = (  # the solvers that cut one stage per rank, whatever it costs: blocks, uniform, params
    "to pipeline anyway: compile(..., solver='blocks') or `pdcompile plan MODEL --cluster "
    "{cluster} --solver blocks` (one stage per rank, balanced by time)"
)


def largest_of(plan: Plan) -> tuple[str, float] | None:
    """`options[LARGEST]` as (node, seconds); None when absent or malformed (an edited file)."""
    value = plan.options.get(LARGEST)
    if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], str):
        if _number(value[1]):
            return value[0], float(value[1])
    return None


def alternative_of(plan: Plan) -> dict[str, Any] | None:
    """`options[ALTERNATIVE]`; None when absent or malformed (an edited file)."""
    value = plan.options.get(ALTERNATIVE)
    keys = ("num_stages", "predicted_time", "bottleneck", "compute_s", "comm_s", "other_s")
    if isinstance(value, Mapping) and all(_number(value.get(k)) for k in keys):
        return dict(value)
    return None


def _number(value: Any) -> bool:
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        and value >= 0
    )  # fmt: skip


def largest_node(cost_graph: CostGraph) -> list[Any] | None:
    """`[name, seconds]` of the node with the most forward + backward time (None: no node)."""
    best = max(
        cost_graph.graph.nodes(data=True),
        key=lambda item: item[1]["forward_s"] + item[1]["backward_s"],
        default=None,
    )
    return None if best is None else [best[0], best[1]["forward_s"] + best[1]["backward_s"]]


def pipeline_alternative(plan: Plan, cost_graph: CostGraph) -> dict[str, Any] | None:
    """For a plan of one stage on several ranks: the pipeline of one stage per rank balanced by
    time (`blocks`), priced on the same cluster, schedule and microbatches, as the parts of its
    bottleneck stage (compute, transfers, the rest: all-reduce and optimizer step per
    microbatch); None when there is no such pipeline (one rank, one node, a schedule that
    refuses it)."""
    from pdcompile.core.errors import PartitionError
    from pdcompile.passes.planning.solver_kit import SOLVERS

    blocks = SOLVERS.get("blocks")

    if plan.num_stages != 1 or plan.stages[0].replicas < 2:  # (blocks' plans: no recursion)
        return None
    options = {"schedule": plan.schedule, "num_microbatches": plan.num_microbatches}
    if "cost_model" in plan.options:
        options["cost_model"] = plan.options["cost_model"]
    try:
        other = blocks(cost_graph, plan.cluster, options)
    except PartitionError:
        return None
    if other.num_stages < 2:
        return None
    b = max(other.stages, key=lambda s: s.time_s)
    compute = (b.forward_s + b.backward_s) / b.replicas
    return {
        "num_stages": other.num_stages,
        "predicted_time": other.predicted_time,
        "bottleneck": b.index,
        "compute_s": compute,
        "comm_s": b.comm_s,
        "other_s": max(0.0, b.time_s - compute - b.comm_s),
    }


def describe(plan: Plan) -> str:
    """One sentence: what `plan` is, against data parallelism, and why.

    Example (a data-parallel plan):
        data parallelism on 4 ranks: a pipeline of 4 stages (one per rank, balanced by time)
        was predicted 12% slower, because moving the activations between stages (3.10 ms per
        microbatch into stage 2) costs more than the all-reduce (1.20 ms per microbatch); to
        pipeline anyway: compile(..., solver='blocks') or `pdcompile plan MODEL --cluster
        4@10GB/s --solver blocks` (one stage per rank, balanced by time)
    """
    if not plan.stages:
        return "an empty plan (no stages)"
    ranks = plan.num_devices_used
    devices = plan.cluster.num_devices
    over = f"{ranks} rank{'s' * (ranks != 1)}"
    if ranks != devices:
        over = f"{ranks} of {devices} ranks"
    if plan.num_stages == 1:
        return _one_stage(plan, over)
    stages_of_rank: dict[int, int] = {}
    for s in plan.stages:
        for r in s.ranks:
            stages_of_rank[r] = stages_of_rank.get(r, 0) + 1
    what = f"a pipeline of {plan.num_stages} stages over {over}"
    notes = [f"stage {s.index} replicated on {s.replicas}" for s in plan.stages if s.replicas > 1]
    if max(stages_of_rank.values(), default=1) > 1:
        notes.append(f"{max(stages_of_rank.values())} stages per rank")
    if notes:
        what += f" ({', '.join(notes)})"
    text = what + _against_data_parallel(plan)
    bound = _bounding_node(plan)
    return text + (f"; {bound}" if bound else "")


def _one_stage(plan: Plan, over: str) -> str:
    stage = plan.stages[0]
    if stage.replicas == 1:
        devices = plan.cluster.num_devices
        where = "one rank" if devices == 1 else f"one of {devices} ranks"
        return f"the whole model on {where}: no pipeline, no data parallelism" + (
            _against_data_parallel(plan) if devices > 1 else ""
        )
    text = f"data parallelism on {over}"
    other = alternative_of(plan)
    if not other or not plan.predicted_time:
        return f"{text}; {FORCE.format(cluster=plan.cluster)}"
    change = other["predicted_time"] / plan.predicted_time - 1
    pipeline = f"a pipeline of {other['num_stages']:g} stages (one per rank, balanced by time)"
    force = FORCE.format(cluster=plan.cluster)
    if change <= 0:  # not what the plan was chosen against (other rows, another solver, by hand)
        force = force.replace(" anyway", "")
        return f"{text}, though {pipeline} is predicted {-change:.0%} faster here; {force}"
    slower = f"{change + 1:.1f}x slower" if change >= 1 else f"{change:.0%} slower"
    return f"{text}: {pipeline} was predicted {slower}, because {_why(plan)}; {force}"


def _why(plan: Plan) -> str:
    """The main reason the pipeline of `ALTERNATIVE` is slower than the data-parallel plan."""
    other = alternative_of(plan)
    assert other is not None  # _one_stage checked it
    stage = plan.stages[0]
    compute = (stage.forward_s + stage.backward_s) / stage.replicas
    imbalance = other["compute_s"] - compute
    largest = largest_of(plan)
    if other["comm_s"] >= imbalance:
        return (
            f"moving the activations between stages ({human_seconds(other['comm_s'])} per "
            f"microbatch into stage {other['bottleneck']}) costs more than the all-reduce "
            f"({human_seconds(stage.allreduce_s)} per microbatch)"
        )
    if largest and largest[1] >= BOUNDING * other["compute_s"]:
        return (
            f"the model's largest node, {largest[0]} ({human_seconds(largest[1])} per "
            f"microbatch), bounds every stage, while data parallelism splits all the compute "
            f"{stage.replicas} ways ({human_seconds(compute)} per rank)"
        )
    return (
        f"the stages cannot be balanced: the slowest computes {human_seconds(other['compute_s'])} "
        f"per microbatch against {human_seconds(compute)} per rank under data parallelism, a "
        f"loss larger than the all-reduce a pipeline saves ({human_seconds(stage.allreduce_s)} "
        "per microbatch)"
    )


def _against_data_parallel(plan: Plan) -> str:
    if not plan.data_parallel_time or not plan.predicted_time:
        return ""
    speedup = plan.speedup_over_data_parallel
    if speedup >= 1:
        return f", predicted {speedup:.2f}x faster than data parallelism on this cluster"
    return f", predicted {1 / speedup - 1:.0%} slower than data parallelism on this cluster"


def _bounding_node(plan: Plan) -> str:
    """What to say when the largest node is (nearly) all of the bottleneck stage's compute."""
    largest = largest_of(plan)
    if not largest:
        return ""
    b = max(plan.stages, key=lambda s: s.time_s)
    if largest[0] not in b.nodes:
        return ""
    compute = b.forward_s + b.backward_s
    if compute <= 0 or largest[1] < BOUNDING * compute:
        return ""
    return (
        f"the model's largest node, {largest[0]} ({human_seconds(largest[1])} per microbatch), "
        f"is {largest[1] / compute:.0%} of the bottleneck stage {b.index}'s compute and bounds "
        "the pipeline: no cut can split it"
    )


def step_warning(predicted_s: float, measured_s: float) -> str:
    """`explain()`'s warning when the measured step differs from the predicted one by more than
    `MISMATCH` either way ("" otherwise)."""
    if predicted_s <= 0 or measured_s <= 0:
        return ""
    ratio = measured_s / predicted_s
    if 1 / MISMATCH <= ratio <= MISMATCH:
        return ""
    how = "slower" if ratio > 1 else "faster"
    return (
        f"WARNING: the measured step ({human_seconds(measured_s)}) is {max(ratio, 1 / ratio):.1f}x "
        f"{how} than predicted ({human_seconds(predicted_s)}): the plan was chosen on costs "
        "that do not match this machine; recalibrate the cluster's runtime costs "
        "(`pdcompile calibrate`), profile the model again (`pdcompile profile`, or compile "
        "with profile=True), or compile with replan=True to re-plan on the measured stage times"
    )
