"""The benchmark suites at toy sizes, so that they never rot; nothing here times anything.

The benchmarks are not the library: every test here is in the slow tier.
"""

import functools
import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from tensorflow_probability.substrates import jax as tfp

import samplers
from benchmarks import __main__ as cli
from benchmarks import (
    autoregressive,
    bandwidth,
    beta,
    composite,
    discrete,
    end_to_end,
    flow,
    implementations,
    squashed_normal,
    timing,
    tokens,
)

pytestmark = pytest.mark.slow

_TINY = {
    "batches": (8,),
    "actions": (2,),
    "rounds": 1,
    "compile_batch": 8,
    "memory_batch": 8,
    "repeats": 1,
}


def test_suite_runs_and_writes_its_report(tmp_path):
    with jax.numpy_rank_promotion("allow"):  # TFP broadcasts ranks implicitly
        text = squashed_normal.run(
            _TINY, tmp_path, device=timing.select_device("cpu"), name="toy", bandwidth_tbs=4.8
        )
    assert (tmp_path / "toy.md").read_text() == text
    for heading in (
        "## Rollout step",
        "## Loss step",
        "## Actor step",
        "## Trace plus compile",
        "## Compiled memory",
        "## B = 1 rollout latency",
        "## Entropy estimators",
        "## Memory-bandwidth floor (4.8 TB/s)",
    ):
        assert heading in text
    assert "Device: cpu (platform cpu" in text
    for name in ("samplers", "samplers (pure layer)", "distrax", "tfp", "floor (draw alone)"):
        assert f" {name} |" in text
    assert "non-finite values or gradients: none." in text
    assert "| implementation | actor MiB |" in text
    assert (tmp_path / "toy-scaling.png").stat().st_size > 0
    assert "![time per call against batch size](toy-scaling.png)" in text

    saved = json.loads((tmp_path / "toy.json").read_text())
    assert saved["platform"] == "cpu"
    workloads = {(t["workload"], t["implementation"]) for t in saved["timings"]}
    assert ("actor", "samplers (pure layer)") in workloads
    assert ("rollout", "samplers (pure layer)") not in workloads
    assert all(t["seconds"] > 0 and t["low"] <= t["ratio"] <= t["high"] for t in saved["timings"])
    bandwidth.main([str(tmp_path / "toy.json"), "--out", str(tmp_path / "floor.md")])
    assert "### Actor step" in (tmp_path / "floor.md").read_text()


