"""The conformance suite's architectures: tiny configs, random weights, a batch, its targets and a
loss (docs/conformance.md).

Every builder returns a `Case` `(model, example_inputs, example_kwargs, targets, loss_fn)`: the
model in train mode with every dropout, layer drop and drop path set to 0 (so that a pipeline and
its single-process reference compute the same thing), `BATCH` rows, and `loss_fn(output,
targets)` taking the model's output as `compile` gives it (a Hugging Face `ModelOutput`, a tensor).
Hugging Face models are built from their config classes (no download); `transformers` is needed
for them only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from pdcompile import zoo

BATCH = 8  # rows: 2 per microbatch on 2 stages (4 microbatches)
SEQ = 16  # tokens
VOCAB = 128
CLASSES = 10
IMAGE = 32  # pixels per side (Hugging Face vision)
SMALL_IMAGE = 16  # the classic networks written here


class Case(NamedTuple):
    model: nn.Module
    example_inputs: tuple
    example_kwargs: dict[str, Any]
    targets: Tensor
    loss_fn: Callable[[Any, Tensor], Tensor]


class Architecture(NamedTuple):
    name: str
    family: str  # decoder, encoder, seq2seq, vision, classic
    build: Callable[[], Case]


def logits_of(output: Any) -> Tensor:
    """The logits of a model's output: the tensor itself, a `ModelOutput`'s (a dict) `logits`, or
    a tuple's first item."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping):
        return output["logits"]
    return output[0]


def token_loss(output: Any, targets: Tensor) -> Tensor:
    """Cross entropy of every position's logits [B, T, V] against targets [B, T]."""
    logits = logits_of(output)
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def class_loss(output: Any, targets: Tensor) -> Tensor:
    """Cross entropy of logits [B, C] (or [B, C, H, W] against [B, H, W]) against targets."""
    return F.cross_entropy(logits_of(output).float(), targets)


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        yield


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError("Hugging Face architectures need transformers: the 'hf' extra") from e
    return transformers


def _no_dropout(config: Any) -> Any:
    """Every dropout-like probability of a Hugging Face config set to 0 (dropout, layer drop,
    drop path, drop connect), so the pipeline and the reference draw nothing random."""
    for key, value in list(vars(config).items()):
        if "drop" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def _tokens(high: int = VOCAB, length: int = SEQ) -> Tensor:
    return torch.randint(3, high, (BATCH, length))  # [B, T]; 0-2 are pad, bos, eos


def _hf(model_class: str, config_class: str, seed: int, **config: Any) -> nn.Module:
    tf = _transformers()
    with _seeded(seed):
        cfg = _no_dropout(getattr(tf, config_class)(**config))
        return getattr(tf, model_class)(cfg).train()


# ---- decoders: next-token cross entropy over the logits ----

_DECODER = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def _causal_lm(prefix: str, seed: int, constants: dict | None = None, **config: Any) -> Case:
    """`constants`: non-tensor keyword arguments of the call (bound into the graph)."""
    model = _hf(f"{prefix}ForCausalLM", f"{prefix}Config", seed, **{**_DECODER, **config})
    with _seeded(seed):
        ids = _tokens()
    kwargs = {"input_ids": ids, **(constants or {})}
    return Case(model, (), kwargs, torch.roll(ids, -1, dims=1), token_loss)


def gpt2() -> Case:
    tf = _transformers()
    with _seeded(100):
        cfg = _no_dropout(tf.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        ))  # fmt: skip
        model, ids = tf.GPT2LMHeadModel(cfg).train(), _tokens()
    kwargs = {"input_ids": ids, "return_dict": True}  # a constant, bound into the graph
    return Case(model, (), kwargs, torch.roll(ids, -1, dims=1), token_loss)


def bloom() -> Case:
    tf = _transformers()
    with _seeded(101):
        cfg = _no_dropout(tf.BloomConfig(
            vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, pad_token_id=0,
            bos_token_id=1, eos_token_id=2,
        ))  # fmt: skip
        model, ids = tf.BloomForCausalLM(cfg).train(), _tokens()
    return Case(model, (), {"input_ids": ids}, torch.roll(ids, -1, dims=1), token_loss)


