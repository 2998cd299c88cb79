import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import samplers


def test_output_is_a_pytree_with_the_expected_fields():
    out = samplers.StatefulModuleOutput(
        next_state=(), output={"a": jnp.ones(2)}, regularization_loss=jnp.ones(()), metrics={}
    )
    assert out.rollout_extras is None
    doubled = jax.tree.map(lambda x: 2 * x, out)
    assert doubled.output["a"].tolist() == [2.0, 2.0]
    assert len(jax.tree.leaves(out)) == 2
    assert jax.jit(lambda o: o)(out).regularization_loss == 1.0


@pytest.mark.parametrize("cls", [samplers.StatefulModule, samplers.ActionSampler])
def test_interfaces_are_abstract(cls):
    with pytest.raises(TypeError, match="abstract"):
        cls()


def test_a_custom_stateful_module_plugs_in():
    class Counter(samplers.StatefulModule):
        def __call__(self, state, inputs, rollout_extras=None):
            return samplers.StatefulModuleOutput(state + 1, inputs, jnp.zeros(()), {})

        def initialize_state(self, batch_size):
            return jnp.zeros(batch_size)

        def reset_state(self, prev_state):
            return jnp.zeros_like(prev_state)

    counter = Counter()
    out = nnx.jit(lambda m, s, x: m(s, x))(counter, counter.initialize_state(3), jnp.ones(3))
    assert out.next_state.tolist() == [1.0, 1.0, 1.0]
    assert counter.reset_state(out.next_state).tolist() == [0.0, 0.0, 0.0]


def test_samplers_are_action_samplers_and_stateful_modules():
    head = samplers.NormalTanhSampler(nnx.Rngs(0), 0.0)
    assert isinstance(head, samplers.ActionSampler) and isinstance(head, samplers.StatefulModule)
    assert isinstance(head, samplers.SquashedNormalSampler)
