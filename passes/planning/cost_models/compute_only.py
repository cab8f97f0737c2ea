"""`compute-only`: stages balanced by their compute alone. Torch-free."""

from __future__ import annotations

from typing import Any

from pdcompile.passes.planning.cost_model import CostModel, register_cost_model


@register_cost_model("compute-only")
class ComputeOnly(CostModel):
    """Links cost nothing: transfers and all-reduces are free, stages weigh their compute and
    updates (as GPipe's and torchgpipe's balancing by time)."""

    def transfer_s(self, cut_bytes: Any, bandwidth: Any, replicas: Any) -> Any:
        return 0.0 * cut_bytes

    def ring_s(self, grad_bytes: Any, replicas: Any, bandwidth: Any) -> Any:
        return 0.0 * grad_bytes
