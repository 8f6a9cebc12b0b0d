"""The training wing: float32 master weights, loss scaling and the step engine.

``optimizer`` (``MixedPrecisionOptimizer``: masters, public API, state_dict) drives ``step`` (the
one engine: plan runs -> check -> per run unscale, step, refresh), over ``loss_scale`` (the scale
and the stage machine) and ``distributed`` (overflow agreed by every rank); ``kernels`` is the
compiled executor of a run (``compile_step=True``).  Nothing here imports the conversion wing.
"""
