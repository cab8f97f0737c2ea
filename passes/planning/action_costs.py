"""What the runtime's own work costs per action: the simulator's terms besides compute and
bandwidth. Torch-free.

From the cluster's `RuntimeCosts` (memory bandwidth B for weights and optimizer state, cache
bandwidth C for what the compute just produced, both counting bytes read plus bytes written; a
fixed `tensor_s` t per tensor touched; a fixed `message_s` per message) and each level's latency
alpha, for a stage with P parameter bytes, G gradient bytes, W = P + G + optimizer bytes in n
tensors (a tied tensor's copies included, each counted at its gradient's size):

    send          send_s + 2 * bytes / C              (packed into one buffer, then posted;
                                                       send_s defaults to message_s)
    recv          message_s, after the message arrives (unpacked as views of the buffer)
    transfer      alpha + bytes / bandwidth           (the bytes share the link; docs/simulator.md)
    copy          2 * P / B + n * t                   (a `step` while a version kept by `push`
                                                       shares the live weights, which move
                                                       apart; `simulated_weights` says when)
    step          the stage's measured `optimizer_s` (the optimizer's step timed on tensors of
                  the stage's sizes: `analyze(optimizer=...)`) where the plan has it, else
                  (2 * W - G) / B + n * t             (read weights, gradients and state; write
                                                       weights and state); a tied tensor's
                                                       copies scale either by their bytes
    F on a weight + n * t: the weights swapped in for the call (`runtime/weight_slots.py`;
    copy          `pipedream`, `2bw`)
    F after a B   + P / B: the backward's gradients pushed the weights out of the caches, so the
                  forward reads them from memory again (1F1B's forwards, not GPipe's)
    gradients     a backward adds the stage's measured `accumulate_s` (its gradients added to
                  those held, timed per node: `analyze`) where the plan has it, else
                  3 * G / C + n * t, to the gradients its weights hold (autograd keeps the first
                  ones as they are: free); moving a copy's gradients to the live weights costs
                  the same when they hold some, else n * t
    all-reduce    2 (r - 1) alpha + c + 2 (r - 1) / r * G / bandwidth + 4 * F / B + n * t over
                  r ranks (c = collective_s; bandwidth the link's, at most the runtime's
                  collective_bandwidth): tensors of up to COALESCE_MAX_BYTES are flattened
                  into one buffer, reduced and copied back, larger ones reduced in place; F, the
                  bytes flattened, is taken as min(G, n * COALESCE_MAX_BYTES), its bound
    loss          every `train_step` ends with the last stage's ranks sending the loss to every
                  other rank: a send of LOSS_BYTES each, a receive on the others
    clip          3 * G / C + n * t per stage of the rank (the squares of its gradients summed,
                  then the gradients scaled: priced as if the norm were always over the limit),
                  then, over a group of r ranks, the scalar all-reduce 2 (r - 1) alpha + c
    check         the scalar all-reduce of a non-finite flag: 2 (r - 1) alpha + c
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdcompile.core.cluster import Cluster
from pdcompile.passes.planning.plans import Plan

# the runtime all-reduces a gradient tensor of more bytes in place; the others of a stage are
# flattened into one buffer, reduced, and copied back (runtime/distributed.py)
COALESCE_MAX_BYTES = 2**20
# the smaller gradients of a replicated stage are reduced in buckets of up to this many bytes,
# started while the backward runs (runtime/grad_buckets.py; DDP's default)
BUCKET_BYTES = 25 * 2**20
LOSS_BYTES = 32 + 16  # what a loss message's sender writes: the wire preamble and two float64


@dataclass(frozen=True)
class StageCosts:
    """Seconds of one stage's runtime actions on one of its ranks (docs in the module)."""

    copy_s: float
    step_s: float
    swap_s: float
    accumulate_s: float
    collect_s: float
    allreduce_s: float
    reload_s: float
    clip_s: float


def stage_costs(plan: Plan, cluster: Cluster) -> dict[int, StageCosts]:
    """`StageCosts` of every stage of `plan` on `cluster`."""
    runtime = cluster.runtime
    tied = {s: 0 for s in range(plan.num_stages)}  # bytes of tied tensors each stage copies
    for stages, grad_bytes in plan.ties:
        for stage in stages[1:]:  # the first holds the original
            tied[stage] += grad_bytes
    costs = {}
    for s in plan.stages:
        extra = tied[s.index]
        scale = (s.param_bytes + extra) / s.param_bytes if s.param_bytes else 1.0
        grads, n = s.grad_bytes + extra, s.param_tensors
        copy = runtime.moved_s(2 * (s.param_bytes + extra), n)
        # the measured step replaces the estimate of its memory traffic (it is that traffic)
        step = s.optimizer_s * scale if s.optimizer_s > 0 else runtime.moved_s(
            (2 * s.weight_bytes - s.grad_bytes) * scale, n)  # fmt: skip
        # likewise the measured accumulation of the gradients (analyze times it per node)
        add = s.accumulate_s * scale if s.accumulate_s > 0 else runtime.moved_s(
            3 * grads, n, cached=True)  # fmt: skip
        costs[s.index] = StageCosts(
            copy_s=copy,
            step_s=step,
            swap_s=runtime.moved_s(0, n),
            accumulate_s=add,
            collect_s=runtime.moved_s(0, n),
            allreduce_s=allreduce_s(s.grad_bytes, s.ranks, cluster, n),
            reload_s=runtime.moved_s(s.param_bytes),
            clip_s=runtime.moved_s(3 * grads, n, cached=True),
        )
    return costs


def tie_costs(plan: Plan, cluster: Cluster) -> list[float]:
    """Seconds of each tie group's all-reduce (one tensor over every rank of its stages)."""
    return [
        allreduce_s(
            grad_bytes, sorted({r for s in stages for r in plan.stages[s].ranks}), cluster, 1
        )  # a rank holding several of the stages takes part once
        for stages, grad_bytes in plan.ties
    ]


def allreduce_s(nbytes: float, ranks: list[int] | tuple[int, ...], cluster: Cluster,
                tensors: int) -> float:  # fmt: skip
    """A ring all-reduce of `nbytes` in `tensors` tensors over `ranks` (0 for one rank)."""
    r = len(ranks)
    if r < 2:
        return 0.0
    first, last = min(ranks), max(ranks)
    network = 2 * (r - 1) * cluster.latency(first, last) + cluster.runtime.collective_s
    bound = cluster.runtime.collective_bandwidth or math.inf
    bandwidth = min(cluster.bandwidth(first, last), bound)
    network += 2 * (r - 1) / r * nbytes / bandwidth
    flattened = min(nbytes, tensors * COALESCE_MAX_BYTES)  # at most: tensor sizes are not known
    return network + cluster.runtime.moved_s(4 * flattened, tensors)


def scalar_allreduce_s(ranks: tuple[int, ...], cluster: Cluster) -> float:
    """An all-reduce of one number over `ranks` (a clip's norm, a check's flag): latency only."""
    if len(ranks) < 2:
        return 0.0
    first, last = min(ranks), max(ranks)
    return 2 * (len(ranks) - 1) * cluster.latency(first, last) + cluster.runtime.collective_s


def send_s(cluster: Cluster, nbytes: float) -> float:
    """The sender's time to pack a message of `nbytes` and post it."""
    return cluster.runtime.sent_s + cluster.runtime.moved_s(2 * nbytes, cached=True)
