"""pdcompile: a compiler for pipeline-parallel training in PyTorch.

Capture a model (`trace`), label its graph with costs (`analyze`), cut it into pipeline stages,
generate one module per stage and run them with the 1F1B schedule. See README.md and docs/.

Imports are lazy: `import pdcompile` and the torch-free parts (`CostGraph`, the errors, the
solvers) work on a machine without torch; torch is imported when a name that needs it is used.
"""

from __future__ import annotations

import importlib
from typing import Any

from pdcompile.core.errors import (
    BatchError,
    CheckpointError,
    CodegenError,
    ConfigError,
    CostError,
    LossError,
    PartitionError,
    PdcompileError,
    PipelineTimeoutError,
    PlanWarning,
    ScheduleError,
    SpecError,
    StageCommError,
    TraceError,
    TraceWarning,
    UnsettledProfileWarning,
)
from pdcompile.core.version import __version__ as __version__

# public name -> module that defines it
_LAZY = {
    "trace": "pdcompile.capture.tracing",
    "analyze": "pdcompile.compiling.analysis",
    "calibrate": "pdcompile.passes.framework_cost",
    "FrameworkCost": "pdcompile.passes.framework_cost",
    "CostGraph": "pdcompile.core.cost_graph",
    "DeviceModel": "pdcompile.passes.device_model",
    "Cluster": "pdcompile.core.cluster",
    "Plan": "pdcompile.passes.planning.plans",
    "Stage": "pdcompile.passes.planning.plans",
    "evaluate": "pdcompile.passes.planning.evaluation",
    "plan": "pdcompile.passes.planning.planner",
    "register_solver": "pdcompile.passes.planning.solver_kit",
    "register_schedule": "pdcompile.scheduling.registry",
    "schedules": "pdcompile.scheduling.registry",
    "PipelineSchedule": "pdcompile.scheduling.base",
    "register_cost_model": "pdcompile.passes.planning.cost_model",
    "CostModel": "pdcompile.passes.planning.cost_model",
    "solvers": "pdcompile.passes.planning.solver_kit",
    "codegen": "pdcompile.lowering.stage_codegen",
    "compile": "pdcompile.compiler",
    "PlanConfig": "pdcompile.passes.planning.plan_config",
    "TrainConfig": "pdcompile.runtime.train_config",
    "Replan": "pdcompile.passes.planning.replan_decision",
    "PipelinedModule": "pdcompile.compiling.pipelined_module",
    "StagedProgram": "pdcompile.lowering.staged_program",
    "load_full_state_dict": "pdcompile.runtime.checkpoint",
    "Simulation": "pdcompile.passes.planning.simulator",
    "simulate": "pdcompile.passes.planning.simulator",
}
_SUBMODULES = {"ir": "pdcompile.core.ir", "zoo": "pdcompile.zoo", "passes": "pdcompile.passes",
               "runtime": "pdcompile.runtime"}  # fmt: skip

__all__ = [
    "BatchError",
    "CheckpointError",
    "Cluster",
    "CodegenError",
    "ConfigError",
    "CostError",
    "CostModel",
    "CostGraph",
    "DeviceModel",
    "FrameworkCost",
    "LossError",
    "PartitionError",
    "PdcompileError",
    "PipelineSchedule",
    "PipelineTimeoutError",
    "Plan",
    "PlanConfig",
    "PlanWarning",
    "Replan",
    "ScheduleError",
    "Simulation",
    "SpecError",
    "Stage",
    "StageCommError",
    "StagedProgram",
    "TraceError",
    "TraceWarning",
    "TrainConfig",
    "UnsettledProfileWarning",
    "analyze",
    "calibrate",
    "codegen",
    "evaluate",
    "ir",
    "load_full_state_dict",
    "plan",
    "register_cost_model",
    "register_schedule",
    "register_solver",
    "schedules",
    "simulate",
    "solvers",
    "trace",
    "zoo",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
    else:
        raise AttributeError(f"module 'pdcompile' has no attribute {name!r}")
    if name == "schedules":  # pdcompile.schedules.from_torch_csv, .to_torch_csv
        from pdcompile.scheduling import torch_csv

        value.from_torch_csv, value.to_torch_csv = torch_csv.from_torch_csv, torch_csv.to_torch_csv
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
