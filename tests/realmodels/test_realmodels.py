"""Issue 10: a standing real-model suite.  Every model in ``rm_models.ENTRIES`` goes through every
check in ``rm_checks`` (O0 bitwise in eval and train mode; per policy and dtype: conversion,
state_dict keys, float32 outputs, eval determinism, SQNR within 3 dB of torch.autocast's, a few
MixedPrecisionOptimizer steps tracking float32; float64 kept float64).

Known bugs are ``xfail(strict=True)`` with their issue item (``rm_known.py``): a fix makes them XPASS,
which fails the run until the entry is removed.  Only the cases in ``DEFAULT`` run by default;
``FXAMP_REALMODELS=all python -m pytest tests/realmodels -q`` runs all of them.  The invariants every
conversion path meets on these models (issue 37) are ``test_invariants.py``'s.
"""

from __future__ import annotations

import pytest
import torch

import rm_checks
from rm_checks import DTYPES, cases
from rm_known import case_params
from rm_models import ENTRIES, REGISTRY, available

pytestmark = pytest.mark.usefixtures("one_thread")

#: the representative subset CI runs (one of each family of front end, policy, dtype and check)
DEFAULT = {
    ("gpt2", "numerics", "O1", "bfloat16"),
    ("gpt2", "training", "O2", "bfloat16"),
    ("bert", "numerics", "O2", "float16"),
    ("t5", "numerics", "O1", "bfloat16"),
    ("vit", "numerics", "O2", "bfloat16"),
    ("mixtral", "numerics", "O2", "bfloat16"),
    ("nn.TransformerEncoder-in-model", "numerics", "O1", "bfloat16"),
    ("nn.LSTM", "numerics", "O2", "float16"),
    ("nn.LSTM", "o0", None, None),
    ("nn.MultiheadAttention", "numerics", "O1", "float16"),
    ("nn.MultiheadAttention", "training", "O1", "bfloat16"),
    ("conv-bn-relu", "numerics", "O2", "bfloat16"),
    ("conv-bn-relu", "training", "O2", "float16"),
    ("gpt2", "training-lean", "O2", "bfloat16"),
    ("llama", "in-place-numerics", "O2", "bfloat16"),
    ("bert", "in-place-rows", "O2", "bfloat16"),
    ("gpt2", "in-place-training", "O2", "bfloat16"),
    ("conv-bn-relu", "training-lean", "O2", "bfloat16"),
    ("conv-bn-relu", "o0", None, None),
    ("conv-bn-relu", "float64", "O1", "bfloat16"),
}


def _params():
    return case_params(ENTRIES, cases, DEFAULT, available, lambda *parts: "-".join(x for x in parts if x))


@pytest.mark.parametrize("name,check,policy,dtype", list(_params()))
def test_real_model(name, check, policy, dtype):
    torch.manual_seed(0)
    fn = rm_checks.CHECKS[check]
    try:
        if check == "o0":
            fn(REGISTRY[name])
        else:
            fn(REGISTRY[name], policy, DTYPES[dtype])
    except rm_checks.NotApplicable as exc:
        pytest.skip(str(exc))


def test_default_subset_is_in_the_registry():
    every = {(e.name, *c) for e in ENTRIES for c in cases(e)}
    assert DEFAULT <= every, sorted(DEFAULT - every)
