"""Models, plans and references shared by the runtime tests (local and distributed)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import pdcompile
from pdcompile import zoo
from pdcompile.passes.planning.plans import Plan, consecutive_ranks
from pdcompile.scheduling.builder import tie_components
from pdcompile.scheduling.pipedream import version, vertical_version


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run at one CPU thread, as the spawned ranks do: a convolution's sums at two threads round
    differently, so a reference computed there differs from the ranks' in the last bits, which
    BatchNorm amplifies past the comparison's tolerance within a few steps."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def mlp_case(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Callable]:
    torch.manual_seed(seed)
    model = zoo.MLP(p=0.0).train()
    x, y = torch.randn(12, 32), torch.randint(0, 10, (12,))
    return model, x, y, F.cross_entropy


def resnet_case(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Callable]:
    torch.manual_seed(seed)
    model = zoo.ResNet().train()
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    return model, x, y, F.cross_entropy


def unet_case(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Callable]:
    """Skip connections: cut in three, stage 0 sends two encoder features straight to stage 2."""
    torch.manual_seed(seed)
    model = zoo.UNet().train()
    x, y = torch.randn(8, 3, 32, 32), torch.randn(8, 4, 32, 32)
    return model, x, y, F.mse_loss


def gpt_case(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Callable]:
    torch.manual_seed(seed)
    model = zoo.GPT(zoo.GPTConfig(dropout=0.0, n_layer=2)).train()
    x = torch.randint(0, 128, (8, 16))
    y = torch.randint(0, 128, (8, 16))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    return model, x, y, loss_fn


def program_for(model: nn.Module, x: torch.Tensor, replicas: list[int], solver: str = "uniform"):
    """A StagedProgram of `model` cut into len(replicas) stages with these replica counts."""
    gm = pdcompile.trace(model, (x,))
    costs = pdcompile.analyze(gm, (x,), profile=False)
    plan = pdcompile.plan(costs, pdcompile.Cluster.parse(str(len(replicas))), solver=solver)
    assert plan.num_stages == len(replicas), plan
    ranks = consecutive_ranks(replicas)
    stages = tuple(
        dataclasses.replace(s, replicas=r, ranks=ranks[i])
        for i, (s, r) in enumerate(zip(plan.stages, replicas, strict=True))
    )
    cluster = pdcompile.Cluster.parse(str(sum(replicas)))
    return pdcompile.codegen(gm, Plan(stages=stages, cluster=cluster, schedule=plan.schedule))


def microbatches(x: torch.Tensor, y: torch.Tensor, m: int) -> list[tuple[Any, Any, float]]:
    xs, ys = torch.tensor_split(x, m), torch.tensor_split(y, m)
    return [(a, b, a.shape[0] / x.shape[0]) for a, b in zip(xs, ys, strict=True)]


def accumulate_reference(
    model, x, y, loss_fn, optimizer, m: int, steps: int, clip=None, scheduler=None
) -> tuple[nn.Module, float]:
    """Single-process gradient accumulation over the same microbatches in the same order
    (clipped with `torch.nn.utils.clip_grad_norm_`, the learning rate from `scheduler`);
    returns the trained copy and the last step's loss."""
    ref = copy.deepcopy(model)
    opt = optimizer(list(ref.parameters()))
    sched = scheduler(opt) if scheduler else None
    for _ in range(steps):
        loss = 0.0
        for a, b, share in microbatches(x, y, m):
            part = loss_fn(ref(a), b) * share
            part.backward()
            loss += float(part.detach())
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            assert norm > clip, "the test's clip never acts"
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
    return ref, loss


