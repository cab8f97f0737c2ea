"""The closed loop: re-plan from measured stage times (`decision`, torch-free) and move a
running job to the new plan (`move`)."""

from pdcompile.closed_loop.decision import Decision, Replan, StageTime, decide

__all__ = ["Decision", "Replan", "StageTime", "decide"]
