"""The schedule simulator against closed forms, hand-computed transfers and runtime costs, and the
local executor."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch
from pipeline_support import mlp_case, program_for

import pdcompile
from pdcompile import Cluster, CostGraph, PartitionError, Plan, Stage, simulate
from pdcompile.core.cluster import RuntimeCosts
from pdcompile.passes.planning.plans import consecutive_ranks
from pdcompile.passes.planning.timeline import load_trace
from pdcompile.pictures.gantt import plot_simulation
from pdcompile.runtime.local import LocalPipeline
from pdcompile.scheduling import get_schedule

F, B = 1.0, 2.0  # seconds per microbatch of every stage
ACT, PARAM, WEIGHT = 100, 10, 30  # bytes per stage
FAST = 1e30  # bytes/s: transfers take no time


def equal_plan(
    replicas: list[int],
    *,
    cluster: Cluster | None = None,
    size: int = 1000,
    grad_bytes: int = PARAM,
    tensors: int = 0,
) -> Plan:
    """Stages of equal cost, each receiving `size` bytes per microbatch from the one before."""
    ranks = consecutive_ranks(replicas)
    stages = tuple(
        Stage(
            index=i, nodes=(f"n{i}",), replicas=r, ranks=ranks[i], forward_s=F, backward_s=B,
            recv_bytes=((i - 1, size),) if i else (), activation_bytes=ACT, param_bytes=PARAM,
            grad_bytes=grad_bytes, weight_bytes=WEIGHT, param_tensors=tensors,
        )
        for i, r in enumerate(replicas)
    )  # fmt: skip
    return Plan(stages=stages, cluster=cluster or Cluster([(sum(replicas), FAST)]))


def in_flight(sim, rank: int) -> int:
    """The most activations a rank held at once, from its memory timeline."""
    base = sim.memory[rank][0][1]
    return max((used - base) // ACT for _, used in sim.memory[rank])


SHAPES = [(2, 4), (3, 5), (4, 4), (4, 16), (8, 8)]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "m"), SHAPES)
def test_synchronous_bubble_is_the_closed_form(kind, stages, m):
    sim = simulate(equal_plan([1] * stages), schedule=kind, num_microbatches=m)
    assert sim.time_per_step == pytest.approx((m + stages - 1) * (F + B), rel=1e-12)
    expected = (stages - 1) / (m + stages - 1)
    assert sim.bubble_fraction == pytest.approx([expected] * stages, rel=1e-12)


@pytest.mark.parametrize(("stages", "m"), SHAPES)
def test_in_flight_activations_and_versions(stages, m):
    plan = equal_plan([1] * stages)
    gpipe = simulate(plan, schedule="gpipe", num_microbatches=m)
    one = simulate(plan, schedule="1f1b", num_microbatches=m)
    two = simulate(plan, schedule="2bw", num_microbatches=m)
    dream = simulate(plan, schedule="pipedream", num_microbatches=m)
    grads = PARAM  # held from a stage's first backward to its update
    for s in range(stages):
        assert in_flight(gpipe, s) == m
        # gpipe: every forward before the first backward, so before the gradients
        assert gpipe.schedule_memory[s] == WEIGHT - grads + m * ACT
        held = min(stages - s, m)
        assert in_flight(one, s) == held
        # 1f1b holds as many again after its first backward where a forward follows it
        after = held if m > held else held - 1
        assert one.schedule_memory[s] == max(WEIGHT - grads + held * ACT, WEIGHT + after * ACT)
        # two copies: the weights this step computes on and those the next one will
        copies = 2 if s < stages - 1 else 1
        assert two.schedule_memory[s] == WEIGHT + copies * PARAM + held * ACT
        # pipedream: w_s + 1 microbatches in flight, each on its own stashed version, at a
        # forward after the update that freed the gradients
        assert dream.schedule_memory[s] == WEIGHT - grads + (stages - s) * (ACT + PARAM)
    # everything released at the end, the gradients by the update
    assert [m for _, m in one.memory[0]][-1] == WEIGHT - grads + one.message_memory[0]


@pytest.mark.parametrize("kind", ["pipedream", "2bw"])
@pytest.mark.parametrize(("stages", "m"), SHAPES)
def test_streaming_bubble_is_only_the_refill_after_each_call(kind, stages, m):
    """Each `train_step` ends with the loss all-reduce, after which the forwards refill the
    pipeline: (S - 1) forwards per call, so the bubble vanishes as calls grow."""
    sim = simulate(equal_plan([1] * stages), schedule=kind, num_microbatches=m)
    refill = (stages - 1) * F
    assert sim.time_per_step == pytest.approx(m * (F + B) + refill, rel=1e-12)
    assert sim.bubble_fraction == pytest.approx([refill / sim.time_per_step] * stages)
    assert sim.bubble_fraction[0] < (stages - 1) / (m + stages - 1)  # 1f1b's


def test_pipedream_bubble_vanishes_as_calls_grow():
    bubbles = [
        simulate(equal_plan([1] * 4), schedule="pipedream", num_microbatches=m).bubble_fraction[0]
        for m in (8, 32, 128)
    ]
    assert bubbles == sorted(bubbles, reverse=True)
    assert bubbles[-1] < 0.01


@pytest.mark.parametrize(
    ("kind", "replicas", "m"),
    [("pipedream", [1] * 8, 2), ("pipedream", [4, 1, 1], 4), ("2bw", [1] * 8, 8),
     ("2bw", [2, 1, 1], 4)],
)  # fmt: skip
def test_streaming_time_per_step_is_that_of_a_steady_call(kind, replicas, m, monkeypatch):
    """Unequal stages, weight copies that cost time: the first calls still fill the pipeline
    (and `2bw` computes on the first weights twice); the one measured is steady."""
    plan = equal_plan(replicas, cluster=Cluster([(sum(replicas), FAST)], runtime=COSTS))
    plan = plan.with_(stages=tuple(
        dataclasses.replace(s, forward_s=1 + s.index % 3 / 2, backward_s=2 + s.index % 2,
                            param_tensors=TENSORS)
        for s in plan.stages
    ))  # fmt: skip
    calls = get_schedule(kind).steady_calls(replicas, m)

    def step(count: int) -> float:
        monkeypatch.setattr(type(get_schedule(kind)), "steady_calls", lambda *_: count)
        return simulate(plan, schedule=kind, num_microbatches=m).time_per_step

    assert step(calls) == pytest.approx(step(calls + 2))
    assert step(1) != pytest.approx(step(calls))


def test_transfers_take_bytes_over_bandwidth():
    size, bandwidth = 4000, 1000.0  # 4 s per message
    slow = simulate(equal_plan([1, 1], cluster=Cluster([(2, bandwidth)]), size=size),
                    schedule="1f1b", num_microbatches=1)  # fmt: skip
    # F0, activations over, F1, B1, gradients back, B0
    assert slow.time_per_step == pytest.approx(2 * (F + B) + 2 * size / bandwidth)
    recv = [e for e in slow.timeline if e.kind == "recv" and e.rank == 1]
    assert (recv[0].start, recv[0].end) == pytest.approx((0.0, F + size / bandwidth))


def test_a_shared_link_is_slower_than_separate_links():
    """Two replicas send at once from one server to another: over one inter-server link they
    get half its bandwidth each; on a flat cluster each pair of ranks has its own link."""
    size, slow = 2000, 1000.0
    shared = Cluster([(2, FAST), (2, slow)])  # ranks 0, 1 on one server, 2, 3 on the other
    flat = Cluster([(4, slow)])
    times = {}
    for name, cluster in (("shared", shared), ("flat", flat)):
        plan = equal_plan([2, 2], cluster=cluster, size=size, grad_bytes=0)
        times[name] = simulate(plan, schedule="1f1b", num_microbatches=2).time_per_step
    assert times["flat"] == pytest.approx(2 * (F + B) + 2 * size / slow)
    assert times["shared"] == pytest.approx(times["flat"] + 2 * size / slow)


def test_replicated_stage_averages_with_a_ring_allreduce():
    bandwidth = 1000.0
    plan = equal_plan([2, 1], cluster=Cluster([(3, bandwidth)]), size=0, grad_bytes=500)
    sim = simulate(plan, schedule="1f1b", num_microbatches=4)
    reduce = [e for e in sim.timeline if e.kind == "allreduce"]
    assert sorted(e.rank for e in reduce) == [0, 1]
    ring = 2 * (2 - 1) / 2 * 500 / bandwidth
    # the reduction starts when both replicas are halfway through their last backward
    # (pdcompile/scheduling/reduce_overlap.py), and the action ends at the later of its start and
    # its end
    halfway = max((e.start + e.end) / 2 for e in sim.timeline if e.rank in (0, 1)
                  and e.kind == "B" and e.microbatch in (2, 3))  # fmt: skip
    expected = max(max(e.start for e in reduce), halfway + ring)
    assert {round(e.end, 9) for e in reduce} == {round(expected, 9)}
    busy = [sum(e.duration for e in sim.timeline if e.rank == r and e.kind in "FB")
            for r in range(3)]  # fmt: skip
    assert busy == pytest.approx([2 * (F + B), 2 * (F + B), 4 * (F + B)])
    dream = simulate(plan, schedule="pipedream", num_microbatches=4)
    assert {e.rank for e in dream.timeline if e.kind == "allreduce"} == {0, 1}


def test_faster_devices_shorten_compute():
    plan = equal_plan([1, 1])
    quick = Cluster([(2, FAST)], speed=[2.0, 2.0])
    base = simulate(plan, schedule="gpipe", num_microbatches=4).time_per_step
    assert simulate(plan, schedule="gpipe", num_microbatches=4, cluster=quick).time_per_step == (
        pytest.approx(base / 2)
    )


@functools.cache
def mlp_program(replicas: tuple[int, ...]):
    """The zoo MLP's program cut for `replicas`, and its analytic costs (built once)."""
    model, x, _, _ = mlp_case()
    costs = pdcompile.analyze(pdcompile.trace(model, (x,)), (x,), profile=False)
    return program_for(model, x, list(replicas)), costs


