"""pdcompile: a compiler for pipeline-parallel training in PyTorch.

Capture a model (`trace`), label its graph with costs (`analyze`), cut it into pipeline stages,
generate one module per stage and run them with the 1F1B schedule. See README.md and docs/.

Imports are lazy: `import pdcompile` and the torch-free parts (`CostGraph`, the errors, the
solvers) work on a machine without torch; torch is imported when a name that needs it is used.
"""

from __future__ import annotations

import importlib
from typing import Any

from pdcompile.errors import (
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

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "trace": "pdcompile.capture.tracing",
    "analyze": "pdcompile.analysis",
    "calibrate": "pdcompile.passes.framework_cost",
    "FrameworkCost": "pdcompile.passes.framework_cost",
    "CostGraph": "pdcompile.cost_graph",
    "DeviceModel": "pdcompile.passes.device_model",
    "Cluster": "pdcompile.cluster",
    "Plan": "pdcompile.plans",
    "Stage": "pdcompile.plans",
    "evaluate": "pdcompile.evaluation",
    "plan": "pdcompile.planning",
    "register_solver": "pdcompile.planning",
    "register_schedule": "pdcompile.schedules.registry",
    "schedules": "pdcompile.schedules.registry",
    "PipelineSchedule": "pdcompile.schedules.base",
    "register_cost_model": "pdcompile.cost_model",
    "CostModel": "pdcompile.cost_model",
    "solvers": "pdcompile.planning",
    "codegen": "pdcompile.codegen.stage_codegen",
    "compile": "pdcompile.compiler",
    "PlanConfig": "pdcompile.compiling.plan_config",
    "TrainConfig": "pdcompile.compiling.train_config",
    "Replan": "pdcompile.closed_loop.decision",
    "PipelinedModule": "pdcompile.pipelined_module",
    "StagedProgram": "pdcompile.codegen.staged_program",
    "load_full_state_dict": "pdcompile.runtime.checkpoint",
    "Simulation": "pdcompile.runtime.simulator",
    "simulate": "pdcompile.runtime.simulator",
}
_SUBMODULES = ("ir", "zoo", "passes", "runtime")

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
        # importing pdcompile.codegen's module made the (callable) package the attribute: keep it
        value = globals().get(name, value)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"pdcompile.{name}")
    else:
        raise AttributeError(f"module 'pdcompile' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
