"""The errors pdcompile raises on purpose: one base class, one subclass per phase.

Every message says what was observed, which node, module or option is at fault, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "BatchError",
    "CheckpointError",
    "CodegenError",
    "ConfigError",
    "CostError",
    "LossError",
    "PartitionError",
    "PdcompileError",
    "PipelineTimeoutError",
    "PlanWarning",
    "ScheduleError",
    "SpecError",
    "StageCommError",
    "TraceError",
    "TraceWarning",
    "UnsettledProfileWarning",
]


class PdcompileError(Exception):
    """Base class of every error pdcompile raises deliberately."""


class SpecError(PdcompileError, ValueError):
    """A model spec (`package.module:factory` or `file.py:factory`) cannot be loaded."""


class TraceError(PdcompileError, RuntimeError):
    """The model cannot be captured into a graph (by any path that was tried)."""


class CostError(PdcompileError, RuntimeError):
    """A cost pass (profiling, analytic costs, coarsening) cannot label the graph."""


class PartitionError(PdcompileError, ValueError):
    """No plan exists for the given costs, cluster and options, or a plan is malformed."""


class CodegenError(PdcompileError, RuntimeError):
    """Stage modules cannot be generated from a graph and a plan."""


class ScheduleError(PdcompileError, ValueError):
    """A schedule is invalid (unmatched send/receive, missing backward, deadlock)."""


class StageCommError(PdcompileError, RuntimeError):
    """Communication between stages failed or delivered something unexpected."""


class CheckpointError(PdcompileError, RuntimeError):
    """A checkpoint cannot be written, or is partial, altered or incompatible."""


class PipelineTimeoutError(StageCommError, TimeoutError):
    """A collective or point-to-point operation waited longer than its timeout, or its peer
    died."""


class BatchError(PdcompileError, ValueError):
    """A batch given to `train_step` or `eval_step` does not fit the captured model (type,
    shape, dtype or device of an input, or rows of the targets)."""


class ConfigError(PdcompileError, ValueError):
    """A setting is invalid (of `compile`, `plan` or an executor): the message names the
    option, the value given and the remedy. Settings are checked once, when their config is
    built (`pdcompile/compiling/config.py`), before any work and on every rank."""


# A setting a phase used to check raises ConfigError of that phase's class too, so an `except`
# written for the phase's class still catches it.
class PlanConfigError(ConfigError, PartitionError):
    """A planning setting is invalid (cluster, solver, microbatches, memory, ...)."""


class ScheduleConfigError(ConfigError, ScheduleError):
    """A schedule or step setting is invalid (schedule, clipping, timeouts, non-finite losses)."""


class CostConfigError(ConfigError, CostError):
    """The optimizer setting is invalid (no factory, or one that fails on a tensor)."""


class CheckpointConfigError(ConfigError, CheckpointError):
    """An automatic checkpoint setting is invalid (`checkpoint_dir`, `checkpoint_every`)."""


class LossError(PdcompileError, ValueError):
    """The loss function failed or gave something other than a finite scalar tensor (a NaN or
    infinite loss under `nonfinite="raise"`)."""


class TraceWarning(UserWarning):
    """Capture succeeded with a compromise (for example a submodule turned into a leaf)."""


class PlanWarning(UserWarning):
    """A plan was made with a compromise (for example microbatches that do not split evenly
    over a stage's replicas, so some replicas idle)."""


class UnsettledProfileWarning(UserWarning):
    """A profile was measured with a compromise: some times were still unsettled (their median
    far above their fastest repeat, a busy machine) after the extra measuring rounds; they are
    used, and not cached."""
