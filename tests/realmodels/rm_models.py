"""The real-model registry: architectures nobody on fxamp wrote, built tiny with random weights.

Every entry builds a float32 model with every dropout (and layer drop, SpecAugment masking, router
jitter, stochastic depth) switched off, so train mode is deterministic and O0 can be compared
bitwise in both modes.  Nothing is downloaded: Hugging Face models come from small configs.
Sizes: hidden <= 64, 1-2 layers, sequences <= 16, batch 2.

``Entry.inputs(seed)`` returns ``(args, kwargs)``; ``frontend`` is what ``fxamp.convert`` gets
(``"export"`` for Hugging Face models, ``"auto"`` for ``torch.nn`` built-ins, which try torch.fx
first and fall back to torch.export with the example inputs).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, FrozenSet, Optional, Tuple

import torch
import torch.nn as nn

from rm_patterns import (DLRM, VQVAE, BNActNet, MaskGPT, SeqResNet, SeqViT, SNDiscriminator, UNet, WeightNormVocoder,
                         channels_last_images, dlrm_inputs, mel_inputs, seq_resnet_channels_last, unet_inputs)

try:  # transformers is an optional ([examples]) dependency: its entries are skipped without it
    import transformers

    transformers.logging.set_verbosity_error()
except Exception:  # pragma: no cover - depends on the environment
    transformers = None

# timm: checked for this suite.  timm 1.0.31 (the current release) declares torchvision as a
# dependency and ``import timm`` imports it (timm/layers/create_norm.py: ``from torchvision.ops.misc
# import FrozenBatchNorm2d``).  torchvision cannot be installed here (its CUDA wheel breaks
# ``import transformers``), so there are no timm entries.

V = 96  # vocabulary of every text model
B = 2   # batch
S = 8   # sequence length

Inputs = Tuple[Tuple[Any, ...], Dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    family: str                           # "decoder", "encoder", "enc-dec", "speech", "vision", "dual", "nn", "pattern"
    build: Callable[[], nn.Module]
    inputs: Callable[[int], Inputs]
    frontend: str = "export"
    needs: str = ""                       # "transformers" when it needs it
    convert_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    fp16: bool = False                    # also checked in float16 (bfloat16 always)
    default: bool = False                 # part of the fast default subset (not marked slow)
    sequential_blocks: bool = False       # its repeated layers sit in nn.Sequentials: convert_ must find them


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ids(seed: int, b: int = B, s: int = S, lo: int = 0) -> torch.Tensor:
    return torch.randint(lo, V, (b, s), generator=gen(seed))


def no_dropout(model: nn.Module) -> nn.Module:
    """Every dropout probability to 0: nn.Dropout modules and float attributes named like dropouts."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for key, value in list(vars(m).items()):
            if isinstance(value, float) and not isinstance(value, bool) and (
                    "dropout" in key or "drop_prob" in key or key in ("layerdrop", "drop_path")):
                setattr(m, key, 0.0)
    return model


def hf(fn: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        return no_dropout(fn())
    return build


# --------------------------------------------------------------------------- Hugging Face: decoders

def lm_inputs(seed: int) -> Inputs:
    return (ids(seed),), {}


def padded_lm_inputs(seed: int) -> Inputs:
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :2] = 0  # left padding in the first sequence
    return (ids(seed),), {"attention_mask": mask}


LLAMA_LIKE = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, max_position_embeddings=32, attention_dropout=0.0)


@hf
def gpt2() -> nn.Module:
    c = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                                eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(c)


@hf
def llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_LIKE))


@hf
def mistral() -> nn.Module:
    return transformers.MistralForCausalLM(transformers.MistralConfig(**LLAMA_LIKE, sliding_window=4))


@hf
def qwen2() -> nn.Module:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**LLAMA_LIKE))


@hf
def mixtral() -> nn.Module:
    c = transformers.MixtralConfig(**{**LLAMA_LIKE, "num_hidden_layers": 1}, num_local_experts=4,
                                   num_experts_per_tok=2, router_jitter_noise=0.0)
    return transformers.MixtralForCausalLM(c)


