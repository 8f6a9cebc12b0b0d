"""torch.nn's transformers, traced by torch.fx into their per-op math.

``torch.fx`` keeps torch.nn modules as leaves, and cannot trace ``nn.TransformerEncoderLayer``,
``nn.TransformerEncoder`` or ``nn.Transformer`` anyway: their ``forward`` checks the input's rank
and the masks' dtypes in Python (``if src.dim() != 3``, ``F._canonical_mask``) to choose the
inference fast path (``torch._transformer_encoder_layer_fwd``, nested tensors).  As leaves they
ran whole in float32.  The fx front end instead traces them through :data:`FORWARDS`: their
reference (training-mode) path, which computes the same function in both modes, with the checks
that need tensor values done at run time by the two small functions below::

    encoder.layers.0(src)        ==>     self_attn = self.encoder.layers.0.self_attn(src, src, src, need_weights=False, ...)
                                         dropout1 = self.encoder.layers.0.dropout1(getitem)
                                         norm1 = self.encoder.layers.0.norm1(src + dropout1)
                                         linear = F.linear(norm1, linear1_weight, linear1_bias) ...

``nn.MultiheadAttention`` stays a leaf (classified safe: projections and attention in low
precision); ``nn.TransformerDecoderLayer``'s own ``forward`` traces as written.  The fused layer
kernel is never called (outputs agree with it to rounding), but where ``nn.TransformerEncoder``
would take its nested-tensor path (eval, no autograd graph, a ``src_key_padding_mask``: it
computes only the real tokens and pads the result with zeros), :func:`fast_path_padding` zeroes
the padded positions the same way, so those outputs are the original's, not computed values.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
# torch's own mask helpers (no public equivalent): calling them keeps the converted module's
# masks exactly the original's, including their validation errors
from torch.nn.modules.transformer import _detect_is_causal_mask, _get_seq_len

__all__ = ["FORWARDS", "canonical_masks", "causal_hint", "fast_path_padding", "traced_class"]


def canonical_masks(src: torch.Tensor, mask: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor],
                    names: Tuple[str, str] = ("mask", "src_key_padding_mask")) -> Tuple[Any, Any]:
    """(mask, key_padding_mask) as ``TransformerEncoder(Layer).forward`` makes them: float masks of ``src``'s dtype."""
    key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name=names[1], other_type=F._none_or_dtype(mask),
                                         other_name=names[0], target_type=src.dtype)
    mask = F._canonical_mask(mask=mask, mask_name=names[0], other_type=None, other_name="",
                             target_type=src.dtype, check_other=False)
    return mask, key_padding_mask


def causal_hint(mask: Optional[torch.Tensor], is_causal: Optional[bool], src: torch.Tensor, batch_first: bool) -> bool:
    """Whether ``mask`` is the causal mask (``is_causal=None``: detect it, as the encoders do)."""
    return _detect_is_causal_mask(mask, is_causal, _get_seq_len(src, batch_first))


def fast_path_padding(first_layer: nn.TransformerEncoderLayer, use_nested_tensor: bool, mask_check: bool,
                      src: torch.Tensor, mask: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor],
                      output: torch.Tensor) -> torch.Tensor:
    """``output`` (after the layers, before the final norm) with zeros at the padded positions when
    ``nn.TransformerEncoder.forward`` would have run its nested-tensor path, else ``output`` as is.

    That path (eval, no autograd graph, a key padding mask and no attention mask; torch 2.x's
    conditions, checked here in the same order) computes the real tokens only and pads the result
    back with zeros, so in inference the original returns zeros where the traced reference path
    computes values.  ``use_nested_tensor`` and ``mask_check`` are the encoder's attributes.
    """
    if key_padding_mask is None or not _takes_nested_path(first_layer, use_nested_tensor, mask_check, src, mask,
                                                          key_padding_mask):
        return output
    return output.masked_fill(key_padding_mask.bool().unsqueeze(-1), 0.0)  # (bool or float: nonzero pads)


def _takes_nested_path(first: nn.TransformerEncoderLayer, use_nested_tensor: bool, mask_check: bool,
                       src: torch.Tensor, mask: Optional[torch.Tensor], key_padding_mask: torch.Tensor) -> bool:
    """``nn.TransformerEncoder.forward``'s choice of its nested-tensor path (``why_not_sparsity_fast_path``)."""
    if not torch.backends.mha.get_fastpath_enabled() or not use_nested_tensor or first.training:
        return False
    if src.dim() != 3:
        return False
    if mask_check and (torch.compiler.is_compiling()
                       or not torch._nested_tensor_from_mask_left_aligned(src, key_padding_mask.logical_not())):
        return False
    if src.is_nested or mask is not None or torch.is_autocast_enabled():  # (torch's own checks, as written)
        return False
    attn = first.self_attn
    tensors = (src, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight, attn.out_proj.bias,
               first.norm1.weight, first.norm1.bias, first.norm2.weight, first.norm2.bias,
               first.linear1.weight, first.linear1.bias, first.linear2.weight, first.linear2.bias)
    devices = ("cpu", "cuda", "xpu", torch.utils.backend_registration._privateuse1_backend_name)
    if torch.overrides.has_torch_function(tensors) or src.device.type not in devices:
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