def llama() -> Case:
    return _causal_lm("Llama", 102)


def mistral() -> Case:
    return _causal_lm("Mistral", 103, sliding_window=8)


def mixtral() -> Case:
    """Routing by data (top-k, in-place div_, index_add_); trained with use_cache=False passed."""
    return _causal_lm("Mixtral", 104, {"use_cache": False}, num_local_experts=4,
                      num_experts_per_tok=2)  # fmt: skip


def qwen2_moe() -> Case:
    return _causal_lm("Qwen2Moe", 105, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=64)  # fmt: skip


def olmoe() -> Case:
    return _causal_lm("Olmoe", 106, num_experts=4, num_experts_per_tok=2)


def qwen3_moe() -> Case:
    return _causal_lm("Qwen3Moe", 107, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, head_dim=16)  # fmt: skip


def qwen2() -> Case:
    return _causal_lm("Qwen2", 108)


def qwen3() -> Case:
    return _causal_lm("Qwen3", 109, head_dim=16)


def gemma() -> Case:
    return _causal_lm("Gemma", 110, head_dim=16)


def gemma2() -> Case:
    return _causal_lm("Gemma2", 111, head_dim=16, sliding_window=8)


def phi() -> Case:
    return _causal_lm("Phi", 112, num_key_value_heads=4)


def phi3() -> Case:
    return _causal_lm("Phi3", 113)


def gpt_neox() -> Case:
    return _causal_lm("GPTNeoX", 114)


def opt() -> Case:
    return _causal_lm("OPT", 115, ffn_dim=128, word_embed_proj_dim=64)


def falcon() -> Case:
    return _causal_lm("Falcon", 116, num_kv_heads=4)


def stablelm() -> Case:
    return _causal_lm("StableLm", 117)


def starcoder2() -> Case:
    return _causal_lm("Starcoder2", 118)


# ---- encoders: masked-LM or sequence-classification heads ----

_ENCODER = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=128, max_position_embeddings=64, pad_token_id=0,
)  # fmt: skip


