"""The closed loop: re-plan from measured stage times (`decision`, torch-free) and move a
running job to the new plan (`move`)."""

from pdcompile.passes.planning.replan_decision import Decision, Replan, StageTime, decide

__all__ = ["Decision", "Replan", "StageTime", "decide"]
