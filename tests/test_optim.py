"""The optimizers against their published formulas, written out again here; and their error bounds.

verify cannot see a wrong optimizer formula: the distributed run and the single-process reference
step with the same code (docs/mutation_testing.md). So each optimizer is compared, over several
steps on random float64 arrays, with the formula as its paper or reference library states it:

    AdamW   Loshchilov & Hutter, arXiv 1711.05101, Algorithm 2, with α = 1 and the schedule
            multiplier η = lr (refimpl/optim/adamw.py's docstring: decay lr·λ·θ, decoupled)
    SGD     PyTorch's torch.optim.SGD (dampening 0, no Nesterov): d = g + λθ; b = d at the first
            step, else μb + d; θ ← θ − lr·b
    clip    g ← g · min(1, max_norm / (‖g‖ + 1e-6)), ‖g‖ over all gradients together

SGD's and the moments' arithmetic is the same operations in the same order, so those are compared
bit for bit. AdamW's θ is written the paper's way, θ − η(m̂/(√v̂ + ε) + λθ), not refimpl's
(θ·(1 − lr·λ) − (lr/(1 − β₁ᵗ))·(m/(√(v/(1 − β₂ᵗ)) + ε))): each step, from the same θ, the two
agree to 1e-15 of the magnitude of the terms (a few roundings each). A wrong bias correction,
a coupled decay or a missing factor moves θ by a sizeable fraction of lr.

update_error_bound(g, δ, state) bounds |θ(g) − θ(g + Δg)| for |Δg| ≤ δ element-wise, from the same
state (verify --dtype mixed compares master weights with it): a property test draws states (from a
gradient history, as training makes them), gradients near zero that change sign, steps t = 1 and
t > 1, and perturbations at ±δ and inside, and checks the bound, up to float64 rounding.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refimpl.autograd import Parameter
from refimpl.optim import SGD, AdamW, clip_coefficient, clip_grad_norm_

N = 40  # elements per array


def textbook_adamw(theta, m, v, t, g, lr, betas, eps, weight_decay):
    """Algorithm 2 of arXiv 1711.05101 (α = 1, η_t = lr): returns the new (θ, m, v)."""
    b1, b2 = betas
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g ** 2
    m_hat = m / (1 - b1 ** t)
    v_hat = v / (1 - b2 ** t)
    return theta - lr * (m_hat / (np.sqrt(v_hat) + eps) + weight_decay * theta), m, v


def textbook_sgd(theta, buf, t, g, lr, momentum, weight_decay):
    """torch.optim.SGD's update (dampening 0, nesterov False): returns the new (θ, buffer)."""
    d = g + weight_decay * theta if weight_decay else g
    if momentum:
        buf = d.copy() if t == 1 else momentum * buf + d
        d = buf
    return theta - lr * d, buf


def gradients(rng, steps, n=N):
    """A gradient per step, of very different scales, some elements exactly zero."""
    out = []
    for _ in range(steps):
        g = rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3)
        g[rng.random(n) < 0.1] = 0.0
        out.append(g)
    return out


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("betas,eps,lr", [((0.9, 0.999), 1e-8, 1e-3), ((0.5, 0.9), 1e-3, 0.05),
                                          ((0.0, 0.6), 1e-6, 0.3)])
def test_adamw_matches_the_papers_algorithm_step_by_step(betas, eps, lr, weight_decay):
    rng = np.random.default_rng(7)
    opt = AdamW([], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    theta = rng.standard_normal(N)
    state = opt.init_state(theta)
    m, v = np.zeros(N), np.zeros(N)
    for t, g in enumerate(gradients(rng, 6), start=1):
        before = theta.copy()
        opt.update(theta, g.copy(), state)
        expected, m, v = textbook_adamw(before, m, v, t, g, lr, betas, eps, weight_decay)
        assert state["step"] == t
        assert np.array_equal(state["m"], m) and np.array_equal(state["v"], v), f"moments differ at step {t}"
        u = m / (1 - betas[0] ** t) / (np.sqrt(v / (1 - betas[1] ** t)) + eps)
        terms = np.abs(before) + lr * (np.abs(u) + weight_decay * np.abs(before))
        assert np.all(np.abs(theta - expected) <= 1e-15 * terms), f"θ differs from the formula at step {t}"


def test_adamw_first_step_moves_each_element_by_lr_against_its_sign():
    """At t = 1 the bias corrections make m̂ = g and v̂ = g²: the step is lr·g/(|g| + ε)."""
    opt = AdamW([], lr=0.01, betas=(0.9, 0.999), eps=1e-12, weight_decay=0.0)
    theta = np.zeros(4)
    opt.update(theta, np.array([3.0, -0.5, 2e-3, -700.0]), opt.init_state(theta))
    np.testing.assert_allclose(theta, [-0.01, 0.01, -0.01, 0.01], rtol=1e-9, atol=0)


@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.0, 0.05), (0.7, 0.05)])
def test_sgd_matches_pytorchs_formula_bit_for_bit(momentum, weight_decay):
    rng = np.random.default_rng(11)
    lr = 0.03
    opt = SGD([], lr=lr, momentum=momentum, weight_decay=weight_decay)
    theta = rng.standard_normal(N)
    state = opt.init_state(theta)
    expected, buf = theta.copy(), None
    for t, g in enumerate(gradients(rng, 5), start=1):
        opt.update(theta, g.copy(), state)
        expected, buf = textbook_sgd(expected, buf, t, g, lr, momentum, weight_decay)
        assert np.array_equal(theta, expected), f"θ differs from the formula at step {t}"
        if momentum:
            assert np.array_equal(state["momentum"], buf)


