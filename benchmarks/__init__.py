"""fxamp's benchmarks against torch.autocast: ``python -m benchmarks [--quick] [--device cuda]`` (see run.py)."""
