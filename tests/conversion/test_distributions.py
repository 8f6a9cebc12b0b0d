"""torch.distributions in forward (a policy's ``Categorical``, a mixture density network's ``Normal``).  Their
argument validation checks the values against the support, a data-dependent branch no graph holds: the refusal
now says so and how to turn it off, and with it off the model converts and matches float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributions import Categorical, Distribution

import fxamp
from fxamp.errors import TraceError


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh())
        self.pi, self.v = nn.Linear(64, 6), nn.Linear(64, 1)

    def forward(self, obs, actions):
        h = self.body(obs)
        dist = Categorical(logits=self.pi(h))
        return dist.log_prob(actions), dist.entropy(), self.v(h).squeeze(-1)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=g), torch.randint(0, 6, (8,), generator=g)


@pytest.fixture
def validation():
    before = Distribution._validate_args
    yield
    Distribution.set_default_validate_args(before)


def test_a_distributions_argument_check_is_refused_with_how_to_turn_it_off(validation):
    Distribution.set_default_validate_args(True)
    with pytest.raises(TraceError, match=r"torch.distributions' check of its arguments' values \(validate_args\).*"
                                         r"set_default_validate_args\(False\)"):
        fxamp.convert(ActorCritic(), "O2", dtype=torch.bfloat16, example_inputs=_inputs())


@pytest.mark.parametrize("policy", ["O1", "O2"])
def test_with_validation_off_a_policy_network_converts_and_matches_float32(policy, validation):
    Distribution.set_default_validate_args(False)
    torch.manual_seed(0)
    model = ActorCritic()
    reference = model(*_inputs())
    amp = fxamp.convert(model, policy, dtype=torch.bfloat16, example_inputs=_inputs())
    for ours, ref in zip(amp(*_inputs()), reference):
        assert float((ours.float() - ref).norm() / ref.norm()) < 1e-2
