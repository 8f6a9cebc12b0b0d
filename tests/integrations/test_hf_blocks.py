"""Hugging Face models converted in place (``fxamp.convert_``): what users do with their model still works.

Tiny random-weight GPT-2, Llama, T5 and Whisper (nothing downloaded), bfloat16: greedy ``generate`` with the KV
cache (the tokens of float32 where every step's top-2 logit margin is wide, else autocast's),
``save_pretrained``/``from_pretrained`` (names and float32 kept) and gradient checkpointing (the bytes
saved for backward within 1.2x of autocast's with checkpointing) on those and on BERT and ViT, ``Trainer.evaluate``'s
``eval_loss``, ``.device`` and ``.to()``; one capture per block family, not per layer.
"""

from __future__ import annotations

import copy
import json
import math
import pickle
import warnings

import pytest
import torch

import fxamp
from fxamp.conversion.blocks import converted_modules, family_of

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

pytestmark = pytest.mark.usefixtures("one_thread")

V = 96
BF16 = torch.bfloat16


def gpt2(layers: int = 2):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=layers, n_head=4,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def llama(layers: int = 2):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


MODELS = {"gpt2": gpt2, "llama": llama}


def ids(b: int = 2, s: int = 6) -> torch.Tensor:
    return torch.randint(1, V, (b, s), generator=torch.Generator().manual_seed(3))


def converted(make, policy="O1", **kw):
    model = make(**kw)
    fxamp.convert_(model, policy, dtype=BF16)
    return model


def block_families(model):
    return list({id(family_of(m)): family_of(m) for _, m in converted_modules(model) if not family_of(m).glue}.values())


def greedy_margins(model, prompt, steps):
    """The float32 model's top-2 logit margin at each greedy step."""
    out = model.generate(prompt, max_new_tokens=steps, do_sample=False, output_scores=True,
                         return_dict_in_generate=True)
    return min(float((s.topk(2).values[:, 0] - s.topk(2).values[:, 1]).min()) for s in out.scores)


@pytest.mark.parametrize("name,policy", [("gpt2", "O1"), ("llama", "O1"), ("llama", "O2")])
def test_generate_with_the_kv_cache(name, policy):
    make = MODELS[name]
    ref, model = make(layers=4), converted(make, policy, layers=4)
    prompt, steps = ids(), 6
    tokens = model.generate(prompt, max_new_tokens=steps, do_sample=False)
    assert type(model).__name__ == type(ref).__name__ and model.generation_config is not None
    if greedy_margins(ref, prompt, steps) > 0.05:  # wide enough for bfloat16's rounding of the logits
        expected = ref.generate(prompt, max_new_tokens=steps, do_sample=False)
    else:
        with torch.autocast("cpu", BF16):
            expected = ref.generate(prompt, max_new_tokens=steps, do_sample=False)
    assert torch.equal(tokens, expected)
    assert torch.equal(model.generate(prompt, max_new_tokens=steps, do_sample=False, use_cache=False), tokens)
    out = model(prompt, use_cache=True)
    assert out.past_key_values is not None and out.past_key_values.get_seq_length() == prompt.shape[1]
    (family,) = block_families(model)  # 4 layers, one family; prefill, decode and no-cache variants
    assert len(family.paths) == 4 and family.captures <= 4


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_save_pretrained_round_trip_keeps_names_and_float32(name, policy, tmp_path):
    make = MODELS[name]
    ref, model = make(), converted(make, policy)
    model.save_pretrained(tmp_path)
    state = model.state_dict()
    assert list(state) == list(ref.state_dict())
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    # O1 and O2 alike: the original float32 weights (under O2 held for the masters, not their bfloat16 rounding)
    loaded = type(ref).from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = ids()
    assert torch.equal(loaded(x).logits, ref(x).logits)


