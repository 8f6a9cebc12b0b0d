"""Checks shared by test_export.py and test_transformers.py: one converted model, every property the
torch.export front end promises (numerics against float32, gradients, shapes, modes, names).

Numerics are measured as SQNR in dB of the converted model's float32 output against the original's
(both in eval mode): ``20·log10(‖ref‖ / ‖out − ref‖)``.  float16 keeps ~11 significant bits and
bfloat16 ~8, so a model whose matmuls run in them lands near 50-60 dB and 35-45 dB; the
thresholds below leave room for depth and accumulation order.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Tuple

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

import fxamp

#: minimum SQNR (dB) of a converted model's forward against float32
MIN_SQNR = {torch.float16: 40.0, torch.bfloat16: 25.0}
#: minimum cosine similarity of the whole gradient vector against float32's
MIN_GRAD_COS = {torch.float16: 0.999, torch.bfloat16: 0.99}

Inputs = Callable[[int, int], Tuple[Tuple[Any, ...], Dict[str, Any]]]


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    noise = (out - ref).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(ref.norm().item() / noise)


def main_output(out: Any) -> torch.Tensor:
    """The tensor to compare: ``logits`` of a ModelOutput, else the first float leaf."""
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    return next(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())


def float_leaves(out: Any):
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def grads(module: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in module.named_parameters() if p.grad is not None}


def check_converted(model: nn.Module, inputs: Inputs, policy: str, dtype: torch.dtype, *,
                    shapes=((2, 8), (3, 12)), dropout: bool = True, **convert_kwargs: Any) -> nn.Module:
    """Convert ``model`` with the export front end from ``inputs(*shapes[0])`` and check every promise.

    ``inputs(batch, length)`` builds (args, kwargs); ``shapes[1]`` is a second, unseen shape.
    ``dropout``: the model has active dropout, so two train-mode calls must differ.
    """
    torch.manual_seed(0)
    args, kwargs = inputs(*shapes[0])
    model.eval()
    amp = fxamp.convert(model, policy, dtype=dtype, example_inputs=args, example_kwargs=kwargs,
                        frontend="export", **convert_kwargs)
    assert fxamp.conversion_info(amp).frontend == "export"
    assert not model.training, "convert() must leave the model's mode as it was"
    assert set(amp.state_dict()) == set(model.state_dict()), "state_dict keys must equal the original's"
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, f"{name}: the original model must stay float32"

    # forward, at the capture shape and an unseen one, in eval mode: close to float32 and deterministic
    amp.eval()
    for batch, length in shapes:
        a, k = inputs(batch, length)
        with torch.no_grad():
            ref = model(*a, **k)
            out = amp(*a, **k)
            again = amp(*a, **k)
        assert type(out) is type(ref), f"output structure {type(out).__name__} != {type(ref).__name__}"
        # a value torch.export cannot return (a DynamicCache) comes back as None, the rest as it was
        returnable = pytree.tree_map(lambda v: v if isinstance(v, (torch.Tensor, int, float, bool, str)) else None, ref)
        assert pytree.tree_structure(out) == pytree.tree_structure(returnable)
        for leaf in float_leaves(out):
            assert leaf.dtype == torch.float32, "floating outputs must come back in float32"
        r, o = main_output(ref), main_output(out)
        assert o.shape == r.shape
        db = sqnr(r, o)
        assert db >= MIN_SQNR[dtype], f"SQNR {db:.1f} dB < {MIN_SQNR[dtype]} dB at shape {(batch, length)}"
        for x, y in zip(float_leaves(out), float_leaves(again)):
            assert torch.equal(x, y), "eval() must be deterministic"

    # backward in eval mode: a gradient on every trainable parameter, aligned with float32's
    a, k = inputs(*shapes[1])
    model.zero_grad(set_to_none=True)
    amp.zero_grad(set_to_none=True)
    main_output(model(*a, **k)).float().pow(2).mean().backward()
    ref_grads = grads(model)
    model.zero_grad(set_to_none=True)
    amp.zero_grad(set_to_none=True)
    main_output(amp(*a, **k)).pow(2).mean().backward()
    missing = [n for n, p in amp.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"no gradient on {missing[:5]}"
    got = grads(amp)
    assert set(got) == set(ref_grads)
    flat_ref = torch.cat([ref_grads[n].flatten() for n in sorted(ref_grads)])
    flat_got = torch.cat([got[n].flatten() for n in sorted(ref_grads)])
    assert torch.isfinite(flat_got).all()
    cos = torch.nn.functional.cosine_similarity(flat_ref, flat_got, dim=0).item()
    assert cos >= MIN_GRAD_COS[dtype], f"gradient cosine similarity {cos:.4f} against float32"

    # train mode: dropout is live again (two calls differ), and training still reaches every parameter
    amp.train()
    amp.zero_grad(set_to_none=True)
    a, k = inputs(*shapes[0])
    first = amp(*a, **k)
    second = amp(*a, **k)
    if dropout:
        assert not torch.equal(main_output(first), main_output(second)), "train-mode dropout must be random"
    loss = getattr(first, "loss", None)
    if loss is None:
        loss = main_output(first).pow(2).mean()
    else:
        assert loss.dtype == torch.float32, "the model's own loss must be computed in float32"
    loss.backward()
    missing = [n for n, p in amp.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"no gradient in train mode on {missing[:5]}"
    amp.eval()
    model.zero_grad(set_to_none=True)
    return amp


def unlisted_aten_ops(gm: torch.fx.GraphModule) -> Dict[str, int]:
    """aten ops the classifier put on no list (in-place ops are decided by the graph, not the lists)."""
    found: Dict[str, int] = {}
    for node in gm.graph.nodes:
        d = node.meta.get("fxamp")
        if d is not None and d.category is fxamp.conversion.op_lists.Category.UNLISTED and d.op.startswith("aten."):
            found[d.op] = found.get(d.op, 0) + 1
    return found
