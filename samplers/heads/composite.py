"""Composite heads: one head per part of a structured action, sampled together.

:class:`CompositeSampler` runs a dict or tuple of heads on slices of one network
output (``Dict`` and ``Tuple`` action spaces); :class:`ParameterizedSampler`
chooses one of ``N`` discrete actions, each with continuous parameters of its own
(parameterised or hybrid action spaces). Each is the shell of
:class:`samplers.ActionSampler` around a distribution of the pure layer
(:class:`samplers.Composite`, :class:`samplers.Parameterized`); each part adds its
own entropy cost and metrics. Both take the call contract of every head and nest.
"""

import abc
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array

from samplers import _checks
from samplers.distributions._keys import part_keys
from samplers.distributions.composite import (
    Composite,
    Parameterized,
    Spec,
    build,
    check_parameters,
    leaves,
    path_name,
    paths,
    spec_of,
)
from samplers.heads.action_sampler import ActionSampler, Scored
from samplers.heads.discrete import CategoricalSampler


class _Composite(ActionSampler):
    """What the composites share: parts at paths, their slices, keys and hooks."""

    takes_mask = True
    _sizes: tuple[int, ...]

    @abc.abstractmethod
    def _spec(self) -> Spec:
        """The structure of the parts, each leaf the part's index in call order."""

    @abc.abstractmethod
    def _heads(self) -> list[Any]:
        """The parts in call order (the order their inputs are sliced in)."""

    @abc.abstractmethod
    def _masks(self, mask: Any) -> list:
        """The parts' masks in call order."""

    @abc.abstractmethod
    def _joint(self, dists: list) -> Composite:
        """The distribution of the parts' distributions."""

    @property
    def num_params(self) -> int:
        """The sum of the parts' ``num_params``: their slices of the network output."""
        return sum(self._sizes)

    def _setup(self, rngs, rng_collection: str) -> None:
        """Checks the parts, sizes their slices and sets the stream."""
        what = type(self).__name__
        paths_ = list(paths(self._spec()))
        heads = self._heads()
        self._sizes = tuple(part_size(what, p, h) for p, h in zip(paths_, heads, strict=True))
        _refuse_shared(what, self._leaves())
        per_env_streams = _per_env_streams(what, paths_, heads)
        # Each part weighs its own entropy: the composite's weight is 0.
        super().__init__(rngs, 0.0, per_env_streams=per_env_streams, rng_collection=rng_collection)

    def _leaves(self) -> Iterator[tuple[tuple[str, ...], Any]]:
        """``(path, head)`` of every part, nested composites' parts included."""
        for path, head in zip(paths(self._spec()), self._heads(), strict=True):
            if isinstance(head, _Composite):
                yield from (((*path, *inner), leaf) for inner, leaf in head._leaves())
            else:
                yield path, head

    def _parts(self) -> list[tuple[tuple[str, ...], Any]]:
        return list(zip(paths(self._spec()), self._heads(), strict=True))

    def _slices(self, inputs) -> list[Array]:
        """Each part's slice of ``inputs``, in call order."""
        inputs = _checks.float_array("inputs", inputs)
        parts = f"head.num_params, the parts' {list(self._sizes)} one after the other"
        self._check_width(inputs, "inputs", parts)
        starts = [sum(self._sizes[:i]) for i in range(len(self._sizes))]
        return [inputs[..., a : a + n] for a, n in zip(starts, self._sizes, strict=True)]

    def _distribution(self, inputs, mask) -> Composite:
        dists = []
        for (path, head), part_inputs, part_mask in zip(
            self._parts(), self._slices(inputs), self._masks(mask), strict=True
        ):
            if part_mask is not None and not head.takes_mask:
                raise TypeError(
                    f"got a mask for part {path_name(path)!r}, a {type(head).__name__}, which "
                    f"takes no mask; pass None for that part or leave it out."
                )
            dists.append(head.distribution(part_inputs, part_mask))
        return self._joint(dists)

    def _split(self, value, what: str) -> list:
        return leaves(self._spec(), value, what, type(self).__name__)

    def _modes(self, deterministic: bool | None) -> list:
        if deterministic is None and self.deterministic:
            deterministic = True
        return [head._modes(deterministic) for head in self._heads()]

    def _entropy_needs_key(self) -> bool:
        return any(head._entropy_needs_key() for head in self._heads())

    def _part_keys(self, key) -> list:
        found = list(paths(self._spec()))
        return [None] * len(found) if key is None else part_keys(key, found)

    def _sample(self, inputs, dist, modes, key) -> Scored:
        rows = zip(
            self._heads(),
            self._slices(inputs),
            self._split(dist.parts, "parts"),
            modes,
            self._part_keys(key),
            strict=True,
        )
        return self._joined(dist, [h._sample(x, d, m, k) for h, x, d, m, k in rows])

    def _unpack(self, dist, rollout_extras) -> tuple[Any, list]:
        rows = zip(
            self._heads(),
            self._split(dist.parts, "parts"),
            self._split(rollout_extras, "rollout_extras"),
            strict=True,
        )
        unpacked = [head._unpack(d, extras) for head, d, extras in rows]
        return build(self._spec(), [data for data, _ in unpacked]), [old for _, old in unpacked]

    def _replay(self, dist, data) -> Scored:
        rows = zip(
            self._heads(), self._split(dist.parts, "parts"), self._split(data, "data"), strict=True
        )
        return self._joined(dist, [head._replay(d, x) for head, d, x in rows])

    def _joined(self, dist, parts: list[Scored]) -> Scored:
        """The parts' scorings as one, the parts' kept as ``extras``."""
        for (path, head), part in zip(self._parts(), parts, strict=True):
            _check_batch_shape(path, head, "log_likelihood", part.log_likelihood, dist.batch_shape)
        action = build(self._spec(), [part.action for part in parts])
        own = build(self._spec(), [part.log_likelihood for part in parts])
        log_likelihoods, log_likelihood = dist.combine(action, own)
        data = build(self._spec(), [part.data for part in parts])
        return Scored(data, action, log_likelihood, log_likelihoods, extras=parts)

    def _pack(self, scored: Scored) -> Any:
        rows = zip(self._heads(), scored.extras, strict=True)
        return build(self._spec(), [head._pack(part) for head, part in rows])

    def _part_costs(self, dist, key, scored: Scored) -> list[Array]:
        """Each part's entropy cost, from its own entropy and weight."""
        costs = []
        for (path, head), d, k, part in zip(
            self._parts(),
            self._split(dist.parts, "parts"),
            self._part_keys(key),
            scored.extras,
            strict=True,
        ):
            cost = head._regularization(d, k, part)
            _check_batch_shape(path, head, "regularization_loss", cost, dist.batch_shape)
            costs.append(cost)
        return costs

    def _metrics(self, inputs, dist, scored: Scored) -> dict:
        """The parts' metrics, keyed ``"name/metric"``."""
        olds = scored.old_log_likelihood or [None] * len(scored.extras)
        rows = zip(
            self._parts(),
            self._slices(inputs),
            self._split(dist.parts, "parts"),
            scored.extras,
            olds,
            strict=True,
        )
        return {
            f"{path_name(path)}/{key}": value
            for (path, head), x, d, part, old in rows
            for key, value in head._all_metrics(
                x, d, dataclasses.replace(part, old_log_likelihood=old)
            ).items()
        }


