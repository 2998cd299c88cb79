"""Distributions over structured actions: :class:`Composite` and :class:`Parameterized`.

A :class:`Composite` is a ``distrax.Joint`` over a dict or tuple (nested) of
independent distributions, the action space's ``Dict`` or ``Tuple``; a
:class:`Parameterized` chooses one of ``N`` discrete actions, each with continuous
parameters of its own (a parameterised, or hybrid, action space). Both follow the
replay protocol (:mod:`samplers.distributions.replay`): their replay data is their
parts' in the parts' structure.

Keys: one key gives each part the key ``fold_in(key, crc32(name))`` for each name on
its path (a tuple's parts are named ``str(i)``), so a part's draws depend on the key
and its own name alone: adding or removing another part by name changes none of
them.
"""

from collections.abc import Iterator, Mapping
from typing import Any, cast

import distrax
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray
from tensorflow_probability.substrates import jax as tfp

from samplers.distributions import _keys
from samplers.distributions import replay as _replay
from samplers.distributions.categorical import MaskedCategorical
from samplers.distributions.replay import Replayable

tfd = tfp.distributions

# A structure of parts: a dict (str keys, in the given order) or tuple whose leaves are
# the parts' indices in that order.
Spec = dict | tuple


def spec_of(parts: Any, what: str = "parts") -> Spec:
    """The structure of ``parts`` (a dict with str keys or a tuple, nested) with each
    leaf replaced by its index in the given order.

    Raises:
        TypeError: a level is neither a non-empty dict with str keys nor a non-empty
            tuple or list.
    """
    count = 0

    def walk(value, where):
        nonlocal count
        if isinstance(value, Mapping):
            bad = [key for key in value if not isinstance(key, str)]
            if bad:
                raise TypeError(
                    f"{where} needs str keys (they name the parts' keys and metrics), got "
                    f"{bad!r}; use e.g. {{str(key): part}}."
                )
            if not value:
                raise TypeError(f"{where} needs at least one part, got an empty dict.")
            return {key: walk(sub, f"{where}[{key!r}]") for key, sub in value.items()}
        if isinstance(value, (tuple, list)):
            if not value:
                raise TypeError(f"{where} needs at least one part, got an empty tuple.")
            return tuple(walk(sub, f"{where}[{i}]") for i, sub in enumerate(value))
        count += 1
        return count - 1

    if not isinstance(parts, (Mapping, tuple, list)):
        raise TypeError(
            f"{what} must be a dict or a tuple, got {type(parts).__name__}; pass e.g. "
            f"{{'move': part_a, 'fire': part_b}}."
        )
    return cast(Spec, walk(parts, what))


