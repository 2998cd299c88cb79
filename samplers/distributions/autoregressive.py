"""Sub-actions in order, each conditioned on the earlier ones: :class:`Autoregressive`.

An action of named sub-actions ``a_1, ..., a_K`` (a unit, then what it does, then a
target legal for both) whose probability factorises as ``p(a_1) p(a_2 | a_1) ...
p(a_K | a_<K)``. Each sub-action's distribution is built by a *step*, a function of
the earlier sub-actions' replay data (a discrete one's action, a squashed one's
pre-image; see :mod:`samplers.distributions.replay`):

- a sample draws the sub-actions in order, each from the key ``fold_in(key,
  crc32(name))`` of its name, as :class:`samplers.Composite`'s parts;
- a replay scores stored data *teacher-forced*: every step is built from the stored
  data at once, with no sequential loop, and a sample's log-probability *is* the
  replay of its data, so a stored copy reproduces it bit for bit;
- ``entropy()`` and the KL are exact: the sum over sub-actions of the expected
  conditional entropy (or KL), ``sum_k E[H(a_k | a_<k)]``, with the expectation over
  every prefix enumerated and batched. That needs every sub-action but the last to
  be discrete, and at most ``max_prefixes`` prefixes; otherwise
  :meth:`Autoregressive.entropy_along` is the estimate from one prefix.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import distrax
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray
from tensorflow_probability.substrates import jax as tfp

from samplers import _checks
from samplers.distributions import _keys
from samplers.distributions import replay as _replay
from samplers.distributions.categorical import MaskedCategorical
from samplers.distributions.composite import Composite, leaves, ordered_sum, spec_of
from samplers.distributions.discrete import MultiBinary, MultiDiscrete
from samplers.distributions.pre_image import PreImageReplay
from samplers.distributions.replay import Replayable

tfd = tfp.distributions

# A step: the earlier sub-actions' replay data, by name, to this sub-action's distribution.
Step = Callable[[dict[str, Any]], distrax.Distribution]


class Autoregressive(distrax.Distribution, Replayable):
    """Named sub-actions sampled in order, each conditioned on the earlier ones.

    ``steps`` maps each sub-action's name, in order, to its step: a function of a
    dict of the earlier sub-actions' replay data (``{}`` for the first) that returns
    the sub-action's distribution, any ``distrax`` distribution of this package's
    kinds (a masked discrete one, a squashed Normal, a Beta, a
    :class:`samplers.Composite`). A step must also accept prefixes with one more
    leading axis than the batch, ``[P, *batch]`` (the enumeration of :meth:`entropy`
    and the KL stacks the prefixes there), and give distributions of that batch
    shape: index a per-state table ``legal`` ``[B, units, targets]`` as
    ``legal[jnp.arange(B), prefix["unit"]]``, which gives ``[B, targets]`` and
    ``[P, B, targets]`` alike, not by the batch axis's position
    (``legal[:, prefix["unit"]]``, a reshape to 2-D).

    An action, a sample and the replay data are dicts by sub-action name;
    ``log_prob`` is ``((l_1 + l_2) + l_3) ...`` in the given order, exactly that of
    :meth:`replay_parts`. :meth:`deterministic_replay_data` takes the most probable
    (or deterministic) sub-action at each step: greedy decoding, not the joint
    mode. The KL to another ``Autoregressive`` over the same names, ``sum_k
    E_p[KL(p_k(.|a_<k) || q_k(.|a_<k))]``, is registered with TFP and exact as
    :meth:`entropy` is.

    An action whose earlier sub-actions have probability 0 scores ``-inf``, also
    where a later sub-action has no distribution under that prefix (a masked
    categorical row with no allowed action, NaN on its own): that sub-action's
    conditional log-probability counts as ``-inf`` there, and its conditional
    entropy (:meth:`conditional_entropies`) as 0.

    Args:
        steps: The steps by name, in order (a dict with str keys).
        max_prefixes: The most prefixes :meth:`entropy` and the KL enumerate.

    Raises:
        TypeError: ``steps`` is not a non-empty dict of callables with str keys, or
            the first step returns no ``distrax`` distribution.

    Example:
        >>> import jax, jax.numpy as jnp, samplers
        >>> logits = jnp.array([[0.0, 1.0]])  # one state, two units
        >>> legal = jnp.array([[True, False, False], [True, True, True]])  # unit 0 waits
        >>> dist = samplers.Autoregressive({
        ...     "unit": lambda prefix: samplers.MaskedCategorical(logits),
        ...     "target": lambda prefix: samplers.MaskedCategorical(
        ...         jnp.zeros(prefix["unit"].shape + (3,)), legal[prefix["unit"]]
        ...     ),
        ... })
        >>> action, data, log_prob = dist.sample_with_replay(seed=jax.random.key(0))
        >>> bool(dist.replay(data)[1] == log_prob), dist.entropy()
        (True, Array([1.3854], dtype=float32))
    """

    def __init__(self, steps: Mapping[str, Step], *, max_prefixes: int = 4096):
        if not isinstance(steps, Mapping) or not steps:
            raise TypeError(
                f"Autoregressive takes a non-empty dict of steps by sub-action name, got "
                f"{type(steps).__name__}; pass e.g. {{'unit': step_a, 'target': step_b}}."
            )
        for name, step in steps.items():
            if not isinstance(name, str) or not callable(step):
                raise TypeError(
                    f"Autoregressive's steps must map str names to functions of the "
                    f"earlier sub-actions' data, got {name!r}: {type(step).__name__}."
                )
        self._steps = dict(steps)
        self._names = tuple(steps)
        self.max_prefixes = _checks.positive_int("max_prefixes", max_prefixes)
        self._first = self._build(0, {})

    @property
    def names(self) -> tuple[str, ...]:
        """The sub-actions' names, in order."""
        return self._names

    def _build(self, index: int, prefix: dict) -> distrax.Distribution:
        name = self._names[index]
        dist = self._steps[name](prefix)
        if not isinstance(dist, distrax.Distribution):
            raise TypeError(
                f"step {name!r} must return a distrax distribution, got {type(dist).__name__}."
            )
        return dist

    def _at(self, index: int, prefix: dict) -> distrax.Distribution:
        """Sub-action ``index``'s distribution given a copy of ``prefix``."""
        return self._first if index == 0 else self._build(index, dict(prefix))

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self._first.batch_shape)

    def _action_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Each sub-action's shape and dtype, traced from the greedy decoding."""
        return jax.eval_shape(lambda: self.replay(self.deterministic_replay_data())[0])

    @property
    def event_shape(self) -> dict[str, tuple[int, ...]]:
        """Each sub-action's event shape, by name."""
        shapes = self._action_shapes()
        return {name: shapes[name].shape[len(self.batch_shape) :] for name in self._names}

    @property
    def dtype(self) -> dict[str, Any]:
        """Each sub-action's dtype, by name."""
        shapes = self._action_shapes()
        return {name: shapes[name].dtype for name in self._names}

    def step_distributions(self, replay_data: dict) -> dict[str, distrax.Distribution]:
        """Each sub-action's distribution given the stored earlier ones (teacher forcing)."""
        dists = {self._names[0]: self._first}
        for index, name in enumerate(self._names[1:], start=1):
            dists[name] = self._build(index, _prefix(self._names, replay_data, index))
        return dists

    # The replay protocol.

    def _draw(self, choose: Callable) -> dict:
        """``{name: choose(name, its distribution given the earlier choices)}``, in order."""
        data: dict = {}
        for index, name in enumerate(self._names):
            data[name] = choose(name, self._at(index, data))
        return data

    def sample_replay_data(self, *, seed) -> dict:
        """Each sub-action's replay data, drawn in order from the key of its name."""
        seed = _keys.integer_seed(seed)
        keys = dict(
            zip(self._names, _keys.part_keys(seed, [(n,) for n in self._names]), strict=True)
        )
        return self._draw(lambda name, d: _replay.sample_replay_data(d, keys[name]))

    def deterministic_replay_data(self) -> dict:
        """Greedy: each sub-action's deterministic data given the earlier ones."""
        return self._draw(lambda _, d: _replay.deterministic_replay_data(d))

    def replay_parts(self, replay_data: dict) -> tuple[dict, dict]:
        """``(action, log_probs)``: each sub-action and its conditional log-probability."""
        action, log_probs, _ = self._replay_steps(replay_data, self.step_distributions(replay_data))
        return action, log_probs

    def replay_with_entropies(self, replay_data: dict) -> tuple[dict, dict, dict]:
        """``(action, log_probs, entropies)``: :meth:`replay_parts` and
        :meth:`conditional_entropies`, from the step distributions built once."""
        dists = self.step_distributions(replay_data)
        action, log_probs, impossible = self._replay_steps(replay_data, dists)
        return action, log_probs, _entropies(dists, impossible)

    def _replay_steps(self, replay_data: dict, dists: dict) -> tuple[dict, dict, dict]:
        """``(action, log_probs, impossible)`` of the stored data under the step
        distributions built from it."""
        pairs = {name: _replay.replay(dist, replay_data[name]) for name, dist in dists.items()}
        own = {n: lp for n, (_, lp) in pairs.items()}
        log_probs, impossible = _after_impossible(self._names, own)
        return {n: a for n, (a, _) in pairs.items()}, log_probs, impossible

    def replay(self, replay_data: dict) -> tuple[dict, Array]:
        """The sub-actions and the sum of their log-probabilities, teacher-forced."""
        action, log_probs = self.replay_parts(replay_data)
        return action, ordered_sum(list(log_probs.values()))

    def check_replay_data(self, replay_data: Any, name: str = "replay data") -> dict:
        """Each sub-action's data checked by its step's distribution; refuses data that is
        not a dict by sub-action name."""
        if not isinstance(replay_data, Mapping) or set(replay_data) != set(self._names):
            got = sorted(replay_data) if isinstance(replay_data, Mapping) else replay_data
            raise ValueError(
                f"{name} must be a dict with the sub-actions {list(self._names)}, got "
                f"{type(replay_data).__name__} {got}; pass the {name} of a sample."
            )

        def check(data):
            return self._draw(lambda k, d: _replay.check_replay_data(d, data[k], f"{name}[{k!r}]"))

        # Each step is built for its shapes and dtypes alone: no step is computed.
        checked = jax.eval_shape(check, dict(replay_data))
        return jax.tree.map(lambda x, s: jnp.asarray(x, s.dtype), dict(replay_data), checked)

    # distrax's methods.

    def _sample_n(self, key: PRNGKeyArray, n: int) -> dict:
        def one(key):
            return self.replay(self.sample_replay_data(seed=key))[0]

        if n == 1:  # sample(seed=key) is the action of sample_replay_data(seed=key)
            return jax.tree.map(lambda x: x[None], one(key))
        return jax.vmap(one)(jax.random.split(key, n))

    def log_prob(self, value: dict) -> Array:
        """``sum_k log p(a_k | a_<k)`` of actions by name, in order.

        A squashed sub-action conditions the later ones through its pre-image: the
        one a sample remembers, else the inverse of the action (infinite on a bound;
        store and :meth:`replay` the data instead).
        """
        if not isinstance(value, Mapping) or set(value) != set(self._names):
            raise ValueError(
                f"value must be a dict with the sub-actions {list(self._names)}, got "
                f"{type(value).__name__}."
            )
        log_probs = {}

        def score(name, dist):
            log_probs[name] = jnp.asarray(dist.log_prob(value[name]))
            return _data_of_action(dist, value[name])

        self._draw(score)
        return ordered_sum(list(_after_impossible(self._names, log_probs)[0].values()))

    def entropy(self) -> Array:
        """``H(a) = sum_k E[H(a_k | a_<k)]``, exact: every prefix enumerated, batched.

        Raises:
            NotImplementedError: a sub-action before the last is not discrete, or the
                prefixes number more than ``max_prefixes``.
        """
        return self._expected(lambda p, _: jnp.asarray(p.entropy()), None, "entropy")

    def entropy_along(self, replay_data: dict) -> Array:
        """``sum_k H(a_k | a_<k)`` along the stored prefix: for a sample of this
        distribution an unbiased estimate of :meth:`entropy`, with no extra key.

        Its variance is that of the conditional entropies over prefixes (zero when
        they do not depend on the prefix); scoring another policy's prefix (the
        rollout's, in a loss pass) biases it by how far the two policies differ.
        """
        return ordered_sum(list(self.conditional_entropies(replay_data).values()))

    def conditional_entropies(self, replay_data: dict) -> dict[str, Array]:
        """Each sub-action's entropy given the stored earlier ones, by name (0 where the
        stored prefix has probability 0 and the sub-action no distribution)."""
        return self.replay_with_entropies(replay_data)[2]

    def _expected(self, term: Callable, other: "Autoregressive | None", what: str) -> Array:
        """``sum_k E_{a_<k ~ self}[term(p_k, q_k)]`` over every prefix, batched."""
        prefix: dict = {}  # each leaf [P, *batch, ...] after the first sub-action
        log_weight: Any = None  # log p(prefix), [P, *batch]
        total = jnp.zeros(())
        last = len(self._names) - 1
        for index, name in enumerate(self._names):
            p = self._at(index, prefix)
            q = None if other is None else other._at(index, prefix)
            if log_weight is not None:
                possible = log_weight > -jnp.inf
                p, q = _finite_where_impossible(p, possible), _finite_where_impossible(q, possible)
            value = term(p, q)
            if log_weight is None:
                total = value  # the first sub-action's, from the one empty prefix
            else:
                weight = jnp.exp(log_weight)
                total = total + jnp.sum(jnp.where(weight > 0, weight * value, 0.0), axis=0)
            if index == last:
                break
            values = support(p)
            count = 1 if log_weight is None else int(jnp.shape(log_weight)[0])
            if values is None or count * values.shape[0] > self.max_prefixes:
                reason = (
                    f"sub-action {name!r} ({type(p).__name__}) is not discrete (a "
                    f"categorical, multi-discrete or multi-binary one)"
                    if values is None
                    else f"the prefixes up to {name!r} number {count * values.shape[0]}"
                )
                raise NotImplementedError(
                    f"the exact {what} enumerates the prefixes of every sub-action but the "
                    f"last, at most max_prefixes={self.max_prefixes} of them, and {reason}; "
                    f"use entropy_along(replay_data), the estimate from one prefix (the "
                    f"head's entropy='along_sample'), or raise max_prefixes."
                )
            prefix, log_weight = _extend(prefix, log_weight, name, p, values)
        return jnp.asarray(total)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaskTable:
    """A sub-action's mask as a table indexed by earlier categorical sub-actions.

    The function form of a prefix-dependent mask, ``lambda prefix:
    legal[prefix["unit"]]``, cannot be stored in a rollout; a ``MaskTable`` is the
    same mask as a pytree of arrays that a training loop stores beside the action
    and passes back in the loss pass. ``table`` has the head's batch shape, then one
    axis per sub-action named in ``given`` (its number of choices), then the shape
    of the mask: ``[*batch, n_unit, num_targets]`` for ``given="unit"``. Called with
    a prefix (a dict of the earlier sub-actions by name, each ``[*batch]``), it
    returns the rows those sub-actions pick, ``[*batch, num_targets]``.

    Args:
        table: The masks of every choice of the ``given`` sub-actions.
        given: The name of the earlier sub-action that indexes the table, or a tuple
            of names in the table's axis order.

    Raises:
        TypeError: ``given`` is not a name or a non-empty tuple of names. The head
            that receives the table checks its shape and names.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> legal = jnp.array([[[True, False, False], [True, True, True]]])  # 1 state, 2 units
        >>> table = samplers.MaskTable(legal, given="unit")
        >>> table({"unit": jnp.array([0])}).tolist()
        [[True, False, False]]
    """

    table: Array
    given: str | tuple[str, ...] = dataclasses.field(metadata={"static": True})

    def __post_init__(self):
        given = self.given
        names = tuple(given) if isinstance(given, tuple | list) else (given,)
        if not names or not all(isinstance(name, str) for name in names):
            raise TypeError(
                f"MaskTable's given is a sub-action's name or a tuple of names, got "
                f"{self.given!r}; pass e.g. given='unit'."
            )
        if not isinstance(self.given, str):
            object.__setattr__(self, "given", names)

    @property
    def names(self) -> tuple[str, ...]:
        """``given`` as a tuple of names."""
        return (self.given,) if isinstance(self.given, str) else tuple(self.given)

    def __call__(self, prefix: Mapping[str, Array]) -> Array:
        rows = jnp.asarray(self.table)
        for name in self.names:
            index = jnp.asarray(prefix[name])
            shape = index.shape + (1,) * (rows.ndim - index.ndim)
            rows = jnp.take_along_axis(rows, index.reshape(shape), axis=index.ndim)
            rows = jnp.squeeze(rows, axis=index.ndim)
        return rows