def _ordered(events) -> dict[int, list[tuple]]:
    by_rank: dict[int, list[tuple]] = {}
    for e in events:  # each rank's events are recorded in the order it ran them
        by_rank.setdefault(e.rank, []).append((e.kind, e.microbatch, e.peer))
    return by_rank


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "2bw", "pipedream"])
@pytest.mark.parametrize("replicas", [[1, 1, 1], [2, 1]], ids=["straight", "2-1"])
def test_simulated_order_is_what_the_local_executor_runs(kind, replicas):
    _, x, y, loss_fn = mlp_case()
    program, costs = mlp_program(tuple(replicas))
    m = 4
    plan = pdcompile.evaluate(program.plan, costs, schedule=kind, num_microbatches=m)
    sim = simulate(plan)
    pipeline = LocalPipeline(program, schedule=kind, num_microbatches=m, loss_fn=loss_fn,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.01))  # fmt: skip
    for worker in pipeline.workers.values():
        worker.timeline = []
    rules = get_schedule(kind)
    calls = rules.steady_calls(replicas, m) if rules.streaming else 1
    for _ in range(calls):
        pipeline.train_step((x,), y)
    measured = _ordered(e for w in pipeline.workers.values() for e in w.timeline)
    assert _ordered(sim.timeline) == measured
    assert sum(len(v) for v in measured.values()) == len(sim.timeline)