def paths(spec: Spec, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The path of names of each leaf of ``spec``, in leaf order (a tuple's: ``str(i)``)."""
    items = spec.items() if isinstance(spec, dict) else enumerate(spec)
    for name, sub in items:
        path = (*prefix, str(name))
        if isinstance(sub, (dict, tuple)):
            yield from paths(sub, path)
        else:
            yield path


def build(spec: Spec, values: list) -> Any:
    """``spec`` with each leaf ``i`` replaced by ``values[i]``."""
    if isinstance(spec, dict):
        return {name: build(sub, values) for name, sub in spec.items()}
    if isinstance(spec, tuple):
        return tuple(build(sub, values) for sub in spec)
    return values[spec]


def leaves(spec: Spec, value: Any, what: str, owner: str) -> list:
    """The leaves of ``value``, a structure like ``spec``, in leaf order.

    Raises:
        ValueError: ``value`` does not have ``spec``'s structure (``what`` and
            ``owner`` name it in the message).
    """
    found: list = [None] * len(list(paths(spec)))

    def walk(spec, value, path):
        where = f"{what}[{path_name(path)!r}]" if path else what
        if isinstance(spec, dict):
            if not isinstance(value, Mapping) or set(value) != set(spec):
                got = sorted(value, key=str) if isinstance(value, Mapping) else type(value).__name__
                raise ValueError(
                    f"{where} must be a dict with the keys {list(spec)} of {owner}'s parts, "
                    f"got {got}; pass the {what} in the parts' structure."
                )
            for key, sub in spec.items():
                walk(sub, value[key], (*path, key))
        elif isinstance(spec, tuple):
            if not isinstance(value, (tuple, list)) or len(value) != len(spec):
                got = f"length {len(value)}" if isinstance(value, (tuple, list)) else value
                raise ValueError(
                    f"{where} must be a tuple of {len(spec)} entries, one per part of "
                    f"{owner}, got {type(value).__name__} {got}; pass the {what} in the "
                    f"parts' structure."
                )
            for i, (sub, item) in enumerate(zip(spec, value, strict=True)):
                walk(sub, item, (*path, str(i)))
        else:
            found[spec] = value

    walk(spec, value, ())
    return found


def path_name(path: tuple[str, ...]) -> str:
    """A part's path as one name, ``"a/b"``."""
    return "/".join(path)


def check_parameters(owner: str, kind: str, num_actions: int, parameters: Any) -> None:
    """Refuses parameters that are not a tuple of ``kind`` (distributions or heads), one
    for each of the choice's ``num_actions`` actions."""
    if not isinstance(parameters, (tuple, list)):
        raise TypeError(
            f"parameters must be a tuple of {kind}, one per discrete action, got "
            f"{type(parameters).__name__}."
        )
    if len(parameters) != num_actions:
        raise ValueError(
            f"{owner} needs one of its parameter {kind} per discrete action: the choice has "
            f"{num_actions} actions, got {len(parameters)}; give the choice "
            f"{len(parameters)} actions, or one parameter entry per action."
        )


def ordered_sum(values: list[Array]) -> Array:
    """``((v_0 + v_1) + v_2) ...``, exactly the sum of the values given.

    The barrier keeps XLA from fusing a part's last step into the sum (a multiply and
    an add into one FMA, say), so the sum is that of the values a caller also returns.
    """
    values = jax.lax.optimization_barrier(values)
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total


class Composite(distrax.Joint, Replayable):
    """Independent distributions over the parts of a structured action, one event.

    ``parts`` is a dict (str keys, kept in the given order) or a tuple of
    distributions, nested as the action space is; every part has the same batch
    shape. A sample is the parts' samples in their structure; ``log_prob`` is the sum
    of the parts', ``((l_0 + l_1) + l_2) ...`` in the given order, exactly that of
    :meth:`log_prob_parts`; :meth:`entropy` the sum of the parts' (exact where each
    part's is); the KL to another ``Composite`` of the same structure the sum of the
    parts' KLs (registered with TFP). It is a ``distrax.Joint``, whose other methods
    it keeps (``mean``, ``mode``, ...).

    The replay data is the parts' replay data in their structure (a squashed part's
    pre-image, a discrete part's action): :meth:`sample_with_replay` and
    :meth:`replay`, with :meth:`replay_parts` for each part's log-probability. Keys:
    see the module; ``sample``, ``sample_replay_data`` and ``sample_and_log_prob``
    draw each part from the same key.

    Args:
        parts: A dict of distributions with str keys, or a tuple (or list), nested.

    Raises:
        TypeError: ``parts`` is not a non-empty dict with str keys or tuple of
            distributions.
        ValueError: the parts' batch shapes differ.

    Example:
        >>> import jax, jax.numpy as jnp, samplers
        >>> dist = samplers.Composite({
        ...     "move": samplers.normal_tanh(jnp.zeros((8, 4))),
        ...     "fire": samplers.MaskedCategorical(jnp.zeros((8, 3))),
        ... })
        >>> action, data, log_prob = dist.sample_with_replay(seed=jax.random.key(0))
        >>> action["move"].shape, action["fire"].shape, log_prob.shape
        ((8, 2), (8,), (8,))
        >>> bool(jnp.all(dist.replay(data)[1] == log_prob))
        True
    """

    def __init__(self, parts: Any):
        self._spec = spec_of(parts, type(self).__name__)
        self._paths = tuple(paths(self._spec))
        flat = leaves(self._spec, parts, "parts", type(self).__name__)
        for path, part in zip(self._paths, flat, strict=True):
            if not isinstance(part, distrax.Distribution):
                raise TypeError(
                    f"{type(self).__name__}'s part {path_name(path)!r} must be a distrax "
                    f"distribution, got {type(part).__name__}; wrap a TFP distribution with "
                    f"distrax.as_distribution."
                )
        self._parts = flat
        super().__init__(build(self._spec, flat))

    @property
    def parts(self) -> Any:
        """The parts, in their structure (a dict keeps the given order)."""
        return build(self._spec, self._parts)

    def _map(self, function, *trees) -> Any:
        """``function(part, *leaves)`` for each part, in the parts' structure."""
        flat = [leaves(self._spec, tree, "value", type(self).__name__) for tree in trees]
        values = [function(part, *row) for part, *row in zip(self._parts, *flat, strict=True)]
        return build(self._spec, values)

    def _keys(self, seed) -> list:
        seed = _keys.integer_seed(seed)
        return _keys.part_keys(seed, list(self._paths))

    def _sample_n(self, key: PRNGKeyArray, n: int) -> Any:
        keys = build(self._spec, self._keys(key))
        return self._map(lambda part, k: part.sample(seed=k, sample_shape=n), keys)

    def _sample_n_and_log_prob(self, key: PRNGKeyArray, n: int) -> tuple[Any, Array]:
        samples = self._sample_n(key, n)
        return samples, self.log_prob(samples)

    def log_prob_parts(self, value: Any) -> Any:
        """Each part's ``log_prob`` of its part of ``value``, in the parts' structure."""
        return self._map(lambda part, v: jnp.asarray(part.log_prob(v)), value)

    def log_prob(self, value: Any) -> Array:
        """The sum of :meth:`log_prob_parts` in the parts' order."""
        return self._total(self.log_prob_parts(value))

    def _total(self, log_prob_parts: Any) -> Array:
        return ordered_sum(leaves(self._spec, log_prob_parts, "log_probs", type(self).__name__))

    def entropy(self) -> Array:
        """The sum of the parts' entropies, in the parts' order."""
        return ordered_sum([jnp.asarray(part.entropy()) for part in self._parts])

    def sample_replay_data(self, *, seed) -> Any:
        """Each part's replay data from its key (see the module)."""
        keys = self._keys(seed)
        data = [_replay.sample_replay_data(p, k) for p, k in zip(self._parts, keys, strict=True)]
        return build(self._spec, data)

    def deterministic_replay_data(self) -> Any:
        """Each part's deterministic replay data."""
        return build(self._spec, [_replay.deterministic_replay_data(p) for p in self._parts])

    def combine(self, action: Any, own_log_probs: Any) -> tuple[Any, Array]:
        """``(log_prob_parts, log_prob)`` from each part's own log-probability of ``action``.

        For a ``Composite`` the parts' own values and their sum in the parts' order;
        :class:`Parameterized` counts the chosen action's parameters alone.
        """
        del action
        return own_log_probs, self._total(own_log_probs)

    def _own(self, replay_data: Any) -> tuple[Any, Any]:
        """The parts' actions and own log-probabilities, replayed, in their structure."""
        pairs = self._map(_replay.replay, replay_data)
        flat = leaves(self._spec, pairs, "replay_data", type(self).__name__)
        own = [log_prob for _, log_prob in flat]
        return build(self._spec, [action for action, _ in flat]), build(self._spec, own)

    def replay_parts(self, replay_data: Any) -> tuple[Any, Any]:
        """``(action, log_prob_parts)``: each part's replay, combined as :meth:`combine` does."""
        action, own = self._own(replay_data)
        return action, self.combine(action, own)[0]

    def replay(self, replay_data: Any) -> tuple[Any, Array]:
        """The parts' actions and the log-probability that :meth:`combine` makes of theirs."""
        action, own = self._own(replay_data)
        return action, self.combine(action, own)[1]

    def check_replay_data(self, replay_data: Any, name: str = "replay data") -> Any:
        """The parts' checks of their data; refuses data not in the parts' structure."""
        flat = leaves(self._spec, replay_data, name, type(self).__name__)
        checked = [
            _replay.check_replay_data(part, data, f"{name}[{path_name(path)!r}]")
            for path, part, data in zip(self._paths, self._parts, flat, strict=True)
        ]
        return build(self._spec, checked)

    def __getitem__(self, index) -> "Composite":
        """Slices every part's batch shape."""
        return Composite(build(self._spec, [part[index] for part in self._parts]))


class Parameterized(Composite):
    """A choice among ``N`` discrete actions, each with continuous parameters of its own.

    ``choice`` is a :class:`samplers.MaskedCategorical` over ``N`` actions and
    ``parameters`` a tuple of ``N`` distributions, ``parameters[k]`` those of action
    ``k``. Every part is sampled (so that shapes are static), but only the chosen
    action's parameters count:

    - the action is ``{"choice": k, "parameters": (every part's action, ...)}``;
    - ``log_prob = log p(k) + log p(theta_k | k)``, the chosen part's picked with a
      one-hot ``where``, so the other parameters get exactly zero gradient (and their
      ``-inf`` or NaN never reaches the sum); :meth:`log_prob_parts` is
      ``{"choice": log p(k), "parameters": log p(theta_k | k)}``;
    - :meth:`entropy` is the joint entropy ``H(K) + sum_k p(k) H(theta_k)``, exact
      where the parts' are; a forbidden action (``p(k) = 0``) adds nothing;
    - the KL to another ``Parameterized`` is ``KL(choice) + sum_k p(k)
      KL(theta_k || theta'_k)``, registered with TFP.

    The replay data is ``{"choice": ..., "parameters": (...)}`` of the parts' data;
    keys as :class:`Composite` gives them.

    Args:
        choice: A :class:`samplers.MaskedCategorical` (or ``distrax.Categorical``)
            over ``N`` actions.
        parameters: ``N`` distributions with the choice's batch shape.

    Raises:
        TypeError: ``choice`` is not a Categorical, or ``parameters`` not a tuple.
        ValueError: ``len(parameters)`` is not the number of actions, or the batch
            shapes differ.

    Example:
        >>> import jax, jax.numpy as jnp, samplers
        >>> dist = samplers.Parameterized(
        ...     samplers.MaskedCategorical(jnp.zeros((4, 2)), jnp.array([[True, False]] * 4)),
        ...     (samplers.normal_tanh(jnp.zeros((4, 2))), samplers.normal_tanh(jnp.zeros((4, 4)))),
        ... )
        >>> action, data, log_prob = dist.sample_with_replay(seed=jax.random.key(0))
        >>> action["choice"], action["parameters"][1].shape
        (Array([0, 0, 0, 0], dtype=int32), (4, 2))
    """

    def __init__(self, choice: distrax.Categorical, parameters: Any):
        if not isinstance(choice, distrax.Categorical):
            raise TypeError(
                f"Parameterized's choice must be a samplers.MaskedCategorical, got "
                f"{type(choice).__name__}."
            )
        check_parameters("Parameterized", "distributions", choice.num_categories, parameters)
        super().__init__({"choice": choice, "parameters": tuple(parameters)})

    @property
    def choice(self) -> distrax.Categorical:
        """The distribution of the discrete action."""
        return self._parts[0]

    @property
    def parameters(self) -> tuple:
        """The distributions of each action's parameters."""
        return tuple(self._parts[1:])

    def _probs(self) -> Array:
        choice = self.choice
        if isinstance(choice, MaskedCategorical):
            return choice.probs
        return jax.nn.softmax(jnp.asarray(choice.logits), axis=-1)

    def _total(self, log_prob_parts: Any) -> Array:
        return ordered_sum([log_prob_parts["choice"], log_prob_parts["parameters"]])

    def _pick(self, choice: Array, log_probs: list[Array]) -> Array:
        """``log_probs[choice]`` per batch element, by a one-hot ``where``."""
        one_hot = jax.nn.one_hot(choice, len(log_probs), dtype=jnp.bool_)
        stacked = jnp.stack(log_probs, -1)
        return jnp.sum(jnp.where(one_hot, stacked, 0.0), axis=-1)

    def combine(self, action: Any, own_log_probs: Any) -> tuple[dict, Array]:
        """``({"choice": log p(k), "parameters": log p(theta_k | k)}, their sum)``."""
        choice = jnp.asarray(action["choice"])
        parts = {
            "choice": own_log_probs["choice"],
            "parameters": self._pick(choice, list(own_log_probs["parameters"])),
        }
        return parts, self._total(parts)

    def log_prob_parts(self, value: Any) -> dict:
        """``{"choice": log p(k), "parameters": log p(theta_k | k)}``."""
        return self.combine(value, super().log_prob_parts(value))[0]

    def entropy(self) -> Array:
        """``H(K) + sum_k p(k) H(theta_k)``."""
        entropies = jnp.stack([jnp.asarray(p.entropy()) for p in self.parameters], -1)
        return jnp.asarray(self.choice.entropy()) + self._expected(entropies)

    def _expected(self, values: Array) -> Array:
        """``sum_k p(k) values[..., k]``, where a forbidden action's value adds nothing."""
        probs = self._probs()
        return jnp.sum(jnp.where(probs > 0, probs * values, 0.0), axis=-1)

    def __getitem__(self, index) -> "Parameterized":
        return Parameterized(self.choice[index], tuple(p[index] for p in self.parameters))


def _composite_kl(p: Composite, q: Composite, *_, **__) -> Array:
    """The sum of the parts' KLs, in the parts' order; the structures must match."""
    if p._spec != q._spec:
        raise ValueError(
            f"p and q must have the same parts in the same structure, got {list(p._paths)} "
            f"and {list(q._paths)}."
        )
    kls = [jnp.asarray(a.kl_divergence(b)) for a, b in zip(p._parts, q._parts, strict=True)]
    if isinstance(p, Parameterized) and isinstance(q, Parameterized):
        return ordered_sum([kls[0], p._expected(jnp.stack(kls[1:], -1))])
    return ordered_sum(kls)


tfd.RegisterKL(Composite, Composite)(_composite_kl)
