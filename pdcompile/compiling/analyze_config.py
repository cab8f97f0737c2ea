"""`analyze`'s settings: one frozen `AnalyzeConfig`, each option documented once."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdcompile.passes.device_model import DeviceModel
from pdcompile.passes.framework_cost import FrameworkCost
from pdcompile.passes.step_costs import OptimizerFactory


@dataclass(frozen=True)
class AnalyzeConfig:
    """What `analyze` is told: its keywords.

    Attributes:
        example_kwargs: the example call's keyword inputs, as given to `trace`.
        profile: measure times on `device`; False prices nodes with `device_model` only (works
            for models on the meta device).
        device: where to profile (default: where the example inputs are). The graph is copied
            there; the model itself is never moved.
        optimizer: "sgd", "momentum" or "adam", or a factory `params -> torch.optim.Optimizer`
            (what `compile` takes): sizes the optimizer state and is the optimizer whose step
            prices each node's `optimizer_s` (timed on tensors of the node's parameter sizes;
            without profiling, the bytes it moves on the device model).
        device_model: preset name or DeviceModel for the analytic costs (default: nearest preset).
        coarsen: group nodes into at most this many layers.
        cache: profile cache: True (default directory), a directory, or False.
        num_threads: CPU threads while profiling.
        progress: show progress (`pdcompile.core.progress`: a bar on a terminal, lines in a log).
        calibration: the per-operation framework cost folded into the node times
            (`pdcompile.calibrate`, docs/costs.md): True uses the one cached for this machine,
            device and thread count (profiling measures it when none is, in about a second;
            without profiling none is measured), a `FrameworkCost` that one, False none. None
            (the default): True when profiling, False otherwise.
        loss_fn, targets: `loss_fn(output, targets) -> scalar` and targets for the example's
            rows: the loss is timed on the graph's output (forward and backward; without
            profiling, its FLOPs and bytes on the device model) into the CostGraph's
            `loss_forward_s` and `loss_backward_s`. Without both the loss is not priced (0.0).
        autocast: the dtype `compile(autocast=)` runs forwards in: the activations are
            measured under `torch.autocast` (docs/memory.md); the weights stay fp32.
        loaded_by: how many other processes train on this machine while it profiles
            (`compile`'s other ranks do, as in the run: `runtime/profile_load.py`); recorded,
            and part of the cache keys, so a profile taken alone is not reused for a loaded
            one, nor the reverse.
        rows, max_rows: the row counts the times are had at (`profiled_rows`): `rows` as given
            (with the example's), else 1, the example's and `max_rows` (the largest
            microbatch the caller will run: `compile` passes its `global_batch_size`), capped
            at `ROW_CAP`. The CostGraph keeps each node's times at each (`row_s`), and
            `scaled` reads them at any row count. `rows=()` times the example's rows alone
            (then times scale linearly). A row count the model cannot run at (a BatchNorm1d
            on 1 row) is left out, with a warning.
    """

    example_kwargs: Mapping[str, Any] | None = None
    profile: bool = True
    device: str | torch.device | None = None
    optimizer: str | OptimizerFactory = "sgd"
    device_model: str | DeviceModel | None = None
    coarsen: int | None = None
    cache: bool | str = True
    num_threads: int = 1
    progress: bool = True
    calibration: bool | FrameworkCost | None = None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    targets: Any = None
    autocast: torch.dtype | None = None
    loaded_by: int = 0
    rows: Sequence[int] | None = None
    max_rows: int | None = None
