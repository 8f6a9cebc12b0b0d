"""``conversion/attention.py``: attention with active dropout routed to fxamp's low-precision runtime."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.conversion.graph import decision_of
from fxamp.conversion.runtime import attention, multi_head_attention


class Sdpa(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_sdpa_with_dropout_runs_through_runtime_attention():
    amp = fxamp.convert(Sdpa(0.5).train(), "O1", dtype=torch.bfloat16)
    (node,) = [n for n in amp.graph.nodes if n.target is attention]
    assert decision_of(node).compute is torch.bfloat16
    assert F.scaled_dot_product_attention not in targets(amp)
    x = torch.randn(2, 5, 8)
    assert amp.eval()(x).dtype == torch.float32
    ref = Sdpa(0.5).eval()
    ref.load_state_dict(amp.state_dict())
    torch.testing.assert_close(amp(x), ref(x), rtol=3e-2, atol=3e-2)  # eval: no dropout, bf16 vs fp32


@pytest.mark.parametrize("p,policy", [(0.0, "O1"), (0.5, "O0")])
def test_no_dropout_or_float32_attention_is_left_alone(p, policy):
    amp = fxamp.convert(Sdpa(p).train(), policy, dtype=torch.bfloat16)
    assert attention not in targets(amp)
    assert F.scaled_dot_product_attention in targets(amp)


def test_multi_head_attention_leaf_with_dropout_runs_through_runtime():
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.1, batch_first=True)
    amp = fxamp.convert(layer, "O1", dtype=torch.bfloat16)
    assert multi_head_attention in targets(amp)
    amp2 = fxamp.convert(nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True),
                         "O1", dtype=torch.bfloat16)
    assert multi_head_attention not in targets(amp2)
    amp.eval()
    x = torch.randn(2, 3, 8)
    layer.eval()
    torch.testing.assert_close(amp(x), layer(x), rtol=5e-2, atol=5e-2)


class FunctionalMHA(nn.Module):
    """WavLM's attention: ``F.multi_head_attention_forward`` called with its own projections (one torch.fx node)."""

    def __init__(self, d=16, heads=2, need_weights=True):
        super().__init__()
        self.heads, self.need_weights = heads, need_weights
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, bias):
        x = x.transpose(0, 1)  # (seq, batch, d)
        out, _ = F.multi_head_attention_forward(
            x, x, x, x.shape[-1], self.heads, torch.empty([0]),
            torch.cat((self.q.bias, self.k.bias, self.v.bias)), None, None, False, 0.0, self.out.weight,
            self.out.bias, self.training, None, self.need_weights, bias, use_separate_proj_weight=True,
            q_proj_weight=self.q.weight, k_proj_weight=self.k.weight, v_proj_weight=self.v.weight)
        return out.transpose(0, 1)


@pytest.mark.parametrize("need_weights", [True, False])
def test_the_multi_head_attention_function_runs_low_as_the_module_does(need_weights):
    # it was "unlisted": one node on float32 inputs, so a block converted in place ran its attention in float32
    torch.manual_seed(0)
    model, x, bias = FunctionalMHA(need_weights=need_weights).eval(), torch.randn(2, 5, 16), torch.randn(4, 5, 5)
    amp = fxamp.convert(model, "O1", dtype=torch.bfloat16, frontend="fx")
    (node,) = [n for n in amp.graph.nodes if n.target is F.multi_head_attention_forward]
    d = decision_of(node)
    assert d.compute == torch.bfloat16 and "need_weights" in d.reason, d
    with torch.no_grad():
        ref, out = model(x, bias), amp(x, bias)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = model(x, bias).float()
    err, auto_err = (out - ref).norm() / ref.norm(), (auto - ref).norm() / ref.norm()
    assert out.dtype == torch.float32 and 0 < err < 3 * auto_err + 1e-3, (err, auto_err)
