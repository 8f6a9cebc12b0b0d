"""Lightning's FSDP2 path (ModelParallelStrategy + configure_model) with FxampPrecision, 2 CPU processes."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("lightning")
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_fsdp2_script.py")


def test_model_parallel_strategy_trains_like_one_process(tmp_path):
    from tests.training.test_fsdp2 import _reference

    root = os.path.dirname(os.path.dirname(os.path.dirname(SCRIPT)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = _reference("gpt", torch.bfloat16)  # one process, both ranks' micro-batches, clipped at 1.0
    for rank in range(2):
        losses = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(losses) == 5
        assert max(abs(a - b) for a, b in zip(losses, ref["losses"][rank])) <= 5e-4