def test_plan_json_keeps_the_byte_counts_and_old_plans_ask_to_be_rescored(tmp_path):
    program, costs = mlp_program((1, 1))
    plan = pdcompile.evaluate(program.plan, costs)
    assert plan.stages[1].recv_bytes == ((0, 12 * 64 * 4),)  # the MLP's 64 features, float32
    assert all(s.activation_bytes and s.weight_bytes and s.param_bytes for s in plan.stages)
    assert Plan.from_json(plan.to_json()) == plan
    old = json.loads(plan.to_json())
    del old["rank_memory"]  # written since the simulator gives the memory
    for stage in old["stages"]:
        for field in ("recv_bytes", "activation_bytes", "param_bytes", "grad_bytes",
                      "weight_bytes"):  # fmt: skip
            del stage[field]
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = Plan.load(tmp_path / "old.json")
    assert loaded.stages[1].forward_s == plan.stages[1].forward_s
    with pytest.raises(PartitionError, match="re-score it with pdcompile.evaluate"):
        simulate(loaded)


def test_too_small_a_cluster_is_refused():
    with pytest.raises(PartitionError, match="ranks up to 2 but cluster 2@"):
        simulate(equal_plan([1, 1, 1]), cluster=Cluster([(2, FAST)]))


def test_chrome_trace_and_plot(tmp_path):
    sim = simulate(equal_plan([1, 1]), schedule="1f1b", num_microbatches=3)
    sim.to_chrome_trace(tmp_path / "sim.json")
    assert load_trace(tmp_path / "sim.json") == sim.timeline
    plot_simulation(sim, tmp_path / "sim.png")
    assert (tmp_path / "sim.png").stat().st_size > 1000


