"""Numerics regressions against torch.autocast: fxamp's SQNR against float32 within 3 dB of autocast's.

Each test builds a tiny model whose decision once cost more than 3 dB and pins the fix.
"""

import math

import pytest
import torch

import fxamp

transformers = pytest.importorskip("transformers")


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return 10 * math.log10(ref.pow(2).sum().item() / (out - ref).pow(2).sum().item())


def _modernbert() -> torch.nn.Module:
    # initializer_range 0.1: the embedding norm's share of the output is large enough to see a low table
    c = transformers.ModernBertConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=64, local_attention=8,
                                      attention_dropout=0.0, embedding_dropout=0.0, mlp_dropout=0.0, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
                                      initializer_range=0.1)
    torch.manual_seed(0)
    return transformers.ModernBertModel(c).eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_o2_modernbert_embedding_table_stays_float32(dtype):
    """ModernBERT normalises its token embedding straight away (no sum with positions): under O2 a
    low-precision table lost 11 dB against autocast; the lookup now runs float32 because only a
    float32 layer norm uses it, so O2 keeps the table float32."""
    model = _modernbert()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (2, 8), generator=g)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, -3:] = 0
    amp = fxamp.convert(model, "O2", dtype=dtype, example_kwargs={"input_ids": ids, "attention_mask": mask},
                        frontend="export")
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
        out = amp(input_ids=ids, attention_mask=mask).last_hidden_state
        with torch.autocast("cpu", dtype=dtype):
            auto = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert out.dtype == torch.float32
    db, db_auto = _sqnr(ref, out), _sqnr(ref, auto.float())
    assert db >= db_auto - 3.0, f"O2 {dtype}: {db:.1f} dB vs autocast {db_auto:.1f} dB"
    assert amp.state_dict()["embeddings.tok_embeddings.weight"].dtype == torch.float32
    assert amp.state_dict()["layers.0.mlp.Wi.weight"].dtype == dtype  # O2 still stores the linears low


def test_embedding_lookup_reason_names_its_float32_user():
    """fxamp.report says why the lookup runs float32."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.norm = torch.nn.LayerNorm(8)

        def forward(self, ids):
            return self.norm(self.emb(ids))

    text = fxamp.report(Net(), "O2", example_inputs=torch.tensor([[1, 2, 3]]), dtype=torch.float16).to_json()
    assert "looking up in float32 keeps the table's bits" in text


def _convnextv2() -> torch.nn.Module:
    c = transformers.ConvNextV2Config(num_channels=3, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 2, 1],
                                      image_size=32, num_labels=10)
    torch.manual_seed(0)
    model = transformers.ConvNextV2ForImageClassification(c).eval()
    with torch.no_grad():  # GRN's gamma and beta start at zero: give them a trained model's weight in the output
        for name, p in model.named_parameters():
            if "grn" in name:
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("policy", ["O1", "O2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_convnextv2_grn_within_a_db_of_autocast(policy, dtype):
    """ConvNeXt-V2's global response norm (an L2 norm over the spatial dims, divided by its channel
    mean) was reported 4.4 dB below autocast in float16; the norm and the mean run float32 and the
    rest follows them, as autocast's type promotion does: within 1 dB."""
    model = _convnextv2()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 3
    amp = fxamp.convert(model, policy, dtype=dtype, example_inputs=(x,))
    with torch.no_grad():
        ref = model(x).logits
        out = amp(x).logits
        with torch.autocast("cpu", dtype=dtype):
            auto = model(x).logits
    rows = [r for r in fxamp.report(amp).rows if r.op.endswith("vector_norm")]
    assert rows and all(r.compute == "float32" for r in rows)
    assert _sqnr(ref, out) >= _sqnr(ref, auto.float()) - 1.0


class _Rotary(torch.nn.Module):
    """Llama's rotary embedding as Hugging Face writes it: a float32 ``inv_freq`` buffer read ``.float()`` into a
    float32 product with the positions, under autocast(enabled=False)."""

    def __init__(self, dim: int = 128):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), persistent=True)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x, positions):
        inv_freq = self.inv_freq[None, :, None].float().expand(positions.shape[0], -1, 1)
        with torch.autocast("cpu", enabled=False):
            angles = (inv_freq.float() @ positions[:, None, :].float()).transpose(1, 2)
        emb = torch.cat([angles, angles], dim=-1)
        return self.proj(x * emb.cos() + x * emb.sin())


def test_o2_keeps_a_buffer_float32_a_rotary_table_at_position_2000_as_autocast():
    """A buffer has no float32 master: O2 stored Llama's inv_freq bfloat16 (its one user, .float(), follows its
    input), a rounding no optimizer undoes and every checkpoint keeps. At position 2000 the rotary angles were off by
    up to 2.4 radians (head dim 128): 8 dB against autocast's 51 dB. Buffers stay float32 under O2, and the
    user's buffer comes back bitwise from a save."""
    torch.manual_seed(0)
    model = _Rotary().eval()
    g = torch.Generator().manual_seed(1)
    x, positions = torch.randn(1, 64, 128, generator=g), torch.arange(1984, 2048)[None]
    with torch.no_grad():
        ref = model(x, positions)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = model(x, positions).float()
        amp = fxamp.convert(model, "O2", dtype=torch.bfloat16, example_inputs=(x, positions))
        out = amp(x, positions).float()
    assert dict(amp.named_buffers())["inv_freq"].dtype == torch.float32
    assert torch.equal(amp.state_dict()["inv_freq"], model.inv_freq)
    assert _sqnr(ref, out) >= _sqnr(ref, auto) - 3, (_sqnr(ref, out), _sqnr(ref, auto))