@hf
def qwen2_moe() -> nn.Module:
    c = transformers.Qwen2MoeConfig(**{**LLAMA_LIKE, "num_hidden_layers": 1}, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, shared_expert_intermediate_size=32)
    return transformers.Qwen2MoeForCausalLM(c)


@hf
def olmoe() -> nn.Module:
    c = transformers.OlmoeConfig(**{**LLAMA_LIKE, "num_hidden_layers": 1}, num_experts=4, num_experts_per_tok=2)
    return transformers.OlmoeForCausalLM(c)


@hf
def gemma2() -> nn.Module:
    # logit soft-capping (final and attention), (1 + w) RMSNorm, sliding-window layers alternating with global
    c = transformers.Gemma2Config(**LLAMA_LIKE, head_dim=8, sliding_window=4, final_logit_softcapping=30.0,
                                  attn_logit_softcapping=50.0)
    return transformers.Gemma2ForCausalLM(c)


@hf
def gemma3() -> nn.Module:
    # (1 + w) RMSNorm, q/k norms, scaled embeddings, local/global rotary bases
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**LLAMA_LIKE, head_dim=8, sliding_window=4))


@hf
def phi3() -> nn.Module:
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(**LLAMA_LIKE, resid_pdrop=0.0, embd_pdrop=0.0,
                                                                pad_token_id=0))


@hf
def gpt_neox() -> nn.Module:
    c = transformers.GPTNeoXConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=32, rotary_pct=0.5,
                                   hidden_dropout=0.0, attention_dropout=0.0)
    return transformers.GPTNeoXForCausalLM(c)


@hf
def falcon() -> nn.Module:
    c = transformers.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=32)
    return transformers.FalconForCausalLM(c)


@hf
def bloom() -> nn.Module:
    # ALiBi position biases, an embedding LayerNorm
    c = transformers.BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
                                 attention_dropout=0.0)
    return transformers.BloomForCausalLM(c)


@hf
def opt() -> nn.Module:
    c = transformers.OPTConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                               max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0,
                               attention_dropout=0.0, layerdrop=0.0, pad_token_id=1)
    return transformers.OPTForCausalLM(c)


@hf
def gptj() -> nn.Module:
    c = transformers.GPTJConfig(vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPTJForCausalLM(c)


@hf
def stablelm() -> nn.Module:
    c = transformers.StableLmConfig(**LLAMA_LIKE, partial_rotary_factor=0.25, hidden_dropout=0.0)
    return transformers.StableLmForCausalLM(c)


@hf
def starcoder2() -> nn.Module:
    c = transformers.Starcoder2Config(**LLAMA_LIKE, residual_dropout=0.0, embedding_dropout=0.0, sliding_window=4)
    return transformers.Starcoder2ForCausalLM(c)


@hf
def gpt_neo() -> nn.Module:
    # local (windowed) attention layers; a tensor constant fill value (torch.tensor(finfo.min)) in torch.where
    c = transformers.GPTNeoConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                                  max_position_embeddings=32, attention_types=[[["global", "local"], 1]],
                                  window_size=4, embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0)
    return transformers.GPTNeoForCausalLM(c)


@hf
def mamba() -> nn.Module:
    # the selective scan's slow path (torch ops only, no custom kernels)
    c = transformers.MambaConfig(vocab_size=V, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                                 conv_kernel=4, use_mambapy=False)
    return transformers.MambaForCausalLM(c)


@hf
def jamba() -> nn.Module:
    # a hybrid stack: one Mamba and one attention layer (a MoE MLP on the second), without custom kernels
    c = transformers.JambaConfig(**LLAMA_LIKE, num_experts=2, num_experts_per_tok=1, attn_layer_period=2,
                                 attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4,
                                 mamba_d_conv=4, mamba_expand=2, use_mamba_kernels=False)
    return transformers.JambaForCausalLM(c)