# -- latency, the runtime's own costs, ties ---------------------------------------------------

COSTS = RuntimeCosts(memory_bandwidth=1000.0, tensor_s=0.01, message_s=0.1)  # bytes/s, s, s
TENSORS = 3
COPY = 2 * PARAM / 1000.0 + TENSORS * 0.01  # a weight copy: 2 P / B + n t
STEP = (2 * WEIGHT - PARAM) / 1000.0 + TENSORS * 0.01  # (2 W - G) / B + n t
ADD = 3 * PARAM / 1000.0 + TENSORS * 0.01  # gradients added to those held: 3 G / C + n t
SWAP = MOVE = TENSORS * 0.01  # a forward on a copy swaps its tensors in; its gradients move
RELOAD = PARAM / 1000.0  # a forward after a backward reads the weights from memory again: P / B


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_latency_adds_once_per_message_on_the_critical_path(stages):
    """One microbatch: 2 (S - 1) messages in a row (activations down, gradients back); the
    last stage's loss message reaches stage 0 while that computes its backward."""
    alpha = 0.25
    plan = equal_plan([1] * stages, cluster=Cluster([(stages, FAST, alpha)]))
    sim = simulate(plan, schedule="1f1b", num_microbatches=1)
    messages = 2 * (stages - 1)
    assert sim.time_per_step == pytest.approx(stages * (F + B) + messages * alpha)
    recv = next(e for e in sim.timeline if e.kind == "recv" and e.rank == 1)
    assert recv.end == pytest.approx(F + alpha)


def test_latency_and_bandwidth_add_up():
    size, bandwidth, alpha = 4000, 1000.0, 0.5
    plan = equal_plan([1, 1], cluster=Cluster([(2, bandwidth, alpha)]), size=size)
    sim = simulate(plan, schedule="gpipe", num_microbatches=1)
    # the loss message reaches rank 0 during its backward
    assert sim.time_per_step == pytest.approx(2 * (F + B) + 2 * (size / bandwidth + alpha))


def test_sends_receives_and_steps_cost_what_the_formulas_say():
    """One microbatch over two stages: F0, send (pack + post), recv, F1, B1, send, recv, B0,
    step on rank 0, then the receive of the loss message rank 1 posted after its step (off the
    critical path)."""
    size = 100
    plan = equal_plan([1, 1], cluster=Cluster([(2, FAST)], runtime=COSTS), size=size,
                      tensors=TENSORS)  # fmt: skip
    sim = simulate(plan, schedule="1f1b", num_microbatches=1)
    send, recv = 0.1 + 2 * size / 1000.0, 0.1
    assert sim.time_per_step == pytest.approx(2 * (F + B) + 2 * send + 3 * recv + STEP)
    durations = {(e.rank, e.kind): e.duration for e in sim.timeline}
    assert durations[(0, "send")] == pytest.approx(send)
    arrival = next(e for e in sim.timeline if e.kind == "recv" and e.rank == 1)
    assert arrival.end == pytest.approx(F + send + recv)  # waited from 0, then unpacked
    assert durations[(0, "step")] == durations[(1, "step")] == pytest.approx(STEP)


