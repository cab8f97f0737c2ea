"""The planner's searches around the solvers: the microbatch count for a fixed batch
(`microbatch_count`) and `schedule="auto"` (`schedule_choice`). Torch-free."""
