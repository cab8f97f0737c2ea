"""The local executor against single-process references: synchronous schedules against
gradient accumulation, `pipedream` against a sequential replay of its version function, `2bw`
against W(t+1) = W(t) - lr grad(W(t-1)), streaming across steps with two weight versions."""

from __future__ import annotations

import pytest
import torch
from pipeline_support import (
    STEP_LR,
    accumulate_reference,
    gpt_case,
    mlp_case,
    pipedream_reference,
    program_for,
    resnet_case,
    two_bw_reference,
    two_bw_run,
    varied_batches,
)

from pdcompile.core.errors import ScheduleError
from pdcompile.runtime.local import LocalPipeline

SGD = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731
ADAM = lambda params: torch.optim.Adam(params, lr=1e-2)  # noqa: E731


def assert_matches(pipeline: LocalPipeline, reference: dict[str, torch.Tensor]) -> None:
    for rank, module in pipeline.stage_modules().items():
        for name, p in module.named_parameters():
            torch.testing.assert_close(p, reference[name], msg=f"rank {rank}: {name}")


# GPT runs with SGD only: the key bias of attention has an exactly zero gradient (softmax
# ignores a constant shift), so its computed gradient is rounding noise, which Adam scales up to
# full-size steps that no two summation orders agree on.
CASES = [
    (mlp_case, [1, 1, 1], SGD), (mlp_case, [2, 1], SGD), (mlp_case, [2, 1], ADAM),
    (resnet_case, [1, 1], SGD), (resnet_case, [1, 1], ADAM), (gpt_case, [1, 1, 1], SGD),
]  # fmt: skip
IDS = [
    "mlp-3-sgd",
    "mlp-2x1-sgd",
    "mlp-2x1-adam",
    "resnet-2-sgd",
    "resnet-2-adam",
    "gpt-3-tied-sgd",
]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("case", "replicas", "optimizer"), CASES, ids=IDS)
def test_synchronous_schedules_equal_gradient_accumulation(case, replicas, optimizer, schedule):
    model, x, y, loss_fn = case()
    program = program_for(model, x, replicas)
    m = 4
    pipeline = LocalPipeline(
        program, schedule=schedule, num_microbatches=m, loss_fn=loss_fn, optimizer=optimizer
    )
    for _ in range(5):
        loss = pipeline.train_step((x,), y)
    ref, ref_loss = accumulate_reference(model, x, y, loss_fn, optimizer, m, steps=5)
    assert_matches(pipeline, dict(ref.named_parameters(remove_duplicate=False)))
    assert loss == pytest.approx(ref_loss, rel=1e-5)


@pytest.mark.parametrize(
    ("case", "replicas"),
    [(mlp_case, [1, 1, 1]), (mlp_case, [2, 1]), (gpt_case, [1, 1])],
    ids=["straight", "replicated", "gpt-tied"],
)
def test_pipedream_equals_the_version_replay_and_differs_without_stashing(case, replicas) -> None:
    model, x, y, loss_fn = case()
    program = program_for(model, x, replicas)
    m, steps = 2 if replicas == [2, 1] else 5, 5 if replicas == [2, 1] else 2  # 10 minibatches
    reference = pipedream_reference(program, x, y, loss_fn, SGD, m, steps)
    expected = {n: p for stage in reference for n, p in stage.named_parameters()}
    results = {}
    for stash in (True, False):
        pipeline = LocalPipeline(
            program, schedule="pipedream", num_microbatches=m, loss_fn=loss_fn, optimizer=SGD,
            stash=stash,
        )  # fmt: skip
        for _ in range(steps):
            pipeline.train_step((x,), y)
        pipeline.flush()  # the last minibatches' backwards are still in flight
        results[stash] = pipeline
    assert_matches(results[True], expected)
    with pytest.raises(AssertionError):
        assert_matches(results[False], expected)


@pytest.mark.parametrize("replicas", [[1, 1, 1], [2, 1]], ids=["straight", "replicated"])
def test_vertical_sync_equals_its_version_replay(replicas) -> None:
    model, x, y, loss_fn = mlp_case()
    program = program_for(model, x, replicas)
    m, steps = 2, 5
    expected = {
        n: p
        for stage in pipedream_reference(program, x, y, loss_fn, SGD, m, steps, vertical=True)
        for n, p in stage.named_parameters()
    }
    pipeline = LocalPipeline(
        program, schedule="pipedream", num_microbatches=m, loss_fn=loss_fn, optimizer=SGD,
        vertical_sync=True,
    )  # fmt: skip
    for _ in range(steps):
        pipeline.train_step((x,), y)
    pipeline.flush()
    assert_matches(pipeline, expected)
    plain = {
        n: p
        for stage in pipedream_reference(program, x, y, loss_fn, SGD, m, steps)
        for n, p in stage.named_parameters()
    }
    with pytest.raises(AssertionError):  # the rule matters: plain versions give other weights
        assert_matches(pipeline, plain)


