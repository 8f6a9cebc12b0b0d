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