def test_a_send_can_cost_other_than_a_receive():
    size, runtime = 100, RuntimeCosts(memory_bandwidth=1000.0, message_s=0.1, send_s=0.25)
    plan = equal_plan([1, 1], cluster=Cluster([(2, FAST)], runtime=runtime), size=size)
    sim = simulate(plan, schedule="1f1b", num_microbatches=1)
    durations = {(e.rank, e.kind): e.duration for e in sim.timeline}
    assert durations[(0, "send")] == pytest.approx(0.25 + 2 * size / 1000.0)
    arrival = next(e for e in sim.timeline if e.kind == "recv" and e.rank == 1)
    assert arrival.end == pytest.approx(F + durations[(0, "send")] + 0.1)
    with pytest.raises(PartitionError, match="send_s"):
        RuntimeCosts(send_s=-1.0)


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        # the first backward's gradients are autograd's own; GPipe's forwards follow forwards
        ("gpipe", 3 * ADD + STEP),
        ("1f1b", 3 * ADD + STEP + 3 * RELOAD),  # F0 B0 F1 B1 ...: 3 forwards after a backward
        # the step's weights kept for the next one, gradients moved to the live weights; the
        # call's first forward follows the last call's backward
        ("2bw", 4 * SWAP + 3 * ADD + MOVE + COPY + STEP + 4 * RELOAD),
        ("pipedream", 4 * (COPY + SWAP + MOVE + STEP + RELOAD)),  # per minibatch: its version
    ],
)
def test_gradients_copies_and_steps_of_one_stage(kind, extra):
    m = 4
    plan = equal_plan([1], cluster=Cluster([(1, FAST)], runtime=COSTS), tensors=TENSORS)
    sim = simulate(plan, schedule=kind, num_microbatches=m)
    assert sim.time_per_step == pytest.approx(m * (F + B) + extra)


def test_replica_allreduce_is_a_ring_with_latency_and_flattening():
    grad, bandwidth, alpha, fixed = 500, 1000.0, 0.05, 0.3
    runtime = RuntimeCosts(1000.0, 0.01, collective_s=fixed)
    cluster = Cluster([(3, bandwidth, alpha)], runtime=runtime)
    plan = equal_plan([2, 1], cluster=cluster, size=0, grad_bytes=grad, tensors=TENSORS)
    ring = 2 * alpha + fixed + 2 * (1 / 2) * grad / bandwidth + 4 * grad / 1000.0 + TENSORS * 0.01
    # the backend's own bound: the slower of it and the link moves the bytes
    for bound, moved in ((None, bandwidth), (100.0, 100.0), (5000.0, bandwidth)):
        slowed = dataclasses.replace(runtime, collective_bandwidth=bound) if bound else runtime
        bounded = plan.with_(cluster=Cluster([(3, bandwidth, alpha)], runtime=slowed))
        timeline = simulate(bounded, num_microbatches=4).timeline
        reduce = [e for e in timeline if e.kind == "allreduce"]
        assert sorted(e.rank for e in reduce) == [0, 1]
        # started when both replicas are halfway through their last backward (reduce_overlap.py)
        halfway = max((e.start + e.end) / 2 for e in timeline
                      if e.rank in (0, 1) and e.kind == "B" and e.microbatch in (2, 3))  # fmt: skip
        seconds = ring - grad / bandwidth + grad / moved
        expected = max(max(e.start for e in reduce), halfway + seconds)
        assert [e.end for e in reduce] == pytest.approx([expected] * 2)
    with pytest.raises(PartitionError, match="collective_bandwidth must be a positive number"):
        RuntimeCosts(collective_bandwidth=0.0)


def test_ties_add_an_allreduce_between_the_tied_stages():
    bandwidth, tied = 1000.0, 400
    plan = equal_plan([1, 1, 1], cluster=Cluster([(3, bandwidth)]), size=0)
    with_tie = plan.with_(ties=(((0, 2), tied),))
    sim = simulate(with_tie, schedule="1f1b", num_microbatches=2)
    reduce = [e for e in sim.timeline if e.kind == "allreduce"]
    assert sorted(e.rank for e in reduce) == [0, 2]
    ring = 2 * (1 / 2) * tied / bandwidth
    assert [e.end for e in reduce] == pytest.approx([max(e.start for e in reduce) + ring] * 2)
    assert simulate(plan, schedule="1f1b", num_microbatches=2).timeline != sim.timeline
    # pipedream: stage 0 waits for stage 2's gradients of the tied tensor at every update
    free = simulate(plan, schedule="pipedream", num_microbatches=4).time_per_step
    assert simulate(with_tie, schedule="pipedream", num_microbatches=4).time_per_step > free


def test_a_tie_naming_a_missing_stage_is_refused():
    plan = equal_plan([1, 1]).with_(ties=(((0, 5), 10),))
    with pytest.raises(PartitionError, match="tie group \\[0, 5\\]"):
        simulate(plan)