def _entropies(dists: dict, impossible: dict) -> dict[str, Array]:
    """Each step's entropy, 0 where its prefix is impossible and it has no distribution."""
    entropies = {name: jnp.asarray(dist.entropy()) for name, dist in dists.items()}
    return {
        name: jnp.where(impossible[name] & jnp.isnan(h), 0.0, h) for name, h in entropies.items()
    }


def _after_impossible(names: tuple[str, ...], log_probs: dict) -> tuple[dict, dict]:
    """``(log_probs, impossible)``: the conditional log-probabilities, ``-inf`` where
    they are NaN after a prefix of probability 0 (a row with no allowed action under a
    forbidden earlier choice), and whether each sub-action's prefix has probability 0.

    The ``where`` passes no gradient to the NaN it replaces, and the masked rows' own
    gradients are zero, so the gradient stays finite."""
    impossible: Any = False
    fixed, before = {}, {}
    for name in names:
        log_prob = log_probs[name]
        before[name] = impossible
        fixed[name] = jnp.where(impossible & jnp.isnan(log_prob), -jnp.inf, log_prob)
        impossible = impossible | (log_prob == -jnp.inf)
    return fixed, before


def _prefix(names: tuple[str, ...], data: dict, index: int) -> dict:
    return {name: data[name] for name in names[:index]}