class CompositeSampler(_Composite):
    """One head per part of a structured action: a ``Dict`` or ``Tuple`` action space.

    ``parts`` is a dict (str keys, in the given order) or a tuple of heads, each
    with ``num_params``: any head of this library (``SquashedNormalSampler`` needs
    ``action_dim``), or a composite. The network output ``params``,
    ``[*batch, num_params]``, is sliced along its last axis by the parts'
    ``num_params`` in the parts' order (a dict's order as given, not sorted); the
    parts are independent, so the log-likelihood is the sum of theirs.

    Output: ``{"action": the parts' actions in their structure, "log_likelihood":
    their sum [*batch], "log_likelihoods": each part's [*batch]}``; the sum is taken
    in the parts' order, ``((l_0 + l_1) + l_2) ...``, and is exactly that of the
    ``log_likelihoods`` output. Each part's values are those of the part alone called
    with the stream the composite gave it (see Streams). ``regularization_loss`` is the
    sum of the parts' in the same order, each part's from its own ``entropy_weight``
    and entropy: exact for the discrete heads (over the allowed actions) and for a
    squashed head built with ``entropy="exact"`` (bounded squashings) or ``"base"`` (an
    unsquashed Normal); a one-sample estimate for a squashed head's default
    ``"sample"``.
    ``metrics`` are the parts', keyed ``"name/metric"`` (a tuple's ``"0/metric"``).
    ``rollout_extras`` and ``next_state`` are the parts' in their structure; a replay
    of the extras scores every part's stored action, reproducing each part's
    log-likelihood bit for bit for the same params and batch shape.

    ``mask`` is a dict (or tuple) in the parts' structure: a dict may leave out
    parts, a tuple needs one entry per part, and ``None`` for a part means no mask.
    A mask for a part whose head takes none is refused.

    ``deterministic``: ``module.eval()`` and ``module.train()`` reach every part
    (nnx sets the flag on every nested module). A call's ``deterministic=`` is passed
    to every part; with ``None``, the composite's own flag when it is True, else each
    part's own (so ``head.parts["a"].eval()`` makes that part alone deterministic).

    The distribution is a :class:`samplers.Composite` of the parts' distributions
    (:meth:`distribution`), and the call is :class:`samplers.ActionSampler`'s. Keys:
    the composite draws from its own stream (``rngs``) as every head does, and gives
    each part the key ``jax.random.fold_in(key, zlib.crc32(name.encode()))`` for its
    name (a tuple's name is ``str(i)``; a nested composite's parts fold in their
    own names in turn); the streams the parts were built with are not used. A
    part's noise therefore does not change when another part is added or removed
    by name; in a tuple, removing a part renames the parts after it. The parts must
    agree on ``per_env_streams``; with it, the state is one key per environment, as
    for any head.

    Args:
        parts: A dict of heads with str keys, or a tuple (or list) of heads.
        rngs: The ``nnx.Rngs`` whose ``rng_collection`` stream (else ``default``)
            gives the key, or one ``nnx.RngStream``.
        rng_collection: The stream the key is drawn from, ``"action"`` as the heads'.

    Raises:
        TypeError: ``parts`` is not a non-empty dict with str keys or a tuple of
            heads, or a part is not a head or is given twice.
        ValueError: a part has no ``num_params``, the parts differ in
            ``per_env_streams``, or the ``nnx.Rngs`` has no stream to draw from.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from samplers import CategoricalSampler, CompositeSampler, SquashedNormalSampler
        >>> rngs = nnx.Rngs(0)
        >>> head = CompositeSampler(
        ...     {
        ...         "move": SquashedNormalSampler(rngs, 0.01, action_dim=2),
        ...         "fire": CategoricalSampler(rngs, 0.01, num_actions=2),
        ...     },
        ...     rngs=rngs,
        ... )
        >>> out = head((), jnp.zeros((8, head.num_params)), mask={"fire": jnp.ones((8, 2), bool)})
        >>> head.num_params, out.output["action"]["move"].shape, out.output["action"]["fire"].shape
        (6, (8, 2), (8,))
        >>> again = head((), jnp.zeros((8, 6)), out.rollout_extras)
        >>> bool(jnp.all(again.output["log_likelihood"] == out.output["log_likelihood"]))
        True
    """

    def __init__(
        self,
        parts: Mapping[str, Any] | Sequence[Any],
        *,
        rngs: Any,
        rng_collection: str = "action",
    ):
        if not isinstance(parts, (Mapping, tuple, list)):
            raise TypeError(
                f"CompositeSampler takes a dict or a tuple of heads, got "
                f"{type(parts).__name__}; pass e.g. {{'move': head_a, 'fire': head_b}}."
            )
        spec_of(parts, "CompositeSampler")  # str keys, no empty level
        if isinstance(parts, Mapping):
            self._names = tuple(parts)
            self._is_dict = True
            self.parts = nnx.data(dict(parts))
        else:
            self._names = tuple(str(i) for i in range(len(parts)))
            self._is_dict = False
            self.parts = nnx.data(tuple(parts))
        self._setup(rngs, rng_collection)

    def _spec(self) -> Spec:
        if self._is_dict:
            return {name: i for i, name in enumerate(self._names)}
        return tuple(range(len(self._names)))

    def _heads(self) -> list[Any]:
        if self._is_dict:
            # Looked up by name: nnx hands a module's dicts back with sorted keys.
            parts = cast(dict, self.parts)
            return [parts[name] for name in self._names]
        return list(self.parts)

    def _joint(self, dists: list) -> Composite:
        return Composite(build(self._spec(), dists))

    def _masks(self, mask) -> list:
        """The parts' masks in call order; a dict may leave parts out."""
        if mask is None:
            return [None] * len(self._names)
        if self._is_dict and isinstance(mask, Mapping):
            unknown = sorted(set(mask) - set(self._names), key=str)
            if unknown:
                raise ValueError(
                    f"mask has keys {unknown} that are no parts of this CompositeSampler "
                    f"(its parts: {list(self._names)}); key each mask by its part's name."
                )
            mask = {name: mask.get(name) for name in self._names}
        return self._split(mask, "mask")

    def _regularization(self, dist, key, scored: Scored) -> Array:
        costs = self._part_costs(dist, key, scored)
        total = costs[0]
        for cost in costs[1:]:
            total = total + cost
        return total