def test_evaluate_reads_ties_and_tensor_counts_from_the_cost_graph():
    costs = CostGraph(batch_size=1, meta={
        "param_tensors": {"b": 2, "c": 1, "d": 1},
        "ties": [{"nodes": ["b", "d"], "grad_bytes": 400}, {"nodes": ["c", "c2"], "grad_bytes": 8}],
    })  # fmt: skip
    costs.add_node("a", kind="input")
    for node in ("b", "c", "c2", "d"):
        costs.add_node(node, forward_s=1.0, backward_s=2.0, param_bytes=100, grad_bytes=100)
    for u, v in (("a", "b"), ("b", "c"), ("c", "c2"), ("c2", "d")):
        costs.add_edge(u, v, bytes=8)
    groups = [("a", "b"), ("c", "c2"), ("d",)]
    ranks = consecutive_ranks([1, 1, 1])
    plan = Plan(
        stages=tuple(Stage(i, g, 1, ranks[i]) for i, g in enumerate(groups)),
        cluster=Cluster([(3, FAST)]),
    )
    scored = pdcompile.evaluate(plan, costs)
    assert scored.ties == (((0, 2), 400),)  # c and c2 share a stage: no tie
    assert [s.param_tensors for s in scored.stages] == [2, 1, 2]  # stage 2 holds a copy
    broken = CostGraph(costs.graph, costs.batch_size, {**costs.meta, "ties": [{"nodes": "b"}]})
    with pytest.raises(PartitionError, match="malformed 'param_tensors' .* or 'ties'"):
        pdcompile.evaluate(plan, broken)


@functools.cache
def gpt_program(replicas: tuple[int, ...]):
    """pipeline_support's GPT (its embedding tied to the head) cut for `replicas`."""
    from pipeline_support import gpt_case

    model, x, _, _ = gpt_case()
    costs = pdcompile.analyze(pdcompile.trace(model, (x,)), (x,), profile=False)
    return program_for(model, x, list(replicas)), costs


@pytest.mark.parametrize("kind", ["1f1b", "pipedream"])
def test_ties_are_the_runtimes(kind):
    """The plan learns the GPT's tie from its CostGraph; the simulated order, tie all-reduces
    included, is the one the local executor runs."""
    from pipeline_support import gpt_case

    _, x, y, loss_fn = gpt_case()
    program, costs = gpt_program((1, 1))
    plan = pdcompile.evaluate(program.plan, costs, schedule=kind, num_microbatches=4)
    assert [stages for stages, _ in plan.ties] == [t.stages for t in program.ties] == [(0, 1)]
    assert plan.stages[1].param_tensors == sum(1 for _ in program.stages[1].parameters())
    sim = simulate(plan)
    pipeline = LocalPipeline(program, schedule=kind, num_microbatches=4, loss_fn=loss_fn,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.01))  # fmt: skip
    for worker in pipeline.workers.values():
        worker.timeline = []
    for _ in range(get_schedule(kind).steady_calls([1, 1], 4) if kind == "pipedream" else 1):
        pipeline.train_step((x,), y)
    measured = _ordered(e for w in pipeline.workers.values() for e in w.timeline)
    assert _ordered(sim.timeline) == measured
    assert any(kind == "allreduce" for kind, _, _ in measured[0])


def test_clusters_with_latency_and_runtime_costs_round_trip():
    cluster = Cluster.parse("8@300GB/s+2us,4@25Gbit/s+15us", runtime=COSTS)
    assert [lv.latency for lv in cluster.levels] == [2e-6, 15e-6]
    assert cluster.latency(0, 7) == 2e-6 and cluster.latency(7, 8) == 15e-6
    assert str(cluster) == "8@300GB/s+2us,4@3.125GB/s+15us"
    assert Cluster.parse(str(cluster), runtime=COSTS) == cluster
    assert Cluster.from_json(cluster.to_json()) == cluster
    assert Cluster.parse("2@1e+9B/s").levels[0].bandwidth == 1e9  # an exponent, not a latency
    old = {"levels": [[2, 1e9]], "memory": None, "speed": None}  # written before latencies
    assert Cluster.from_dict(old) == Cluster([(2, 1e9)])
    assert Cluster.from_dict(old).runtime == RuntimeCosts()
    for bad in ("2@1GB/s+5 parsecs", "2@1GB/s+-3us"):
        with pytest.raises(PartitionError, match="cannot read latency"):
            Cluster.parse(bad)
    with pytest.raises(PartitionError, match="tensor_s must be a number of seconds >= 0"):
        RuntimeCosts(tensor_s=-1.0)
    with pytest.raises(PartitionError, match="cache_bandwidth must be a positive number"):
        RuntimeCosts(cache_bandwidth=0.0)
    with pytest.raises(PartitionError, match="malformed cluster description"):
        Cluster.from_dict({**old, "runtime": {"memory_bandwidth": 1e9, "speed": 2}})