def support(dist: distrax.Distribution) -> Array | None:
    """Every value of a discrete distribution's event, ``[S, *event]``, or ``None``."""
    if isinstance(dist, MultiDiscrete):
        grids = jnp.meshgrid(*(jnp.arange(n) for n in dist.nvec), indexing="ij")
        return jnp.stack([g.reshape(-1) for g in grids], -1)
    if isinstance(dist, MultiBinary):
        bits = dist.event_shape[0]
        codes = jnp.arange(2**bits)
        return (codes[:, None] >> jnp.arange(bits)) & 1
    if isinstance(dist, distrax.Categorical):
        return jnp.arange(dist.num_categories)
    return None


def _extend(prefix: dict, log_weight, name: str, dist, support: Array):
    """The prefixes times every value of ``name``: index ``s * P + p`` for the ``s``-th
    value after the ``p``-th prefix; and their log-probabilities."""
    lead = tuple(dist.batch_shape)
    size = support.shape[0]
    event = support.shape[1:]
    values = jnp.broadcast_to(
        support.reshape(size, *(1,) * len(lead), *event), (size, *lead, *event)
    )
    log_probs = jax.vmap(dist.log_prob)(values)  # [S, *lead]
    if log_weight is None:
        return {name: values}, log_probs
    count = log_weight.shape[0]

    def flat(x):
        return x.reshape(size * count, *x.shape[2:])

    extended = {n: flat(jnp.broadcast_to(x[None], (size, *x.shape))) for n, x in prefix.items()}
    extended[name] = flat(values)
    return extended, flat(log_weight[None] + log_probs)


