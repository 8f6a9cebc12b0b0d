"""The training wing: float32 master weights, loss scaling and the step engine.

``optimizer`` (``MixedPrecisionOptimizer``, the facade: masters, public verbs, state_dict) hands every
verb of a step to ``step`` (the one engine: stage -> check -> execute -> record, the overflow decision host- or
device-decided, and the scaler's per-step state machine, the base of ``loss_scale.LossScaler``), which stages,
checks and executes through ``executors`` (the check's flags, the staging, plain, segmented), over the tensor
lists ``plan`` built once per layout.  A step runs code in those three files (``zero_grad`` and
``clip_grad_norm_``: ``iteration``); a lean one also in ``lean_step``, ``flat`` and ``quant``; ``distributed`` only under an initialized ``torch.distributed``
(overflow agreed by every rank), ``kernels`` only with ``compile_step=True`` (the compiled executor's
kernels, imported only then: it brings ``torch._dynamo``); ``tests/test_layout.py`` traces it.
``config`` (``LossScaleConfig``, the ``loss_scale=`` option) is read at construction, never by a
step.  Per-tensor precision of masters and state (``masters=``/``state=``): ``lean`` (the modes, terms
and counts of each master, kept between steps), ``lean_step`` (the float32 workspace the engine's executors enter
and leave around each inner step, its executors), ``quant`` (bf16/int8
state), ``calibrate`` (``"auto"``: measure, choose, the table); ``checkpoint`` is the wrapper's
``state_dict`` layout.  Nothing here imports the conversion wing.
"""
