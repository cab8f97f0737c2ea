"""Every kind of action, in one table: what it computes, what it holds, how it is priced and drawn.
Torch-free.

The builder, the validator, the simulator, the memory walks, the pictures and the closed loop
read the kinds from here and compare no kind name of their own; the workers run an action by the
method named after its letter (`StageWorker._F`). Adding a kind is a row below, the worker's
method that computes it, and the schedule whose orders use it.

A compute kind is an item of a schedule's order: the work of one microbatch at one stage. Its
row says what it receives before it and sends after it (`act`ivations forward, `grad`ients
back), what it does to the microbatches the stage holds (`holds`: the change to the count
holding all their activations and to the count holding only what the weight gradient reads),
whether it adds to the weights' gradients (`accumulates`), and which seconds of the stage it
takes (`seconds`: `Stage` fields, summed).

An overlapped pair (`FB`, DualPipe's and torch's `OVERLAP_F_B`) is a forward and a backward part,
of two microbatches and maybe two stages of one rank, run as one so that a GPU can overlap them.
It is written as a bracket, in orders and in actions alike: the `FB` item, then its two parts as
ordinary compute items (`overlapped` writes the three). The builder puts the parts' receives
before the bracket and their sends after both parts. Everything that only needs the work
(the validator's `needs`, the memory walks, the closed loop's measured stage times, the workers'
`F` and `B`) reads the parts as any other compute; only what the overlap changes reads the
bracket (`brackets`): the simulator's price, a GPU's streams, the pictures. So an action stays a
tuple of eight small fields, with none for a second microbatch on millions of actions. On a CPU
the parts run one after the other, the forward first, as DualPipe runs a pair it cannot
overlap: a forward's activations are then held before the backward frees its own, what a GPU
running both at once holds too, so the memory walks are right for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# what a compute kind computes
FORWARD = "forward"
BACKWARD = "backward"  # the fused backward: input and weight gradients in one pass
INPUT_GRADIENTS = "input gradients"  # a split backward's first part
WEIGHT_GRADIENTS = "weight gradients"  # its second part

ACT, GRAD = "act", "grad"  # the two message streams


@dataclass(frozen=True)
class ActionKind:
    """One row of the table (docs in the module).

    Attributes:
        letter: the `Action.kind` it is written as.
        label, colour: its legend entry and colour in Gantt charts.
        computes: for a compute kind, what it computes (`FORWARD`, `BACKWARD`, ...); "" for the
            others (messages, collectives, updates, weight versions).
        receives, sends: the stream it receives before it and sends after it (compute kinds).
        starts: it begins a microbatch at its stage (a forward: the weight version is stashed
            before it, its input given by the batch).
        ends: it ends a microbatch at its stage (its activations are all freed, a stashed
            version dropped after it, a round's update may follow).
        needs: the compute kinds of the same (stage, microbatch) that must run before it.
        holds: (all activations, weight-gradient activations): how it changes the counts of
            microbatches the stage holds, at its start for a kind that `starts`, else at its end.
        recomputes: a recomputing stage runs the forward again inside it.
        recompute_inside: of it, what it recomputes is held inside it only (the memory a CPU
            probe cannot see).
        accumulates: it adds gradients to the weights' (from its end to the update).
        autograd_gradients: the gradients it adds come from autograd's accumulation, which the
            replicas' bucket hooks see (a split backward's W adds some by hand).
        seconds: the `Stage` fields whose sum prices it in the simulator.
        drawn_as_idle: Gantt charts draw it hatched, as waiting.
        thin: Gantt charts draw it as a thin box (it may overlap compute).
        collective: the ranks of its `group` take part together.
        brackets: it opens an overlapped pair: the compute actions right after it (a forward,
            then a backward part: `overlappable`) that run as one.
    """

    letter: str
    label: str = ""
    colour: str = ""
    computes: str = ""
    receives: str = ""
    sends: str = ""
    starts: bool = False
    ends: bool = False
    needs: tuple[str, ...] = ()
    holds: tuple[int, int] = (0, 0)
    recomputes: bool = False
    recompute_inside: bool = False
    accumulates: bool = False
    autograd_gradients: bool = False
    seconds: tuple[str, ...] = ()
    drawn_as_idle: bool = False
    thin: bool = False
    collective: bool = False
    brackets: int = 0

    @property
    def is_compute(self) -> bool:
        return bool(self.computes)


TABLE = (
    ActionKind("F", "forward", "#4c72b0", FORWARD, receives=ACT, sends=ACT, starts=True,
               holds=(1, 0), seconds=("forward_s",)),
    ActionKind("B", "backward", "#55a868", BACKWARD, receives=GRAD, sends=GRAD, ends=True,
               needs=("F",), holds=(-1, 0), recomputes=True, recompute_inside=True,
               accumulates=True, autograd_gradients=True, seconds=("backward_s",)),
    ActionKind("I", "backward, input part", "#8cc79b", INPUT_GRADIENTS, receives=GRAD,
               sends=GRAD, needs=("F",), holds=(-1, 1), recomputes=True,
               seconds=("backward_input_s",)),
    ActionKind("W", "backward, weight part", "#2f7a45", WEIGHT_GRADIENTS, ends=True,
               needs=("I",), holds=(0, -1), accumulates=True, seconds=("backward_weight_s",)),
    ActionKind("send", "send (communication)", "#dd8452", thin=True),
    ActionKind("recv", "idle: waiting for a message", "#e4e4e4", drawn_as_idle=True, thin=True),
    ActionKind("allreduce", "all-reduce (communication)", "#c44e52", collective=True),
    ActionKind("clip", "clip", "#8172b3", collective=True),
    ActionKind("check", collective=True),
    ActionKind("step", "optimizer step", "#937860"),
    ActionKind("FB", "overlapped forward and backward", "#000000", brackets=2),
    ActionKind("push"),
    ActionKind("pop"),
)  # fmt: skip
KINDS: dict[str, ActionKind] = {k.letter: k for k in TABLE}

# the letters, for the code that builds or reads actions (never the strings themselves)
F, B, I, W = "F", "B", "I", "W"  # noqa: E741
SEND, RECV, ALLREDUCE, CLIP, CHECK, STEP, PUSH, POP = (
    "send", "recv", "allreduce", "clip", "check", "step", "push", "pop",
)  # fmt: skip
OVERLAP = "FB"
assert set(KINDS) == {F, B, I, W, SEND, RECV, ALLREDUCE, CLIP, CHECK, STEP, PUSH, POP, OVERLAP}

COMPUTE = tuple(k.letter for k in TABLE if k.is_compute)  # F, B, I, W
FUSED = (F, B)  # a schedule's compute kinds with a fused backward
SPLIT = (F, I, W)  # and with the backward split into input and weight gradients
UPDATES = (CHECK, CLIP, STEP)  # what a rank runs once per update besides its all-reduces


def kind(letter: str) -> ActionKind:
    """The row of `letter` (an unknown one: a row that computes nothing)."""
    return KINDS.get(letter) or ActionKind(letter)


def is_compute(letter: str) -> bool:
    """Whether actions of kind `letter` are compute items of a schedule's order."""
    return letter in COMPUTE