def _finite_where_impossible(dist, possible):
    """A categorical whose rows at impossible prefixes (probability 0) allow every
    action: they weigh nothing, and a row without an allowed action there would
    otherwise put NaN into the gradient through the zero weight."""
    if not isinstance(dist, MaskedCategorical):
        return dist
    mask = jnp.where(possible[..., None], dist.mask, True)
    logits = jnp.where(possible[..., None], dist.logits, 0.0)
    return MaskedCategorical(logits, mask, dtype=dist.dtype)


def _data_of_action(dist: distrax.Distribution, action) -> Any:
    """The replay data that conditions the later sub-actions, for a given action."""
    if isinstance(dist, PreImageReplay):
        recalled = dist.recall_pre_image(action)
        return dist.bijector.inverse(action) if recalled is None else recalled
    return action


def _autoregressive_kl(p: Autoregressive, q: Autoregressive, *_, **__) -> Array:
    if p.names != q.names:
        raise ValueError(
            f"p and q must have the same sub-actions in the same order, got {list(p.names)} "
            f"and {list(q.names)}."
        )

    def term(p_k, q_k):
        return jnp.asarray(p_k.kl_divergence(q_k))

    return p._expected(term, q, "KL divergence")


tfd.RegisterKL(Autoregressive, Autoregressive)(_autoregressive_kl)


