"""pdcompile: a compiler for pipeline-parallel training in PyTorch.

Capture a model (`trace`), label its graph with costs, cut it into pipeline stages, generate one
module per stage and run them with the 1F1B schedule. See README.md and docs/.
"""

from pdcompile import ir, zoo
from pdcompile.errors import (
    CheckpointError,
    CodegenError,
    CostError,
    PartitionError,
    PdcompileError,
    PipelineTimeoutError,
    ScheduleError,
    SpecError,
    StageCommError,
    TraceError,
    TraceWarning,
)
from pdcompile.tracing import trace

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CodegenError",
    "CostError",
    "PartitionError",
    "PdcompileError",
    "PipelineTimeoutError",
    "ScheduleError",
    "SpecError",
    "StageCommError",
    "TraceError",
    "TraceWarning",
    "ir",
    "trace",
    "zoo",
]