def varied_batches(x: torch.Tensor, y: torch.Tensor, steps: int, seed: int = 1) -> list:
    """A different (x, y) per step, like `x, y` (integer targets drawn from y's range), so that
    a misplaced microbatch across steps changes the result."""
    generator = torch.Generator().manual_seed(seed)

    def like(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return torch.randn(t.shape, generator=generator, dtype=t.dtype)
        return torch.randint(0, int(t.max()) + 1, t.shape, generator=generator)

    return [(like(x), like(y)) for _ in range(steps)]


def pipedream_reference(
    program, x, y, loss_fn, optimizer, m: int, steps: int, *, vertical=False, clip=None,
    data=None, scheduler=None,
):  # fmt: skip
    """Replays PipeDream's version function sequentially: minibatch k runs forward and
    backward at stage s on the weights after v(k, s) updates of s; each stage averages the
    gradients of a round of r_s minibatches into one update (clipped per stage, stages that
    share tied weights by one norm over all their gradients, each tied tensor once; then the
    learning rate from `scheduler`). `data`: one (x, y) per step (default: x, y every step)."""
    replicas = [s.replicas for s in program.plan.stages]
    live = [copy.deepcopy(stage) for stage in program.stages]
    opts = [optimizer(list(stage.parameters())) for stage in live]
    scheds = [scheduler(opt) for opt in opts] if scheduler else []
    groups = tie_components(len(live), [tie.stages for tie in program.ties])
    # tied copies held by another stage than the tie's owner: counted once in a norm
    copies = [{n for t in program.ties if t.owner != s for n in t.names} for s in range(len(live))]
    history = [[{n: p.detach().clone() for n, p in s.named_parameters()}] for s in live]
    pending: list[list[dict[str, torch.Tensor]]] = [[] for _ in live]
    clipped: list[bool] = []
    k = 0
    for xs, ys in data or [(x, y)] * steps:
        for a, b, _share in microbatches(xs, ys, m):
            rule = vertical_version if vertical else version
            versions = [history[s][rule(replicas, s, k)] for s in range(len(live))]
            weights = [{n: t.clone().requires_grad_(True) for n, t in v.items()} for v in versions]
            inbox: dict[str, Any] = {}  # every value sent so far, by name
            for s, stage in enumerate(live):
                args = (a,) if s == 0 else ()
                kwargs = {n: inbox[n] for n in program.signatures[s].inputs} if s else {}
                out = torch.func.functional_call(stage, weights[s], args, kwargs)
                if s < len(live) - 1:
                    inbox.update(out)
            loss_fn(out, b).backward()
            for tie in program.ties:  # tied copies (one replica each) update with the sum
                names = [next(n for n in tie.names if n in weights[s]) for s in tie.stages]
                total = sum(weights[s][n].grad for s, n in zip(tie.stages, names, strict=True))
                for s, n in zip(tie.stages, names, strict=True):
                    weights[s][n].grad = total
            ready = []  # stages whose round is complete: they update now
            for s in range(len(live)):
                pending[s].append({n: w.grad for n, w in weights[s].items()})
                if len(pending[s]) == replicas[s]:
                    for n, p in live[s].named_parameters():
                        p.grad = sum(g[n] for g in pending[s]) / replicas[s]
                    pending[s] = []
                    ready.append(s)
            for group in {groups[s] for s in ready} if clip is not None else ():
                counted = [p.grad for s in group for n, p in live[s].named_parameters()
                           if n not in copies[s]]  # fmt: skip
                norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in counted]))
                clipped.append(bool(norm > clip))
                for s in group:
                    for p in live[s].parameters():
                        p.grad.mul_(min(1.0, clip / (float(norm) + 1e-6)))
            for s in ready:
                opts[s].step()
                opts[s].zero_grad(set_to_none=True)
                if scheds:
                    scheds[s].step()
                history[s].append({n: p.detach().clone() for n, p in live[s].named_parameters()})
            k += 1
    assert clip is None or any(clipped), "the test's clip never acts"
    return live


def two_bw_reference(model, x, y, loss_fn, optimizer, m: int, steps: int) -> nn.Module:
    """PipeDream-2BW: step t applies the gradient (accumulated over the microbatches) computed
    on the weights before the previous step: W(t+1) = W(t) - lr grad(W(t-1)), the first on W(0)."""
    return two_bw_run(model, [(x, y)] * steps, loss_fn, optimizer, m)[0]


def two_bw_run(
    model, data, loss_fn, optimizer, m: int, clip=None, scheduler=None
) -> tuple[nn.Module, list[float]]:
    """`two_bw_reference` over one (x, y) per step in `data` (the gradient clipped with
    `clip_grad_norm_`, the learning rate from `scheduler`); returns the trained copy and each
    step's loss (the row-weighted mean over its microbatches, computed on W(t-1))."""
    ref = copy.deepcopy(model)
    params = dict(ref.named_parameters())
    opt = optimizer(list(params.values()))
    sched = scheduler(opt) if scheduler else None
    older = {n: p.detach().clone() for n, p in params.items()}
    losses = []
    for x, y in data:
        weights = {n: t.clone().requires_grad_(True) for n, t in older.items()}
        loss = 0.0
        for a, b, share in microbatches(x, y, m):
            part = loss_fn(torch.func.functional_call(ref, weights, (a,)), b) * share
            part.backward()
            loss += float(part.detach())
        losses.append(loss)
        older = {n: p.detach().clone() for n, p in params.items()}
        for n, p in params.items():
            p.grad = weights[n].grad
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            assert norm > clip, "the test's clip never acts"
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
    return ref, losses


CASES = {"mlp": mlp_case, "resnet": resnet_case, "unet": unet_case, "gpt": gpt_case}
STEP_LR = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # noqa: E731
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
}


def stage_parameters(pipeline) -> dict:
    """Copies of every parameter the pipeline's stages on this rank hold, under every name."""
    return {
        n: p.detach().clone()
        for worker in pipeline.workers.values()
        for n, p in worker.module.named_parameters(remove_duplicate=False)
    }