@hf
def rwkv() -> nn.Module:
    # the time-mixing recurrence on CPU: a Python loop over time, its state a list of tensors written in place;
    # rescale_every=0: with it, eval's first call rescales the weights in place and sets layers_are_rescaled, a
    # Python flag that gates the rescale and no graph keeps: whole-model capture is refused, naming it
    # (tests/conversion/test_writes.py; in place, RwkvModel runs as written and is right)
    return transformers.RwkvForCausalLM(transformers.RwkvConfig(vocab_size=V, context_length=32, hidden_size=32,
                                                                num_hidden_layers=2, attention_hidden_size=32,
                                                                intermediate_size=64, rescale_every=0))


# --------------------------------------------------------------------------- Hugging Face: encoders

def masked_inputs(seed: int, lo: int = 0) -> Inputs:
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, -2:] = 0  # right padding in the first sequence
    return (ids(seed, lo=lo),), {"attention_mask": mask}


BERT_LIKE = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@hf
def funnel() -> nn.Module:
    # pooled attention between stages; its blocks a ModuleList of ModuleLists
    return transformers.FunnelForMaskedLM(transformers.FunnelConfig(
        vocab_size=V, block_sizes=[1, 1], d_model=32, n_head=4, d_head=8, d_inner=64, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=32))


@hf
def bert() -> nn.Module:
    return transformers.BertForMaskedLM(transformers.BertConfig(**BERT_LIKE))


@hf
def roberta() -> nn.Module:
    return transformers.RobertaForSequenceClassification(
        transformers.RobertaConfig(**BERT_LIKE, pad_token_id=1, num_labels=3))


@hf
def distilbert() -> nn.Module:
    c = transformers.DistilBertConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                      max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                                      seq_classif_dropout=0.0)
    return transformers.DistilBertForMaskedLM(c)


@hf
def deberta_v2() -> nn.Module:
    c = transformers.DebertaV2Config(**BERT_LIKE, relative_attention=True, position_buckets=8,
                                     pos_att_type=["p2c", "c2p"], max_relative_positions=16)
    return transformers.DebertaV2ForMaskedLM(c)


@hf
def electra() -> nn.Module:
    return transformers.ElectraForPreTraining(transformers.ElectraConfig(**BERT_LIKE, embedding_size=16))


@hf
def xlm_roberta() -> nn.Module:
    return transformers.XLMRobertaForMaskedLM(transformers.XLMRobertaConfig(**BERT_LIKE, pad_token_id=1))


@hf
def mpnet() -> nn.Module:
    return transformers.MPNetForMaskedLM(transformers.MPNetConfig(**BERT_LIKE, pad_token_id=1))


@hf
def modernbert() -> nn.Module:
    # the token embedding normalised straight away (no sum with positions); initializer_range 0.1 as in
    # tests/conversion/test_numerics_regressions.py, so the embedding norm's share of the output shows a low table
    c = transformers.ModernBertConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=64, local_attention=8,
                                      attention_dropout=0.0, embedding_dropout=0.0, mlp_dropout=0.0, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
                                      initializer_range=0.1)
    return transformers.ModernBertModel(c)  # last_hidden_state: an MLM head (tied to the table) hides the loss


@hf
def mobilebert() -> nn.Module:
    # NoNorm (an elementwise affine in place of LayerNorm), bottlenecks, stacked feed-forwards
    c = transformers.MobileBertConfig(vocab_size=V, hidden_size=32, embedding_size=16, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=32, intra_bottleneck_size=16,
                                      true_hidden_size=16, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, num_feedforward_networks=2)
    return transformers.MobileBertForMaskedLM(c)


# --------------------------------------------------------------------------- Hugging Face: encoder-decoders

def seq2seq_inputs(seed: int) -> Inputs:
    return (ids(seed),), {"decoder_input_ids": ids(seed + 1000, s=S - 2)}


@hf
def t5() -> nn.Module:
    c = transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                              num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(c)


@hf
def bart() -> nn.Module:
    c = transformers.BartConfig(vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1,
                                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                                activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0)
    return transformers.BartForConditionalGeneration(c)


SEQ2SEQ_LIKE = dict(vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                    dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0,
                    decoder_layerdrop=0.0, pad_token_id=0, decoder_start_token_id=0)


