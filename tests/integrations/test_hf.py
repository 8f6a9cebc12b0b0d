"""fxamp.integrations.hf.prepare with the real transformers.Trainer: a character-level GPT-2 on pydoc topics."""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
transformers.logging.set_verbosity_error()

import fxamp  # noqa: E402
from fxamp.integrations import hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 32


def _corpus():
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text]), len(chars)


DATA, VOCAB = _corpus()
CUT = int(len(DATA) * 0.9)


class Blocks(torch.utils.data.Dataset):
    """``n`` fixed windows of ``BLOCK`` characters from ``DATA[lo:hi]``; the model computes its own loss from labels."""

    def __init__(self, lo, hi, n, seed):
        self.starts = torch.randint(lo, hi - BLOCK, (n,), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        x = DATA[self.starts[i]:self.starts[i] + BLOCK]
        return {"input_ids": x, "labels": x}


TRAIN, VAL = Blocks(0, CUT, 4000, 0), Blocks(CUT, len(DATA), 128, 1)


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=BLOCK, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def args(out, steps, **kw):
    kw = {"per_device_train_batch_size": 8, "per_device_eval_batch_size": 128, "learning_rate": 2e-3,
          "warmup_steps": 10, "save_strategy": "no", "logging_steps": 1000, **kw}
    return transformers.TrainingArguments(output_dir=str(out), max_steps=steps, use_cpu=True, report_to=[], seed=0,
                                          disable_tqdm=True, **kw)


@torch.no_grad()
def mean_eval_loss(model):
    """Mean cross-entropy per predicted character on VAL, the same way for every model.

    (Trainer.evaluate() on a GPT-2 divides the summed loss by ``num_items_in_batch``, which counts the
    labels before the model shifts them: BLOCK/(BLOCK-1) below the mean.  The converted graph takes
    exactly the batch's keys, so its loss is the plain mean: compare both the same way.)
    """
    model.eval()
    batch = torch.utils.data.default_collate([VAL[i] for i in range(len(VAL))])
    loss = model(**batch).loss.item()
    model.train()
    return loss


def example_batch():
    return torch.utils.data.default_collate([TRAIN[0], TRAIN[1]])


def fxamp_trainer(a, dtype="bf16", callbacks=(), **kw):
    model, optimizers = hf.prepare(gpt2(), a, "O2", dtype=dtype, example_batch=example_batch(), **kw)
    return transformers.Trainer(model=model, args=a, optimizers=optimizers, train_dataset=TRAIN, eval_dataset=VAL,
                                callbacks=list(callbacks))


def test_bf16_matches_trainer_bf16_and_resumes_exactly(tmp_path):
    """100 steps (eval loss ~2.6): within 2% of TrainingArguments(bf16=True); resume from step 50 is exact.

    Measured at 300 steps, batch 16 of 64 characters (loss ~2.27, the Trainer's evaluate() losses of
    the references corrected by 64/63, see mean_eval_loss): fxamp O2 bfloat16 lands within 0.2% of
    TrainingArguments(bf16=True) and of float32, with or without max_grad_norm=1.
    """
    steps = 100
    ref = transformers.Trainer(model=gpt2(), args=args(tmp_path / "ref", steps, bf16=True), train_dataset=TRAIN,
                               eval_dataset=VAL)
    ref.train()
    ref_loss = mean_eval_loss(ref.model)

    full = fxamp_trainer(args(tmp_path / "full", steps, save_strategy="steps", save_steps=50))
    full.train()
    loss = mean_eval_loss(full.model)
    assert abs(loss - ref_loss) / ref_loss < 0.02, (loss, ref_loss)
    opt = full.optimizer
    assert isinstance(opt, fxamp.MixedPrecisionOptimizer) and opt.skipped_steps == 0
    assert fxamp.conversion_info(full.model).policy.params == torch.bfloat16
    assert full.model.get_parameter("transformer.h.0.attn.c_attn.weight").dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in opt.master_params())

    ckpt = tmp_path / "full" / "checkpoint-50"
    assert (ckpt / "optimizer.pt").exists()
    resumed = fxamp_trainer(args(tmp_path / "resumed", steps))
    resumed.train(resume_from_checkpoint=str(ckpt))
    a, b = full.model.state_dict(), resumed.model.state_dict()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
    for m, n in zip(full.optimizer.master_params(), resumed.optimizer.master_params()):
        torch.testing.assert_close(n, m, rtol=0, atol=1e-6)
    assert mean_eval_loss(resumed.model) == pytest.approx(loss, abs=1e-6)
    assert full.evaluate()["eval_loss"] == pytest.approx(loss, rel=1e-5)  # Trainer.evaluate works too


class InjectInf(transformers.TrainerCallback):
    """An inf in one float16 gradient at step ``at``; records the weights around that step."""

    def __init__(self, at):
        self.at, self.seen = at, {}

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        if state.global_step == self.at:
            model.get_parameter("transformer.h.0.mlp.c_fc.weight").grad[0, 0] = math.inf
            self.seen["before"] = ({k: v.clone() for k, v in model.state_dict().items()}, optimizer.current_scale,
                                   optimizer.skipped_steps)

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        if state.global_step == self.at:
            self.seen["after"] = ({k: v.clone() for k, v in model.state_dict().items()}, optimizer.current_scale,
                                  optimizer.skipped_steps)