def replay_embedding(dist: distrax.Distribution) -> Callable:
    """The embedding of ``dist``'s replay data that a later sub-action is conditioned
    on, from its kind alone (no parameters): a discrete one's one-hot (one per
    sub-action of a ``MultiDiscrete``, a ``MultiBinary``'s bits), a bounded squashed
    one's ``tanh(x / k)`` of its pre-image ``x`` (``k`` its squashing's pre-image
    scale: the action rescaled to ``[-1, 1]``), an unsquashed one's ``x``, a
    composite's parts' embeddings concatenated in the parts' order.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> from samplers.distributions.autoregressive import replay_embedding
        >>> replay_embedding(samplers.MaskedCategorical(jnp.zeros(3)))(jnp.array(1))
        Array([0., 1., 0.], dtype=float32)
    """
    if isinstance(dist, MultiDiscrete):
        nvec = dist.nvec
        return lambda a: jnp.concatenate(
            [jax.nn.one_hot(a[..., i], n) for i, n in enumerate(nvec)], -1
        )
    if isinstance(dist, MultiBinary):
        return lambda a: jnp.asarray(a, jnp.float32)
    if isinstance(dist, distrax.Categorical):
        count = dist.num_categories
        return lambda a: jax.nn.one_hot(a, count)
    if isinstance(dist, Composite):
        spec = spec_of(dist.parts)
        parts = [replay_embedding(part) for part in leaves(spec, dist.parts, "parts", "Composite")]
        return lambda data: jnp.concatenate(
            [e(x) for e, x in zip(parts, leaves(spec, data, "data", "Composite"), strict=True)],
            -1,
        )
    if isinstance(dist, PreImageReplay):
        bounds = dist.bounds
        if bounds is not None:
            scale = bounds.pre_image_scale
            return lambda x: jnp.tanh(x / scale)
    return lambda x: jnp.asarray(x)