@pytest.mark.parametrize("name", MODELS)
def test_o2_trained_save_pretrained_gives_the_float32_masters_back(name, tmp_path):
    """Issue 37 item 3: after training, ``save_pretrained`` writes the masters (not their bfloat16 rounding), and
    ``fxamp.integrations.hf.save_pretrained`` records float32 in config.json, so the default ``from_pretrained``
    (``dtype="auto"``, read from the config) returns a float32 model equal to the masters."""
    from fxamp.integrations import hf

    model = converted(MODELS[name], "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model)
    x = ids()
    for _ in range(2):
        opt.zero_grad()
        opt.backward(model(x, labels=x).loss)
        assert opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    masters = {names[id(low)]: m for low, m in opt.master_pairs()}
    assert len(masters) > 4
    for i, copied in enumerate((copy.deepcopy(model), pickle.loads(pickle.dumps(model)))):
        copied.save_pretrained(tmp_path / f"copy{i}")  # a copy: the masters' values when copied, not their rounding
        float32_config_and_weights(tmp_path / f"copy{i}", masters)
    hf.save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"
    loaded = type(model).from_pretrained(tmp_path)
    assert loaded.dtype == torch.float32
    state = loaded.state_dict()
    for key, master in masters.items():
        assert state[key].dtype == torch.float32 and torch.equal(state[key], master), key
    assert torch.equal(opt.fp32_state_dict()[key], master)
    with pytest.raises(ValueError, match="upload the folder"):
        hf.save_pretrained(model, tmp_path, push_to_hub=True)


def float32_config_and_weights(folder, expected):
    """config.json says float32, and the default ``from_pretrained`` (``dtype="auto"``: the config's) gives the
    original class back in float32, with ``expected``'s weights bit for bit."""
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert loaded.dtype == torch.float32 and "fxamp" not in type(loaded).__module__
    state = loaded.state_dict()
    for key, value in expected.items():
        assert state[key].dtype == torch.float32 and torch.equal(state[key], value), key
    return loaded


@pytest.mark.parametrize("name", MODELS)
def test_o2_models_own_save_pretrained_writes_float32_in_config_json(name, tmp_path):
    """Issue 37 B: ``model.save_pretrained`` itself (what ``Trainer.save_model`` calls) writes the dtype of the
    weights it wrote, not ``model.dtype`` (bfloat16 under O2, which the model keeps computing in)."""
    ref, model = MODELS[name](), converted(MODELS[name], "O2")
    cls = type(ref)
    assert model.dtype == BF16 and isinstance(model, cls) and type(model).__name__ == cls.__name__
    model.save_pretrained(tmp_path / "plain")
    assert model.dtype == BF16 and model.get_input_embeddings().weight.dtype == BF16
    loaded = float32_config_and_weights(tmp_path / "plain", ref.state_dict())
    assert type(loaded) is cls
    for i, copied in enumerate((copy.deepcopy(model), pickle.loads(pickle.dumps(model)))):
        assert type(copied) is type(model) and copied.dtype == BF16
        copied.save_pretrained(tmp_path / str(i))  # (a copy holds the float32 originals too: issue 37)
        float32_config_and_weights(tmp_path / str(i), ref.state_dict())
    with pytest.raises(ValueError, match=r"save_pretrained\(push_to_hub=True\) of a model fxamp\.convert_ "
                                         r"converted would upload config\.json .*upload the folder"):
        model.save_pretrained(tmp_path / "hub", push_to_hub=True)
    o1 = converted(MODELS[name], "O1")  # float32 storage: transformers writes float32 itself, the class stays
    assert type(o1) is cls


def test_trainer_save_model_after_o2_training_gives_the_float32_masters_back(tmp_path):
    model = converted(gpt2, "O2")
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model)
    x = ids()
    for _ in range(2):
        opt.zero_grad()
        opt.backward(model(x, labels=x).loss)
        assert opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    masters = {names[id(low)]: m for low, m in opt.master_pairs()}
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, report_to=[])
    transformers.Trainer(model=model, args=args, optimizers=(opt, None)).save_model(str(tmp_path / "saved"))
    float32_config_and_weights(tmp_path / "saved", masters)
    assert model.dtype == BF16


