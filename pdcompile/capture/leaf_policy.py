"""Which modules symbolic tracing keeps whole (leaves) and which it traces through.

Primitive layers from `torch.nn` (Linear, Conv, norms, activations, Embedding, RNNs,
MultiheadAttention, ...) are leaves: they are the units a pipeline stage is made of. Containers and
composites are traced through, so their parts can land in different stages. The transformer
composites of `torch.nn` contain an inference fast path that symbolic tracing cannot follow;
they are traced through the equivalent slow path below, so every layer comes out as its own nodes.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from pdcompile.core.errors import TraceError

_PRIMITIVE_PACKAGES = ("torch.nn.modules.", "torch.ao.nn.")

TRACED_THROUGH: tuple[type[nn.Module], ...] = (
    nn.Sequential,
    nn.ModuleList,
    nn.ModuleDict,
    nn.Transformer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)


def is_primitive(module: nn.Module) -> bool:
    """A layer defined by PyTorch itself that is not a container or a composite."""
    return type(module).__module__.startswith(_PRIMITIVE_PACKAGES) and not isinstance(
        module, TRACED_THROUGH
    )


@dataclass(frozen=True)
class LeafPolicy:
    """Decides, for each submodule met during tracing, whether it becomes one `call_module` node.

    Args:
        types: user-given module classes that are leaves (instances of subclasses too).
        names: user-given qualified names of submodules that are leaves.
        auto: qualified names turned into leaves because they could not be traced, with the reason.
    """

    types: tuple[type[nn.Module], ...] = ()
    names: frozenset[str] = frozenset()
    auto: Mapping[str, str] = field(default_factory=dict)

    def is_leaf(self, module: nn.Module, qualified_name: str) -> bool:
        return (
            qualified_name in self.names
            or qualified_name in self.auto
            or isinstance(module, self.types)
            or is_primitive(module)
        )

    def with_auto_leaf(self, qualified_name: str, reason: str) -> LeafPolicy:
        return LeafPolicy(self.types, self.names, {**self.auto, qualified_name: reason})

    @classmethod
    def from_user(
        cls, model: nn.Module, leaf_modules: Iterable[type[nn.Module] | str]
    ) -> LeafPolicy:
        """Validate `leaf_modules` (classes or qualified names) against `model`.

        Raises:
            TraceError: a name that is no submodule of `model`, or an entry of another kind.
        """
        types: list[type[nn.Module]] = []
        names: set[str] = set()
        known = dict(model.named_modules())
        for entry in leaf_modules:
            if isinstance(entry, type) and issubclass(entry, nn.Module):
                types.append(entry)
            elif isinstance(entry, str):
                if entry not in known or entry == "":
                    close = difflib.get_close_matches(entry, [n for n in known if n], n=3)
                    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
                    raise TraceError(
                        f"leaf_modules names {entry!r}, which is not a submodule of "
                        f"{type(model).__name__}{hint} (give qualified names as printed by "
                        "model.named_modules(), or module classes)"
                    )
                names.add(entry)
            else:
                raise TraceError(
                    f"leaf_modules entries must be nn.Module classes or qualified names, got "
                    f"{entry!r} of type {type(entry).__name__}"
                )
        return cls(tuple(types), frozenset(names))


def _encoder_forward(
    encoder: nn.TransformerEncoder,
    src: Any,
    mask: Any = None,
    src_key_padding_mask: Any = None,
    is_causal: bool | None = None,
) -> Any:
    # The slow path of nn.TransformerEncoder.forward. `is_causal` is only a hint next to an
    # explicit mask, so an unknown value (None) is passed on as False and the mask is used.
    output = src
    for layer in encoder.layers:
        output = layer(
            output,
            src_mask=mask,
            src_key_padding_mask=src_key_padding_mask,
            is_causal=bool(is_causal),
        )
    return encoder.norm(output) if encoder.norm is not None else output


def _encoder_layer_forward(
    layer: nn.TransformerEncoderLayer,
    src: Any,
    src_mask: Any = None,
    src_key_padding_mask: Any = None,
    is_causal: bool = False,
) -> Any:
    # The slow path of nn.TransformerEncoderLayer.forward; masks are canonicalised by the
    # MultiheadAttention leaf itself.
    x = src
    if layer.norm_first:
        x = x + layer._sa_block(layer.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
        return x + layer._ff_block(layer.norm2(x))
    x = layer.norm1(x + layer._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
    return layer.norm2(x + layer._ff_block(x))


def _decoder_forward(
    decoder: nn.TransformerDecoder,
    tgt: Any,
    memory: Any,
    tgt_mask: Any = None,
    memory_mask: Any = None,
    tgt_key_padding_mask: Any = None,
    memory_key_padding_mask: Any = None,
    tgt_is_causal: bool | None = None,
    memory_is_causal: bool = False,
) -> Any:
    # nn.TransformerDecoder.forward without its nested-tensor check.
    output = tgt
    for layer in decoder.layers:
        output = layer(
            output,
            memory,
            tgt_mask=tgt_mask,
            memory_mask=memory_mask,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
            tgt_is_causal=bool(tgt_is_causal),
            memory_is_causal=memory_is_causal,
        )
    return decoder.norm(output) if decoder.norm is not None else output


def _transformer_forward(
    transformer: nn.Transformer,
    src: Any,
    tgt: Any,
    src_mask: Any = None,
    tgt_mask: Any = None,
    memory_mask: Any = None,
    src_key_padding_mask: Any = None,
    tgt_key_padding_mask: Any = None,
    memory_key_padding_mask: Any = None,
    src_is_causal: bool | None = None,
    tgt_is_causal: bool | None = None,
    memory_is_causal: bool = False,
) -> Any:
    # nn.Transformer.forward without its shape checks, which branch on traced sizes.
    memory = transformer.encoder(
        src, mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=src_is_causal
    )
    return transformer.decoder(
        tgt,
        memory,
        tgt_mask=tgt_mask,
        memory_mask=memory_mask,
        tgt_key_padding_mask=tgt_key_padding_mask,
        memory_key_padding_mask=memory_key_padding_mask,
        tgt_is_causal=tgt_is_causal,
        memory_is_causal=memory_is_causal,
    )


# Traceable forwards of composites whose own forward symbolic tracing cannot follow.
TRACEABLE_FORWARDS: dict[type[nn.Module], Callable[..., Any]] = {
    nn.TransformerEncoder: _encoder_forward,
    nn.TransformerEncoderLayer: _encoder_layer_forward,
    nn.TransformerDecoder: _decoder_forward,
    nn.Transformer: _transformer_forward,
}