def _encoder(model_class: str, config_class: str, seed: int, head: str, **config: Any) -> Case:
    """`head` "mlm": token cross entropy over the vocabulary; "cls": CLASSES-way classification."""
    extra = {"num_labels": CLASSES} if head == "cls" else {}
    model = _hf(model_class, config_class, seed, **{**_ENCODER, **extra, **config})
    with _seeded(seed):
        ids = _tokens()
        mask = torch.ones_like(ids)
        mask[: BATCH // 2, -3:] = 0  # padded rows: the mask reaches the attention
        targets = _tokens() if head == "mlm" else torch.randint(0, CLASSES, (BATCH,))
    loss = token_loss if head == "mlm" else class_loss
    return Case(model, (), {"input_ids": ids, "attention_mask": mask}, targets, loss)


def bert() -> Case:
    return _encoder("BertForMaskedLM", "BertConfig", 200, "mlm")


def roberta() -> Case:
    return _encoder("RobertaForMaskedLM", "RobertaConfig", 201, "mlm", pad_token_id=1)


def deberta_v2() -> Case:
    return _encoder("DebertaV2ForSequenceClassification", "DebertaV2Config", 202, "cls",
                    relative_attention=True, pos_att_type=["p2c", "c2p"],
                    max_relative_positions=32)  # fmt: skip


def distilbert() -> Case:
    return _encoder("DistilBertForMaskedLM", "DistilBertConfig", 203, "mlm",
                    dim=64, n_layers=2, n_heads=4, hidden_dim=128)  # fmt: skip


def albert() -> Case:
    """One layer's weights shared by both layers (ALBERT's cross-layer sharing)."""
    return _encoder("AlbertForMaskedLM", "AlbertConfig", 204, "mlm", embedding_size=32)


def electra() -> Case:
    return _encoder("ElectraForSequenceClassification", "ElectraConfig", 205, "cls",
                    embedding_size=32)  # fmt: skip


# ---- encoder-decoders: decoder_input_ids and use_cache=False given, token cross entropy on the
# logits ----

_SEQ2SEQ = dict(
    vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
    max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    decoder_start_token_id=1,
)  # fmt: skip


def _seq2seq(model_class: str, config_class: str, seed: int, **config: Any) -> Case:
    model = _hf(model_class, config_class, seed, **{**_SEQ2SEQ, **config})
    with _seeded(seed):
        ids, labels = _tokens(), _tokens(length=SEQ // 2)
    decoder_ids = torch.cat([torch.ones_like(labels[:, :1]), labels[:, :-1]], dim=1)  # shifted
    kwargs = {"input_ids": ids, "decoder_input_ids": decoder_ids, "use_cache": False}
    return Case(model, (), kwargs, labels, token_loss)


def t5() -> Case:
    tf = _transformers()
    with _seeded(300):
        cfg = _no_dropout(tf.T5Config(
            vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=2,
            decoder_start_token_id=0,
        ))  # fmt: skip
        model = tf.T5ForConditionalGeneration(cfg).train()
        ids, labels = _tokens(), _tokens(length=SEQ // 2)
    decoder_ids = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)
    kwargs = {"input_ids": ids, "decoder_input_ids": decoder_ids, "use_cache": False}
    return Case(model, (), kwargs, labels, token_loss)


def bart() -> Case:
    return _seq2seq("BartForConditionalGeneration", "BartConfig", 301)


def marian() -> Case:
    return _seq2seq("MarianMTModel", "MarianConfig", 302, decoder_vocab_size=VOCAB)


def pegasus() -> Case:
    return _seq2seq("PegasusForConditionalGeneration", "PegasusConfig", 303)


def whisper() -> Case:
    """Log-mel features [B, 16 bins, 32 frames] (two convolutions halve 32 frames to 16)."""
    tf = _transformers()
    with _seeded(304):
        cfg = _no_dropout(tf.WhisperConfig(
            vocab_size=VOCAB, num_mel_bins=16, d_model=64, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
            decoder_ffn_dim=128, max_source_positions=16, max_target_positions=32,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
            suppress_tokens=[], begin_suppress_tokens=[],
        ))  # fmt: skip
        model = tf.WhisperForConditionalGeneration(cfg).train()
        features, labels = torch.randn(BATCH, 16, 32), _tokens(length=SEQ // 2)
    decoder_ids = torch.cat([torch.ones_like(labels[:, :1]), labels[:, :-1]], dim=1)
    kwargs = {"input_features": features, "decoder_input_ids": decoder_ids, "use_cache": False}
    return Case(model, (), kwargs, labels, token_loss)


# ---- vision: CLASSES-way image classification of [B, 3, 32, 32] ----


def _vision(model_class: str, config_class: str, seed: int, **config: Any) -> Case:
    model = _hf(model_class, config_class, seed, num_labels=CLASSES, **config)
    with _seeded(seed):
        pixels = torch.randn(BATCH, 3, IMAGE, IMAGE)
        targets = torch.randint(0, CLASSES, (BATCH,))
    return Case(model, (), {"pixel_values": pixels}, targets, class_loss)


def vit() -> Case:
    return _vision("ViTForImageClassification", "ViTConfig", 400, image_size=IMAGE, patch_size=8,
                   hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=128)  # fmt: skip


def swin() -> Case:
    return _vision("SwinForImageClassification", "SwinConfig", 401, image_size=IMAGE,
                   patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                   window_size=4)  # fmt: skip


def convnext() -> Case:
    return _vision("ConvNextForImageClassification", "ConvNextConfig", 402, num_stages=2,
                   hidden_sizes=[16, 32], depths=[1, 1], patch_size=2)  # fmt: skip


def resnet() -> Case:
    return _vision("ResNetForImageClassification", "ResNetConfig", 403, embedding_size=16,
                   hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic")  # fmt: skip


def mobilenet_v2() -> Case:
    return _vision("MobileNetV2ForImageClassification", "MobileNetV2Config", 404,
                   image_size=IMAGE, depth_multiplier=0.25)  # fmt: skip


def efficientnet() -> Case:
    """hidden_dim: the head's width, round_filters(1280) at width 0.25."""
    return _vision("EfficientNetForImageClassification", "EfficientNetConfig", 405,
                   image_size=IMAGE, width_coefficient=0.25, depth_coefficient=0.25,
                   hidden_dim=320)  # fmt: skip


def regnet() -> Case:
    return _vision("RegNetForImageClassification", "RegNetConfig", 406, embedding_size=16,
                   hidden_sizes=[16, 32], depths=[1, 1], groups_width=8)  # fmt: skip


# ---- classic networks written here: in-place ReLU, concatenation, recurrence, skips ----


class BasicConv2d(nn.Module):
    """torchvision's Inception-v3 unit: conv, batch norm, `F.relu(x, inplace=True)`."""

    def __init__(self, c_in: int, c_out: int, **conv: Any) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, bias=False, **conv)
        self.bn = nn.BatchNorm2d(c_out, eps=0.001)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.conv(x)), inplace=True)


class InceptionA(nn.Module):
    """1x1, 5x5, double 3x3 and pooled branches concatenated on channels."""

    def __init__(self, c_in: int, pool: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(c_in, 16, kernel_size=1)
        self.branch5x5_1 = BasicConv2d(c_in, 12, kernel_size=1)
        self.branch5x5_2 = BasicConv2d(12, 16, kernel_size=5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(c_in, 16, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(16, 24, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(24, 24, kernel_size=3, padding=1)
        self.branch_pool = BasicConv2d(c_in, pool, kernel_size=1)

    def forward(self, x: Tensor) -> Tensor:
        b1 = self.branch1x1(x)
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = self.branch_pool(F.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([b1, b5, b3, bp], 1)  # [B, 56 + pool, H, W]


class InceptionB(nn.Module):
    """Grid reduction: strided 3x3 and double 3x3 branches beside a max pool."""

    def __init__(self, c_in: int) -> None:
        super().__init__()
        self.branch3x3 = BasicConv2d(c_in, 32, kernel_size=3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(c_in, 16, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(16, 24, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(24, 24, kernel_size=3, stride=2)

    def forward(self, x: Tensor) -> Tensor:
        b3 = self.branch3x3(x)
        bd = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([b3, bd, bp], 1)  # [B, 56 + c_in, H/2, W/2]


class InceptionV3Net(nn.Module):
    """A small Inception-v3: stem with `nn.ReLU(inplace=True)`, two A blocks, a B reduction."""

    def __init__(self, n_classes: int = CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True)
        )
        self.mixed_5b = InceptionA(16, pool=8)  # -> 64
        self.mixed_5c = InceptionA(64, pool=16)  # -> 72
        self.mixed_6a = InceptionB(72)  # -> 128 channels, (side - 1) // 2
        self.dropout = nn.Dropout(0.0)
        self.fc = nn.Linear(128, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.mixed_5c(self.mixed_5b(self.stem(x)))  # [B, 72, 16, 16]
        x = self.mixed_6a(x)  # [B, 128, 7, 7]
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)  # [B, 128]
        return self.fc(self.dropout(x))


class DenseLayer(nn.Module):
    """torchvision's dense layer: BN, in-place ReLU, 1x1 bottleneck, BN, in-place ReLU, 3x3, on
    the concatenation of every earlier feature map."""

    def __init__(self, c_in: int, growth: int, bn_size: int = 2) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(c_in)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(c_in, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[Tensor]) -> Tensor:
        x = torch.cat(features, 1)  # [B, c_in, H, W]
        x = self.conv1(self.relu1(self.norm1(x)))
        return self.conv2(self.relu2(self.norm2(x)))  # [B, growth, H, W]


class DenseBlock(nn.ModuleDict):
    def __init__(self, num_layers: int, c_in: int, growth: int) -> None:
        super().__init__()
        for i in range(num_layers):
            self[f"denselayer{i + 1}"] = DenseLayer(c_in + i * growth, growth)

    def forward(self, x: Tensor) -> Tensor:
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)  # [B, c_in + num_layers * growth, H, W]


class DenseNet(nn.Module):
    """Two dense blocks with a transition between; `F.relu(x, inplace=True)` before the head."""

    def __init__(self, growth: int = 8, n_classes: int = CLASSES) -> None:
        super().__init__()
        self.features = nn.Sequential()
        self.features.add_module("conv0", nn.Conv2d(3, 16, 3, padding=1, bias=False))
        self.features.add_module("norm0", nn.BatchNorm2d(16))
        self.features.add_module("relu0", nn.ReLU(inplace=True))
        self.features.add_module("denseblock1", DenseBlock(3, 16, growth))  # -> 40
        self.features.add_module("transition1", nn.Sequential(
            nn.BatchNorm2d(40), nn.ReLU(inplace=True), nn.Conv2d(40, 20, 1, bias=False),
            nn.AvgPool2d(2, 2),
        ))  # fmt: skip
        self.features.add_module("denseblock2", DenseBlock(3, 20, growth))  # -> 44
        self.features.add_module("norm5", nn.BatchNorm2d(44))
        self.classifier = nn.Linear(44, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        features = self.features(x)  # [B, 44, 8, 8]
        out = F.relu(features, inplace=True)
        out = torch.flatten(F.adaptive_avg_pool2d(out, 1), 1)  # [B, 44]
        return self.classifier(out)


class LSTMLanguageModel(nn.Module):
    """Embedding, a 2-layer `nn.LSTM`, a projection to the vocabulary."""

    def __init__(self, vocab: int = VOCAB, d_embed: int = 32, d_hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_embed)
        self.lstm = nn.LSTM(d_embed, d_hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(d_hidden, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        out, _ = self.lstm(self.embed(ids))  # [B, T, d_hidden]
        return self.head(out)  # [B, T, vocab]


def _classifier(model: nn.Module, seed: int) -> Case:
    with _seeded(seed):
        x = torch.randn(BATCH, 3, SMALL_IMAGE, SMALL_IMAGE)
        y = torch.randint(0, CLASSES, (BATCH,))
    return Case(model.train(), (x,), {}, y, class_loss)


def inception_v3() -> Case:
    with _seeded(500):
        model = InceptionV3Net()
    return _classifier(model, 500)


def densenet() -> Case:
    with _seeded(501):
        model = DenseNet()
    return _classifier(model, 501)


def lstm() -> Case:
    with _seeded(502):
        model, ids = LSTMLanguageModel().train(), _tokens()
    return Case(model, (ids,), {}, torch.roll(ids, -1, dims=1), token_loss)


def unet() -> Case:
    """pdcompile.zoo's U-Net: per-pixel 4-way segmentation."""
    model, (x,) = zoo.unet()
    with _seeded(503):
        x = torch.randn(BATCH, *x.shape[1:])
        targets = torch.randint(0, 4, (BATCH, *x.shape[2:]))  # [B, 32, 32]
    return Case(model, (x,), {}, targets, class_loss)


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in [
        *(Architecture(f.__name__, "decoder", f) for f in (
            gpt2, llama, mistral, mixtral, qwen2_moe, olmoe, qwen3_moe, qwen2, qwen3, gemma,
            gemma2, phi, phi3, gpt_neox, opt, falcon, bloom, stablelm, starcoder2,
        )),
        *(Architecture(f.__name__, "encoder", f)
          for f in (bert, roberta, deberta_v2, distilbert, albert, electra)),
        *(Architecture(f.__name__, "seq2seq", f) for f in (t5, bart, whisper, marian, pegasus)),
        *(Architecture(f.__name__, "vision", f)
          for f in (vit, swin, convnext, resnet, mobilenet_v2, efficientnet, regnet)),
        *(Architecture(f.__name__, "classic", f) for f in (inception_v3, densenet, lstm, unet)),
    ]
}  # fmt: skip

# the CI tier: cheap and diverse (an MoE decoder with in-place div_/index_put_, an encoder with a
# padding mask, in-place ReLU with concatenation twice, a recurrent leaf, a convolutional HF model)
SAMPLE = ("gpt2", "bert", "inception_v3", "densenet", "lstm", "resnet")