class Rows(torch.utils.data.Dataset):
    """Eight rows of ``ids``-like tokens, the model's own loss from labels."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        row = ids(8, 8)[i]
        return {"input_ids": row, "labels": row}


def trainer_args(out, **kw):
    return transformers.TrainingArguments(output_dir=str(out), max_steps=3, per_device_train_batch_size=2,
                                          learning_rate=1e-3, warmup_steps=1, max_grad_norm=0.0, save_strategy="no",
                                          use_cpu=True, report_to=[], seed=0, disable_tqdm=True, logging_steps=1, **kw)


def record_calls(model):
    """The keyword arguments of each training forward (the Trainer's batches, ``num_items_in_batch`` included), and
    the hook's handle."""
    calls = []

    def hook(module, args, kwargs):
        if module.training:
            calls.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})

    return calls, model.register_forward_pre_hook(hook, with_kwargs=True)


def without_dropout(model):
    """Training forwards that depend on the weights and the batch only (GPT-2's dropout draws from the RNG)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model.train()


@pytest.mark.parametrize("name,converted_first,trainer_schedule", [("gpt2", False, False), ("llama", True, False),
                                                                   ("gpt2", False, True)])
def test_trainer_trains_a_model_converted_in_place_as_a_plain_loop_and_saves_the_masters(name, converted_first,
                                                                                          trainer_schedule, tmp_path):
    """Issue 37: ``hf.prepare(..., in_place=True)`` (or a model ``fxamp.convert_`` already converted) gives the same
    model object, still a ``PreTrainedModel``, and the optimizers; ``Trainer.train()`` then gives bit for bit the
    losses and masters of a plain loop with the same optimizer (``opt.backward``) on the same batches, and
    ``Trainer.save_model`` the masters, float32 in config.json.  ``optimizers=(opt, None)``: the Trainer builds
    its own schedule on the wrapper (a ``torch.optim.Optimizer`` over the inner one's groups), the same one."""
    from fxamp.integrations import hf

    args = trainer_args(tmp_path / "run")
    model = without_dropout(MODELS[name]())
    if converted_first:
        fxamp.convert_(model, "O2", dtype=BF16)
        prepared, (opt, sched) = hf.prepare(model, args, "O2", dtype="bf16")
    else:
        prepared, (opt, sched) = hf.prepare(model, args, "O2", dtype="bf16", in_place=True)
    assert prepared is model and isinstance(model, transformers.PreTrainedModel) and model.dtype == BF16
    calls, recording = record_calls(model)
    trainer = transformers.Trainer(model=model, args=args, optimizers=(opt, None if trainer_schedule else sched),
                                   train_dataset=Rows())
    trainer.train()
    recording.remove()
    assert (trainer.lr_scheduler is not sched) == trainer_schedule
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == len(calls) == 3 and all(math.isfinite(x) for x in losses)
    assert opt.skipped_steps == 0
    names = {id(p): n for n, p in model.named_parameters()}
    masters = {names[id(low)]: m.detach().clone() for low, m in opt.master_pairs()}

    plain = fxamp.convert_(without_dropout(MODELS[name]()), "O2", dtype=BF16)  # the same optimizer, by hand
    inner = torch.optim.AdamW(plain.parameters(), lr=args.learning_rate, weight_decay=0.0)
    mine = fxamp.MixedPrecisionOptimizer(inner, model=plain)
    schedule = transformers.get_scheduler(args.lr_scheduler_type, inner, num_warmup_steps=1, num_training_steps=3)
    expected = []
    for call in calls:
        loss = plain(**call).loss
        expected.append(loss.item())
        mine.backward(loss)
        assert mine.step()
        schedule.step()
        mine.zero_grad()
    assert losses == expected
    plain_names = {id(p): n for n, p in plain.named_parameters()}
    pairs = {plain_names[id(low)]: master for low, master in mine.master_pairs()}
    assert sorted(pairs) == sorted(masters) and len(masters) > 4
    for key, master in pairs.items():
        assert torch.equal(master, masters[key]), key
    trainer.save_model(str(tmp_path / "saved"))
    float32_config_and_weights(tmp_path / "saved", masters)
    state = model.state_dict()
    torch.save(model, tmp_path / "model.pt")  # (prepare's hook pickles: a copy gets an inert one)
    for copied in (torch.load(tmp_path / "model.pt", weights_only=False), copy.deepcopy(model)):
        assert all(torch.equal(copied.state_dict()[k], v) for k, v in state.items())
        copied(**calls[0]).loss.backward()  # a copy's training forward: not scaled through opt, which stays ready
        assert opt.stage == "ready"


def test_trainer_with_an_optimizer_built_by_hand_names_prepare(tmp_path):
    """Without ``hf.prepare`` the Trainer's ``loss.backward()`` bypasses the loss scale: step() says what to do."""
    model = converted(gpt2, "O2").train()
    opt = fxamp.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters()), model=model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, lambda step: 1.0)
    trainer = transformers.Trainer(model=model, args=trainer_args(tmp_path), optimizers=(opt, sched),
                                   train_dataset=Rows())
    with pytest.raises(fxamp.OptimizerStateError, match=r"step\(\) without a backward pass .*transformers\.Trainer.*"
                                                        r"fxamp\.integrations\.hf\.prepare\(model, args, \.\.\., "
                                                        r"in_place=True"):
        trainer.train()
    assert trainer.optimizer is opt  # a MixedPrecisionOptimizer carries accelerate's mark: it is not wrapped again


