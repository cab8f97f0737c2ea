"""A zoo of small but real models for tests, examples and the CLI.

Every entry is a zero-argument factory returning ``(model, example_inputs)`` or
``(model, example_inputs, example_kwargs)``. Factories are deterministic and leave the
global RNG untouched; models come back in train mode with batch size 4 on dim 0.

    pdcompile graph pdcompile.zoo:gpt
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "mlp", "resnet", "gpt", "transformer_encoder", "kwargs_model", "data_dependent",
    "inception", "unet", "hf_gpt2", "hf_bert", "hf_llama", "ZOO", "HF_ZOO",
]  # fmt: skip

BATCH = 4


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Run the body with a fixed CPU seed, restoring the global RNG afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class MLP(nn.Module):
    """Plain feed-forward net: (Linear -> GELU -> Dropout) x 3 -> Linear."""

    def __init__(self, d_in: int = 32, d_hidden: int = 64, d_out: int = 10, p: float = 0.1):
        super().__init__()
        h = d_hidden
        self.net = nn.Sequential(
            nn.Linear(d_in, h), nn.GELU(), nn.Dropout(p),
            nn.Linear(h, h), nn.GELU(), nn.Dropout(p),
            nn.Linear(h, h), nn.GELU(), nn.Dropout(p),
            nn.Linear(h, d_out),
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # [B, d_in] -> [B, d_out]


def _conv_bn(c_in: int, c_out: int, k: int, stride: int = 1, act: bool = True) -> nn.Sequential:
    """Conv(k x k, same padding) -> BatchNorm -> optional ReLU."""
    conv = nn.Conv2d(c_in, c_out, k, stride, padding=k // 2, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(c_out), *([nn.ReLU()] if act else []))


class BasicBlock(nn.Module):
    """ResNet basic block; a 1x1 conv shortcut when shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = _conv_bn(c_in, c_out, 3, stride)
        self.conv2 = _conv_bn(c_out, c_out, 3, act=False)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = _conv_bn(c_in, c_out, 1, stride, act=False)

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv2(self.conv1(x))  # [B, c_out, H/s, W/s]
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Small CIFAR-style ResNet: stem, 4 basic blocks (two downsampling), pool, head."""

    def __init__(self, n_classes: int = 10, width: int = 16):
        super().__init__()
        w = width
        self.stem = _conv_bn(3, w, 3)
        self.layer1 = BasicBlock(w, w)
        self.layer2 = BasicBlock(w, 2 * w, stride=2)
        self.layer3 = BasicBlock(2 * w, 2 * w)
        self.layer4 = BasicBlock(2 * w, 4 * w, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * w, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)  # [B, w, 32, 32]
        x = self.layer2(self.layer1(x))  # [B, 2w, 16, 16]
        x = self.layer4(self.layer3(x))  # [B, 4w, 8, 8]
        x = torch.flatten(self.pool(x), 1)  # [B, 4w]
        return self.fc(x)  # [B, n_classes]


@dataclass
class GPTConfig:
    vocab_size: int = 128
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention via F.scaled_dot_product_attention."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:  # [B, T, C] -> [B, T, C]
        heads = (3, self.n_head, self.n_embd // self.n_head)
        qkv = self.c_attn(x).unflatten(-1, heads).permute(2, 0, 3, 1, 4)  # [3, B, nh, T, hd]
        q, k, v = qkv[0], qkv[1], qkv[2]  # indexing, not unpacking: fx-friendly
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, nh, T, hd]
        return self.resid_drop(self.c_proj(y.transpose(1, 2).flatten(2)))


class Block(nn.Module):
    """Pre-LN transformer block: attention and a C -> 4C -> C MLP, each residual."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        c = cfg.n_embd
        self.ln_1 = nn.LayerNorm(c)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(c)
        self.mlp = nn.Sequential(
            nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c), nn.Dropout(cfg.dropout)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only LM with the LM head tied to the token embedding."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        for m in self.modules():  # GPT-2 style init
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)  # [T]
        x = self.drop(self.wte(idx) + self.wpe(pos))  # [B, T, C]
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # [B, T, vocab]


