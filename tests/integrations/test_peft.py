"""LoRA fine-tuning with PEFT: a PEFT-wrapped tiny Llama (random weights, nothing downloaded) converted to O2,
trained through ``MixedPrecisionOptimizer`` over its adapters only. The losses stay within 3x of autocast's
distance from float32's, the frozen base never moves, the frozen originals are named and freed on request, and
``save_pretrained`` writes the adapters' float32 masters, which load into a float32 base as trained."""

from __future__ import annotations

import warnings

import pytest
import torch

import fxamp

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
transformers.logging.set_verbosity_error()

pytestmark = pytest.mark.usefixtures("one_thread")

V, STEPS, LR = 96, 4, 1e-2


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def lora_llama() -> torch.nn.Module:
    model = peft.get_peft_model(llama(),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # (PEFT starts B at zero: the adapters would not change the first loss)
                p.normal_(std=0.02)
    return model


IDS = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(1))


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def losses_of(model, step, autocast: bool = False):
    out = []
    for _ in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(IDS, labels=IDS).loss.float()
        out.append(loss.item())
        step(loss)
    return out


def plain_step(opt):
    def step(loss):
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


def fxamp_step(opt):
    def step(loss):
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
    return step


def deviation(losses, ref):
    return max(abs(a - b) for a, b in zip(losses, ref)) / max(abs(v) for v in ref)


@pytest.fixture(scope="module")
def references():
    model = lora_llama().train()
    fp32 = losses_of(model, plain_step(torch.optim.AdamW(trainable(model), lr=LR)))
    model = lora_llama().train()
    auto = losses_of(model, plain_step(torch.optim.AdamW(trainable(model), lr=LR)), autocast=True)
    return fp32, auto


@pytest.mark.parametrize("path", ["convert_", "convert"])
def test_lora_o2_trains_the_adapters_about_as_close_to_float32_as_autocast(path, references, tmp_path):
    fp32, auto = references
    model = lora_llama()
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    if path == "convert_":
        fxamp.convert_(model, "O2", dtype=torch.bfloat16)
        with pytest.warns(UserWarning, match="frozen parameters of the model"):
            opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(trainable(model), lr=LR), model=model)
        assert fxamp.release_originals(model) > 0  # the frozen base: the adapters' originals are their masters now
        amp = model
    else:
        amp = fxamp.convert(model, "O2", dtype=torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # whole-model conversion holds no original to name
            opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(trainable(amp), lr=LR), model=amp)
    assert {p.dtype for p in trainable(amp)} == {torch.bfloat16}  # the adapters: stored low, float32 masters
    losses = losses_of(amp.train(), fxamp_step(opt))
    assert losses[-1] < losses[0]
    assert deviation(losses, fp32) <= max(3 * deviation(auto, fp32), 5e-4), (losses, auto, fp32)
    after = amp.state_dict()
    moved = [k for k in base if not torch.equal(after[k].float(), base[k].bfloat16().float())
             and not torch.equal(after[k], base[k])]
    assert not moved, f"frozen weights moved: {moved[:3]}"
    if path == "convert_":  # PEFT saves the adapters from state_dict(): the float32 masters
        amp.save_pretrained(tmp_path)
        masters = opt.fp32_state_dict()
        loaded = peft.PeftModel.from_pretrained(llama(), tmp_path).eval()
        for name, p in loaded.named_parameters():
            if "lora_" in name:
                assert p.dtype == torch.float32 and torch.equal(p, masters[name]), name
