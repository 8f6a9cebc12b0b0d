"""Hugging Face models through the torch.export front end (issue 5): GPT-2, BERT, Llama, BART, ViT.

Each is built from a tiny config with random weights (nothing is downloaded), with dropout on, and
converted under O1 and O2 and in float16 and bfloat16 (``CASES``); ``export_helpers.check_converted`` checks SQNR
against float32 (≥ 40 dB float16, ≥ 25 dB bfloat16), gradients on every parameter (cosine ≥ 0.999
/ 0.99 against float32's), a second batch and sequence length, eval determinism, live train-mode
dropout, ``state_dict`` keys, ``ModelOutput`` structure and float32 outputs and losses.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fxamp
from export_helpers import check_converted, unlisted_aten_ops

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

pytestmark = pytest.mark.usefixtures("one_thread")


DTYPES = [torch.float16, torch.bfloat16]
POLICIES = ["O1", "O2"]
V = 96  # vocabulary


def ids(b, s):
    return torch.randint(0, V, (b, s))


def gpt2():
    config = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config), lambda b, s: ((ids(b, s),), {})


def bert():
    config = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=32)
    model = transformers.BertForMaskedLM(config)

    def inputs(b, s):
        mask = torch.ones(b, s, dtype=torch.long)
        mask[0, -2:] = 0  # padding in the first sequence
        return (ids(b, s),), {"attention_mask": mask}

    return model, inputs


def llama():
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32,
                                      attention_dropout=0.1)
    return transformers.LlamaForCausalLM(config), lambda b, s: ((ids(b, s),), {})


def bart():
    config = transformers.BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=32)
    return (transformers.BartForConditionalGeneration(config),
            lambda b, s: ((ids(b, s),), {"labels": ids(b, s - 2)}))


def vit():
    config = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                    num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    hidden_dropout_prob=0.1, num_labels=10)
    # the image size is fixed by the position embeddings: the second shape is another batch
    return transformers.ViTForImageClassification(config), lambda b, s: ((torch.randn(b, 3, 16, 16),), {})


MODELS = {"gpt2": gpt2, "bert": bert, "llama": llama, "bart": bart, "vit": vit}


#: each model under both policies and both dtypes, paired so that every (policy, dtype) pair still runs on two or
#: three architectures (all 20 combinations: CI's 5-minute budget; the real-model suite runs more of these models)
CASES = [(name, policy, dtype) for i, name in enumerate(MODELS)
         for policy, dtype in zip(POLICIES, DTYPES if i % 2 == 0 else DTYPES[::-1])]


@pytest.mark.parametrize("name,policy,dtype", CASES,
                         ids=[f"{n}-{p}-{str(d).removeprefix('torch.')}" for n, p, d in CASES])
def test_model(name, policy, dtype):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    amp = check_converted(model, inputs, policy, dtype)
    assert not unlisted_aten_ops(amp), "every aten op in these models is on a list"


def test_issue_example():
    """The example from issue 5, as written: auto front end, another batch and length."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512))
    example = torch.randint(0, 512, (2, 16))
    amp = fxamp.convert(model, policy="O1", example_inputs=(example,), dtype=torch.float16)  # falls back to torch.export
    out = amp(torch.randint(0, 512, (4, 24)))  # another batch and length
    assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithCrossAttentions)
    assert out.logits.shape == (4, 24, 512) and out.logits.dtype == torch.float32
    info = fxamp.conversion_info(amp)
    assert info.frontend == "export"
    assert "co_varnames is too small" in info.notes[0]
    assert any("input sizes, * = dynamic: input_ids (*, *)" in n for n in info.notes)
    # the cache object GPT-2 returns by default is no tensor pytree: it comes back as None, with a note
    assert out.past_key_values is None
    assert any("DynamicCache" in n and "come back as None" in n for n in info.notes)


def test_labels_give_a_float32_loss_close_to_float32s():
    torch.manual_seed(0)
    model, _ = gpt2()
    model.eval()
    x = ids(2, 8)
    amp = fxamp.convert(model, "O2", dtype=torch.bfloat16, example_inputs=(x,), example_kwargs={"labels": x})
    amp.eval()
    y = ids(3, 10)
    with torch.no_grad():
        ref = model(y, labels=y).loss
        out = amp(input_ids=y, labels=y).loss
    assert out.dtype == torch.float32
    assert abs(out.item() - ref.item()) / ref.item() < 0.01
    losses = [d for n in amp.graph.nodes if (d := n.meta.get("fxamp")) is not None and "cross_entropy" in d.op]
    assert losses and all(d.compute == torch.float32 for d in losses)
    # without labels (issue 37: it was refused, "labels missing"): a second graph, once, on the same parameters
    with torch.no_grad():
        out = amp(y)
        assert out.loss is None and out.logits.dtype == torch.float32
        assert torch.nn.functional.cosine_similarity(out.logits.flatten(), model(y).logits.flatten(), dim=0) > 0.999
    assert fxamp.conversion.lazy.range_fallback(amp)._fxamp_captures == 1


def test_a_last_batch_of_one_trains_a_gpt2_converted_from_a_batch_of_eight():
    """Issue 37: the epoch's last partial batch (1) was refused, then a second graph is captured for it."""
    torch.manual_seed(0)
    model, _ = gpt2()
    x = ids(8, 8)
    amp = fxamp.convert(model, "O2", dtype=torch.bfloat16, example_inputs=(x,), example_kwargs={"labels": x})
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(amp.parameters(), lr=1e-3), model=amp)
    for batch in (ids(8, 8), ids(1, 8)):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            want = model(batch, labels=batch).loss  # (the float32 original, not trained: before the step)
        loss = amp(batch, labels=batch).loss
        assert abs(loss.item() - want.item()) / want.item() < 0.01
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
        model.load_state_dict(opt.fp32_state_dict(amp))  # the original follows the masters
    assert sum("captured a second graph" in n for n in fxamp.conversion_info(amp).notes) == 1




def test_llama_without_attention_dropout_is_captured_once():
    """Llama reads self.training only to pick its attention dropout (0.0 by default) and, behind
    gradient_checkpointing, the cache: one capture serves both modes."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(ids(2, 8),))
    assert any(n.startswith("captured once, in training mode") for n in fxamp.conversion_info(amp).notes)
    x = ids(2, 8)
    with torch.no_grad():
        train_out = amp.train()(x).logits
        eval_out = amp.eval()(x).logits
    assert torch.equal(train_out, eval_out)  # no dropout in either mode


def test_recurrent_gemma_generates_in_place_with_its_states_kept_by_its_layers():
    """RecurrentGemma keeps its convolution and recurrence states in plain attributes between calls: the capture of
    its layers is refused (they run as written) and leaves no torch.fx proxy there (generate failed on one)."""
    torch.manual_seed(0)
    config = transformers.RecurrentGemmaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                               lru_width=32, attention_window_size=8,
                                               block_types=["recurrent", "attention"])
    model = transformers.RecurrentGemmaForCausalLM(config).eval()
    amp = fxamp.convert_(copy.deepcopy(model), "O2", dtype=torch.bfloat16)
    prompt = ids(2, 5)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="keeps a tensor in self.conv1d_state between calls.*"
                                                               "finer blocks"):
        out = amp.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 9)
    states = [v for m in amp.modules() for k, v in vars(m).items() if k in ("conv1d_state", "recurrent_states")]
    assert states and all(v is None or type(v) is torch.Tensor for v in states)
    with torch.no_grad():
        want, got = model(out).logits, amp(out).logits
    assert float((got - want).norm() / want.norm()) < 0.02