def test_sgd_does_not_change_the_gradient_it_is_given():
    opt = SGD([], lr=0.1, momentum=0.9, weight_decay=0.1)
    theta, g = np.ones(3), np.array([1.0, -2.0, 0.5])
    state = opt.init_state(theta)
    for _ in range(2):
        opt.update(theta, g, state)
    assert np.array_equal(g, [1.0, -2.0, 0.5])


# -- clipping by the global norm ------------------------------------------------------------------

@pytest.mark.parametrize("max_norm", [0.01, 1.0, 1e6])
def test_clip_grad_norm_scales_by_the_global_norm(max_norm):
    rng = np.random.default_rng(3)
    params = [Parameter(rng.standard_normal(s)) for s in [(3, 4), (5,), (2, 2, 2)]]
    for p in params:
        p.grad = rng.standard_normal(p.shape)
    params.append(Parameter(np.ones(2)))  # no gradient: skipped
    grads = [p.grad.copy() for p in params[:-1]]
    norm = np.linalg.norm(np.concatenate([g.ravel() for g in grads]))  # ‖g‖ over all gradients
    coefficient = max_norm / (norm + 1e-6)

    returned = clip_grad_norm_(params, max_norm)

    assert returned == pytest.approx(norm, rel=1e-15)
    assert clip_coefficient(norm ** 2, max_norm) == pytest.approx(min(1.0, coefficient), rel=1e-15)
    for p, g in zip(params, grads):
        expected = g * coefficient if coefficient < 1 else g
        np.testing.assert_allclose(p.grad, expected, rtol=1e-15, atol=0)
    if coefficient < 1:
        after = np.linalg.norm(np.concatenate([p.grad.ravel() for p in params[:-1]]))
        assert after == pytest.approx(max_norm * norm / (norm + 1e-6), rel=1e-14) and after < max_norm
    assert params[-1].grad is None


def test_clip_coefficient_takes_the_squared_norm():
    assert clip_coefficient(16.0, 2.0) == 2.0 / (4.0 + 1e-6)  # ‖g‖ = 4
    assert clip_coefficient(1.0, 5.0) == 1.0  # never scales up
    assert clip_coefficient(0.0, 1.0) == 1.0
    with pytest.raises(ValueError, match="max_norm must be positive"):
        clip_coefficient(1.0, 0.0)


# -- update_error_bound: a gradient off by δ moves θ by at most the bound -------------------------

BETAS = st.one_of(st.sampled_from([(0.9, 0.999), (0.9, 0.95), (0.0, 0.999), (0.99, 0.9), (0.5, 0.5),
                                   (0.5, 0.25), (0.9, 0.0), (0.0, 0.0)]),  # β₁²/β₂ = 1; β₂ = 0
                  st.tuples(st.floats(0.0, 0.995), st.floats(0.0, 0.9999)))


def perturbed(rng, g, delta):
    """g + Δg with |Δg| ≤ δ: at ±δ, inside, and, where δ ≥ |g|, a sign flip of g to −g or −sign(g)·δ."""
    kind = rng.integers(0, 4, g.shape)
    inside = rng.uniform(-1, 1, g.shape) * delta
    edge = np.where(rng.random(g.shape) < 0.5, -delta, delta)
    flip = np.where(np.abs(g) <= delta / 2, -2 * g, -np.sign(g) * delta)
    d = np.select([kind == 0, kind == 1, kind == 2], [inside, edge, flip], 0.0)
    assert np.all(np.abs(d) <= delta)
    return g + d


def drawn_case(rng, n=N):
    """A gradient with elements near zero (within δ, so the perturbation can flip their sign)."""
    g = rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 2, n)
    delta = np.abs(g) * 10.0 ** rng.uniform(-12, 0.5, n)  # δ from far below |g| to above it
    tiny = rng.random(n) < 0.3
    g[tiny] *= 1e-9
    g[rng.random(n) < 0.05] = 0.0
    return g, delta