@pytest.mark.parametrize(("case", "replicas"), [(mlp_case, [1, 1, 1]), (gpt_case, [1, 1])])
def test_two_bw_applies_gradients_one_step_stale(case, replicas) -> None:
    model, x, y, loss_fn = case()
    program = program_for(model, x, replicas)
    m, steps = 4, 4
    pipeline = LocalPipeline(
        program, schedule="2bw", num_microbatches=m, loss_fn=loss_fn, optimizer=SGD
    )
    for _ in range(steps):
        pipeline.train_step((x,), y)
    expected = dict(two_bw_reference(model, x, y, loss_fn, SGD, m, steps).named_parameters(
        remove_duplicate=False
    ))  # fmt: skip
    assert_matches(pipeline, expected)
    fresh = accumulate_reference(model, x, y, loss_fn, SGD, m, steps)[0]
    with pytest.raises(AssertionError):  # and that differs from fresh gradients
        assert_matches(pipeline, dict(fresh.named_parameters(remove_duplicate=False)))


def _watch_versions(pipeline: LocalPipeline) -> dict[int, tuple[int, int]]:
    """Per rank, the most (distinct weight versions alive, stashed copies) after any action:
    a version is alive while it is the live weights or stashed."""
    most = dict.fromkeys(pipeline.workers, (0, 0))
    for rank, worker in pipeline.workers.items():

        def watched(action, run=worker.run, worker=worker, rank=rank) -> None:
            run(action)
            alive = len(set(worker.versions.copies) | {worker.versions.updates})
            most[rank] = tuple(map(max, most[rank], (alive, len(worker.versions.copies))))

        worker.run = watched
    return most


@pytest.mark.parametrize(
    ("case", "replicas", "m"),
    [(mlp_case, [1, 1, 1], 3), (mlp_case, [2, 1], 4), (mlp_case, [3, 1], 3), (gpt_case, [1, 1], 2)],
    ids=["straight", "2x1", "3x1", "gpt-tied"],
)
def test_two_bw_streams_steps_on_two_versions_and_equals_its_reference(case, replicas, m) -> None:
    """A different batch every step (a microbatch misplaced across steps would show), the
    steps overlap (stage 0 runs forwards of step 1 before its update 0, and backwards stay in
    flight across calls), at most two weight versions per stage, and after a flush the weights
    and every step's loss are the reference's."""
    model, x, y, loss_fn = case()
    program = program_for(model, x, replicas)
    data = varied_batches(x, y, steps=4)
    pipeline = LocalPipeline(
        program, schedule="2bw", num_microbatches=m, loss_fn=loss_fn, optimizer=SGD
    )
    most = _watch_versions(pipeline)
    first = pipeline.workers[(0, 0)]
    first.timeline = []
    losses = [pipeline.train_step((xs,), ys) for xs, ys in data[:2]]
    in_flight = len(first.flight)  # stage 0's backwards of step 1 wait for the next call
    losses += [pipeline.train_step((xs,), ys) for xs, ys in data[2:]]
    pipeline.flush()
    expected, expected_losses = two_bw_run(model, data, loss_fn, SGD, m)
    assert_matches(pipeline, dict(expected.named_parameters(remove_duplicate=False)))
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    order = [(e.kind, e.microbatch) for e in first.timeline]
    step_one = next(i for i, (kind, k) in enumerate(order) if kind == "F" and k >= m)
    assert step_one < order.index(("step", 0))
    assert in_flight > 0
    assert max(alive for alive, _ in most.values()) == 2
    assert max(copies for _, copies in most.values()) <= 2


def test_two_bw_clips_globally_while_streaming() -> None:
    """One norm over every rank at each update (a collective the stages reach at different
    times), with a StepLR, on a replicated stage."""
    model, x, y, loss_fn = mlp_case()
    data = varied_batches(x, y, steps=4)
    pipeline = LocalPipeline(
        program_for(model, x, [2, 1]), schedule="2bw", num_microbatches=4, loss_fn=loss_fn,
        optimizer=SGD, clip_grad_norm=0.05, lr_scheduler=STEP_LR,
    )  # fmt: skip
    for xs, ys in data:
        pipeline.train_step((xs,), ys)
    expected, _ = two_bw_run(model, data, loss_fn, SGD, 4, clip=0.05, scheduler=STEP_LR)
    assert_matches(pipeline, dict(expected.named_parameters()))  # stage_modules() flushes
    unclipped, _ = two_bw_run(model, data, loss_fn, SGD, 4, scheduler=STEP_LR)
    with pytest.raises(AssertionError):
        assert_matches(pipeline, dict(unclipped.named_parameters()))


