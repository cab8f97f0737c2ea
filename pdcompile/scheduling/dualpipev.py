"""`dualpipev`: DeepSeek-V3's DualPipe cut in half (DualPipeV): two stages per rank in a V,
one copy of the parameters, forwards and backwards of two microbatches overlapped.

The model is cut into 2p stages on p ranks as for `zb-v`: the rank at position r runs stage r
(down the V) and stage 2p - 1 - r (back up). Each rank's order is DeepSeek's
(github.com/deepseek-ai/DualPipe, `dualpipev.py`) and torch's `ScheduleDualPipeV`, action for
action (`tests/test_dualpipev.py` compares them), in eight phases:

1. 2(p - r - 1) forwards down;
2. r + 1 times a forward down and one up;
3. p - r - 1 times a split backward up (I, then its W at once) and a forward up;
4. M - 2p + r + 1 times a forward down overlapped with a backward up, then a forward up
   overlapped with a backward down (the last rank runs its first pair down, at the turn of the
   V, as a forward and a backward of their own: its forward's sends leave before the backward,
   which DeepSeek does to shorten the bubble);
5. p - r - 1 times a backward up, then a forward up overlapped with a backward down;
6. r + 1 times a backward up and one down, the first r + 1 of these fused, the rest split;
7. p - r - 1 times the oldest W due and a split backward down;
8. the r + 1 W's still due, oldest first.

Overlapped pairs are `FB` brackets (`action_kinds.overlapped`: the forward, then the fused
backward); the backwards are fused (`B`) where DualPipe's are and split (`I`, then `W`) where
it fills bubbles with the weight gradients. Needs M >= 2p, one microbatch per stage, as both
references (fewer leave phase 4 of rank 0 empty). Synchronous: one update per step.

Equal stages (F, I, W per microbatch and stage; B = I + W), the pairs run one after the other
(`RuntimeCosts.fb_overlap` 0, a CPU), M >= 2p: a call takes
2M(F + I + W) + max((p - 2)F + (p - 1)I, 2(p - 1)F) + (p - 1) max(0, I - W),
and each rank holds at most 2p + 1 microbatch-chunks of activations (counting those whose W is
pending): DeepSeek's PP + 1 on PP = 2p stages. With F = I = W the call's idle time is
2(p - 1)F, DeepSeek's (PP/2 - 1)(F&B + B - 3W) with F&B = F + B, which is exact whenever
F = I >= W and a simplification otherwise. These forms were read off the longest paths through
the orders (p = 2 to 6) and are checked against simulation on random stage times up to p = 16
(`tests/test_dualpipev.py`, `tests/test_schedule_conformance.py`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from pdcompile.scheduling.action_kinds import B, F, I, W, overlapped
from pdcompile.scheduling.base import PipelineSchedule
from pdcompile.scheduling.chunks import VPlacement
from pdcompile.scheduling.closed_forms import ClosedForms, split_parts, v_bubble
from pdcompile.scheduling.placement import Item
from pdcompile.scheduling.registry import register_schedule


class _Order:
    """One rank's order as it is written: the next microbatch of each stage's forwards and
    backwards, and the split backwards whose W is due, oldest first."""

    def __init__(self, down: int, up: int) -> None:
        self.items: list[Item] = []
        self.forwards = {down: 0, up: 0}
        self.backwards = {down: 0, up: 0}
        self.due: deque[tuple[int, int]] = deque()

    def _next(self, counts: dict[int, int], stage: int) -> tuple[int, int]:
        counts[stage] += 1
        return stage, counts[stage] - 1

    def forward(self, stage: int) -> None:
        self.items.append((F, *self._next(self.forwards, stage)))

    def backward(self, stage: int, split: bool = False) -> None:
        """A fused backward, or with `split` its input part I (its W falls due)."""
        stage, k = self._next(self.backwards, stage)
        self.items.append((I if split else B, stage, k))
        if split:
            self.due.append((stage, k))

    def weight(self) -> None:
        """The oldest W due."""
        self.items.append((W, *self.due.popleft()))

    def pair(self, forward: int, backward: int) -> None:
        """A forward of stage `forward` overlapped with a fused backward of `backward`."""
        self.items += overlapped(self._next(self.forwards, forward),
                                 self._next(self.backwards, backward))  # fmt: skip


def dualpipev_order(p: int, num_microbatches: int, position: int) -> list[Item]:
    """The DualPipeV order of the rank at `position` (0 to p - 1) of p, for M >= 2p
    microbatches (the phases in the module's docstring)."""
    r, m = position, num_microbatches
    down, up = r, 2 * p - 1 - r
    order = _Order(down, up)
    for _ in range(2 * (p - r - 1)):
        order.forward(down)
    for _ in range(r + 1):
        order.forward(down)
        order.forward(up)
    for _ in range(p - r - 1):
        order.backward(up, split=True)
        order.weight()
        order.forward(up)
    for i in range(m - 2 * p + r + 1):
        if i == 0 and r == p - 1:  # the turn of the V: not overlapped
            order.forward(down)
            order.backward(up)
        else:
            order.pair(down, up)
        order.pair(up, down)
    for _ in range(p - r - 1):
        order.backward(up)
        order.pair(up, down)
    for j in range(2 * (r + 1)):
        order.backward(down if j % 2 else up, split=j > r)
    for _ in range(p - r - 1):
        order.weight()
        order.backward(down, split=True)
    while order.due:
        order.weight()
    return order.items


def _step_time(
    rules: DualPipeV, num_stages: int, num_microbatches: int, forward_s: float,
    backward_s: float, *, weight_s: float | None = None, chunks: int = 2,
) -> float:  # fmt: skip
    """2M(F + I + W) + max((p - 2)F + (p - 1)I, 2(p - 1)F) + (p - 1) max(0, I - W), p =
    num_stages / 2 (one rank: 2M(F + I + W)). Two stages per rank, whatever `chunks`."""
    f, (i, w) = forward_s, split_parts(backward_s, weight_s)
    p, m = num_stages // 2, num_microbatches
    fill = max((p - 2) * f + (p - 1) * i, 2 * (p - 1) * f) + (p - 1) * max(0.0, i - w)
    return 2 * m * (f + i + w) + fill


def _in_flight(
    rules: DualPipeV, replicas: Sequence[int], stage: int, num_microbatches: int, *,
    chunks: int = 2,
) -> int:  # fmt: skip
    """Microbatch-chunks the rank running `stage` holds, its two stages together: 2p + 1."""
    return len(replicas) + 1


@register_schedule("dualpipev")
class DualPipeV(VPlacement, PipelineSchedule):
    """DualPipeV: DeepSeek's DualPipe halved, a V of two stages per rank, overlapped F+B pairs."""

    meaning = (
        "synchronous (DeepSeek's DualPipeV): two stages per rank in a V (rank r runs stages r "
        "and 2p - 1 - r), one copy of the weights; in the steady state each forward runs "
        "overlapped with a backward of another microbatch (one after the other on a CPU), and "
        "the warm-up and cool-down split backwards to fill bubbles with weight gradients; every "
        "stage updates once per step from all microbatches: exactly single-process gradient "
        "accumulation."
    )
    items_per_microbatch = 3  # some backwards split (the fused ones are `action_kinds.ways`)
    fewest_beyond = 0
    fewest_why = " (one per stage, as DeepSeek's and torch's DualPipeV)"
    closed_forms = ClosedForms(
        step_time=_step_time, bubble=v_bubble(_step_time), in_flight=_in_flight
    )

    def v_rank_order(self, p: int, num_microbatches: int, position: int) -> list[Item]:
        return dualpipev_order(p, num_microbatches, position)
