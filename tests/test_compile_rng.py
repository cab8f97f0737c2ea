"""`compile` and `analyze` draw nothing from the caller's random generators: what they do inside
(a cluster measured or read from its cache, a profile's adaptive repeats, the capture's runs of
the model) never changes the dropout masks training draws afterwards.

The bug this guards (issue 31's soak): a cached cluster whose re-check failed under load was
measured again, and the measurement's probe modules drew their initial weights from the global
generator, so two runs of one seed trained on different dropout masks whenever the machine was
busy, and a resumed run differed from an uninterrupted one."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from spawn import run_ranks

import pdcompile
from pdcompile import zoo
from pdcompile.runtime.distributed import init_process_group

CONFIG = zoo.GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.5)


def _gpt() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.block_size))
    return zoo.GPT(CONFIG).train(), x, torch.roll(x, -1, dims=1)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def test_a_local_compile_with_a_profile_leaves_the_generator_where_it_was() -> None:
    model, x, y = _gpt()
    before = torch.get_rng_state()
    pipe = pdcompile.compile(model, (x,), loss_fn=_loss, optimizer=_sgd, cluster=2,
                             example_targets=y)  # fmt: skip
    assert torch.equal(torch.get_rng_state(), before)
    pipe.train_step(x, y)  # training draws its dropout masks from the caller's generator
    assert not torch.equal(torch.get_rng_state(), before)


def test_analyze_leaves_the_generator_where_it_was() -> None:
    model, x, _ = _gpt()
    gm = pdcompile.trace(model, (x,))
    before = torch.get_rng_state()
    pdcompile.analyze(gm, (x,))
    assert torch.equal(torch.get_rng_state(), before)


def _measured(rank: int, world_size: int, init_file: str, cache: str) -> bool:
    os.environ["PDCOMPILE_CACHE_DIR"] = cache  # empty: the cluster is measured
    init_process_group(rank, world_size, init_file=init_file, timeout_s=120)
    model, x, y = _gpt()
    before = torch.get_rng_state()
    pipe = pdcompile.compile(model, (x,), loss_fn=_loss, optimizer=_sgd, solver="uniform",
                             profile=False)  # fmt: skip
    kept = torch.equal(torch.get_rng_state(), before)
    assert "measured" in pipe.explain(), pipe.explain()
    pipe.close()
    dist.destroy_process_group()
    return kept


def test_measuring_the_cluster_draws_nothing_from_any_rank_s_generator(tmp_path) -> None:
    assert run_ranks(_measured, 2, str(tmp_path / "cache"), timeout_s=180) == [True, True]