class EncoderClassifier(nn.Module):
    """Token embedding + nn.TransformerEncoder + linear head on the mean over positions."""

    def __init__(self, vocab: int = 128, d_model: int = 64, n_classes: int = 10, max_len: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(max_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model=64, nhead=4, dim_feedforward=128, batch_first=True, dropout=0.1
        )
        self.encoder = nn.TransformerEncoder(
            layer, num_layers=3, norm=nn.LayerNorm(d_model), enable_nested_tensor=False
        )
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, tokens: Tensor, src_key_padding_mask: Tensor | None = None) -> Tensor:
        x = self.embed(tokens) + self.pos[: tokens.size(1)]  # [B, T, d]
        x = self.encoder(x, src_key_padding_mask=src_key_padding_mask)  # [B, T, d]
        if src_key_padding_mask is None:
            pooled = x.mean(dim=1)  # [B, d]
        else:  # mean over non-padded positions (True = padding)
            keep = (~src_key_padding_mask).unsqueeze(-1).to(x.dtype)  # [B, T, 1]
            pooled = (x * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        return self.head(pooled)  # [B, n_classes]


class KwargsModel(nn.Module):
    """Takes keyword-only inputs (context, mask, scale) and returns a dict."""

    def __init__(self, d: int = 32, d_ctx: int = 16, n_out: int = 10):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.ctx = nn.Linear(d_ctx, d)
        self.body = nn.Sequential(nn.GELU(), nn.Linear(d, d), nn.GELU())
        self.out = nn.Linear(d, n_out)

    def forward(
        self,
        x: Tensor,
        *,
        context: Tensor | None = None,
        mask: Tensor | None = None,
        scale: float = 1.0,
    ) -> dict[str, Tensor]:
        h = self.inp(x)  # [B, d]
        if context is not None:
            h = h + self.ctx(context)  # context: [B, d_ctx]
        if mask is not None:
            h = h * mask  # mask: [B, d]
        feats = self.body(h) * scale  # [B, d]
        return {"logits": self.out(feats), "features": feats}


class Router(nn.Module):
    """Picks one of two experts from the sign of the input mean (not fx-traceable)."""

    def __init__(self, d: int):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        if x.mean() > 0:  # data-dependent branch
            return self.a(x)
        return self.b(x)


class DataDependent(nn.Module):
    """Linear stack with a single data-dependent `router` in the middle."""

    def __init__(self, d: int = 32, n_out: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)
        self.router = Router(d)
        self.fc3 = nn.Linear(d, d)
        self.head = nn.Linear(d, n_out)

    def forward(self, x: Tensor) -> Tensor:
        x = self.fc2(F.relu(self.fc1(x)))  # [B, d]
        x = self.router(x)  # [B, d]; which expert runs depends on the data
        return self.head(F.relu(self.fc3(x)))  # [B, n_out]


class InceptionBlock(nn.Module):
    """Four parallel branches concatenated on channels."""

    def __init__(self, c_in: int, c1: int, c3r: int, c3: int, c5r: int, c5: int, cp: int):
        super().__init__()
        self.b1 = _conv_bn(c_in, c1, 1)
        self.b3 = nn.Sequential(_conv_bn(c_in, c3r, 1), _conv_bn(c3r, c3, 3))
        self.b5 = nn.Sequential(_conv_bn(c_in, c5r, 1), _conv_bn(c5r, c5, 3), _conv_bn(c5, c5, 3))
        self.bp = nn.Sequential(nn.MaxPool2d(3, 1, 1), _conv_bn(c_in, cp, 1))

    def forward(self, x: Tensor) -> Tensor:
        ys = [self.b1(x), self.b3(x), self.b5(x), self.bp(x)]
        return torch.cat(ys, dim=1)  # [B, c1+c3+c5+cp, H, W]


class Inception(nn.Module):
    """Stem, two inception blocks with a max-pool between, global pool, head."""

    def __init__(self, n_classes: int = 10):
        super().__init__()
        self.stem = _conv_bn(3, 32, 3)
        self.inc1 = InceptionBlock(32, 16, 16, 24, 8, 12, 12)  # -> 64 channels
        self.down = nn.MaxPool2d(2)
        self.inc2 = InceptionBlock(64, 24, 24, 32, 8, 16, 16)  # -> 88 channels
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(88, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.inc1(self.stem(x))  # [B, 64, 32, 32]
        x = self.inc2(self.down(x))  # [B, 88, 16, 16]
        return self.fc(torch.flatten(self.pool(x), 1))  # [B, n_classes]


def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    """(Conv3x3 -> BN -> ReLU) x 2."""
    return nn.Sequential(_conv_bn(c_in, c_out, 3), _conv_bn(c_out, c_out, 3))


class Up(nn.Module):
    """Transposed-conv upsample, concatenate the encoder skip, double conv."""

    def __init__(self, c_in: int, c_skip: int, c_out: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_in // 2, 2, stride=2)
        self.conv = _double_conv(c_in // 2 + c_skip, c_out)

    def forward(self, x: Tensor, skip: Tensor) -> Tensor:
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    """3-level U-Net; the outermost skip spans the whole network."""

    def __init__(self, n_classes: int = 4, w: int = 8):
        super().__init__()
        self.enc1 = _double_conv(3, w)  # 32x32
        self.enc2 = _double_conv(w, 2 * w)  # 16x16
        self.enc3 = _double_conv(2 * w, 4 * w)  # 8x8
        self.bottleneck = _double_conv(4 * w, 8 * w)  # 4x4
        self.up3 = Up(8 * w, 4 * w, 4 * w)
        self.up2 = Up(4 * w, 2 * w, 2 * w)
        self.up1 = Up(2 * w, w, w)
        self.out = nn.Conv2d(w, n_classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        s1 = self.enc1(x)  # [B, w, 32, 32]
        s2 = self.enc2(F.max_pool2d(s1, 2))  # [B, 2w, 16, 16]
        s3 = self.enc3(F.max_pool2d(s2, 2))  # [B, 4w, 8, 8]
        b = self.bottleneck(F.max_pool2d(s3, 2))  # [B, 8w, 4, 4]
        y = self.up3(b, s3)  # [B, 4w, 8, 8]
        y = self.up2(y, s2)  # [B, 2w, 16, 16]
        y = self.up1(y, s1)  # [B, w, 32, 32]
        return self.out(y)  # [B, n_classes, 32, 32]


Inputs = tuple[Tensor, ...]
Example = tuple[nn.Module, Inputs] | tuple[nn.Module, Inputs, dict[str, Any]]


def mlp() -> Example:
    with _seeded(0):
        return MLP().train(), (torch.randn(BATCH, 32),)


def resnet() -> Example:
    with _seeded(1):
        return ResNet().train(), (torch.randn(BATCH, 3, 32, 32),)


def gpt() -> Example:
    with _seeded(2):
        cfg = GPTConfig()
        return GPT(cfg).train(), (torch.randint(0, cfg.vocab_size, (BATCH, 16)),)


def transformer_encoder() -> Example:
    with _seeded(3):
        return EncoderClassifier().train(), (torch.randint(0, 128, (BATCH, 16)),)


def kwargs_model() -> Example:
    with _seeded(4):
        model = KwargsModel().train()
        return model, (torch.randn(BATCH, 32),), {"context": torch.randn(BATCH, 16)}


def data_dependent() -> Example:
    with _seeded(5):
        return DataDependent().train(), (torch.randn(BATCH, 32),)


def inception() -> Example:
    with _seeded(6):
        return Inception().train(), (torch.randn(BATCH, 3, 32, 32),)


def unet() -> Example:
    with _seeded(7):
        return UNet().train(), (torch.randn(BATCH, 3, 32, 32),)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "Hugging Face zoo models need transformers; "
            "install the 'hf' extra: pip install 'pdcompile[hf]'"
        ) from e
    return transformers


def hf_gpt2() -> Example:
    tf = _transformers()
    cfg = tf.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    with _seeded(8):
        model = tf.GPT2LMHeadModel(cfg).train()
        return model, (), {"input_ids": torch.randint(0, 128, (BATCH, 16))}


def hf_bert() -> Example:
    tf = _transformers()
    cfg = tf.BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    with _seeded(9):
        model = tf.BertModel(cfg).train()
        ids = torch.randint(0, 128, (BATCH, 16))
        return model, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def hf_llama() -> Example:
    tf = _transformers()
    cfg = tf.LlamaConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    with _seeded(10):
        model = tf.LlamaForCausalLM(cfg).train()
        return model, (), {"input_ids": torch.randint(0, 128, (BATCH, 16))}


ZOO: dict[str, Callable[[], Example]] = {
    f.__name__: f
    for f in (mlp, resnet, gpt, transformer_encoder, kwargs_model, data_dependent, inception, unet)
}
HF_ZOO: dict[str, Callable[[], Example]] = {f.__name__: f for f in (hf_gpt2, hf_bert, hf_llama)}
