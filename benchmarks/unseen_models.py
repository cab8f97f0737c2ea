"""Architectures the conformance suite has never seen (issue 30): tiny configs, random weights, a
batch, its targets and a loss, for the `unseen` test tier (tests/test_unseen_architectures.py,
docs/conformance.md).

Every builder returns a `conformance_models.Case` in the same shape as the suite's: the model in
train mode with every dropout set to 0, `BATCH` rows, and `loss_fn(output, targets)` taking the
model's output as `compile` gives it. None of these is in `conformance_models.ARCHITECTURES`.
Each exercises something the suite lacks: per-layer-type rotary embeddings built from a `set`
(gemma3, modernbert, cohere2), `use_cache` only through `**kwargs` (granitemoe), chunked
attention and top-1 experts (llama4), multi-head latent attention with grouped routing
(deepseek_v3), two towers and a contrastive loss (clip), a selective scan (mamba), sequence
pooling (funnel), interpolated position embeddings (dinov2), a convolutional feature encoder and
CTC (wav2vec2_ctc), two-stream relative attention (xlnet), item assignment into a mask in the
model's own forward (longformer).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from conformance_models import (
    _DECODER,
    BATCH,
    CLASSES,
    IMAGE,
    SEQ,
    VOCAB,
    Architecture,
    Case,
    _encoder,
    _hf,
    _no_dropout,
    _seeded,
    _tokens,
    _transformers,
    class_loss,
    token_loss,
)
from torch import Tensor

# ---- decoders: next-token cross entropy over the logits ----


def _decoder(model_class: str, config_class: str, seed: int, constants: dict | None = None,
             **config: Any) -> Case:  # fmt: skip
    """`constants`: non-tensor keyword arguments of the call (bound into the graph)."""
    model = _hf(model_class, config_class, seed, **{**_DECODER, **config})
    with _seeded(seed):
        ids = _tokens()
    kwargs = {"input_ids": ids, **(constants or {})}
    return Case(model, (), kwargs, torch.roll(ids, -1, dims=1), token_loss)


def gemma3() -> Case:
    """Sliding and full attention layers: one rotary embedding per layer type, computed in the
    order of `set(config.layer_types)`, which depends on the process's string-hash seed."""
    return _decoder("Gemma3ForCausalLM", "Gemma3TextConfig", 600, head_dim=16, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"])  # fmt: skip


def granitemoe() -> Case:
    """Experts with top-2 routing; `use_cache` reaches the model only through `**kwargs`."""
    return _decoder("GraniteMoeForCausalLM", "GraniteMoeConfig", 601, num_local_experts=4,
                    num_experts_per_tok=2)  # fmt: skip


def llama4() -> Case:
    """Llama 4's text model: top-1 experts beside a shared one, chunked attention, layers
    without rotary embeddings, query-key norm."""
    return _decoder("Llama4ForCausalLM", "Llama4TextConfig", 602, head_dim=16,
                    intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
                    interleave_moe_layer_step=1, attention_chunk_size=8,
                    router_jitter_noise=0.0)  # fmt: skip


def deepseek_v3() -> Case:
    """Multi-head latent attention (low-rank queries and keys, a rotary part beside a non-rotary
    one), one dense layer then grouped top-2 routing over 4 experts and a shared one."""
    return _decoder("DeepseekV3ForCausalLM", "DeepseekV3Config", 603, num_key_value_heads=4,
                    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                    v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                    topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32,
                    n_shared_experts=1)  # fmt: skip


def cohere2() -> Case:
    """Sliding and full attention layers; interleaved rotary embeddings (`x[..., ::2]`)."""
    return _decoder("Cohere2ForCausalLM", "Cohere2Config", 604, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"])  # fmt: skip


def mamba() -> Case:
    """A selective state-space model on its sequential (kernel-free) path."""
    tf_config = dict(vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2,
                     expand=2, conv_kernel=4, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2)  # fmt: skip
    model = _hf("MambaForCausalLM", "MambaConfig", 605, **tf_config)
    with _seeded(605):
        ids = _tokens()
    kwargs = {"input_ids": ids, "use_cache": False}
    return Case(model, (), kwargs, torch.roll(ids, -1, dims=1), token_loss)


def xlnet() -> Case:
    """Two-stream relative attention without memory; token cross entropy on the LM head."""
    model = _hf("XLNetLMHeadModel", "XLNetConfig", 606, vocab_size=VOCAB, d_model=64, n_layer=2,
                n_head=4, d_head=16, d_inner=128, mem_len=None, use_mems_train=False,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    with _seeded(606):
        ids = _tokens()
    return Case(model, (), {"input_ids": ids}, torch.roll(ids, -1, dims=1), token_loss)


# ---- encoders: masked-LM heads with a padding mask ----


def modernbert() -> Case:
    """Global and local attention layers, each with its own rotary embedding (built from a
    `set` of the layer types, as gemma3)."""
    return _encoder("ModernBertForMaskedLM", "ModernBertConfig", 610, "mlm", local_attention=8,
                    layer_types=["full_attention", "sliding_attention"], bos_token_id=1,
                    eos_token_id=2, cls_token_id=1, sep_token_id=2)  # fmt: skip


def funnel() -> Case:
    """The sequence pooled to half its length between blocks, upsampled by the decoder."""
    tf = _transformers()
    with _seeded(611):
        cfg = _no_dropout(tf.FunnelConfig(
            vocab_size=VOCAB, block_sizes=[1, 1], d_model=64, n_head=4, d_head=16, d_inner=128,
            num_decoder_layers=1, pad_token_id=0,
        ))  # fmt: skip
        model = tf.FunnelForMaskedLM(cfg).train()
        ids, targets = _tokens(), _tokens()
        mask = torch.ones_like(ids)
        mask[: BATCH // 2, -3:] = 0  # padded rows: the mask reaches the attention
    return Case(model, (), {"input_ids": ids, "attention_mask": mask}, targets, token_loss)


def longformer() -> Case:
    """Item assignment into a mask in the model's own forward (`global_attention_mask[:, 0] =
    1`); the encoder branches on traced shapes (`if padding_len > 0`) and its attention on
    tensor values (`.item()`), so the whole encoder is one automatic leaf."""
    return _encoder("LongformerForSequenceClassification", "LongformerConfig", 612, "cls",
                    attention_window=4)  # fmt: skip


# ---- vision, speech, multimodal ----


def dinov2() -> Case:
    """ViT with layer scale and bicubic interpolation of its position embeddings."""
    model = _hf("Dinov2ForImageClassification", "Dinov2Config", 620, num_labels=CLASSES,
                hidden_size=64, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2,
                image_size=IMAGE, patch_size=8)  # fmt: skip
    with _seeded(620):
        pixels = torch.randn(BATCH, 3, IMAGE, IMAGE)
        targets = torch.randint(0, CLASSES, (BATCH,))
    return Case(model, (), {"pixel_values": pixels}, targets, class_loss)


CTC_LABELS = 8  # target symbols per row
WAVE = 400  # samples per row: 79 frames after the first convolution, 39 after the second


def ctc_loss(output: Any, targets: Tensor) -> Tensor:
    """CTC of the frames' logits [B, T, V] against labels [B, CTC_LABELS] (blank 0), averaged
    over the rows (each row's loss divided by its label count), so microbatches add up."""
    logits = output["logits"].float()
    log_probs = F.log_softmax(logits, dim=-1).transpose(0, 1)  # [T, B, V]
    rows, frames = logits.shape[0], logits.shape[1]
    input_lengths = torch.full((rows,), frames, dtype=torch.long)
    target_lengths = torch.full((rows,), targets.shape[1], dtype=torch.long)
    return F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0)


def wav2vec2_ctc() -> Case:
    """Two 1-d convolutions (group norm on the first), a convolutional position embedding with
    weight norm, an encoder, CTC on the frames; spec augment off (it masks at random)."""
    model = _hf("Wav2Vec2ForCTC", "Wav2Vec2Config", 621, vocab_size=32, hidden_size=64,
                num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                apply_spec_augment=False, mask_time_prob=0.0, pad_token_id=0)  # fmt: skip
    with _seeded(621):
        wave = torch.randn(BATCH, WAVE)
        labels = torch.randint(1, 32, (BATCH, CTC_LABELS))
    return Case(model, (), {"input_values": wave}, labels, ctc_loss)


def clip_loss(output: Any, targets: Tensor) -> Tensor:
    """CLIP's symmetric contrastive loss over the rows of the call (a microbatch): row i's text
    matches row i's image. `targets` only gives the row count."""
    logits_per_image = output["logits_per_image"].float()  # [B, B]
    labels = torch.arange(targets.shape[0])
    return (F.cross_entropy(logits_per_image, labels)
            + F.cross_entropy(logits_per_image.t(), labels)) / 2  # fmt: skip


def clip() -> Case:
    """Text and vision towers, projections and a learned temperature; the loss in `loss_fn`
    (no `return_loss`), so each microbatch contrasts its own rows."""
    tf = _transformers()
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=SEQ, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)  # fmt: skip
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, image_size=IMAGE, patch_size=8)  # fmt: skip
    with _seeded(622):
        config = tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=32)
        for sub in (config, config.text_config, config.vision_config):
            sub.attention_dropout = 0.0
        model = tf.CLIPModel(config).train()
        ids = _tokens()
        ids[:, -1] = 2  # eos last: the text tower pools there
        pixels = torch.randn(BATCH, 3, IMAGE, IMAGE)
    kwargs = {"input_ids": ids, "pixel_values": pixels}
    return Case(model, (), kwargs, torch.zeros(BATCH, dtype=torch.long), clip_loss)


UNSEEN: dict[str, Architecture] = {
    a.name: a
    for a in [
        *(Architecture(f.__name__, "decoder", f)
          for f in (gemma3, granitemoe, llama4, deepseek_v3, cohere2, mamba, xlnet)),
        *(Architecture(f.__name__, "encoder", f) for f in (modernbert, funnel, longformer)),
        Architecture("dinov2", "vision", dinov2),
        Architecture("wav2vec2_ctc", "speech", wav2vec2_ctc),
        Architecture("clip", "multimodal", clip),
    ]
}  # fmt: skip