def assert_within_bound(opt, state, g, g2, delta, theta, t):
    bound = opt.update_error_bound(g, delta, state)
    assert bound.shape == g.shape and np.all(bound >= 0)
    sides = []
    for grad in (g, g2):
        s = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in state.items()}
        p = theta.copy()
        opt.update(p, grad.copy(), s)
        sides.append(p)
    diff = np.abs(sides[0] - sides[1])
    # float64 rounding of each side's arithmetic, a few units in the last place of the terms
    rounding = 2.0 ** -48 * (np.abs(theta) + np.abs(sides[0] - theta) + np.abs(sides[1] - theta))
    worst = np.argmax(diff - bound - rounding)
    assert np.all(diff <= bound + rounding), (
        f"t={t}: |Δθ| = {diff[worst]!r} > bound {bound[worst]!r} at element {worst}: g={g[worst]!r}, "
        f"g+Δg={g2[worst]!r}, δ={delta[worst]!r}, m={state.get('m', state.get('momentum'))[worst]!r}, "
        f"v={state['v'][worst] if 'v' in state else None!r}")


@given(seed=st.integers(0, 2 ** 32 - 1), betas=BETAS, steps_before=st.integers(0, 8),
       lr=st.sampled_from([1e-3, 0.1, 1.0]), eps=st.sampled_from([1e-12, 1e-8, 1e-3]),
       weight_decay=st.sampled_from([0.0, 0.1]))
@settings(max_examples=60)
def test_adamw_update_error_bound_holds(seed, betas, steps_before, lr, eps, weight_decay):
    rng = np.random.default_rng(seed)
    opt = AdamW([], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    theta = rng.standard_normal(N)
    state = opt.init_state(theta)
    t = steps_before + 1
    history = gradients(rng, steps_before)
    # the worst history: g_j ∝ (β₁/β₂)^(t−j) makes |m̂|/√v̂ reach Cₜ (Cauchy–Schwarz)
    if betas[1] > 1e-3 and rng.random() < 0.5:
        g0 = rng.standard_normal(N) * 10.0 ** rng.uniform(-3, 3, N)
        history = [g0 * (betas[0] / betas[1]) ** (t - j) for j in range(1, t)]
    for g in history:  # a state that training can reach
        opt.update(theta.copy(), g, state)
    g, delta = drawn_case(rng)
    assert_within_bound(opt, state, g, perturbed(rng, g, delta), delta, theta, t)


@given(seed=st.integers(0, 2 ** 32 - 1), steps_before=st.integers(0, 4), momentum=st.sampled_from([0.0, 0.9]),
       weight_decay=st.sampled_from([0.0, 0.1]), lr=st.sampled_from([1e-3, 0.5]))
@settings(max_examples=30)
def test_sgd_update_error_bound_holds(seed, steps_before, momentum, weight_decay, lr):
    rng = np.random.default_rng(seed)
    opt = SGD([], lr=lr, momentum=momentum, weight_decay=weight_decay)
    theta = rng.standard_normal(N)
    state = opt.init_state(theta)
    for g in gradients(rng, steps_before):
        opt.update(theta.copy(), g, state)
    g, delta = drawn_case(rng)
    assert_within_bound(opt, state, g, perturbed(rng, g, delta), delta, theta, steps_before + 1)


def test_adamw_bound_is_reached_by_a_sign_flip_at_the_first_step():
    """t = 1: θ moves by lr·g/(|g| + ε); g = ±x, |x| ≫ ε, differ by 2·lr·x/(x + ε) ≈ 2·lr = lr·2C₁."""
    opt = AdamW([], lr=0.01, eps=1e-12, weight_decay=0.0)
    theta = np.zeros(1)
    g, delta = np.array([1e-3]), np.array([2e-3])
    bound = opt.update_error_bound(g, delta, opt.init_state(theta))
    assert bound[0] == pytest.approx(0.02, rel=1e-12)
    moved = []
    for grad in (g, -g):
        p = theta.copy()
        opt.update(p, grad, opt.init_state(p))
        moved.append(p[0])
    assert abs(moved[0] - moved[1]) == pytest.approx(0.02, rel=1e-8) and abs(moved[0] - moved[1]) <= bound[0]


@pytest.mark.parametrize("betas", [(0.5, 0.25), (0.9, 0.81), (0.9, 0.0), (0.0, 0.0)])
def test_adamw_update_error_bound_is_finite_where_its_closed_form_divides_by_zero(betas):
    """β₁²/β₂ = 1 makes Σ_{j<t} (β₁²/β₂)ʲ = t (the closed form is 0/0); β₂ = 0 makes it ∞ after step 1,
    and with it the bound wherever δ > 0 (v̂ = g² forgets the history that m̂ keeps, unless β₁ = 0)."""
    opt = AdamW([], lr=0.1, betas=betas, eps=1e-8, weight_decay=0.0)
    rng = np.random.default_rng(0)
    theta = rng.standard_normal(N)
    state = opt.init_state(theta)
    for g in gradients(rng, 3):
        opt.update(theta.copy(), g, state)
    g, delta = drawn_case(rng)
    bound = opt.update_error_bound(g, delta, state)
    assert not np.any(np.isnan(bound)) and np.all(bound >= 0)
    assert np.all(np.isfinite(bound)) == (betas[1] > 0 or betas[0] == 0)  # β₁ = 0: m̂ has no history
    assert_within_bound(opt, state, g, perturbed(rng, g, delta), delta, theta, 4)