def test_prepare_in_place_refuses_what_it_cannot_honour(tmp_path):
    from fxamp.integrations import hf

    args = trainer_args(tmp_path)
    with pytest.raises(ValueError, match=r"prepare\(in_place=True\) takes no example_batch=: .* drop it"):
        hf.prepare(gpt2(), args, "O2", in_place=True, example_batch={"input_ids": ids()})
    with pytest.raises(TypeError, match="in_place must be True or False, not 'yes'"):
        hf.prepare(gpt2(), args, "O2", in_place="yes")
    model = converted(gpt2, "O2")
    with pytest.raises(ValueError, match=r"prepare\(dtype=float16\) of a model fxamp.convert_ converted to bfloat16: "
                                         r"pass dtype='bfloat16'"):
        hf.prepare(model, args, "O2", dtype="16")
    with pytest.raises(ValueError, match=r"already converted in place takes no conversion options \(blocks\)"):
        hf.prepare(model, args, "O2", blocks=["transformer.h.*"])


def saved_bytes(model, x, autocast: bool) -> int:
    return saved_bytes_of(model, (x,), {"labels": x, "use_cache": False}, autocast)


@pytest.mark.parametrize("name", MODELS)
def test_gradient_checkpointing_keeps_its_saving(name):
    make = MODELS[name]
    x = ids(2, 16)
    ref, model = make(layers=4).train(), converted(make, layers=4).train()
    plain = saved_bytes(model, x, autocast=False)
    for m in (ref, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    theirs = saved_bytes(ref, x, autocast=True)
    ours = saved_bytes(model, x, autocast=False)
    assert ours <= 1.2 * theirs, (ours, theirs)
    assert ours < 0.7 * plain  # checkpointing dropped most of the blocks' activations


def test_trainer_evaluate_device_and_to(tmp_path):
    model = converted(gpt2)
    assert model.device == torch.device("cpu") and model.to("cpu") is model

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            row = ids(4, 8)[i]
            return {"input_ids": row, "labels": row}

    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=2, use_cpu=True,
                                          report_to=[])
    metrics = transformers.Trainer(model=model, args=args, eval_dataset=Rows()).evaluate()
    expected = transformers.Trainer(model=gpt2(), args=args, eval_dataset=Rows()).evaluate()
    assert metrics["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-2)  # bfloat16 against float32


def bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=32)
    x = ids(2, 8)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, -2:] = 0
    return transformers.BertForMaskedLM(config).eval(), (x,), {"attention_mask": mask, "labels": x}


def t5():
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4,
                                   decoder_start_token_id=0)
    x = ids(2, 8)
    return transformers.T5ForConditionalGeneration(config).eval(), (x,), {"labels": x}


def vit():
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=64, num_labels=5)
    return transformers.ViTForImageClassification(config).eval(), (torch.randn(2, 3, 16, 16),), \
        {"labels": torch.tensor([1, 2])}