class ParameterizedSampler(_Composite):
    """A choice among ``N`` discrete actions, each with continuous parameters of its own.

    ``choice`` is a :class:`CategoricalSampler` with ``num_actions == N`` and
    ``parameters`` a tuple of ``N`` heads, ``parameters[k]`` for the parameters of
    action ``k`` (any head with ``num_params``, composites included). The network
    output ``[*batch, num_params]`` is ``[choice logits | parameters[0]'s |
    parameters[1]'s | ...]``. Every parameter head samples (so that shapes are
    static), but only the chosen action's parameters count:

    - action: ``{"choice": k [*batch], "parameters": (every parameter head's
      action, ...)}``; the environment uses ``parameters[k]``;
    - ``log_likelihood = log p(k) + log p(theta_k | k)``, the chosen head's
      log-likelihood picked with a one-hot ``where``, so the other parameter heads
      get exactly zero gradient from it; ``log_likelihoods`` is
      ``{"choice": log p(k), "parameters": log p(theta_k | k)}``;
    - ``regularization_loss = choice's + sum_k p(k) * parameters[k]'s``, with
      ``p(k)`` the choice's (masked) probabilities, gradient kept. When every head
      has entropy weight ``w`` and an exact entropy, this is ``-w * H(K,
      theta_K)`` with the joint entropy ``H(K, theta_K) = H(K) + sum_k p(k)
      H(theta_k)``; a head with an estimated entropy (a squashed head's default
      ``"sample"``) puts its estimate in place of ``H(theta_k)``.

    ``mask`` (booleans ``[*batch, N]``) applies to the choice: a forbidden action is
    never chosen, and its parameter head gets exactly zero gradient from the
    log-likelihood and from the entropy (its ``p(k)`` is 0). The distribution is a
    :class:`samplers.Parameterized` (:meth:`distribution`). Keys, state,
    ``deterministic``, metrics (``"choice/metric"``, ``"parameters/0/metric"``)
    and replay are those of :class:`CompositeSampler`, for the parts
    ``{"choice": choice, "parameters": (...)}``.

    Args:
        choice: The :class:`CategoricalSampler` of the discrete action.
        parameters: One head per discrete action, a tuple (or list).
        rngs: As in :class:`CompositeSampler`.
        rng_collection: As in :class:`CompositeSampler`.

    Raises:
        TypeError: ``choice`` is not a :class:`CategoricalSampler`, or a parameter
            head is not a head or is given twice.
        ValueError: ``len(parameters)`` is not ``choice.num_actions``, a head has no
            ``num_params``, or the heads differ in ``per_env_streams``.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> rngs = nnx.Rngs(0)
        >>> dash, kick = (samplers.SquashedNormalSampler(rngs, 0.01, action_dim=2) for _ in "dk")
        >>> choice = samplers.CategoricalSampler(rngs, 0.01, num_actions=2)
        >>> head = samplers.ParameterizedSampler(choice, (dash, kick), rngs=rngs)
        >>> out = head((), jnp.zeros((8, head.num_params)), mask=jnp.array([[True, False]] * 8))
        >>> head.num_params, out.output["action"]["choice"]
        (10, Array([0, 0, 0, 0, 0, 0, 0, 0], dtype=int32))
    """

    def __init__(
        self,
        choice: CategoricalSampler,
        parameters: Sequence[Any],
        *,
        rngs: Any,
        rng_collection: str = "action",
    ):
        if not isinstance(choice, CategoricalSampler):
            raise TypeError(
                f"ParameterizedSampler's choice must be a CategoricalSampler, got "
                f"{type(choice).__name__}; pass CategoricalSampler(rngs, entropy_weight, "
                f"num_actions=len(parameters))."
            )
        check_parameters("ParameterizedSampler", "heads", choice.num_actions, parameters)
        self.choice = choice
        self.parameters = nnx.data(tuple(parameters))
        self._setup(rngs, rng_collection)

    def _spec(self) -> Spec:
        return {"choice": 0, "parameters": tuple(range(1, len(self.parameters) + 1))}

    def _heads(self) -> list[Any]:
        return [self.choice, *self.parameters]

    def _joint(self, dists: list) -> Parameterized:
        return Parameterized(dists[0], tuple(dists[1:]))

    def _masks(self, mask) -> list:
        return [mask] + [None] * len(self.parameters)

    def _regularization(self, dist: Parameterized, key, scored: Scored) -> Array:
        choice, *parameters = self._part_costs(dist, key, scored)
        probs = dist.choice.probs
        return choice + jnp.sum(probs * jnp.stack(parameters, -1), axis=-1)


