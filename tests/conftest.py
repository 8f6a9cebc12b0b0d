import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one thread is faster, and far steadier on a busy 2-core machine.

    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``; the thread count is restored.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fused_at_any_size(monkeypatch):
    """compile_step's kernels step these small test models: a real model's step uses them only when its
    masters hold ``fused_step.FUSED_MIN_TOTAL`` elements (millions), so that threshold goes to 0; the
    per-master one, ``FUSED_MIN_NUMEL``, is each test's to set."""
    from fxamp.training import kernels as fused_step

    monkeypatch.setattr(fused_step, "FUSED_MIN_TOTAL", dict.fromkeys(fused_step.FUSED_MIN_TOTAL, 0))


@pytest.fixture
def small_chunks(monkeypatch):
    """compile_step's kernels step 4 masters a call, not 16: the graph is the same loop, and a cold
    compile of 4 loops takes a fraction of 16's (CI's fresh virtual environment has no inductor
    cache: every kernel compiles there).  The test of the chunks keeps the real size."""
    from fxamp.training import kernels as fused_step

    monkeypatch.setattr(fused_step, "CHUNK", 4)