def _noise(step, mean_and_std, key):
    """The standard-normal noise that ``step`` draws from ``key``."""
    shape = (*mean_and_std.shape[:-1], mean_and_std.shape[-1] // 2)
    if step.name == "samplers":
        head = samplers.NormalTanhSampler(nnx.Rngs(0), 0.0, reparameterized=True)
        apply, _ = samplers.functional(head)
        out, _ = apply(step.random_input(key), mean_and_std)
        dist = samplers.normal_tanh(mean_and_std)
        return (out.rollout_extras - dist.loc) / dist.scale
    subkey = jax.random.split(key)[1]  # the key-based steps split their key
    if step.name == "tfp":
        zeros = jnp.zeros(shape)
        return tfp.distributions.MultivariateNormalDiag(zeros, jnp.ones(shape)).sample(seed=subkey)
    return jax.random.normal(subkey, shape)


@pytest.mark.parametrize("shift", [0.0, 12.0], ids=["moderate", "saturated"])
def test_actor_steps_compute_the_hand_written_value_and_pathwise_gradient(shift):
    mean_and_std = jax.random.normal(jax.random.key(0), (16, 6)).at[:, :3].add(shift)
    key = jax.random.key(1)
    steps = [s for s in implementations.actor_steps() if s.differentiable]
    assert [s.name for s in steps[:3]] == ["handwritten", "samplers", "samplers (pure layer)"]
    with jax.numpy_rank_promotion("allow"):
        for step in steps:
            eps = _noise(step, mean_and_std, key)
            want = jax.value_and_grad(implementations.actor_loss_from_noise)(mean_and_std, eps)
            (value, _), grad = jax.jit(jax.value_and_grad(step.step, has_aux=True))(
                mean_and_std, step.random_input(key)
            )
            assert jnp.allclose(value, want[0], rtol=1e-5, atol=1e-5), step.name
            assert jnp.allclose(grad, want[1], rtol=1e-4, atol=1e-5), step.name


def test_actor_steps_advance_their_random_state():
    mean_and_std = jax.random.normal(jax.random.key(0), (4, 4))
    with jax.numpy_rank_promotion("allow"):
        for step in implementations.actor_steps():
            rng = step.random_input(jax.random.key(1))
            fn = jax.jit(step.step)
            first, rng = fn(mean_and_std, rng)
            second, _ = fn(mean_and_std, rng)
            assert not jnp.allclose(first, second), step.name


def _missing_platform():
    present = {d.platform for d in jax.devices()} | set(jax.extend.backend.backends())
    missing = [
        p for p in ("tpu", "gpu") if p not in present and not (p == "gpu" and "cuda" in present)
    ]
    if not missing:
        pytest.skip("every platform is present")
    return missing[0]


def test_device_flag_selects_the_platform():
    assert timing.select_device("cpu").platform == "cpu"
    assert timing.select_device() == jax.devices()[0]


def test_device_flag_names_the_available_platforms_when_one_is_missing(capsys):
    missing = _missing_platform()
    message = (
        rf"--device '{missing}': JAX has no {missing} device here; the platforms available are \["
    )
    with pytest.raises(ValueError, match=message + r".*'cpu'.*\]. Pass one of them"):
        timing.select_device(missing)
    with pytest.raises(SystemExit):
        cli.main(["--device", missing])
    assert f"JAX has no {missing} device here" in capsys.readouterr().err


def test_flags_choose_the_device_sizes_and_report_name(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(
        squashed_normal, "run", lambda grid, out, **options: calls.append((grid, out, options))
    )
    cli.main(["--device", "cpu", "--large", "--batches", "8,16", "--out", str(tmp_path)])
    cli.main(["--large", "--name", "gpu", "--bandwidth-tbs", "4.8"])
    (grid, out, options), (large, _, named) = calls
    assert grid["batches"] == (8, 16) and out == tmp_path
    assert options["device"].platform == "cpu"
    assert options["command"].startswith("python -m benchmarks --device cpu --large")
    assert large["batches"][-1] == 2**20
    assert named["name"] == "gpu" and named["bandwidth_tbs"] == 4.8


@pytest.mark.parametrize("batches", ["0", "8,x", ""])
def test_batches_flag_refuses_what_is_not_a_list_of_sizes(batches, capsys):
    with pytest.raises(SystemExit):
        cli.main(["--batches", batches])
    assert "expected positive batch sizes separated by commas" in capsys.readouterr().err


def test_bandwidth_floor_counts_the_bytes_each_step_must_move():
    assert bandwidth.bytes_per_element("rollout", 8) == 4 * (4 * 8 + 1)
    assert bandwidth.bytes_per_element("loss", 8) == 4 * (5 * 8 + 2)
    assert bandwidth.bytes_per_element("actor", 8) == 4 * 4 * 8
    # 128 bytes per element at B = 2**20 over 4.8 TB/s: about 28 us.
    assert bandwidth.floor_seconds("actor", 2**20, 8, 4.8) == pytest.approx(128 * 2**20 / 4.8e12)
    with pytest.raises(ValueError, match="workload must be one of"):
        bandwidth.bytes_per_element("entropy", 8)
    with pytest.raises(ValueError, match="bandwidth_tbs must be positive"):
        bandwidth.floor_seconds("actor", 1, 8, 0.0)
    records = [
        {"workload": "actor", "batch": 2**20, "actions": 8, "implementation": n, "seconds": s}
        for n, s in (("handwritten", 56e-6), ("floor (draw alone)", 1e-6))
    ]
    text = bandwidth.report(records, 4.8)
    assert "| 1048576 | 8 | 128.0 MiB | 28 | 56.0 (49.9%) |" in text
    assert "floor (draw alone)" not in text


_DISCRETE = {case.name: case for case in implementations.discrete_cases()}


def _sample_key(implementation, key):
    """The key ``implementation``'s rollout draws its sample with, from its random input ``key``."""
    if implementation == "samplers":
        return nnx.Rngs(key).default()  # the head's first draw from its stream
    return jax.random.split(key)[1]  # the key-based rollouts split their key


@pytest.mark.parametrize("implementation", ["samplers", "samplers (pure layer)"])
@pytest.mark.parametrize("name", list(_DISCRETE))
def test_discrete_heads_compute_what_the_hand_written_code_computes(name, implementation):
    case = _DISCRETE[name]
    impls = {impl.name: impl for impl in implementations.discrete_implementations(case)}
    assert list(impls) == ["handwritten", "samplers", "samplers (pure layer)"]
    impl, key = impls[implementation], jax.random.key(1)
    with jax.numpy_rank_promotion("allow"):  # distrax's Bernoulli broadcasts ranks implicitly
        logits, mask, action, old, advantage = discrete.inputs(case, 16, jax.random.key(0))
        reference = case.distribution(logits, mask)
        loss = implementations.discrete_distribution_loss(case.distribution)
        want_value, want_grad = jax.jit(jax.value_and_grad(loss))(
            logits, mask, action, old, advantage
        )

    rollout = jax.jit(impl.rollout)
    (sampled, log_likelihood), rng = rollout(logits, mask, impl.random_input(key))
    (again, _), _ = rollout(logits, mask, rng)
    assert not jnp.array_equal(again, sampled)  # the stream advances
    assert sampled.shape == action.shape
    if name != "MultiBinary":  # distrax's Bernoulli draws otherwise
        # The hand-written code's draw from the same key: the same Gumbel noise.
        want_action = reference.sample(seed=_sample_key(implementation, key))
        assert jnp.array_equal(sampled, want_action)
    with jax.numpy_rank_promotion("allow"):
        want = reference.log_prob(sampled)
    assert jnp.all(jnp.isfinite(log_likelihood))  # an allowed action
    assert jnp.allclose(log_likelihood, want, rtol=1e-5, atol=1e-6)

    (value, _), grad = jax.jit(jax.value_and_grad(impl.loss, has_aux=True))(
        logits, mask, action, old, advantage, impl.random_input(key)
    )
    assert jnp.allclose(value, want_value, rtol=1e-5, atol=1e-7)
    assert jnp.allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
    if case.masked:
        assert jnp.all(jnp.where(mask, True, grad == 0.0))  # forbidden logits: no gradient


def test_discrete_suite_runs_and_writes_its_report(monkeypatch, tmp_path):
    # Two of the cases, for the report (the tests above check each case's steps).
    cases = [_DISCRETE["Categorical, masked"], _DISCRETE["MultiBinary"]]
    monkeypatch.setattr(implementations, "discrete_cases", lambda: cases)
    with jax.numpy_rank_promotion("allow"):  # distrax's Bernoulli broadcasts ranks implicitly
        text = discrete.run(
            (8,), tmp_path, device=timing.select_device("cpu"), name="toy", rounds=1
        )
    assert (tmp_path / "toy.md").read_text() == text
    for heading in ("## Rollout", "## Loss", "## Where the time goes (B = 8)"):
        assert heading in text
    for case in cases:
        assert f"| {case.name} | 8 |" in text
    assert "| MultiBinary | rollout |" in text
    saved = json.loads((tmp_path / "toy.json").read_text())
    assert saved["rounds"] == 1 and set(saved["load_average"]) == {"before", "after"}
    assert saved["samplers"].startswith("samplers ") and saved["samplers"] in text
    cells = {(t["workload"], t["head"], t["implementation"]) for t in saved["timings"]}
    assert len(cells) == 2 * len(cases) * 3
    pieces = {(p["head"], p["piece"], p["implementation"]) for p in saved["parts"]}
    assert ("MultiBinary", "head rollout", "samplers, metrics returned") in pieces
    for record in saved["timings"] + saved["parts"]:
        assert record["seconds"] > 0 and record["low"] <= record["ratio"] <= record["high"]


def test_discrete_flag_runs_the_discrete_suite(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(
        discrete, "run", lambda batches, out, **options: calls.append((batches, out, options))
    )
    cli.main(["--discrete", "--device", "cpu", "--out", str(tmp_path)])
    cli.main(["--discrete", "--batches", "8,16", "--name", "other"])
    (batches, out, options), (other, _, named) = calls
    assert batches == (1, 4096, 65536) and out == tmp_path
    assert options["name"] == "discrete" and options["device"].platform == "cpu"
    assert options["command"] == f"python -m benchmarks --discrete --device cpu --out {tmp_path}"
    assert other == (8, 16) and named["name"] == "other"
    with pytest.raises(SystemExit):
        cli.main(["--discrete", "--bandwidth-tbs", "4.8"])
    assert "there is no bandwidth floor for the discrete heads" in capsys.readouterr().err


_COMPOSITE = {case.name: case for case in composite.composite_cases()}


@pytest.mark.parametrize(
    "implementation", ["samplers", pytest.param("samplers parts, combined by hand", id="parts")]
)
@pytest.mark.parametrize("name", list(_COMPOSITE))
def test_composite_heads_compute_what_the_hand_written_code_computes(name, implementation):
    case = _COMPOSITE[name]
    impls = {impl.name: impl for impl in composite.implementations_of(case)}
    assert list(impls) == ["handwritten", "samplers", "samplers parts, combined by hand"]
    impl, key = impls[implementation], jax.random.key(1)
    params, stored, old, advantage = composite.inputs(case, 16, jax.random.key(0))
    hand_written = impls["handwritten"]
    (want_value, _), want_grad = jax.jit(jax.value_and_grad(hand_written.loss, has_aux=True))(
        params, stored, old, advantage, key
    )

    rollout = jax.jit(impl.rollout)
    (action, log_likelihood, extras), rng = rollout(params, impl.random_input(key))
    (_, _, again), _ = rollout(params, rng)
    assert jax.tree.structure(extras) == jax.tree.structure(stored)
    assert not jax.tree.all(jax.tree.map(jnp.array_equal, again, extras))  # the streams advance
    # The action is the stored one (a Box part's the tanh of its pre-image), and the
    # hand-written code scores the stored extras as the head does.
    want_action = jax.tree.map(
        lambda x: x if jnp.issubdtype(x.dtype, jnp.integer) else jnp.tanh(x), extras
    )
    assert jax.tree.all(jax.tree.map(jnp.allclose, action, want_action))
    want_log_likelihood, _ = jax.jit(case.replay)(params, extras, key)
    assert jnp.allclose(log_likelihood, want_log_likelihood, rtol=1e-5, atol=1e-5)

    (value, _), grad = jax.jit(jax.value_and_grad(impl.loss, has_aux=True))(
        params, stored, old, advantage, impl.random_input(key)
    )
    assert grad.shape == params.shape
    if case.entropy == "base":  # no noise: the same numbers
        assert jnp.allclose(value, want_value, rtol=1e-5, atol=1e-7)
        assert jnp.allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
    else:  # other noise in the Box's one-sample entropy, which the logits do not see
        logits = case.num_params - 2 * composite.ACTION_DIM
        assert jnp.allclose(grad[:, :logits], want_grad[:, :logits], rtol=1e-4, atol=1e-7)
        assert jnp.all(jnp.isfinite(grad)) and jnp.abs(value - want_value) < 0.05


def test_composite_calls_alone_advance_the_streams_as_the_head_does():
    case = _COMPOSITE["Dict(Discrete(3), Box(6)), base entropy"]
    head = composite.implementations_of(case)[1]
    params, _, _, _ = composite.inputs(case, 4, jax.random.key(0))
    state = head.random_input(jax.random.key(1))
    _, after_rollout = jax.jit(head.rollout)(params, state)
    _, after_call = jax.jit(composite.calls_alone(case)[1])(params, state)
    assert jax.tree.all(jax.tree.map(jnp.array_equal, after_rollout, after_call))
    assert not jax.tree.all(jax.tree.map(jnp.array_equal, state, after_rollout))


def test_composite_suite_runs_and_writes_its_report(monkeypatch, tmp_path):
    # The cases the entropy table needs and the Parameterized one, for the report (the
    # tests above check each case's steps).
    cases = [case for name, case in _COMPOSITE.items() if "(18)" in name or "Param" in name]
    monkeypatch.setattr(composite, "composite_cases", lambda: cases)
    text = composite.run((8,), tmp_path, device=timing.select_device("cpu"), name="toy", rounds=1)
    assert (tmp_path / "toy.md").read_text() == text
    for heading in ("## Rollout", "## Loss", "## The call alone (B = 8)", "## Entropy options"):
        assert heading in text
    for case in cases:
        assert f"| {case.name} | 8 |" in text
    assert "| samplers, exact |" in text
    saved = json.loads((tmp_path / "toy.json").read_text())
    assert saved["rounds"] == 1 and set(saved["load_average"]) == {"before", "after"}
    assert saved["samplers"].startswith("samplers ") and saved["samplers"] in text
    cells = {(t["workload"], t["case"], t["implementation"]) for t in saved["timings"]}
    assert len(cases) == 3 and len(cells) == 2 * len(cases) * 3
    assert len(saved["calls"]) == len(cases) * 4 and len(saved["entropies"]) == 6
    for record in saved["timings"] + saved["calls"] + saved["entropies"]:
        assert record["seconds"] > 0 and record["low"] <= record["ratio"] <= record["high"]


def test_composite_flag_runs_the_composite_suite(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(
        composite, "run", lambda batches, out, **options: calls.append((batches, out, options))
    )
    cli.main(["--composite", "--device", "cpu", "--out", str(tmp_path)])
    cli.main(["--composite", "--batches", "8,16", "--name", "other"])
    (batches, out, options), (other, _, named) = calls
    assert batches == (1, 4096, 65536) and out == tmp_path
    assert options["name"] == "composite" and options["device"].platform == "cpu"
    assert options["command"] == f"python -m benchmarks --composite --device cpu --out {tmp_path}"
    assert other == (8, 16) and named["name"] == "other"
    with pytest.raises(SystemExit):
        cli.main(["--composite", "--bandwidth-tbs", "4.8"])
    assert "there is no bandwidth floor for the composite heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--composite", "--discrete"])
    assert "--discrete and --composite are separate runs" in capsys.readouterr().err


_BETA = {case.name: case for case in beta.beta_cases()}


@pytest.mark.parametrize("name", list(_BETA))
def test_beta_head_computes_what_the_hand_written_code_computes(name):
    case = _BETA[name]
    impls = {impl.name: impl for impl in beta.implementations_of(case)}
    assert list(impls) == ["handwritten", "samplers", "samplers (pure layer)"]
    params, x, z, old, advantage = beta.inputs(case, 16, jax.random.key(0))
    assert jnp.allclose(jax.nn.sigmoid(z), x, rtol=1e-5)
    key = jax.random.key(1)
    (want_value, _), want_grad = jax.jit(
        jax.value_and_grad(impls["handwritten"].loss, has_aux=True)
    )(params, x, old, advantage, key)
    for implementation in ("samplers", "samplers (pure layer)"):
        impl = impls[implementation]
        rollout = jax.jit(impl.rollout)
        (action, log_likelihood, pre_image), rng = rollout(params, impl.random_input(key))
        (_, _, again), _ = rollout(params, rng)
        assert not jnp.array_equal(again, pre_image)  # the stream advances
        # The action is the stored logit's, and the hand-written code scores it alike.
        u = jax.nn.sigmoid(pre_image)
        assert jnp.allclose(action, case.low + (case.high - case.low) * u, rtol=1e-5, atol=1e-6)
        inside = jnp.all((u > beta.CLIP) & (u < 1 - beta.CLIP), axis=-1)
        want = jax.jit(functools.partial(beta.hand_written_log_likelihood, case))(params, u)
        assert jnp.allclose(
            jnp.where(inside, log_likelihood, 0.0),
            jnp.where(inside, want, 0.0),
            rtol=1e-4,
            atol=1e-5,
        )
        (value, _), grad = jax.jit(jax.value_and_grad(impl.loss, has_aux=True))(
            params, z, old, advantage, impl.random_input(key)
        )
        assert jnp.allclose(value, want_value, rtol=1e-5, atol=1e-6)
        assert jnp.allclose(grad, want_grad, rtol=1e-3, atol=1e-6)


def test_beta_suite_runs_and_writes_its_report(tmp_path):
    text = beta.run((8,), tmp_path, device=timing.select_device("cpu"), name="toy", rounds=1)
    assert (tmp_path / "toy.md").read_text() == text
    for heading in ("## Rollout", "## Loss"):
        assert heading in text
    for name in _BETA:
        assert f"| {name} | 8 |" in text
    saved = json.loads((tmp_path / "toy.json").read_text())
    assert saved["rounds"] == 1 and saved["samplers"] in text
    cells = {(t["workload"], t["case"], t["implementation"]) for t in saved["timings"]}
    assert len(cells) == len(saved["timings"]) == 2 * len(_BETA) * 3
    for record in saved["timings"]:
        assert record["seconds"] > 0 and record["low"] <= record["ratio"] <= record["high"]


def test_beta_flag_runs_the_beta_suite(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(
        beta, "run", lambda batches, out, **options: calls.append((batches, out, options))
    )
    cli.main(["--beta", "--batches", "8,16", "--out", str(tmp_path)])
    ((batches, out, options),) = calls
    assert batches == (8, 16) and out == tmp_path and options["name"] == "beta"
    with pytest.raises(SystemExit):
        cli.main(["--beta", "--bandwidth-tbs", "4.8"])
    assert "there is no bandwidth floor for the Beta head" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--discrete", "--beta"])
    assert "--discrete and --beta are separate runs" in capsys.readouterr().err


def test_autoregressive_head_computes_what_the_hand_written_code_computes():
    with jax.numpy_rank_promotion("allow"):  # the hand-written `x @ kernel + bias` broadcasts
        found = autoregressive.differences(batch=16)
        loss_inputs = autoregressive.inputs(8, jax.random.key(0))
    assert set(found) == {
        "rollout log-likelihood",
        "entropy",
        "loss",
        "gradient w.r.t. the features",
        "gradient w.r.t. the weights",
    }
    assert max(found.values()) < autoregressive.TOLERANCE, found
    # Both sides take the weights as an argument: other weights, another loss.
    _, head, _ = autoregressive.implementations_of()
    state = head.random_input(jax.random.key(1))
    loss = jax.jit(head.loss)
    (features, weights), *rest = loss_inputs
    other = jax.tree.map(lambda x: 2.0 * x, weights)
    assert loss((features, weights), *rest, state)[0] != loss((features, other), *rest, state)[0]
    (_, _, extras), next_state = jax.jit(head.rollout)(*loss_inputs[:2], state)
    (_, _, again), _ = jax.jit(head.rollout)(*loss_inputs[:2], next_state)
    assert not jax.tree.all(jax.tree.map(jnp.array_equal, again, extras))  # the stream advances


def test_autoregressive_suite_runs_and_writes_its_report(tmp_path):
    with jax.numpy_rank_promotion("allow"):  # the hand-written `x @ kernel + bias` broadcasts
        text = autoregressive.run(
            (8,), tmp_path, device=timing.select_device("cpu"), name="toy", rounds=1
        )
    assert (tmp_path / "toy.md").read_text() == text
    for heading in ("## Rollout", "## Loss"):
        assert heading in text
    assert f"| {autoregressive.CASE} | 8 |" in text
    saved = json.loads((tmp_path / "toy.json").read_text())
    assert saved["rounds"] == 1 and saved["samplers"] in text
    assert max(saved["differences"].values()) < autoregressive.TOLERANCE
    cells = {(t["workload"], t["implementation"]) for t in saved["timings"]}
    names = ("handwritten", "samplers", "handwritten, the head's keys")
    assert cells == {(w, i) for w in ("rollout", "loss") for i in names}
    for record in saved["timings"]:
        assert record["seconds"] > 0 and record["low"] <= record["ratio"] <= record["high"]


def test_autoregressive_flag_runs_the_autoregressive_suite(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(
        autoregressive, "run", lambda batches, out, **options: calls.append((batches, out, options))
    )
    cli.main(["--autoregressive", "--out", str(tmp_path)])
    cli.main(["--autoregressive", "--batches", "8,16", "--name", "other"])
    (batches, out, options), (other, _, named) = calls
    assert batches == (1, 4096, 65536) and out == tmp_path
    assert options["name"] == "autoregressive"
    assert other == (8, 16) and named["name"] == "other"
    with pytest.raises(SystemExit):
        cli.main(["--autoregressive", "--bandwidth-tbs", "4.8"])
    assert "there is no bandwidth floor for the autoregressive head" in capsys.readouterr().err


@pytest.mark.parametrize("case", flow.flow_cases(), ids=lambda case: case.name)
def test_flow_head_computes_what_the_hand_written_flow_computes(case):
    params = flow.conditioner_params(case)
    inputs = jax.random.normal(jax.random.key(0), (16, 2 * flow.A + flow.F))
    hand_rollout, hand_loss, hand_actor = flow._hand_written(case)
    head_rollout, head_loss, head_actor, head_input, actor_input = flow._head(case, params)
    with jax.numpy_rank_promotion("allow"):  # the hand-written `x @ kernel + bias` broadcasts
        (hand_action, hand_log_likelihood, x_k), _ = jax.jit(hand_rollout)(
            inputs, (jax.random.key(1), params)
        )
        state = head_input(jax.random.key(1))
        (action, log_likelihood, pre_image), next_state = jax.jit(head_rollout)(inputs, state)
        # The head's stored pre-image, scored by the hand-written flow's inverses, and
        # the hand-written one replayed by the head: the same action and log-likelihood.
        base, layers = flow.hand_written_flow(case, inputs, params)
        x0, inverse_log_det = layers.inverse_and_log_det(pre_image)
        assert jnp.allclose(action, jnp.tanh(pre_image), atol=1e-6)
        want = base.log_prob(x0) + inverse_log_det - flow._tanh_log_det(pre_image)
        assert jnp.allclose(log_likelihood, want, rtol=1e-5, atol=1e-5)
        head = flow._build(case)(nnx.Rngs(0))
        nnx.update(head, nnx.State(params))
        replayed = head((), inputs, x_k).output
        assert jnp.allclose(replayed["action"], hand_action, atol=1e-5)
        # (The hand-written rollout scores its draw forward, the replay through the
        # inverses: a spline's inverse, a root of a quadratic, rounds more in float32.)
        assert jnp.allclose(replayed["log_likelihood"], hand_log_likelihood, rtol=1e-4, atol=1e-5)
        # The pure layer draws the hand-written noise and scores it alike.
        pure_rollout, pure_loss, pure_actor = flow._pure_layer(case)
        (pure_action, pure_log_likelihood, pure_x_k), _ = jax.jit(pure_rollout)(
            inputs, (jax.random.key(1), params)
        )
        assert jnp.allclose(pure_x_k, x_k, atol=1e-5)
        assert jnp.allclose(pure_action, hand_action, atol=1e-5)
        assert jnp.allclose(pure_log_likelihood, hand_log_likelihood, rtol=1e-4, atol=1e-5)
        # The stream advances; other conditioner weights give another log-likelihood.
        (_, _, again), _ = jax.jit(head_rollout)(inputs, next_state)
        assert not jnp.array_equal(again, pre_image)
        other = {**state, "conditioners": jax.tree.map(lambda w: 2.0 * w, state["conditioners"])}
        (_, other_log_likelihood, _), _ = jax.jit(head_rollout)(inputs, other)
        assert not jnp.allclose(other_log_likelihood, log_likelihood)
        # The same draws give the hand-written and the pure layer's losses and gradients.
        loss_args = (inputs, x_k, hand_log_likelihood, jnp.ones(16), (jax.random.key(2), params))
        actor_args = (inputs, (jax.random.key(2), params))
        for hand, pure, args in (
            (hand_loss, pure_loss, loss_args),
            (hand_actor, pure_actor, actor_args),
        ):
            (want, _), want_grad = jax.jit(jax.value_and_grad(hand, has_aux=True))(*args)
            (got, _), got_grad = jax.jit(jax.value_and_grad(pure, has_aux=True))(*args)
            assert jnp.allclose(got, want, rtol=1e-5, atol=1e-6)
            assert jnp.allclose(got_grad, want_grad, rtol=1e-4, atol=1e-6)
        for step, args in (
            (hand_loss, loss_args),
            (head_loss, (inputs, x_k, hand_log_likelihood, jnp.ones(16), state)),
            (hand_actor, actor_args),
            (head_actor, (inputs, actor_input(jax.random.key(2)))),
        ):
            (value, _), grad = jax.jit(jax.value_and_grad(step, has_aux=True))(*args)
            assert jnp.isfinite(value) and jnp.all(jnp.isfinite(grad)) and jnp.any(grad != 0)


def test_flow_suite_runs_and_writes_its_report(monkeypatch, tmp_path):
    # One case, for the report (the test above checks each case's steps).
    cases = flow.flow_cases()[:1]
    monkeypatch.setattr(flow, "flow_cases", lambda: cases)
    with jax.numpy_rank_promotion("allow"):  # the hand-written `x @ kernel + bias` broadcasts
        text = flow.run((8,), tmp_path, device=timing.select_device("cpu"), name="toy", rounds=1)
    assert (tmp_path / "toy.md").read_text() == text
    for heading in ("## Rollout", "## Loss", "## SAC actor"):
        assert heading in text
    assert f"| {cases[0].name} | 8 |" in text
    saved = json.loads((tmp_path / "toy.json").read_text())
    assert len(saved["timings"]) == 3 * len(cases) * 3


def test_flow_flag_runs_the_flow_suite(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(
        flow, "run", lambda batches, out, **options: calls.append((batches, out, options))
    )
    cli.main(["--flow", "--batches", "8,16", "--out", str(tmp_path)])
    ((batches, out, options),) = calls
    assert batches == (8, 16) and out == tmp_path and options["name"] == "flow"


_TOKENS_GRID = tokens.Grid(16, 300, (8,), (4,), (16, 4), "float32")


def test_token_steps_agree_with_their_checks():
    found = tokens.checks(tokens.Grid(8, 200, (12,), (6,), (16,), "float32"))
    assert {"training step", "untruncated step", "decode step's support"} <= set(found)
    for check, (value, _) in found.items():
        if "binary" not in check:
            assert value <= tokens.TOLERANCE, (check, value)


def test_tokens_suite_runs_and_writes_its_report(tmp_path):
    device = timing.select_device("cpu")
    text = tokens.run(None, tmp_path, device=device, name="toy", rounds=1, grid=_TOKENS_GRID)
    assert (tmp_path / "toy.md").read_text() == text
    for heading in ("## Training step", "## Decode step", "## Untruncated step"):
        assert heading in text
    for row in (
        "| N = 8, max_kept = 16 | plain JAX |",
        "| N = 8, max_kept = 4 | samplers |",
        "| R = 4, max_kept = 16 | lax.top_k sampler |",
        "| R = 4, max_kept = 16 | lax.approx_max_k sampler |",
        "| N = 8 | samplers |",
    ):
        assert row in text, row
    saved = json.loads((tmp_path / "toy.json").read_text())
    assert saved["grid"]["hidden"] == 16 and saved["grid"]["vocab"] == 300
    assert len(saved["training"]) == 4 and len(saved["untruncated"]) == 2
    for record in saved["training"] + saved["decode"] + saved["untruncated"]:
        assert record["seconds"] > 0 and record["low"] <= record["ratio"] <= record["high"]
        assert record["compiled_bytes"] > 0
    assert not (tmp_path / "toy.partial.json").exists()


def test_tokens_suite_times_samplers_alone_where_plain_jax_is_out_of_memory(monkeypatch, tmp_path):
    interleaved = timing.interleaved

    def exhausted(fns, rounds, *args):
        if tokens.PLAIN in fns:
            raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
        return interleaved(fns, rounds, *args)

    monkeypatch.setattr(timing, "interleaved", exhausted)
    grid = _TOKENS_GRID._replace(kept=(4,))
    text = tokens.run((8,), tmp_path, device=timing.select_device("cpu"), rounds=1, grid=grid)
    assert "| N = 8, max_kept = 4 | plain JAX | out of memory |" in text
    saved = json.loads((tmp_path / "tokens.json").read_text())
    plain, ours = saved["training"]
    assert plain == {
        "cell": "N = 8, max_kept = 4",
        "implementation": "plain JAX",
        "out_of_memory": True,
    }
    assert ours["implementation"] == "samplers" and "ratio" not in ours


def test_tokens_flag_runs_the_tokens_suite(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(
        tokens, "run", lambda batches, out, **options: calls.append((batches, out, options))
    )
    cli.main(["--tokens", "--out", str(tmp_path)])
    cli.main(["--tokens", "--large", "--batches", "1024,8192"])
    (batches, out, options), (large, _, chosen) = calls
    assert batches is None and out == tmp_path and options["name"] == "tokens"
    assert options["large"] is False
    assert large == (1024, 8192) and chosen["large"] is True
    with pytest.raises(SystemExit):
        cli.main(["--tokens", "--full"])
    assert "--tokens has no --full grid" in capsys.readouterr().err


def test_end_to_end_suite_runs_and_writes_its_report(monkeypatch, tmp_path):
    # The hand-written heads score stored actions as the samplers heads do.
    logits, stored = jax.random.normal(jax.random.key(0), (16, 2)), jnp.arange(16) % 2
    ours = samplers.CategoricalSampler(nnx.Rngs(0), 0.01, num_actions=2)((), logits, stored)
    theirs = end_to_end.HandWrittenCategorical(nnx.Rngs(0), 0.01, 2)((), logits, stored)
    assert jnp.allclose(ours.output["log_likelihood"], theirs.output["log_likelihood"])
    assert jnp.allclose(ours.regularization_loss, theirs.regularization_loss)
    inputs, z = jax.random.normal(jax.random.key(1), (16, 2)), jnp.linspace(-12.0, 12.0, 16)
    ours = samplers.NormalTanhSampler(nnx.Rngs(0), 0.0, action_dim=1)((), inputs, z[:, None])
    theirs = end_to_end.HandWrittenNormalTanh(nnx.Rngs(0), 0.0, 1)((), inputs, z[:, None])
    assert jnp.allclose(ours.output["log_likelihood"], theirs.output["log_likelihood"], rtol=1e-5)
    assert jnp.array_equal(ours.output["action"], theirs.output["action"])

    # Two iterations of 8 environments per run, one seed.
    device = timing.select_device("cpu")
    text = end_to_end.run(8, tmp_path, device=device, name="toy", budget=1e-4, seeds=(0,))
    assert (tmp_path / "toy.md").read_text() == text
    assert "## Speed" in text and "## Returns" in text
    saved = json.loads((tmp_path / "toy.json").read_text())
    assert [task["environment"] for task in saved["tasks"]] == ["CartPole-v1", "Pendulum-v1"]
    for task in saved["tasks"]:
        assert task["iterations"] == 2 and task["num_envs"] == 8
        for head in end_to_end.HEADS:
            ((record,),) = [task["heads"][head]["seeds"]]
            assert record["seed"] == 0 and record["steps_per_second"] > 0
            assert record["replay_ratio_error"] == 0.0
            assert jnp.isfinite(record["evaluation_return"])

    calls = []
    monkeypatch.setattr(
        end_to_end, "run", lambda num_envs, out, **options: calls.append((num_envs, out, options))
    )
    cli.main(["--end-to-end", "--num-envs", "64", "--budget", "0.05", "--out", str(tmp_path)])
    cli.main(["--end-to-end", "--name", "other"])
    (num_envs, out, options), (default_envs, _, named) = calls
    assert num_envs == 64 and out == tmp_path
    assert options["budget"] == 0.05 and options["name"] == "end_to_end"
    assert default_envs == end_to_end.NUM_ENVS and named == {
        **named,
        "budget": 1.0,
        "name": "other",
    }
    assert f"(default {end_to_end.NUM_ENVS}: " in " ".join(cli._parser().format_help().split())
    with pytest.raises(SystemExit):
        cli.main(["--beta", "--num-envs", "64"])
