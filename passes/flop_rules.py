"""FLOP formulas that `torch.utils.flop_counter` lacks or gets wrong, and a counter that uses them.

Two faults in torch's counter (checked on torch 2.13):

- **Attention on the CPU counts 0.** On the CPU, `F.scaled_dot_product_attention` runs
  `aten._scaled_dot_product_flash_attention_for_cpu` and its `_backward`, neither of which has a
  formula (nor do the `_fused_attention_overrideable` kernels of other backends), so the fused
  path is 0 FLOPs both ways. Only the math fallback (dropout on the CPU, a mask that needs a
  gradient, the `meta` device) is counted, through the `bmm`s it decomposes into.
- **Grouped convolutions overcount their backward by `groups`.** The `convolution_backward`
  formula prices the weight gradient as a dense convolution of the input with the output
  gradient over all `C_in x C_out` channel pairs, ignoring `groups`: a depthwise convolution's
  weight gradient comes out `channels` times its forward (the forward formula is right, since
  the weight's shape already holds `C_in / groups`).

Conventions, the same on every device and kernel so that a graph priced on `meta` matches the
one priced on the CPU or a GPU:

- Convolution: `2 * N * C_out * (C_in / groups) * prod(kernel) * prod(output positions)` forward
  (input positions for a transposed convolution); bias ignored. Backward: the input gradient
  and the weight gradient each cost what the forward does, counted only when requested
  (`output_mask`).
- Attention over `B x H` heads (query heads under grouped-query attention), `Lq` queries, `Lk`
  keys, head sizes `D` (query, key) and `Dv` (value): two matmuls forward,
  `2*B*H*Lq*Lk*D + 2*B*H*Lq*Lk*Dv`; backward four matmuls (gradients of the values, the
  probabilities, the queries and the keys), exactly twice the forward. The scores a fused
  kernel recomputes in its backward are not counted (torch's own flash/efficient/cudnn formulas
  count them, 2.5x forward; they are overridden here so the fused kernels agree with the math
  path's 2x). Causal and other masks do not change the count: the full `Lq x Lk` matrix is
  counted, as torch's formulas do. The nested-tensor entry points (`_flash_attention_*`,
  `_efficient_attention_*`) keep torch's formulas.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["FLOP_RULES", "flop_counter"]

aten = torch.ops.aten

Shape = Sequence[int]


def flop_counter() -> FlopCounterMode:
    """A silent `FlopCounterMode` with pdcompile's formulas in place of torch's."""
    return FlopCounterMode(display=False, custom_mapping=FLOP_RULES)


def convolution_flops(x_shape: Shape, w_shape: Shape, out_shape: Shape, transposed: bool) -> int:
    """FLOPs of one (possibly grouped or transposed) convolution's forward.

    The weight is `[C_out, C_in / groups, *kernel]` (`[C_in, C_out / groups, *kernel]` when
    transposed), so `w_shape[0] * w_shape[1]` is already the number of channel pairs that meet.
    """
    positions = prod((x_shape if transposed else out_shape)[2:])
    return 2 * x_shape[0] * w_shape[0] * w_shape[1] * prod(w_shape[2:]) * positions


def convolution_backward_flops(
    grad_out_shape: Shape,
    x_shape: Shape,
    w_shape: Shape,
    _bias: Any,
    _stride: Any,
    _padding: Any,
    _dilation: Any,
    transposed: bool,
    _output_padding: Any,
    _groups: int,
    output_mask: Sequence[bool],
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    """The requested input and weight gradients, each the forward's count."""
    forward = convolution_flops(x_shape, w_shape, grad_out_shape, transposed)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


def attention_flops(
    query_shape: Shape, key_shape: Shape, value_shape: Shape, *args: Any, **kwargs: Any
) -> int:
    """Scores (`Q K^T`) and output (`P V`): `2*B*H*Lq*Lk*(D + Dv)`."""
    *batch_heads, q_len, head_dim = query_shape
    k_len, v_dim = key_shape[-2], value_shape[-1]
    return 2 * prod(batch_heads) * q_len * k_len * (head_dim + v_dim)


def attention_backward_flops(
    _grad_out_shape: Shape,
    query_shape: Shape,
    key_shape: Shape,
    value_shape: Shape,
    *args: Any,
    **kwargs: Any,
) -> int:
    """Gradients of V, P, Q and K: twice the forward, scores not recomputed."""
    return 2 * attention_flops(query_shape, key_shape, value_shape)


_ATTENTION_FORWARD = (
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_fused_attention_overrideable,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
)
# Each takes (grad_out, query, key, value, ...) first.
_ATTENTION_BACKWARD = (
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_fused_attention_overrideable_backward,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
)

# Op packet -> formula on shapes (`FlopCounterMode` passes tensors as their shapes).
FLOP_RULES: dict[Any, Any] = {
    aten.convolution_backward: convolution_backward_flops,
    **dict.fromkeys(_ATTENTION_FORWARD, attention_flops),
    **dict.fromkeys(_ATTENTION_BACKWARD, attention_backward_flops),
}