def compute_kinds(items_per_microbatch: int) -> tuple[str, ...]:
    """The compute kinds a schedule's orders hold per microbatch and stage: `FUSED` (2 items)
    or `SPLIT` (3)."""
    return FUSED if items_per_microbatch == len(FUSED) else SPLIT


def ways(kinds: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """The ways a schedule of compute `kinds` may run one microbatch at one stage: `FUSED`
    only, or, splitting backwards, `SPLIT` or `FUSED` (a split schedule may fuse some
    backwards, as `dualpipev` does where DualPipe does)."""
    return (FUSED,) if kinds == FUSED else (SPLIT, FUSED)


def overlapped(
    forward: tuple[int, int], backward: tuple[int, int], part: str = B
) -> list[tuple[str, int, int]]:
    """The order items of the forward of (stage, microbatch) `forward` and the backward `part`
    of `backward` run as one pair: the bracket (named after its forward), then the two.

    >>> overlapped((0, 5), (1, 2))
    [('FB', 0, 5), ('F', 0, 5), ('B', 1, 2)]
    """
    return [(OVERLAP, *forward), (F, *forward), (part, *backward)]


def overlappable(letters: Sequence[str]) -> bool:
    """Whether compute kinds `letters`, in order, may form an overlapped pair: a forward, then
    a backward part (`B`, `I` or `W`)."""
    return (
        len(letters) == 2
        and kind(letters[0]).starts
        and is_compute(letters[1])
        and not kind(letters[1]).starts
    )


def needs_microbatch(letter: str, stream: str = "") -> bool:
    """Whether an action needs its microbatch to have been given (a stream's call may stop before
    it): one that starts the microbatch at its stage, a bracket (named after its forward), its
    weight version's stash, or a message of its activations."""
    row = kind(letter)
    message = letter in (SEND, RECV) and stream == ACT
    return row.starts or bool(row.brackets) or letter == PUSH or message
