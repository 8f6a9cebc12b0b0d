"""The new-user probe, options side: every policy and its string forms, overrides, options with typos and
wrong types, the report, and the public API called in ways a new user would (right or wrong)."""
import copy
import io
import os
import tempfile
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp

from .runner import Cases, bitwise, like_autocast

cases = Cases("options")
BF16, FP16, F32 = torch.bfloat16, torch.float16, torch.float32


class Net(nn.Module):
    """Linear → LayerNorm → GELU → Linear → softmax-weighted sum: each op list met once."""

    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        h = F.gelu(self.norm(self.fc1(x)))
        logits = self.fc2(h)
        return logits + torch.softmax(logits, -1).mean(-1, keepdim=True)


def net() -> Net:
    m = Net()
    with torch.no_grad():
        m.norm.weight.uniform_(0.5, 1.5)
    return m


X = None


def x(n: int = 4) -> torch.Tensor:
    return torch.randn(n, 8)


def warned(fn):
    """``fn()``'s result and the text of every warning it raised."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn()
    return out, " ".join(str(w.message) for w in seen)


# -- every preset × dtype --------------------------------------------------------------------------------------


def _policy_case(policy, dtype):
    def case():
        m = net()
        amp = fxamp.convert(m, policy, dtype=dtype)
        inp = x()
        if policy == "O0":
            with torch.no_grad():
                bitwise(m(inp), amp(inp), "O0 against the float32 model")
            return
        out = amp(inp)
        assert out.dtype == F32, f"{policy} output {out.dtype}"
        # O3 runs the unsafe ops low too: its floor is low precision's, not autocast's
        like_autocast(m, amp, inp, dtype=dtype, floor_db=(20 if dtype == BF16 else 30) if policy == "O3" else None)
        stored = dict(amp.named_parameters())["fc1.weight"].dtype
        assert stored == (dtype if policy in ("O2", "O3") else F32), f"{policy} stores fc1.weight in {stored}"
        norm = dict(amp.named_parameters())["norm.weight"].dtype
        assert norm == (dtype if policy == "O3" else F32), f"{policy} stores the norm weight in {norm}"
    return case


for _p in ("O0", "O1", "O2", "O3"):
    for _d, _dn in ((BF16, "bf16"), (FP16, "fp16")):
        cases.add(name=f"preset_{_p}_{_dn}")(_policy_case(_p, _d))


@cases.add()
def o0_gradients_bitwise():
    m = net()
    ref = copy.deepcopy(m)
    amp = fxamp.convert(m, "O0")
    inp = x()
    amp(inp).sum().backward()
    ref(inp).sum().backward()
    bitwise({n: p.grad for n, p in ref.named_parameters()}, {n: p.grad for n, p in m.named_parameters()}, "grads")


@cases.add()
def o3_keep_norms_fp32():
    m = net()
    amp = fxamp.convert(m, "O3", keep_norms_fp32=True)
    assert dict(amp.named_parameters())["norm.weight"].dtype == F32
    assert dict(amp.named_parameters())["fc1.weight"].dtype == BF16
    like_autocast(m, amp, x(), floor_db=20)


@cases.add("refused")
def keep_norms_fp32_with_an_o3_policy_object():
    # issue 37 probe: the flag was ignored with a Policy (the norms ran in bfloat16); now refused with the fix
    fxamp.convert(net(), fxamp.Policy.parse("O3"), keep_norms_fp32=True)


@cases.add()
def policy_object_with_norms_float32():
    m = net()
    amp = fxamp.convert(m, fxamp.Policy.parse("O3").replace(norms="float32"))
    assert dict(amp.named_parameters())["norm.weight"].dtype == F32
    like_autocast(m, amp, x(), floor_db=20)


@cases.add("refused")
def keep_norms_fp32_with_o1():
    fxamp.convert(net(), "O1", keep_norms_fp32=True)


# -- string forms ----------------------------------------------------------------------------------------------


STRINGS_THAT_WORK = {
    "lowercase": ("o2", {}),
    "spaces": (" O1 ", {}),
    "dtype_name_bf16": ("O2", {"dtype": "bf16"}),
    "dtype_name_float16": ("O1", {"dtype": "float16"}),
    "dtype_torch_half": ("O1", {"dtype": torch.half}),
    "fields": ("params=float32,compute=bfloat16,output=float32", {}),
    "fields_short_names": ("params=bf16,compute=bf16", {}),
    "preset_then_output_keep": ("O2,output=keep", {}),
    "policy_object": (fxamp.Policy(params="float32", compute="bf16"), {}),
    "parsed_policy": (fxamp.Policy.parse("O2", "fp16"), {}),
}


def _string_case(policy, kwargs):
    def case():
        m = net()
        amp = fxamp.convert(m, policy, **kwargs)
        pol = fxamp.conversion_info(amp).policy
        low = pol.compute
        like_autocast(m, lambda t: amp(t).float(), x(), dtype=low)
        assert fxamp.Policy.parse(str(pol)) == pol, f"{pol} does not parse back"
    return case


for _name, (_pol, _kw) in STRINGS_THAT_WORK.items():
    cases.add(name=f"policy_{_name}")(_string_case(_pol, _kw))


@cases.add()
def output_keep_returns_what_the_last_op_gives():
    # output=keep: no cast at the output; Net's last op adds a float32 softmax (unsafe), so float32 is right
    assert fxamp.convert(net(), "O2,output=keep")(x()).dtype == F32
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))  # ends in a low-precision matmul
    amp = fxamp.convert(m, "O2,output=keep")
    out = amp(x())
    assert out.dtype == BF16, f"output=keep gave {out.dtype}"
    like_autocast(m, lambda t: amp(t).float(), x())


@cases.add()
def output_bf16_field():
    out = fxamp.convert(net(), "params=float32,compute=bf16,output=bf16")(x())
    assert out.dtype == BF16, out.dtype


STRINGS_REFUSED = {
    "zero_one_typo": ("01", {}),
    "o4": ("O4", {}),
    "apex_string_amp": ("amp", {}),
    "empty": ("", {}),
    "field_typo": ("params=float32,comput=bf16", {}),
    "field_twice": ("compute=bf16,compute=fp16", {}),
    "no_compute": ("params=bf16", {}),
    "dtype_typo": ("O1", {"dtype": "bf61"}),
    "dtype_float64": ("O1", {"dtype": torch.float64}),
    "dtype_float32": ("O2", {"dtype": "float32"}),
    "dtype_int8": ("O1", {"dtype": torch.int8}),
    "dtype_contradicts": ("params=float32,compute=float16", {"dtype": "bf16"}),
    "preset_trailing_comma_word": ("O2,fast", {}),
    "float8_typo": ("O2,float8=rowwsie", {}),
    "float8_with_fp16": ("O2,float8=rowwise", {"dtype": "fp16"}),
    "policy_int": (2, {}),
    "policy_none": (None, {}),
    "policy_dict": ({"params": "bf16"}, {}),
    "compute_int8_field": ("compute=int8", {}),
}

for _name, (_pol, _kw) in STRINGS_REFUSED.items():
    cases.add("refused", name=f"refused_{_name}")(lambda p=_pol, kw=_kw: fxamp.convert(net(), p, **kw))


# -- every option, right and wrong -----------------------------------------------------------------------------


OPTIONS_REFUSED = {
    "debug_overflow_typo": {"debug_overflow": "recrod"},
    "debug_overflow_bool": {"debug_overflow": True},
    "dynamic_typo": {"dynamic": "batches"},
    "dynamic_bool": {"dynamic": False, "frontend": "export"},
    "weight_cache_str": {"weight_cache": "yes"},
    "recompute_islands_int": {"recompute_islands": 1},
    "overrides_category_typo": {"overrides": {torch.softmax: "nuetral"}},
    "overrides_list": {"overrides": [torch.softmax]},
    "overrides_key_int": {"overrides": {42: "unsafe"}},
    "module_overrides_list": {"module_overrides": ["fc1"]},
    "module_overrides_value_typo": {"module_overrides": {"fc1": "unsafe!"}},
    "node_overrides_value_typo": {"node_overrides": {"softmax": "float32"}},
    "op_lists_dict": {"op_lists": {"safe": [torch.matmul]}},
    "leaf_modules_bad_path": {"leaf_modules": ["encoder"]},
    "leaf_modules_a_string": {"leaf_modules": "norm"},
    "leaf_modules_instance": {"leaf_modules": [nn.GELU()]},
    "frontend_typo": {"frontend": "torchscript"},
    # (with frontend="auto" torch.fx captures without them, so they are never read: next cases)
    "export_example_inputs_wrong_shape": {"example_inputs": (torch.randn(2, 5),), "frontend": "export"},
    "export_example_kwargs_not_a_dict": {"example_kwargs": [("x", torch.randn(2, 8))], "frontend": "export"},
    # (an unknown keyword, apex's keep_batchnorm_fp32, gets Python's own "unexpected keyword argument"
    # TypeError, raised at the caller's line, which the runner cannot tell from a crash: not a case)
}

for _name, _kw in OPTIONS_REFUSED.items():
    cases.add("refused", name=f"option_{_name}")(lambda kw=_kw: fxamp.convert(net(), "O1", **kw))


@cases.add()
def override_softmax_neutral_runs_low():
    m = net()
    rep = fxamp.report(m, "O1", overrides={torch.softmax: "neutral"}, example_inputs=(x(),))
    row = next(r for r in rep if r.op.endswith("softmax"))
    assert row.category == "neutral" and row.source == "override", (row.category, row.source)
    like_autocast(m, fxamp.convert(m, "O1", overrides={torch.softmax: "neutral"}), x())


@cases.add()
def override_module_class_gelu_unsafe():
    class G(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act, self.out = nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2)

        def forward(self, t):
            return self.out(self.act(self.fc(t)))

    m = G()
    rep = fxamp.report(m, "O1", overrides={nn.GELU: "unsafe"}, example_inputs=(x(),))
    row = next(r for r in rep if r.module == "act" and r.is_op)
    assert row.compute == "float32", f"GELU overridden unsafe computes in {row.compute}"
    like_autocast(m, fxamp.convert(m, "O1", overrides={nn.GELU: "unsafe"}), x())


@cases.add()
def override_by_method_string():
    m = net()
    rep = fxamp.report(m, "O1", overrides={"Tensor.mean": "unsafe"}, example_inputs=(x(),))
    rows = [r for r in rep if r.op == "Tensor.mean"]
    assert rows and all(r.compute == "float32" for r in rows), [(r.op, r.compute) for r in rows]


@cases.add()
def override_aten_op_with_export():
    m = net()
    amp = fxamp.convert(m, "O1", overrides={torch.ops.aten.linear: "unsafe"}, frontend="export",
                        example_inputs=(x(),))
    inp = x()
    with torch.no_grad():
        ref = m(inp)
    out = amp(inp)
    assert (out - ref).abs().max() < 1e-4, "linear overridden unsafe did not run in float32"


@cases.add()
def module_override_keeps_a_layer_float32():
    m = net()
    amp = fxamp.convert(m, "O2", module_overrides={"fc2": "unsafe"})
    assert dict(amp.named_parameters())["fc2.weight"].dtype == F32, "fc2 overridden unsafe is stored low"
    assert dict(amp.named_parameters())["fc1.weight"].dtype == BF16
    like_autocast(m, amp, x())


@cases.add()
def module_override_root_everything_unsafe_is_float32():
    m = net()
    amp = fxamp.convert(m, "O1", module_overrides={"": "unsafe"})
    inp = x()
    with torch.no_grad():
        ref = m(inp)
    assert (amp(inp) - ref).abs().max() < 1e-5, "every op overridden unsafe did not run in float32"


@cases.add("either")
def module_override_path_typo_is_said():
    # a path that matches nothing: refused, or at least warned naming the path (never silently ignored)
    _, said = warned(lambda: fxamp.convert(net(), "O1", module_overrides={"fc3": "unsafe"}))
    assert "fc3" in said, f"a module override matching nothing was not said: {said!r}"


@cases.add("either")
def node_override_name_typo_is_said():
    _, said = warned(lambda: fxamp.convert(net(), "O1", node_overrides={"sofmax": "unsafe"}))
    assert "sofmax" in said, f"a node override matching nothing was not said: {said!r}"


@cases.add("either")
def op_override_unused_is_said():
    _, said = warned(lambda: fxamp.convert(net(), "O1", overrides={torch.exp: "unsafe"}))
    assert "exp" in said, f"an op override matching nothing was not said: {said!r}"


@cases.add()
def node_override_by_report_name():
    m = net()
    rep = fxamp.report(m, "O1", example_inputs=(x(),))
    name = next(r.node for r in rep if r.op.endswith("linear") and r.module == "fc2")
    amp = fxamp.convert(m, "O1", node_overrides={name: "unsafe"})
    row = next(r for r in fxamp.report(m, "O1", node_overrides={name: "unsafe"}, example_inputs=(x(),))
               if r.node == name)
    assert row.compute == "float32" and row.source == "node override", (row.compute, row.source)
    like_autocast(m, amp, x())


@cases.add()
def leaf_module_class_runs_float32():
    m = net()
    amp = fxamp.convert(m, "O1", leaf_modules=[nn.LayerNorm])
    like_autocast(m, amp, x())


@cases.add()
def weight_cache_off_is_bitwise_the_same():
    m = net()
    inp = x()
    with torch.no_grad():
        bitwise(fxamp.convert(m, "O1")(inp), fxamp.convert(m, "O1", weight_cache=False)(inp), "weight_cache")


@cases.add()
def weight_cache_sees_an_in_place_weight_update():
    m = net()
    amp = fxamp.convert(m, "O1")
    inp = x()
    with torch.no_grad():
        amp(inp)  # fills the cache
        m.fc1.weight.mul_(2)  # what an optimizer step on the shared float32 weight does
        bitwise(fxamp.convert(m, "O1", weight_cache=False)(inp), amp(inp), "after the weight changed")


@cases.add()
def weight_cache_sees_load_state_dict():
    m, other = net(), net()
    amp = fxamp.convert(m, "O1")
    inp = x()
    with torch.no_grad():
        amp(inp)
        amp.load_state_dict(other.state_dict())
        bitwise(fxamp.convert(other, "O1")(inp), amp(inp), "after load_state_dict")


@cases.add()
def recompute_islands_off_same_gradients():
    m = net()
    inp, y = x(), torch.tensor([0, 1, 2, 3])
    grads = []
    for flag in (True, False):
        mm = copy.deepcopy(m)
        amp = fxamp.convert(mm, "O1", recompute_islands=flag)
        F.cross_entropy(amp(inp), y).backward()
        grads.append({n: p.grad for n, p in mm.named_parameters()})
    bitwise(grads[0], grads[1], "gradients with and without recomputed islands")


@cases.add("refused")
def debug_overflow_raise_names_the_node():
    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, t):
            return self.fc(t * 1e5)  # beyond float16's range after the matmul

    amp = fxamp.convert(Big(), "O1", dtype="fp16", debug_overflow="raise")
    amp(torch.ones(2, 8))


@cases.add()
def debug_overflow_record_then_info():
    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, t):
            return self.fc(t * 1e5)

    amp = fxamp.convert(Big(), "O1", dtype="fp16", debug_overflow="record")
    amp(torch.ones(2, 8))
    info = fxamp.overflow_info(amp)
    assert info is not None and "linear" in str(info).lower(), f"overflow_info: {info!r}"


@cases.add()
def dynamic_none_fixes_the_batch_size():
    m = net()
    amp = fxamp.convert(m, "O1", frontend="export", example_inputs=(x(4),), dynamic="none")
    like_autocast(m, amp, x(4))
    try:
        amp(x(5))
    except RuntimeError as e:  # fxamp's input check (a RuntimeError, as torch.export's own guard is)
        assert "kept static" in str(e) and "dynamic='all'" in str(e), str(e)[:200]
    else:
        raise AssertionError("dynamic='none' ran another batch size without saying anything")


@cases.add()
def dynamic_all_takes_other_sizes():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    amp = fxamp.convert(m, "O1", frontend="export", example_inputs=(torch.randn(2, 3, 8, 8),), dynamic="all")
    like_autocast(m, amp, torch.randn(3, 3, 10, 12))


# -- the model and its dtype -----------------------------------------------------------------------------------


@cases.add("either")
def example_inputs_unused_by_torch_fx():
    # frontend="auto": torch.fx captures without inputs and never reads example_inputs, so one of a wrong
    # shape changes nothing; the converted model still gives the right numbers
    m = net()
    amp = fxamp.convert(m, "O1", example_inputs=(torch.randn(2, 5),))
    like_autocast(m, amp, x())


@cases.add("either")
def export_example_inputs_as_a_list():
    m = net()
    amp = fxamp.convert(m, "O1", frontend="export", example_inputs=[x(2)])
    like_autocast(m, amp, x(3))


@cases.add("refused")
def model_class_not_instance():
    fxamp.convert(Net, "O1")


@cases.add("refused")
def a_function_not_a_module():
    fxamp.convert(lambda t: t * 2, "O1")


@cases.add("refused")
def bf16_model_converted_to_fp16():
    fxamp.convert(net().bfloat16(), "O1", dtype="fp16")


@cases.add("either")
def half_model_o1_fp16():
    m = net().half()
    amp = fxamp.convert(m, "O1", dtype="fp16")
    out = amp(x().half())
    assert out.dtype in (FP16, F32) and torch.isfinite(out).all()


@cases.add("refused")
def o2_model_then_half():
    fxamp.convert(net(), "O2").half()


@cases.add("refused")
def o2_model_then_double():
    fxamp.convert(net(), "O2").to(torch.float64)


@cases.add()
def o2_model_to_cpu_works():
    m = net()
    amp = fxamp.convert(m, "O2").to("cpu")
    like_autocast(m, amp, x())


@cases.add("either")
def converting_a_converted_model():
    m = net()
    twice = fxamp.convert(fxamp.convert(m, "O1"), "O1")
    like_autocast(m, twice, x())


@cases.add("either")
def converting_a_torch_compiled_model():
    m = net()
    amp = fxamp.convert(torch.compile(m, backend="eager"), "O1")
    like_autocast(m, amp, x())


@cases.add("refused")
def converting_a_torchscript_model():
    fxamp.convert(torch.jit.script(nn.Linear(4, 4)), "O1")


@cases.add()
def converting_the_same_model_twice_gives_independent_copies():
    m = net()
    a, b = fxamp.convert(m, "O2"), fxamp.convert(m, "O2")
    with torch.no_grad():
        next(a.parameters()).zero_()
    assert next(b.parameters()).abs().sum() > 0, "two O2 conversions of one model share storage"
    assert m.fc1.weight.abs().sum() > 0, "the original changed"


@cases.add("refused")
def lazy_module_before_first_call():
    fxamp.convert(nn.Sequential(nn.LazyLinear(4), nn.ReLU()), "O1")


@cases.add("refused")
def convert_inplace_policy_typo():
    fxamp.convert_(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), "O5")


@cases.add("refused")
def convert_inplace_keep_originals_str():
    fxamp.convert_(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), "O2", keep_originals="no")


@cases.add("refused")
def convert_inplace_blocks_a_string():
    fxamp.convert_(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), "O1", blocks="0")


# -- report, compare, overrides files, info ----------------------------------------------------------------------


@cases.add()
def report_without_inputs_and_formats():
    rep = fxamp.report(net(), "O2")
    assert len(rep) > 0 and str(rep)
    import json

    data = json.loads(rep.to_json())
    assert data and rep.to_csv().count("\n") >= len([r for r in rep]) // 2


@cases.add()
def report_bare_tensor_inputs_and_numerics():
    rep = fxamp.report(net(), "O1", example_inputs=x(), numerics=True)
    rows = [r for r in rep if r.numerics is not None]
    assert rows, "numerics=True measured no node"


@cases.add()
def report_only_unsafe():
    rep = fxamp.report(net(), "O1", example_inputs=(x(),))
    only = rep.only("unsafe")
    assert all(r.category == "unsafe" or r.resolved == "unsafe" for r in only if r.is_op)


@cases.add("refused")
def report_only_category_typo():
    fxamp.report(net(), "O1").only("unsaf")


@cases.add()
def report_old_argument_order_still_works():
    rep, said = warned(lambda: fxamp.report(net(), (x(),), "O2"))
    assert len(rep) > 0 and "deprecat" in said.lower(), said[:200]


@cases.add("refused")
def report_getitem_unknown_node():
    fxamp.report(net(), "O1")["no_such_node"]


@cases.add()
def report_of_a_converted_module():
    amp = fxamp.convert(net(), "O2")
    rep = fxamp.report(amp, example_inputs=(x(),))
    assert len(rep) > 0 and any(r.low_precision for r in rep if r.is_op)


@cases.add()
def report_gradients_with_loss_fn():
    rep = fxamp.report(net(), "O1", example_inputs=(x(),), gradients=True, loss_fn=lambda out: out.pow(2).mean())
    assert rep.gradients is not None


@cases.add()
def compare_o1_o2():
    diff = fxamp.compare(net(), ("O1", "O2"), example_inputs=(x(),))
    assert str(diff)


@cases.add("refused")
def compare_three_policies():
    fxamp.compare(net(), ("O1", "O2", "O3"))


@cases.add()
def overrides_file_round_trip():
    overrides = {"overrides": {"torch.softmax": "unsafe"}, "module_overrides": {"fc2": "unsafe"}}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "o.json")
        fxamp.save_overrides(overrides, path)
        back = fxamp.load_overrides(path)
    m = net()
    amp = fxamp.convert(m, "O2", **back)
    assert dict(amp.named_parameters())["fc2.weight"].dtype == F32
    like_autocast(m, amp, x())


@cases.add("refused")
def load_overrides_missing_file():
    fxamp.load_overrides("/nonexistent/overrides.json")


@cases.add("either")
def conversion_info_of_a_plain_module():
    info = fxamp.conversion_info(net())
    assert info is None, f"a plain module has conversion info {info!r}"


@cases.add()
def conversion_info_says_the_dtype_chosen():
    info = fxamp.conversion_info(fxamp.convert(net(), "O1"))
    assert info.policy.compute == BF16 and any("bfloat16" in n for n in info.notes), info.notes


@cases.add("either")
def overflow_info_without_debug_overflow():
    info = fxamp.overflow_info(fxamp.convert(net(), "O1"))
    assert info is None or not info, info


@cases.add()
def save_and_load_with_state_dict_in_a_fresh_conversion():
    m = net()
    amp = fxamp.convert(m, "O2")
    buf = io.BytesIO()
    torch.save(amp.state_dict(), buf)
    buf.seek(0)
    fresh = fxamp.convert(net(), "O2")
    fresh.load_state_dict(torch.load(buf))
    inp = x()
    bitwise(amp(inp), fresh(inp), "a fresh O2 conversion loaded from the saved state_dict")
