"""`pdcompile.compile` end to end: in one process (the local executor) and on spawned gloo ranks
(the process group already initialised, as under torchrun)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from pipeline_support import (
    CASES,
    OPTIMIZERS,
    accumulate_reference,
    mlp_case,
    pipedream_reference,
)
from spawn import run_ranks

import pdcompile
from pdcompile import zoo
from pdcompile.core.errors import PdcompileError
from pdcompile.runtime.distributed import init_process_group

SGD = OPTIMIZERS["sgd"]


def test_compile_in_one_process_trains_like_gradient_accumulation() -> None:
    model, x, y, loss_fn = mlp_case()
    pipe = pdcompile.compile(
        model, (x,), loss_fn=loss_fn, optimizer=SGD, cluster="4", solver="uniform",
        profile=False,
    )  # fmt: skip
    assert pipe.plan.num_stages == 4 and pipe.stage is None
    losses = [pipe.train_step(x, y) for _ in range(3)]
    ref, ref_loss = accumulate_reference(
        model, x, y, loss_fn, SGD, pipe.pipeline.num_microbatches, 3
    )
    state = pipe.state_dict()
    assert state.keys() == ref.state_dict().keys()
    for name, tensor in ref.state_dict().items():
        torch.testing.assert_close(state[name], tensor, msg=name)
    assert losses[-1] == pytest.approx(ref_loss, rel=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(pipe.eval_step(x), ref(x))
    text = pipe.explain()
    assert "schedule 1f1b: synchronous" in text and "rank 3 (stage 3)" in text
    assert pipe.version(2, 9) == 9 // pipe.pipeline.num_microbatches


def test_compile_runs_the_microbatches_planned_and_rescores_for_the_rows_run() -> None:
    """Regression: `plan()` scored M = 2 x devices, then `compile` ran 2 x stages, so
    `explain()` compared the run with a prediction for another M."""
    model, x, y, loss_fn = mlp_case()
    pipe = pdcompile.compile(
        model, (x[:2],), loss_fn=loss_fn, optimizer=SGD, cluster="8", profile=False,
    )  # fmt: skip
    planned = pipe.plan
    # 2 x 8 devices, rounded up to whole rounds of the plan's 7 replicas (no replica idles)
    assert [s.replicas for s in planned.stages] == [1, 7]
    assert pipe.pipeline.num_microbatches == planned.num_microbatches == 21
    assert planned.microbatch_size == 2
    xs, ys = x.repeat(6, 1)[:63], y.repeat(6)[:63]  # 63 rows: 3 per microbatch
    pipe.train_step(xs, ys)
    rows = xs.shape[0] // planned.num_microbatches
    scored = pipe.plan
    assert scored.microbatch_size == rows and scored.num_microbatches == planned.num_microbatches
    assert [s.nodes for s in scored.stages] == [s.nodes for s in planned.stages]
    assert scored.step_time == pdcompile.simulate(scored).time_per_step
    assert scored.predicted_time > planned.predicted_time  # 3 rows, not 2


def _train(rank: int, world_size: int, init_file: str, case: str, schedule: str) -> dict:
    init_process_group(rank, world_size, init_file=init_file, timeout_s=120)
    model, x, y, loss_fn = CASES[case]()
    pipe = pdcompile.compile(
        model, (x,), loss_fn=loss_fn, optimizer=SGD, schedule=schedule, solver="uniform",
        profile=False,
    )  # fmt: skip
    losses = [pipe.train_step(x, y) for _ in range(3)]
    outputs = pipe.eval_step(x)
    result = {"state": pipe.state_dict(), "losses": losses, "plan": pipe.plan.to_json(),
              "stage": pipe.stage, "outputs": outputs}  # fmt: skip
    dist.destroy_process_group()
    return result


@pytest.mark.parametrize(
    ("world_size", "case", "schedule"),
    [(2, "gpt", "1f1b"), (3, "mlp", "pipedream")],
    ids=["2-gpt-1f1b", "3-mlp-pipedream"],
)
def test_compile_on_ranks_matches_the_runtime_semantics(world_size, case, schedule) -> None:
    results = run_ranks(_train, world_size, case, schedule, timeout_s=240)
    assert [r["stage"] for r in results] == list(range(world_size))
    assert all(r["losses"] == results[0]["losses"] for r in results)  # every rank gets the loss
    model, x, y, loss_fn = CASES[case]()
    plan = pdcompile.Plan.from_json(results[0]["plan"])
    m = plan.num_microbatches
    if schedule == "pipedream":
        local = pdcompile.compile(model, (x,), loss_fn=loss_fn, optimizer=SGD, plan=plan,
                                  schedule=schedule)  # fmt: skip
        stages = pipedream_reference(local.pipeline.program, x, y, loss_fn, SGD, m, 3)
        reference = {n: t for st in stages for n, t in st.state_dict().items()}
    else:
        ref, _ = accumulate_reference(model, x, y, loss_fn, SGD, m, 3)
        reference = ref.state_dict()
    for r in results:
        for name, tensor in r["state"].items():
            torch.testing.assert_close(tensor, reference[name], msg=f"{case} rank {r}: {name}")
    merged = {n for r in results for n in r["state"]}
    assert merged == set(reference)
    assert results[-1]["outputs"] is not None and results[0]["outputs"] is None


def _mismatched(rank: int, world_size: int, init_file: str) -> str:
    init_process_group(rank, world_size, init_file=init_file, timeout_s=60)
    torch.manual_seed(0)
    model = zoo.MLP(d_hidden=64 if rank == 0 else 48, p=0.0)
    x = torch.randn(8, 32)
    try:
        pdcompile.compile(model, (x,), loss_fn=torch.nn.functional.cross_entropy,
                          optimizer=SGD, profile=False)  # fmt: skip
    except PdcompileError as exc:
        return str(exc)
    return "no error"


def test_a_rank_with_another_model_fails_the_fingerprint_check() -> None:
    messages = run_ranks(_mismatched, 2, timeout_s=120)
    assert all("ranks [1] captured another model or call than rank 0" in m for m in messages)
    assert "this is one of them" in messages[1] and "this is one of them" not in messages[0]


def test_a_plan_for_more_devices_than_ranks_is_refused() -> None:
    model, x, y, loss_fn = mlp_case()
    plan = pdcompile.compile(model, (x,), loss_fn=loss_fn, optimizer=SGD, cluster="3",
                             solver="uniform", profile=False).plan  # fmt: skip
    results = run_ranks(_with_plan, 2, plan.to_json(), timeout_s=120)
    assert all("places its stages on 3 devices but the job has 2 ranks" in m for m in results)


def _with_plan(rank: int, world_size: int, init_file: str, plan_json: str) -> str:
    init_process_group(rank, world_size, init_file=init_file, timeout_s=60)
    model, x, y, loss_fn = mlp_case()
    try:
        pdcompile.compile(model, (x,), loss_fn=loss_fn, optimizer=SGD,
                          plan=pdcompile.Plan.from_json(plan_json))  # fmt: skip
    except PdcompileError as exc:
        return str(exc)
    return "no error"


def _meta(rank: int, world_size: int, init_file: str) -> dict:
    init_process_group(rank, world_size, init_file=init_file, timeout_s=120)
    real, x, y, loss_fn = CASES["gpt"]()
    with torch.device("meta"):
        model = zoo.GPT(zoo.GPTConfig(dropout=0.0, n_layer=2)).train()
    pipe = pdcompile.compile(
        model, (x,), loss_fn=loss_fn, optimizer=SGD, solver="uniform", profile=False,
        weights=real.state_dict,
    )  # fmt: skip
    stages = pipe.pipeline.program.stages
    on_meta = [any(t.is_meta for t in s.state_dict().values()) for s in stages]
    losses = [pipe.train_step(x, y) for _ in range(3)]
    result = {"on_meta": on_meta, "state": pipe.state_dict(), "losses": losses}
    dist.destroy_process_group()
    return result


def test_a_meta_model_materialises_only_each_ranks_own_stage() -> None:
    results = run_ranks(_meta, 2, timeout_s=180)
    assert [r["on_meta"] for r in results] == [[False, True], [True, False]]
    model, x, y, loss_fn = CASES["gpt"]()
    ref, _ = accumulate_reference(model, x, y, loss_fn, SGD, 4, 3)  # 2 stages: 4 microbatches
    reference = ref.state_dict()
    for r in results:
        for name, tensor in r["state"].items():
            torch.testing.assert_close(tensor, reference[name], msg=name)


def test_a_meta_model_without_weights_is_refused() -> None:
    with torch.device("meta"):
        model = zoo.MLP(p=0.0)
    x = torch.randn(8, 32)
    with pytest.raises(PdcompileError, match="the model is on the meta device: pass weights="):
        pdcompile.compile(model, (x,), loss_fn=torch.nn.functional.cross_entropy, optimizer=SGD,
                          cluster="2", profile=False)  # fmt: skip


def _hf(rank: int, world_size: int, init_file: str) -> dict:
    import torch.nn.functional as F

    init_process_group(rank, world_size, init_file=init_file, timeout_s=180)
    losses = {}
    for name in ("hf_gpt2", "hf_llama"):
        model, _, _ = getattr(zoo, name)()
        ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
        targets = torch.roll(ids, -1, dims=1)
        pipe = pdcompile.compile(
            model, (), example_kwargs={"input_ids": ids},
            loss_fn=lambda out, t: F.cross_entropy(out.logits.flatten(0, 1), t.flatten()),
            optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3), solver="uniform", profile=False,
        )  # fmt: skip
        losses[name] = [pipe.train_step((), targets, {"input_ids": ids}) for _ in range(4)]
    dist.destroy_process_group()
    return losses


def test_compile_trains_hugging_face_gpt2_and_llama_on_two_ranks() -> None:
    pytest.importorskip("transformers")
    results = run_ranks(_hf, 2, timeout_s=300)
    for name, losses in results[0].items():
        assert losses == results[1][name]
        assert losses[-1] < losses[0] - 0.3, (name, losses)  # the loss falls


def test_autocast_runs_forwards_in_bfloat16_and_keeps_fp32_weights() -> None:
    model, x, y, loss_fn = CASES["gpt"]()
    seen: list[torch.dtype] = []
    pipe = pdcompile.compile(
        model, (x,), loss_fn=lambda out, t: (seen.append(out.dtype), loss_fn(out.float(), t))[1],
        optimizer=OPTIMIZERS["adam"], cluster="2", solver="uniform", profile=False,
        autocast=torch.bfloat16,
    )  # fmt: skip
    losses = [pipe.train_step(x, y) for _ in range(4)]
    assert set(seen) == {torch.bfloat16}  # the last stage's logits came out of autocast
    assert all(
        t.dtype == torch.float32 for t in pipe.state_dict().values() if t.is_floating_point()
    )
    assert losses[-1] < losses[0]


def test_compile_passes_vertical_sync_to_pipedream() -> None:
    model, x, y, loss_fn = mlp_case()
    pipe = pdcompile.compile(
        model, (x,), loss_fn=loss_fn, optimizer=SGD, cluster="3", solver="uniform",
        profile=False, schedule="pipedream", vertical_sync=True,
    )  # fmt: skip
    m = pipe.pipeline.num_microbatches
    for _ in range(3):
        pipe.train_step(x, y)
    program = pipe.pipeline.program
    stages = pipedream_reference(program, x, y, loss_fn, SGD, m, 3, vertical=True)
    reference = {n: t for st in stages for n, t in st.state_dict().items()}
    for name, tensor in pipe.state_dict().items():
        torch.testing.assert_close(tensor, reference[name], msg=name)
