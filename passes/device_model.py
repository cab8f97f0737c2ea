"""Roofline device models: turn FLOPs and bytes moved into seconds for hardware you may not have.

time = overhead_s + max(flops / peak_flops, bytes / memory_bandwidth)

Presets (dense peaks a well-tuned kernel approaches; tensor-core rates for GPUs, which PyTorch
uses for float32 matmuls only with TF32 enabled, so treat GPU numbers as bf16/TF32 training):

| name | peak FLOP/s | memory bandwidth | overhead per op | basis |
|---|---|---|---|---|
| `cpu` | 5.0e10 | 2.0e10 B/s | 5 us | one x86-64 core with AVX2 FMA, one DRAM channel share |
| `a100` | 3.12e14 | 2.0e12 B/s | 5 us | A100 80GB SXM, bf16 dense, HBM2e |
| `h100` | 9.89e14 | 3.35e12 B/s | 4 us | H100 SXM, bf16 dense, HBM3 |
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcompile.core.errors import CostError


@dataclass(frozen=True)
class DeviceModel:
    """A device as a roofline: peak FLOP/s, memory bandwidth (bytes/s) and a fixed cost per op."""

    peak_flops: float
    memory_bandwidth: float
    overhead_s: float = 0.0
    name: str = "custom"

    def __post_init__(self) -> None:
        if not (self.peak_flops > 0 and self.memory_bandwidth > 0 and self.overhead_s >= 0):
            raise CostError(
                f"DeviceModel needs peak_flops > 0, memory_bandwidth > 0 and overhead_s >= 0, "
                f"got {self.peak_flops}, {self.memory_bandwidth}, {self.overhead_s}"
            )

    def time(self, flops: float, bytes_moved: float) -> float:
        """Seconds for an operation doing `flops` and moving `bytes_moved`."""
        return self.overhead_s + max(flops / self.peak_flops, bytes_moved / self.memory_bandwidth)

    @classmethod
    def get(cls, spec: str | DeviceModel) -> DeviceModel:
        """A preset by name (`cpu`, `a100`, `h100`), or `spec` itself."""
        if isinstance(spec, DeviceModel):
            return spec
        try:
            return PRESETS[spec.lower()]
        except (KeyError, AttributeError):
            raise CostError(
                f"unknown device model {spec!r}; presets: {', '.join(PRESETS)}, or pass "
                "DeviceModel(peak_flops, memory_bandwidth)"
            ) from None


PRESETS = {
    "cpu": DeviceModel(5.0e10, 2.0e10, 5e-6, "cpu"),
    "a100": DeviceModel(3.12e14, 2.0e12, 5e-6, "a100"),
    "h100": DeviceModel(9.89e14, 3.35e12, 4e-6, "h100"),
}
