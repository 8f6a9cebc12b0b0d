"""The training wing: float32 master weights, loss scaling and the step engine.

``optimizer`` (``MixedPrecisionOptimizer``, the facade: masters, public verbs, state_dict) hands every
verb of a step to ``step`` (the one engine: stage -> check -> execute -> record), which asks
``loss_scale`` (the scale and the stage machine: the check, the overflow decision host- or
device-decided) and hands the checked step to one of ``executors`` (plain, segmented, the two lean
ones, compiled) over ``plan`` (the step's tensor lists).  A step runs code in those five files; a
lean one also in ``lean`` and ``quant``; ``distributed`` only under an initialized ``torch.distributed``
(overflow agreed by every rank), ``kernels`` only with ``compile_step=True`` (the compiled executor's
kernels, imported only then: it brings ``torch._dynamo``); ``tests/test_layout.py`` traces it.
``config`` (``LossScaleConfig``, the ``loss_scale=`` option) is read at construction, never by a
step.  Per-tensor precision of masters and state (``masters=``/``state=``): ``lean`` (the modes and
the float32 workspace the engine enters and leaves around each inner step), ``quant`` (bf16/int8
state), ``calibrate`` (``"auto"``: measure, choose, the table); ``checkpoint`` is the wrapper's
``state_dict`` layout.  Nothing here imports the conversion wing.
"""