@hf
def pegasus() -> nn.Module:
    # sinusoidal positions, scaled embeddings, pre-norm with final LayerNorms
    return transformers.PegasusForConditionalGeneration(transformers.PegasusConfig(**SEQ2SEQ_LIKE))


@hf
def marian() -> nn.Module:
    # sinusoidal positions, scaled embeddings, a final_logits_bias buffer
    return transformers.MarianMTModel(transformers.MarianConfig(**SEQ2SEQ_LIKE))


# --------------------------------------------------------------------------- Hugging Face: speech

def audio_inputs(seed: int) -> Inputs:
    return (torch.randn(B, 400, generator=gen(seed)),), {}


@hf
def wav2vec2() -> nn.Module:
    c = transformers.Wav2Vec2Config(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                    intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                    num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
                                    hidden_dropout=0.0, activation_dropout=0.0, attention_dropout=0.0,
                                    feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
                                    mask_time_prob=0.0, mask_feature_prob=0.0)
    return transformers.Wav2Vec2ForCTC(c)


def whisper_inputs(seed: int) -> Inputs:
    feats = torch.randn(B, 16, 16, generator=gen(seed))  # (batch, mel bins, 2 * max_source_positions)
    return (feats,), {"decoder_input_ids": ids(seed + 1000, s=4)}


@hf
def whisper() -> nn.Module:
    c = transformers.WhisperConfig(vocab_size=V, num_mel_bins=16, d_model=32, encoder_layers=1, decoder_layers=1,
                                   encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                   decoder_ffn_dim=64, max_source_positions=8, max_target_positions=16,
                                   dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                   encoder_layerdrop=0.0, decoder_layerdrop=0.0, pad_token_id=0,
                                   bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)
    return transformers.WhisperForConditionalGeneration(c)


# --------------------------------------------------------------------------- Hugging Face: vision

def image_inputs(size: int) -> Callable[[int], Inputs]:
    def inputs(seed: int) -> Inputs:
        return (torch.randn(B, 3, size, size, generator=gen(seed)),), {}
    return inputs


@hf
def vit() -> nn.Module:
    c = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0, num_labels=10)
    return transformers.ViTForImageClassification(c)


@hf
def swin() -> nn.Module:
    c = transformers.SwinConfig(image_size=16, patch_size=2, num_channels=3, embed_dim=16, depths=[1, 1],
                                num_heads=[2, 4], window_size=4, mlp_ratio=2.0, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0, drop_path_rate=0.0, num_labels=10)
    return transformers.SwinForImageClassification(c)


@hf
def convnext() -> nn.Module:
    c = transformers.ConvNextConfig(num_channels=3, num_stages=2, patch_size=2, hidden_sizes=[16, 32], depths=[1, 1],
                                    drop_path_rate=0.0, num_labels=10, image_size=16)
    return transformers.ConvNextForImageClassification(c)


def with_statistics(model: nn.Module) -> nn.Module:
    """Convolutions He-initialised and BatchNorm scales near 1 (HF's small normal inits make a deep conv net's
    activations vanish); BatchNorms given running statistics of their own (not the fresh 0/1)."""
    g = gen(123)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
            m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g))
            m.running_var.copy_(0.5 + 1.5 * torch.rand(m.running_var.shape, generator=g))
            if m.affine:  # (some HF inits leave the scale at initializer_range)
                m.weight.data.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=g))
                m.bias.data.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model


@hf
def resnet() -> nn.Module:
    c = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                  layer_type="basic", num_labels=10)
    return with_statistics(transformers.ResNetForImageClassification(c))


@hf
def regnet() -> nn.Module:
    c = transformers.RegNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                  groups_width=8, num_labels=10)
    return with_statistics(transformers.RegNetForImageClassification(c))


def mobilevit_inputs(seed: int) -> Inputs:
    return (torch.randn(4, 3, 64, 64, generator=gen(seed)),), {}