def test_fp16_loss_scaling_clipping_and_skip(tmp_path):
    inject = InjectInf(at=5)
    t = fxamp_trainer(args(tmp_path, 12, max_grad_norm=0.0), dtype="16", callbacks=[inject], max_grad_norm=1.0)
    t.train()
    (sd0, scale0, skipped0), (sd1, scale1, skipped1) = inject.seen["before"], inject.seen["after"]
    assert scale1 == scale0 / 2 and skipped1 == skipped0 + 1  # (the first steps may overflow by themselves)
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), k
    opt = t.optimizer
    assert opt.skipped_steps == skipped1 and t.model.get_parameter("transformer.wte.weight").dtype == torch.float16
    assert opt.last_grad_norm is not None and math.isfinite(opt.last_grad_norm)  # clipped the float32 masters
    assert t.lr_scheduler.last_epoch == 12 - opt.skipped_steps  # a skipped step holds the schedule back
    assert math.isfinite(t.evaluate()["eval_loss"])


def test_prepare_refuses_what_would_go_wrong(tmp_path):
    with pytest.raises(ValueError, match="set max_grad_norm=0 there"):
        hf.prepare(gpt2(), args(tmp_path, 10), "O2", dtype="16", example_batch=example_batch())
    with pytest.raises(ValueError, match="leave both False"):
        hf.prepare(gpt2(), args(tmp_path, 10, bf16=True), "O2", dtype="bf16", example_batch=example_batch())
    with pytest.raises(ValueError, match="max_steps"):
        hf.prepare(gpt2(), args(tmp_path, -1, num_train_epochs=1), "O2", example_batch=example_batch())


def test_prepare_without_an_example_batch_captures_at_the_first_call(tmp_path):
    """No example batch: fxamp.convert returns a LazyConverted, which captures from the Trainer's first batch."""
    torch.manual_seed(0)
    a = args(tmp_path, 6)
    model, optimizers = hf.prepare(gpt2(), a, "O2", dtype="bf16")
    assert isinstance(model, fxamp.conversion.lazy.LazyConverted)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = transformers.Trainer(model=model, args=a, optimizers=optimizers, train_dataset=TRAIN)
    trainer.train()
    assert len(fxamp.conversion_info(model).signatures) >= 1
    weight = "transformer.h.0.attn.c_attn.weight"
    assert model.get_parameter(weight).dtype == torch.bfloat16
    assert not torch.equal(model.state_dict()[weight], before[weight])  # the Trainer's steps reached it
    assert optimizers[0].skipped_steps == 0 and math.isfinite(mean_eval_loss(model))


def test_compile_step_is_passed_on(tmp_path, monkeypatch, fused_at_any_size, small_chunks):
    from fxamp.training import kernels as fused_step

    monkeypatch.setattr(fused_step, "FUSED_MIN_NUMEL", 0)  # the test model's masters are small
    t = fxamp_trainer(args(tmp_path, 12), compile_step=True)
    t.train()
    assert t.optimizer.compile_step and t.optimizer.skipped_steps == 0
    assert math.isfinite(t.evaluate()["eval_loss"])


def test_lazy_path_evaluate_returns_eval_loss_like_the_example_batch_path(tmp_path):
    """Without example_batch the model is a LazyConverted: the Trainer must still find ``labels`` in its
    forward's signature (on the class), or evaluate() returns no eval_loss."""
    a = args(tmp_path, 1)
    eager, eager_opts = hf.prepare(gpt2(), a, "O2", dtype="bf16", example_batch=example_batch())
    lazy, lazy_opts = hf.prepare(gpt2(), a, "O2", dtype="bf16")
    assert isinstance(lazy, fxamp.conversion.lazy.LazyConverted)
    expected = transformers.Trainer(model=eager, args=a, optimizers=eager_opts, eval_dataset=VAL).evaluate()
    trainer = transformers.Trainer(model=lazy, args=a, optimizers=lazy_opts, eval_dataset=VAL)
    assert trainer.label_names == ["labels"]
    got = trainer.evaluate()
    assert "eval_loss" in got, got
    assert got["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-3)


def test_prepare_refuses_a_dict_for_training_arguments():
    with pytest.raises(TypeError, match="takes the transformers.TrainingArguments the Trainer gets, not dict"):
        hf.prepare(gpt2(), {"learning_rate": 1e-3, "max_steps": 10}, "O2", example_batch=example_batch())


def test_forgotten_optimizers_warns_once_with_the_fix(tmp_path):
    """Trainer(model=...) without optimizers=: its own AdamW steps the bfloat16 weights, no masters."""
    a = args(tmp_path, 4)
    model, _ = hf.prepare(gpt2(), a, "O2", dtype="bf16", example_batch=example_batch())
    trainer = transformers.Trainer(model=model, args=a, train_dataset=TRAIN)
    with pytest.warns(RuntimeWarning, match=r"pass Trainer\(\.\.\., optimizers=optimizers\)") as record:
        trainer.train()
    assert sum("not being stepped" in str(w.message) for w in record) == 1


def test_optimizers_passed_with_gradient_accumulation_does_not_warn(tmp_path, recwarn):
    a = args(tmp_path, 3, gradient_accumulation_steps=3)
    trainer = fxamp_trainer(a)
    trainer.train()
    assert not [w for w in recwarn if "not being stepped" in str(w.message)]
    assert trainer.optimizer.skipped_steps == 0


def test_lean_masters_and_state_are_passed_on(tmp_path):
    with pytest.raises(ValueError, match=r"masters='half' is not a valid mode; valid: 'fp32' \(float32\), 'kahan'"):
        hf.prepare(gpt2(), args(tmp_path, 10), "O2", masters="half", example_batch=example_batch())
    model, (opt, _) = hf.prepare(gpt2(), args(tmp_path, 10), "O2", masters="kahan", state="int8",
                                 example_batch=example_batch())
    assert (str(opt.precision.masters), str(opt.precision.state)) == ("kahan", "int8")