def test_plans_keep_ties_and_tensor_counts_and_old_plans_load(tmp_path):
    plan = equal_plan([1, 1, 1], tensors=TENSORS).with_(ties=(((0, 2), 64),))
    assert Plan.from_json(plan.to_json()) == plan
    old = json.loads(plan.to_json())
    del old["ties"]
    for stage in old["stages"]:
        del stage["param_tensors"]
    loaded = Plan.from_json(json.dumps(old))
    assert loaded.ties == () and [s.param_tensors for s in loaded.stages] == [0, 0, 0]


def _calibrate(rank, world_size, init_file):
    from pdcompile.runtime.calibration import calibrate
    from pdcompile.runtime.distributed import init_process_group

    device = init_process_group(rank, world_size, init_file=init_file, timeout_s=60)
    return calibrate(rank, device, lambda p: torch.optim.SGD(p, lr=0.1), repeats=3)


def test_calibration_measures_the_link_and_the_runtime_on_two_ranks():
    from spawn import run_ranks

    first, second = run_ranks(_calibrate, 2, timeout_s=120)
    assert first == second  # rank 0's figures everywhere
    assert first.latency >= 0 and first.bandwidth > 0 and first.memory_bandwidth > 0
    assert first.send_s > 0 and first.recv_s > 0 and first.tensor_s > 0
    cluster = first.cluster(2)
    assert Cluster.from_json(cluster.to_json()) == cluster
    assert (cluster.runtime.message_s, cluster.runtime.sent_s) == (first.recv_s, first.send_s)
    assert cluster.runtime.cache_bandwidth == first.cache_bandwidth > 0
    assert cluster.runtime.collective_s == first.collective_s >= 0
    assert cluster.runtime.collective_bandwidth == first.collective_bandwidth > 0


def test_what_the_compute_just_produced_moves_at_the_cache_bandwidth():
    """Packing activations and adding gradients run at the cache bandwidth; the optimizer's
    update reads the weights from memory."""
    runtime = RuntimeCosts(memory_bandwidth=1000.0, cache_bandwidth=4000.0)
    plan = equal_plan([1], cluster=Cluster([(1, FAST)], runtime=runtime))
    sim = simulate(plan, schedule="1f1b", num_microbatches=2)
    durations = {(e.kind, e.microbatch): e.duration for e in sim.timeline}
    assert durations[("B", 0)] == pytest.approx(B)  # autograd's own gradients
    assert durations[("B", 1)] == pytest.approx(B + 3 * PARAM / 4000.0)
    assert durations[("step", -1)] == pytest.approx((2 * WEIGHT - PARAM) / 1000.0)


@pytest.mark.parametrize("kind", ["pipedream", "2bw"])
def test_simulated_weight_copies_are_the_workers(kind):
    """The most weight versions each rank holds at once, simulated and in the local executor."""
    _, x, y, loss_fn = mlp_case()
    program, costs = mlp_program((1, 1, 1))
    plan = pdcompile.evaluate(program.plan, costs, schedule=kind, num_microbatches=4)
    plan = plan.with_(stages=tuple(dataclasses.replace(s, activation_bytes=0) for s in plan.stages))
    sim = simulate(plan)
    held = sim.schedule_memory
    simulated = [(held[s.index] - s.weight_bytes) // s.param_bytes for s in plan.stages]
    pipeline = LocalPipeline(program, schedule=kind, num_microbatches=4, loss_fn=loss_fn,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.01))  # fmt: skip
    held = dict.fromkeys(pipeline.workers, 0)
    for rank, worker in pipeline.workers.items():
        run = worker.run

        def counted(action, rank=rank, worker=worker, run=run):
            run(action)
            held[rank] = max(held[rank], len(worker.versions.copies))

        worker.run = counted
    for _ in range(get_schedule(kind).steady_calls([1, 1, 1], 4)):
        pipeline.train_step((x,), y)
    assert simulated == [held[r] for r in sorted(held)]