def part_size(what: str, path: tuple[str, ...], head: Any) -> int:
    """Checks that ``head`` is a head with a ``num_params``, and returns it."""
    if not isinstance(head, ActionSampler):
        raise TypeError(
            f"{what}'s part {path_name(path)!r} must be a policy head (a samplers.ActionSampler "
            f"with num_params), got {type(head).__name__}."
        )
    try:
        size = head.num_params
    except AttributeError as error:
        raise ValueError(
            f"{what} slices the network output by each part's num_params, and part "
            f"{path_name(path)!r} ({type(head).__name__}) has none ({error}); build the part "
            f"with its size (e.g. SquashedNormalSampler(..., action_dim=n)), or give a head "
            f"of your own a num_params."
        ) from None
    return _checks.positive_int(f"num_params of part {path_name(path)!r}", size)


def _check_batch_shape(path, head, what: str, value, batch_shape) -> None:
    """Refuses a part whose log-likelihood or loss is not one value per batch element:
    summed with the others, it would broadcast into a wrong sum."""
    if jnp.shape(value) != tuple(batch_shape):
        raise ValueError(
            f"part {path_name(path)!r} ({type(head).__name__}) returned a {what} of shape "
            f"{jnp.shape(value)} for inputs of batch shape {tuple(batch_shape)}; a head gives "
            f"one value per batch element, summed over its action's own axes."
        )


def _per_env_streams(what: str, paths_: list, heads: list) -> bool:
    """The parts' ``per_env_streams``, refused unless every part has the same."""
    flags = {p: bool(h.per_env_streams) for p, h in zip(paths_, heads, strict=True)}
    if len(set(flags.values())) > 1:
        on = [path_name(p) for p, flag in flags.items() if flag]
        off = [path_name(p) for p, flag in flags.items() if not flag]
        raise ValueError(
            f"{what} needs every part built with the same per_env_streams, got True for "
            f"{on} and False for {off}: the parts with a shared stream would draw "
            f"differently when the batch is split; build every part with "
            f"per_env_streams=True (or every part without)."
        )
    return next(iter(flags.values()))


def _refuse_shared(what: str, leaves_: Iterator[tuple[tuple[str, ...], Any]]) -> None:
    """Refuses a head that appears at two paths: one head cannot be two parts."""
    seen: dict[int, tuple[str, ...]] = {}
    for path, head in leaves_:
        if id(head) in seen:
            raise TypeError(
                f"{what}'s parts {path_name(seen[id(head)])!r} and {path_name(path)!r} are "
                f"the same {type(head).__name__}; build one head per part."
            )
        seen[id(head)] = path