def whisper():
    torch.manual_seed(0)
    config = transformers.WhisperConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                        decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
                                        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        decoder_start_token_id=1)
    return transformers.WhisperForConditionalGeneration(config).eval(), (torch.randn(2, 8, 32),), \
        {"labels": ids(2, 6)}


def saved_bytes_of(model, args, kwargs, autocast: bool) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", BF16, enabled=autocast):
        model(*args, **kwargs).loss.backward()
    return total


@pytest.mark.parametrize("make", [bert, t5, vit, whisper], ids=lambda f: f.__name__)
def test_encoders_and_encoder_decoders_as_hugging_face_users_use_them(make, tmp_path):
    """One conversion each (O1 bfloat16), then what users do: the loss (autocast's), greedy ``generate``
    with the KV cache for T5 and Whisper (their cross-attention reads a flag of the
    ``EncoderDecoderCache`` after the self-attention updated it: prefill and decode steps are variants
    picked before anything changed), ``save_pretrained``/``from_pretrained`` (the original's float32
    output exactly: O1 keeps the weights), gradient checkpointing (its saving kept, within 1.2x of
    autocast's with checkpointing, with no note that it was traced through)."""
    ref, args, kwargs = make()
    model, _, _ = make()
    fxamp.convert_(model, "O1", dtype=BF16)
    out = model(*args, **kwargs)
    with torch.autocast("cpu", BF16):
        expected = ref(*args, **kwargs)
    assert out.loss.dtype == torch.float32
    assert out.loss.item() == pytest.approx(expected.loss.item(), rel=2e-3)
    # layers of one structure share their captures (T5's first block, with the position bias, has its own)
    assert any(len(f.paths) >= 2 for f in block_families(model))

    if make in (t5, whisper):
        steps = 6
        tokens = model.generate(args[0], max_new_tokens=steps, do_sample=False)
        if greedy_margins(ref, args[0], steps) > 0.05:
            expected_tokens = ref.generate(args[0], max_new_tokens=steps, do_sample=False)
        else:
            with torch.autocast("cpu", BF16):
                expected_tokens = ref.generate(args[0], max_new_tokens=steps, do_sample=False)
        assert tokens.shape[1] > steps // 2 and torch.equal(tokens, expected_tokens)
        assert torch.equal(model.generate(args[0], max_new_tokens=steps, do_sample=False, use_cache=False), tokens)

    model.save_pretrained(tmp_path)
    assert list(model.state_dict()) == list(ref.state_dict())
    loaded = type(ref).from_pretrained(tmp_path).eval()
    assert torch.equal(loaded(*args, **kwargs).logits, ref(*args, **kwargs).logits)

    ref.train(), model.train()
    plain = saved_bytes_of(model, args, kwargs, autocast=False)
    for m in (ref, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    theirs = saved_bytes_of(ref, args, kwargs, autocast=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no note that checkpointing was traced through: the layers keep it
        ours = saved_bytes_of(model, args, kwargs, autocast=False)
    assert ours <= 1.2 * theirs and ours < plain, (ours, theirs, plain)


def test_deberta_v2_blocks_share_the_scalars_their_forward_makes():
    """DeBERTa-v2's attention makes scalar tensors in forward (``torch.tensor`` of its scale), which torch.export
    keeps as constants of the graph: they are graph inputs every block shares, not attributes of the first."""
    torch.manual_seed(0)
    config = transformers.DebertaV2Config(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, max_position_embeddings=32, relative_attention=True,
                                          position_buckets=8, pos_att_type=["p2c", "c2p"])
    ref = transformers.DebertaV2Model(config).eval()
    model = transformers.DebertaV2Model(config).eval()
    model.load_state_dict(ref.state_dict())
    fxamp.convert_(model, "O1", dtype=BF16)
    x = ids(2, 8)
    with torch.no_grad():
        out, expected = model(x).last_hidden_state, ref(x).last_hidden_state
    assert float((out - expected).norm() / expected.norm()) < 0.02
    (family,) = block_families(model)
    assert len(family.paths) == 2 and family.captures == 1