@hf
def mobilevit() -> nn.Module:
    # 64 px and a batch of 4 (mobilevit_inputs): at 32 px the last stage is 1x1, and train-mode BatchNorm over 2
    # values per channel turns any rounding into another output (autocast's train-mode loss 54% off float32's there);
    # at 64 px, batch 2, autocast's 4 training steps still drift 0.089 of the largest loss from float32's
    c = transformers.MobileViTConfig(num_channels=3, image_size=64, patch_size=2, hidden_sizes=[16, 24, 32],
                                     neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 48], num_attention_heads=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     classifier_dropout_prob=0.0, num_labels=10)
    return with_statistics(transformers.MobileViTForImageClassification(c))


@hf
def poolformer() -> nn.Module:
    # GroupNorm and average pooling as the token mixer; stages of layers in a ModuleList of ModuleLists
    c = transformers.PoolFormerConfig(num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], num_encoder_blocks=2,
                                      patch_sizes=[7, 3], strides=[4, 2], padding=[2, 1], drop_path_rate=0.0,
                                      num_labels=10)
    return transformers.PoolFormerForImageClassification(c)


@hf
def segformer() -> nn.Module:
    c = transformers.SegformerConfig(num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                     hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
                                     num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=32,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     classifier_dropout_prob=0.0, drop_path_rate=0.0, num_labels=5)
    return with_statistics(transformers.SegformerForSemanticSegmentation(c))


# --------------------------------------------------------------------------- Hugging Face: dual encoder

def clip_inputs(seed: int) -> Inputs:
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -3:] = 0
    return (), {"input_ids": ids(seed), "pixel_values": torch.randn(B, 3, 16, 16, generator=gen(seed + 1)),
                "attention_mask": mask}


@hf
def clip() -> nn.Module:
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=16, attention_dropout=0.0, projection_dim=16)
    vision = dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, attention_dropout=0.0, projection_dim=16)
    return transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))


# --------------------------------------------------------------------------- torch.nn built-ins

D = 32


def seq(seed: int, s: int = S) -> torch.Tensor:
    return torch.randn(B, s, D, generator=gen(seed))


def nn_transformer() -> nn.Module:
    return nn.Transformer(d_model=D, nhead=4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64,
                          dropout=0.0, batch_first=True)