_RUN_TIME = {"canonical_masks": canonical_masks, "causal_hint": causal_hint, "fast_path_padding": fast_path_padding}


def _graph_call(name: str, proxy: fx.Proxy, *args: Any) -> fx.Proxy:
    """A ``call_function`` of the function ``name``: it runs at run time, on the values the masks have then."""
    # looked up in _RUN_TIME, not the module globals, which fx's autowrap patches while tracing
    return proxy.tracer.create_proxy("call_function", _RUN_TIME[name], args, {})


def _masks(src: Any, mask: Any, key_padding_mask: Any, names: Tuple[str, str]) -> Tuple[Any, Any]:
    given = next((a for a in (mask, key_padding_mask) if isinstance(a, fx.Proxy)), None)
    if given is not None:
        masks = _graph_call("canonical_masks", given, src, mask, key_padding_mask, names)
        return masks[0], masks[1]
    return canonical_masks(src, mask, key_padding_mask, names)  # no masks: nothing to record


def _causal(mask: Any, is_causal: Any, src: Any, batch_first: bool) -> Any:
    if isinstance(is_causal, fx.Proxy):  # an input of the traced root: decided at run time
        return _graph_call("causal_hint", is_causal, mask, is_causal, src, batch_first)
    if isinstance(mask, fx.Proxy) and is_causal is None:
        return _graph_call("causal_hint", mask, mask, is_causal, src, batch_first)
    return is_causal is True


def _encoder_layer(m: nn.TransformerEncoderLayer, src: Any, src_mask: Any = None, src_key_padding_mask: Any = None,
                   is_causal: Any = False) -> Any:
    src_mask, src_key_padding_mask = _masks(src, src_mask, src_key_padding_mask,
                                            ("src_mask", "src_key_padding_mask"))
    x = src
    if m.norm_first:
        x = x + m._sa_block(m.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
        x = x + m._ff_block(m.norm2(x))
    else:
        x = m.norm1(x + m._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
        x = m.norm2(x + m._ff_block(x))
    return x


def _encoder(m: nn.TransformerEncoder, src: Any, mask: Any = None, src_key_padding_mask: Any = None,
             is_causal: Optional[bool] = None) -> Any:
    mask, src_key_padding_mask = _masks(src, mask, src_key_padding_mask, ("mask", "src_key_padding_mask"))
    is_causal = _causal(mask, is_causal, src, m.layers[0].self_attn.batch_first)
    output = src
    for layer in m.layers:
        output = layer(output, src_mask=mask, is_causal=is_causal, src_key_padding_mask=src_key_padding_mask)
    if isinstance(src_key_padding_mask, fx.Proxy) and isinstance(src, fx.Proxy):
        tracer = src.tracer
        first = tracer.create_proxy("get_attr", tracer.path_of_module(m.layers[0]), (), {})
        output = _graph_call("fast_path_padding", src_key_padding_mask, first, getattr(m, "use_nested_tensor", False),
                             getattr(m, "mask_check", True), src, mask, src_key_padding_mask, output)
    return m.norm(output) if m.norm is not None else output


def _decoder(m: nn.TransformerDecoder, tgt: Any, memory: Any, tgt_mask: Any = None, memory_mask: Any = None,
             tgt_key_padding_mask: Any = None, memory_key_padding_mask: Any = None,
             tgt_is_causal: Optional[bool] = None, memory_is_causal: bool = False) -> Any:
    tgt_is_causal = _causal(tgt_mask, tgt_is_causal, tgt, m.layers[0].self_attn.batch_first)
    output = tgt
    for layer in m.layers:
        output = layer(output, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                       tgt_key_padding_mask=tgt_key_padding_mask, memory_key_padding_mask=memory_key_padding_mask,
                       tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)
    return m.norm(output) if m.norm is not None else output


def _transformer(m: nn.Transformer, src: Any, tgt: Any, src_mask: Any = None, tgt_mask: Any = None,
                 memory_mask: Any = None, src_key_padding_mask: Any = None, tgt_key_padding_mask: Any = None,
                 memory_key_padding_mask: Any = None, src_is_causal: Optional[bool] = None,
                 tgt_is_causal: Optional[bool] = None, memory_is_causal: bool = False) -> Any:
    # the batch and d_model checks of nn.Transformer.forward need sizes; the layers' matmuls check them too
    memory = m.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=src_is_causal)
    return m.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                     tgt_key_padding_mask=tgt_key_padding_mask, memory_key_padding_mask=memory_key_padding_mask,
                     tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)


def traced_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``forward`` is its entry in :data:`FORWARDS`: the class of fxamp's
    private copy of a root module (a root's forward is traced directly, not through ``call_module``)."""
    return type(cls.__name__, (cls,), {"forward": FORWARDS[cls], "__module__": cls.__module__})


#: exact module class -> the forward fx traces instead of its own (None: its own forward, traced into)
FORWARDS: Dict[type, Optional[Callable[..., Any]]] = {
    nn.TransformerEncoderLayer: _encoder_layer,
    nn.TransformerDecoderLayer: None,
    nn.TransformerEncoder: _encoder,
    nn.TransformerDecoder: _decoder,
    nn.Transformer: _transformer,
}
