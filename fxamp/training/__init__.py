"""The training wing: float32 master weights, loss scaling and the step engine.

``optimizer`` (``MixedPrecisionOptimizer``: masters, public API, state_dict) drives ``step`` (the
one engine: plan runs -> check -> per run unscale, step, refresh), over ``loss_scale`` (the scale
and the whole stage machine: the check, the overflow decision host- or device-decided, the
stages).  A step goes through these three files; a fourth only under an initialized
``torch.distributed`` (``distributed``: overflow agreed by every rank) or with ``compile_step=True``
(``kernels``: the compiled executor of a run, imported only then: it brings ``torch._dynamo``).
``config`` (``LossScaleConfig``, the ``loss_scale=`` option) is read at construction, never by a
step.  Per-tensor precision of masters and state (``masters=``/``state=``): ``lean`` (the modes and
the float32 workspace the engine enters and leaves around each inner step), ``quant`` (bf16/int8
state), ``calibrate`` (``"auto"``: measure, choose, the table); ``checkpoint`` is the wrapper's
``state_dict`` layout.  Nothing here imports the conversion wing.
"""