def nn_transformer_encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(D, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


class EncoderInModel(nn.Module):
    """A user model holding an nn.TransformerEncoder: torch.fx traces it, the encoder a leaf (issue 10 item 8)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.body = nn_transformer_encoder()
        self.head = nn.Linear(D, 8)

    def forward(self, x):
        return self.head(self.body(self.inp(x)))


def nn_transformer_decoder() -> nn.Module:
    layer = nn.TransformerDecoderLayer(D, 4, dim_feedforward=64, dropout=0.0, batch_first=True, norm_first=True)
    return nn.TransformerDecoder(layer, num_layers=2)


class RNNHead(nn.Module):
    """An embedding-free recurrent tagger: a 2-layer LSTM/GRU and a linear head on every step."""

    def __init__(self, kind: str):
        super().__init__()
        rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[kind]
        self.rnn = rnn(D, D, num_layers=2, batch_first=True)
        self.head = nn.Linear(D, 8)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out)


def pack(x: torch.Tensor, lengths: torch.Tensor):
    return nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)


def unpack(packed, total_length: int):
    return nn.utils.rnn.pad_packed_sequence(packed, batch_first=True, total_length=total_length)[0]


# torch.fx cannot trace into the packing (lengths would be a Proxy), nor can torch.export (FakeTensor
# sizes in the RNN): wrapped, torch.fx keeps them as calls and the LSTM as a leaf module
torch.fx.wrap("pack")
torch.fx.wrap("unpack")


class PackedLSTM(nn.Module):
    """An LSTM over a PackedSequence (variable-length batch), unpacked for a linear head."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(D, D, batch_first=True)
        self.head = nn.Linear(D, 8)

    def forward(self, x, lengths):
        out, _ = self.rnn(pack(x, lengths))
        return self.head(unpack(out, S))


class SelfAttention(nn.Module):
    """nn.MultiheadAttention with a key padding mask, then a LayerNorm residual."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(D, 4, dropout=0.0, batch_first=True)
        self.ln = nn.LayerNorm(D)

    def forward(self, x, key_padding_mask):
        y, _ = self.mha(x, x, x, key_padding_mask=key_padding_mask, need_weights=False)
        return self.ln(x + y)


def conv_bn_relu() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def padding_mask(seed: int) -> torch.Tensor:
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[0, -3:] = True  # True = ignore
    return mask


ENTRIES = [
    # decoders
    Entry("gpt2", "decoder", gpt2, lm_inputs, needs="transformers", fp16=True, default=True),
    Entry("llama", "decoder", llama, padded_lm_inputs, needs="transformers", fp16=True),
    Entry("mistral", "decoder", mistral, lm_inputs, needs="transformers"),
    Entry("qwen2", "decoder", qwen2, lm_inputs, needs="transformers"),
    Entry("mixtral", "decoder-moe", mixtral, lm_inputs, needs="transformers"),
    Entry("qwen2_moe", "decoder-moe", qwen2_moe, lm_inputs, needs="transformers"),
    Entry("olmoe", "decoder-moe", olmoe, lm_inputs, needs="transformers"),
    # encoders
    Entry("bert", "encoder", bert, masked_inputs, needs="transformers", fp16=True, default=True),
    Entry("roberta", "encoder", roberta, lambda s: masked_inputs(s, lo=2), needs="transformers"),
    Entry("distilbert", "encoder", distilbert, masked_inputs, needs="transformers"),
    # encoder-decoders
    Entry("t5", "enc-dec", t5, seq2seq_inputs, needs="transformers", fp16=True),
    Entry("bart", "enc-dec", bart, seq2seq_inputs, needs="transformers"),
    # speech
    Entry("wav2vec2", "speech", wav2vec2, audio_inputs, needs="transformers"),
    Entry("whisper", "speech", whisper, whisper_inputs, needs="transformers"),
    # vision
    Entry("vit", "vision", vit, image_inputs(16), needs="transformers", fp16=True),
    # issue 10 item 9: dynamic='batch' takes ~2 minutes on a Swin; the image size is fixed anyway
    Entry("swin", "vision", swin, image_inputs(16), needs="transformers", convert_kwargs={"dynamic": "none"}),
    Entry("convnext", "vision", convnext, image_inputs(16), needs="transformers"),
    # dual encoder
    Entry("clip", "dual", clip, clip_inputs, needs="transformers"),
    # torch.nn built-ins
    Entry("nn.Transformer", "nn", nn_transformer, lambda s: ((seq(s), seq(s + 1, 6)), {}), frontend="auto",
          fp16=True),
    Entry("nn.TransformerEncoder", "nn", nn_transformer_encoder, lambda s: ((seq(s),), {}), frontend="auto",
          fp16=True, default=True),
    Entry("nn.TransformerEncoder-in-model", "nn", EncoderInModel, lambda s: ((seq(s),), {}), frontend="auto"),
    Entry("nn.TransformerDecoder", "nn", nn_transformer_decoder, lambda s: ((seq(s), seq(s + 1, 6)), {}),
          frontend="auto"),
    Entry("nn.LSTM", "nn", lambda: RNNHead("lstm"), lambda s: ((seq(s),), {}), frontend="auto", fp16=True,
          default=True),
    Entry("nn.GRU", "nn", lambda: RNNHead("gru"), lambda s: ((seq(s),), {}), frontend="auto"),
    Entry("nn.LSTM-packed", "nn", PackedLSTM, lambda s: ((seq(s), torch.tensor([S, 5])), {}), frontend="auto"),
    Entry("nn.MultiheadAttention", "nn", SelfAttention, lambda s: ((seq(s), padding_mask(s)), {}),
          frontend="auto", fp16=True, default=True),
    Entry("conv-bn-relu", "nn", conv_bn_relu, image_inputs(16), frontend="auto", fp16=True, default=True),
    # patterns of our own (issue 37): vision beside language
    Entry("bn-act", "pattern", BNActNet, image_inputs(16), frontend="auto"),
    Entry("resnet-seq", "pattern", SeqResNet, image_inputs(16), frontend="auto", sequential_blocks=True),
    Entry("resnet-seq-cl", "pattern", seq_resnet_channels_last, channels_last_images(16), frontend="auto",
          sequential_blocks=True),
    Entry("vit-seq-pool", "pattern", SeqViT, image_inputs(16), frontend="auto", sequential_blocks=True),
    Entry("gpt-mask-buffer", "pattern", MaskGPT, lm_inputs, frontend="auto"),
    Entry("unet-ddpm", "pattern", UNet, unet_inputs(16), frontend="auto", fp16=True),
    Entry("dlrm", "pattern", DLRM, dlrm_inputs, frontend="auto", fp16=True),
    # weights computed by torch.nn.utils.parametrizations (weight_norm, spectral_norm)
    Entry("vocoder-wn", "pattern", WeightNormVocoder, mel_inputs, frontend="auto"),
    Entry("gan-sn", "pattern", SNDiscriminator, image_inputs(16), frontend="auto"),
    # buffers a training call writes under torch.no_grad() (an EMA codebook), a straight-through output
    Entry("vqvae", "pattern", VQVAE, image_inputs(16), frontend="auto"),
    # added by the architecture scan
    Entry("gemma2", "decoder", gemma2, lm_inputs, needs="transformers", fp16=True),
    Entry("gemma3", "decoder", gemma3, padded_lm_inputs, needs="transformers"),
    Entry("phi3", "decoder", phi3, lm_inputs, needs="transformers"),
    Entry("gpt_neox", "decoder", gpt_neox, lm_inputs, needs="transformers"),
    Entry("falcon", "decoder", falcon, lm_inputs, needs="transformers"),
    Entry("bloom", "decoder", bloom, padded_lm_inputs, needs="transformers", fp16=True),
    Entry("opt", "decoder", opt, lm_inputs, needs="transformers"),
    Entry("gptj", "decoder", gptj, lm_inputs, needs="transformers"),
    Entry("stablelm", "decoder", stablelm, lm_inputs, needs="transformers"),
    Entry("starcoder2", "decoder", starcoder2, lm_inputs, needs="transformers"),
    Entry("gpt_neo", "decoder", gpt_neo, padded_lm_inputs, needs="transformers"),
    Entry("mamba", "decoder-ssm", mamba, lm_inputs, needs="transformers"),
    Entry("jamba", "decoder-ssm", jamba, lm_inputs, needs="transformers"),
    Entry("rwkv", "decoder-rnn", rwkv, lm_inputs, needs="transformers"),
    Entry("funnel", "encoder", funnel, masked_inputs, needs="transformers"),
    Entry("deberta_v2", "encoder", deberta_v2, masked_inputs, needs="transformers"),
    Entry("electra", "encoder", electra, masked_inputs, needs="transformers"),
    Entry("xlm_roberta", "encoder", xlm_roberta, lambda s: masked_inputs(s, lo=2), needs="transformers"),
    Entry("mpnet", "encoder", mpnet, lambda s: masked_inputs(s, lo=2), needs="transformers"),
    Entry("modernbert", "encoder", modernbert, lambda s: masked_inputs(s, lo=3), needs="transformers"),
    Entry("mobilebert", "encoder", mobilebert, masked_inputs, needs="transformers", fp16=True),
    Entry("pegasus", "enc-dec", pegasus, seq2seq_inputs, needs="transformers"),
    Entry("marian", "enc-dec", marian, seq2seq_inputs, needs="transformers"),
    Entry("resnet", "vision", resnet, image_inputs(32), needs="transformers", fp16=True),
    Entry("regnet", "vision", regnet, image_inputs(32), needs="transformers"),
    Entry("mobilevit", "vision", mobilevit, mobilevit_inputs, needs="transformers"),
    Entry("poolformer", "vision", poolformer, image_inputs(32), needs="transformers"),
    Entry("segformer", "vision", segformer, image_inputs(32), needs="transformers"),
]

REGISTRY: Dict[str, Entry] = {e.name: e for e in ENTRIES}


def available(entry: Entry) -> Optional[str]:
    """None when the entry can be built here, else why not."""
    if entry.needs == "transformers" and transformers is None:
        return "transformers is not installed"
    return None


def build(entry: Entry, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return entry.build()
