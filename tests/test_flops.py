"""Analytic FLOP counts of attention and convolutions, against counts worked out by hand.

Nodes run through the real analytic pass (`pdcompile.trace`, then `annotate_analytic`); the GPU
attention kernels, which cannot run here, are checked on the formulas the counter holds for them.
The expected figures are written out as arithmetic, not computed by the formulas under test.
Attention: forward `2*B*H*Lq*Lk*D + 2*B*H*Lq*Lk*Dv`, backward twice that, the full matrix counted
whatever the mask. Convolution: `2*N*C_out*(C_in/groups)*kh*kw*H_out*W_out` forward, the same again
for each of the input and weight gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import example

import pdcompile
from pdcompile.compiling.analysis import graph_inputs
from pdcompile.core.ir import FLOPS
from pdcompile.passes.analytic import annotate_analytic
from pdcompile.passes.flop_rules import flop_counter


class Attention(nn.Module):
    """`F.scaled_dot_product_attention` of its inputs, each scaled by a learnt gain so that all
    three need gradients, as projected queries, keys and values do."""

    def __init__(self, mask: torch.Tensor | None = None, **options: object) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))
        self.register_buffer("mask", mask)
        self.options = options

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g, mask = self.gain, self.mask
        return F.scaled_dot_product_attention(q * g, k * g, v * g, attn_mask=mask, **self.options)


def flops_of(model: nn.Module, *inputs: torch.Tensor, node: str) -> tuple[float, float]:
    """`pdcompile.flops` of the node named `node` after the analytic pass."""
    gm = pdcompile.trace(model, inputs)
    annotate_analytic(gm, graph_inputs(gm, inputs, None), "cpu")
    return next(n for n in gm.graph.nodes if n.name == node).meta[FLOPS]


def attention_flops(model: Attention, q: tuple, k: tuple, v: tuple, device: str = "cpu"):
    shapes = [torch.randn(s, device=device) for s in (q, k, v)]
    return flops_of(model.to(device), *shapes, node="scaled_dot_product_attention")


# B=2, H=4 heads, Lq=Lk=8, D=16: two matmuls of 2*B*H*Lq*Lk*D each.
SQUARE = 2 * (2 * 2 * 4 * 8 * 8 * 16)  # 32768


@pytest.mark.parametrize(
    "model",
    [
        Attention(),
        Attention(is_causal=True),
        Attention(torch.randn(8, 8)),  # additive mask
        Attention(torch.rand(8, 8) > 0.5),  # boolean mask
    ],
    ids=["plain", "causal", "float-mask", "bool-mask"],
)
def test_attention_counts_two_matmuls_forward_four_backward(model: Attention) -> None:
    forward, backward = attention_flops(model, (2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16))
    assert (forward, backward) == (SQUARE, 2 * SQUARE) == (32768, 65536)


def test_attention_with_more_keys_than_queries() -> None:
    # B=2, H=3, Lq=5, Lk=7, D=16; causal still counts the whole 5 x 7 matrix.
    forward, backward = attention_flops(
        Attention(is_causal=True), (2, 3, 5, 16), (2, 3, 7, 16), (2, 3, 7, 16)
    )
    assert forward == 2 * (2 * 2 * 3 * 5 * 7 * 16) == 13440
    assert backward == 2 * forward


def test_attention_with_a_narrower_value() -> None:
    # B=2, H=3, Lq=5, Lk=7, D=16, Dv=8 (the CPU's fused kernel needs D == Dv: the math path runs)
    forward, backward = attention_flops(Attention(), (2, 3, 5, 16), (2, 3, 7, 16), (2, 3, 7, 8))
    scores, output = 2 * 2 * 3 * 5 * 7 * 16, 2 * 2 * 3 * 5 * 7 * 8
    assert forward == scores + output == 10080
    # grad V = P^T dO and dP = dO V^T (Dv); grad Q = dS K and grad K = dS^T Q (D)
    assert backward == 2 * output + 2 * scores == 20160


def test_grouped_query_attention_counts_every_query_head() -> None:
    # 4 query heads share 2 key/value heads: each query head still does its own matmuls.
    forward, backward = attention_flops(
        Attention(enable_gqa=True), (2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)
    )
    assert (forward, backward) == (SQUARE, 2 * SQUARE)


def test_math_path_and_meta_device_count_the_same_as_the_fused_kernel() -> None:
    # Dropout sends the CPU to the math path, as does the meta device: it is counted through the
    # bmm's it decomposes into, without flop_rules, and pins the convention the kernels follow.
    shapes, expected = ((2, 4, 8, 16),) * 3, (SQUARE, 2 * SQUARE)
    assert attention_flops(Attention(dropout_p=0.5), *shapes) == expected
    assert attention_flops(Attention(is_causal=True), *shapes, device="meta") == expected


@pytest.mark.parametrize(
    "kernel",
    [
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    ],
)
def test_every_fused_attention_kernel_is_priced_alike(kernel: str) -> None:
    # The GPU kernels cannot run here: call the formulas the counter holds for them, on shapes.
    registry = flop_counter().flop_registry
    forward, backward = (
        getattr(torch.ops.aten, kernel),
        getattr(torch.ops.aten, f"{kernel}_backward"),
    )
    q = torch.empty(2, 4, 8, 16, device="meta")
    assert registry[forward](q, q, q, out_val=None) == SQUARE
    # torch's own flash/efficient/cudnn formulas also count the scores' recomputation (2.5x)
    assert registry[backward](q, q, q, q, out_val=None) == 2 * SQUARE


def conv_flops(conv: nn.Module, input_shape: tuple) -> tuple[float, float]:
    """FLOPs of `conv` behind a 1x1 convolution, so its input needs a gradient too."""
    channels = input_shape[1]
    model = nn.Sequential(nn.Conv2d(channels, channels, 1), conv)
    return flops_of(model, torch.randn(input_shape), node="_1")


@pytest.mark.parametrize(
    ("conv", "forward"),
    [
        # depthwise: N=2, C=8, 6x6 out, 1 input channel per group, 3x3 kernel
        (nn.Conv2d(8, 8, 3, padding=1, groups=8), 2 * 2 * 8 * 6 * 6 * 1 * 3 * 3),
        # grouped: N=2, C_out=16, 6x6 out, 8/4 input channels per group, 3x3 kernel
        (nn.Conv2d(8, 16, 3, padding=1, groups=4), 2 * 2 * 16 * 6 * 6 * 2 * 3 * 3),
        # grouped transposed, stride 2: 8 x 16/4 channel pairs at each of the 6x6 input positions
        (nn.ConvTranspose2d(8, 16, 3, stride=2, groups=4), 2 * 2 * 8 * 4 * 3 * 3 * 6 * 6),
        # dense (unchanged): N=2, C_out=16, 2x2 out (stride 2, no padding), C_in=8, 3x3 kernel
        (nn.Conv2d(8, 16, 3, stride=2), 2 * 2 * 16 * 2 * 2 * 8 * 3 * 3),
    ],
    ids=["depthwise", "grouped", "grouped-transposed", "dense"],
)
def test_convolution_backward_is_input_plus_weight_gradient(conv: nn.Module, forward: int) -> None:
    assert conv_flops(conv, (2, 8, 6, 6)) == (forward, 2 * forward)


def test_depthwise_convolution_without_input_gradient_counts_the_weight_gradient_only() -> None:
    forward = 2 * 2 * 8 * 6 * 6 * 1 * 3 * 3
    depthwise = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8))
    assert flops_of(depthwise, torch.randn(2, 8, 6, 6), node="_0") == (forward, forward)


def test_hugging_face_gpt2_attention_is_counted() -> None:
    pytest.importorskip("transformers")
    model, args, kwargs = example("hf_gpt2", eval_mode=True)  # no dropout: the fused kernel
    gm = pdcompile.trace(model, args, example_kwargs=kwargs)
    annotate_analytic(gm, graph_inputs(gm, args, kwargs), "cpu")
    attention = [n for n in gm.graph.nodes if "scaled_dot_product_attention" in n.name]
    # 2 layers of B=4, H=4, L=16, D=16 causal self-attention
    forward = 2 * (2 * 4 * 4 * 16 * 16 * 16)
    assert [n.meta[FLOPS] for n in attention] == [(forward, 2 * forward)] * 2
