"""FedAlt's device half against the closed form of spec §1.3 and its phase isolation."""

import numpy as np
import pytest
import torch

from device_agent.algorithms import build_local_update
from device_agent.algorithms.fedalt import FedAltUpdate
from protocols.algorithms import FedAltConfig, FedSimConfig
from protocols.codec import Tensors

from .linear_problem import (
    PERSONAL,
    SHARED,
    Problem,
    Recorded,
    assert_round_result,
    descend,
    make_problem,
)

GAMMA_U, GAMMA_V = 0.05, 0.2


def _local_alt(problem: Problem, tau_v: int, tau_u: int) -> dict[str, np.ndarray]:
    """LocalAlt with full batches: tau_v steps on v, then tau_u steps on u at the new v."""
    p = problem.params()
    for _ in range(tau_v):
        p = descend(problem.x, problem.y, p, PERSONAL, GAMMA_V)
    for _ in range(tau_u):
        p = descend(problem.x, problem.y, p, SHARED, GAMMA_U)
    return p


@pytest.mark.parametrize(("tau_v", "tau_u"), [(3, 2), (0, 2), (2, 1)])
def test_fedalt_matches_the_closed_form_alternating_descent(tau_v: int, tau_u: int) -> None:
    # Prepare: full batch, separate step sizes and step counts
    config = FedAltConfig(
        lr=GAMMA_U, personal_lr=GAMMA_V, local_epochs=tau_u, personal_epochs=tau_v, batch_size=12
    )
    problem = make_problem(config)
    start = problem.params()
    expected = _local_alt(problem, tau_v, tau_u)
    # Execute
    result = FedAltUpdate().run(problem.ctx)
    # Assert: the shared delta (local - global) and the kept personal state
    assert_round_result(result, start, expected)
    # ... and the wrong plausible answers are far from it: simultaneous steps, or u before v
    if tau_v:
        simultaneous = start
        for _ in range(tau_u):
            simultaneous = descend(problem.x, problem.y, simultaneous, SHARED + PERSONAL, GAMMA_U)
        assert not np.allclose(simultaneous["hidden.weight"], expected["hidden.weight"], rtol=1e-3)
        u_first = start
        for _ in range(tau_u):
            u_first = descend(problem.x, problem.y, u_first, SHARED, GAMMA_U)
        assert not np.allclose(u_first["hidden.weight"], expected["hidden.weight"], rtol=1e-3)


def test_fedalt_reports_only_the_shared_delta() -> None:
    problem = make_problem(FedAltConfig(lr=GAMMA_U, batch_size=5, local_epochs=2))
    result = FedAltUpdate().run(problem.ctx)
    assert tuple(result.shared_delta) == SHARED
    assert tuple(result.personal) == PERSONAL
    state = problem.ctx.model.state_dict()
    for name in PERSONAL:
        assert torch.equal(result.personal[name], state[name])
    for name in SHARED:
        assert torch.equal(result.shared_delta[name], state[name] - problem.ctx.global_shared[name])
    assert result.num_samples == 12


def _assert_frozen(
    calls: list[Recorded], frozen: tuple[str, ...], value: Tensors, moving: tuple[str, ...]
) -> None:
    """In every call, `frozen` holds `value` bit for bit with no gradient; `moving` trains."""
    for call in calls:
        for name in frozen:
            held, requires_grad, has_grad = call[name]
            assert torch.equal(held, value[name]), name
            assert not requires_grad, name
            assert not has_grad, name
        assert all(call[name][1] for name in moving)


def test_each_fedalt_phase_leaves_the_other_part_bit_identical_and_gradient_free() -> None:
    # Prepare: minibatches of 4 over 12 samples (3 per epoch); budgets cut both phases mid-epoch
    config = FedAltConfig(
        batch_size=4, personal_epochs=2, personal_max_steps=3, local_epochs=2, max_steps=4
    )
    problem = make_problem(config, record=True)
    start = {k: v.clone() for k, v in problem.ctx.model.state_dict().items()}
    # Execute
    result = FedAltUpdate().run(problem.ctx)
    # Assert: 3 personal steps, then 4 shared steps, each seen at its loss call
    calls = problem.task.calls
    assert len(calls) == 3 + 4
    personal_phase, shared_phase = calls[:3], calls[3:]
    _assert_frozen(personal_phase, SHARED, start, PERSONAL)
    v_plus = {name: shared_phase[0][name][0] for name in PERSONAL}
    assert not torch.equal(v_plus["output.weight"], start["output.weight"])
    _assert_frozen(shared_phase, PERSONAL, v_plus, SHARED)
    for name in PERSONAL:
        assert torch.equal(result.personal[name], v_plus[name])
    assert all(p.grad is None and p.requires_grad for p in problem.ctx.model.parameters())


def test_fedalt_is_registered_and_refuses_another_config() -> None:
    assert isinstance(build_local_update("fedalt"), FedAltUpdate)
    with pytest.raises(TypeError, match="FedAltConfig"):
        FedAltUpdate().run(make_problem(FedSimConfig()).ctx)