def test_pipedream_equals_the_version_replay_on_a_different_batch_every_step() -> None:
    model, x, y, loss_fn = mlp_case()
    program = program_for(model, x, [2, 1])
    data = varied_batches(x, y, steps=3)
    pipeline = LocalPipeline(
        program, schedule="pipedream", num_microbatches=2, loss_fn=loss_fn, optimizer=SGD
    )
    for xs, ys in data:
        pipeline.train_step((xs,), ys)
    stages = pipedream_reference(program, x, y, loss_fn, SGD, 2, 3, data=data)
    assert_matches(pipeline, {n: p for stage in stages for n, p in stage.named_parameters()})


@pytest.mark.parametrize("schedule", ["pipedream", "2bw"])
def test_a_long_stream_holds_a_bounded_number_of_actions(schedule) -> None:
    """Streaming 200 steps without a flush: every rank keeps a few steps' worth of actions (the
    stream is released as walked), and the flush after them completes every minibatch."""
    model, x, y, loss_fn = mlp_case()
    pipeline = LocalPipeline(
        program_for(model, x, [2, 1]), schedule=schedule, num_microbatches=2, loss_fn=loss_fn,
        optimizer=SGD,
    )  # fmt: skip
    one_step = max(len(actions) for actions in pipeline.schedule.actions.values())
    most = 0
    for _ in range(200):
        pipeline.train_step((x,), y)
        most = max(most, *(stream.kept for stream in pipeline.streams.values()))
    assert most <= 3 * one_step
    pipeline.flush()
    assert all(not worker.flight for worker in pipeline.workers.values())


def test_a_batch_too_small_for_the_microbatches_is_refused() -> None:
    model, x, y, loss_fn = mlp_case()
    pipeline = LocalPipeline(
        program_for(model, x, [1, 1]), schedule="1f1b", num_microbatches=4, loss_fn=loss_fn,
        optimizer=SGD,
    )  # fmt: skip
    with pytest.raises(ScheduleError, match="a batch of 3 rows cannot be split into 4 micro"):
        pipeline.train_step((x[:3],), y[:3])
    # a smaller last batch that still splits works, with the same stage modules
    assert pipeline.train_step((x[:5],), y[:5]) > 0


@pytest.mark.parametrize(
    ("case", "replicas"), [(gpt_case, [1, 1, 1]), (mlp_case, [2, 1])], ids=["gpt-tied", "mlp-2x1"]
)
def test_synchronous_clipping_is_global_and_the_lr_schedule_steps(case, replicas) -> None:
    """One norm over the whole model (each tied or replicated tensor once), as
    `clip_grad_norm_` on the unpipelined model, and a StepLR per rank."""
    model, x, y, loss_fn = case()
    program = program_for(model, x, replicas)
    pipeline = LocalPipeline(
        program, schedule="1f1b", num_microbatches=4, loss_fn=loss_fn, optimizer=SGD,
        clip_grad_norm=0.05, lr_scheduler=STEP_LR,
    )  # fmt: skip
    for _ in range(5):
        pipeline.train_step((x,), y)
    ref, _ = accumulate_reference(model, x, y, loss_fn, SGD, 4, 5, clip=0.05, scheduler=STEP_LR)
    assert_matches(pipeline, dict(ref.named_parameters(remove_duplicate=False)))
    unclipped, _ = accumulate_reference(model, x, y, loss_fn, SGD, 4, 5, scheduler=STEP_LR)
    with pytest.raises(AssertionError):
        assert_matches(pipeline, dict(unclipped.named_parameters(remove_duplicate=False)))


@pytest.mark.parametrize(("case", "replicas", "clip"), [
    (mlp_case, [1, 1, 1], 0.05),
    (gpt_case, [1, 1, 1], 0.2),  # stages 0 and 2 share the embedding: they clip together
])  # fmt: skip
def test_pipedream_clips_per_stage_and_tied_stages_together(case, replicas, clip) -> None:
    model, x, y, loss_fn = case()
    program = program_for(model, x, replicas)
    reference = pipedream_reference(program, x, y, loss_fn, SGD, 5, 2, clip=clip)
    pipeline = LocalPipeline(
        program, schedule="pipedream", num_microbatches=5, loss_fn=loss_fn, optimizer=SGD,
        clip_grad_norm=clip,
    )  # fmt: skip
    for _ in range(2):
        pipeline.train_step((x,), y)
    pipeline.flush()
    assert_matches(pipeline, {n: p for st in reference for n, p in st.named_parameters()})
    tie_names = [n for tie in program.ties for n in tie.names]
    modules = {n: p for st in pipeline.stage_modules().values() for n, p in st.named_parameters()}
    assert set(tie_names) <= modules.keys()
    for a, b in zip(tie_names, tie_names[1:], strict=False):  # the copies stay equal
        assert torch.equal(modules[a], modules[b]), (a, b)
