"""Composite heads: one head per part of a structured action, sampled together.

:class:`CompositeSampler` runs a dict or tuple of heads on slices of one network
output (``Dict`` and ``Tuple`` action spaces); :class:`ParameterizedSampler`
chooses one of ``N`` discrete actions, each with continuous parameters of its own
(parameterised or hybrid action spaces). Both are heads themselves: they take the
call contract of every head and nest.

Streams: at construction a composite draws one key from its ``rngs`` and gives
each part its own stream, seeded by folding the part's path of names into that key
(``jax.random.fold_in(key, zlib.crc32(name.encode()))`` per name, a tuple's parts
named by their index ``str(i)``). The stream a part was built with is replaced, so
a part's noise depends on the composite's key and the part's name alone: adding or
removing another part (by name) changes none of it.
"""

import abc
import inspect
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, PRNGKeyArray

from samplers import _checks
from samplers.distributions.categorical import MaskedCategorical
from samplers.heads.action_sampler import ActionSampler, draw, stream
from samplers.heads.discrete import CategoricalSampler
from samplers.heads.module import StatefulModuleOutput

# A structure of parts: a dict (str keys) or tuple whose leaves are the parts'
# indices in call order, nested for ParameterizedSampler.
Spec = dict | tuple


class _Composite(ActionSampler):
    """What the composites share: parts at paths, their streams, states and calls."""

    _sizes: tuple[int, ...]

    @abc.abstractmethod
    def _spec(self) -> Spec:
        """The structure of the parts, each leaf the part's index in call order."""

    @abc.abstractmethod
    def _heads(self) -> list[Any]:
        """The parts in call order (the order their params are sliced in)."""

    @property
    def num_params(self) -> int:
        """The sum of the parts' ``num_params``: their slices of the network output."""
        return sum(self._sizes)

    def _setup(self, rngs, rng_collection: str, what: str) -> None:
        """Checks the parts, sizes their slices and gives each part its stream."""
        spec, heads = self._spec(), self._heads()
        paths = list(_paths(spec))
        sizes = []
        for path, head in zip(paths, heads, strict=True):
            sizes.append(_size(what, path, head))
        self._sizes = tuple(sizes)
        _refuse_shared(what, self._leaves())
        flags = {path: bool(head.per_env_streams) for path, head in zip(paths, heads, strict=True)}
        if len(set(flags.values())) > 1:
            on = [_name(p) for p, flag in flags.items() if flag]
            off = [_name(p) for p, flag in flags.items() if not flag]
            raise ValueError(
                f"{what} needs every part built with the same per_env_streams, got True for "
                f"{on} and False for {off}: the parts with a shared stream would draw "
                f"differently when the batch is split; build every part with "
                f"per_env_streams=True (or every part without)."
            )
        self.per_env_streams = next(iter(flags.values()))
        self._reseed(draw(stream(rngs, rng_collection), rng_collection))

    def _leaves(self) -> Iterator[tuple[tuple[str, ...], Any]]:
        """``(path, head)`` of every part, nested composites' parts included."""
        for path, head in zip(_paths(self._spec()), self._heads(), strict=True):
            if isinstance(head, _Composite):
                yield from (((*path, *inner), leaf) for inner, leaf in head._leaves())
            else:
                yield path, head

    def _reseed(self, key: PRNGKeyArray) -> None:
        """Gives each part the stream of its path under ``key`` (see the module)."""
        for path, head in zip(_paths(self._spec()), self._heads(), strict=True):
            part_key = key
            for name in path:
                part_key = jax.random.fold_in(part_key, zlib.crc32(name.encode()))
            if isinstance(head, _Composite):
                head._reseed(part_key)
            else:
                head.rng = nnx.Rngs(**{head.rng_collection: part_key})

    def initialize_state(self, batch_size: int) -> Any:
        """The parts' ``initialize_state(batch_size)``, in the parts' structure.

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> from samplers.heads.composite import CompositeSampler
            >>> from samplers.heads.discrete import CategoricalSampler
            >>> head = CompositeSampler(
            ...     {"a": CategoricalSampler(nnx.Rngs(0), 0.01, 3, per_env_streams=True)},
            ...     rngs=nnx.Rngs(0),
            ... )
            >>> head.initialize_state(4)["a"].shape
            (4,)
        """
        return _build(self._spec(), [head.initialize_state(batch_size) for head in self._heads()])

    def reset_state(self, prev_state: Any) -> Any:
        """The parts' ``reset_state`` of their states, in the parts' structure."""
        states = self._states(prev_state)
        heads = self._heads()
        return _build(self._spec(), [h.reset_state(s) for h, s in zip(heads, states, strict=True)])

    def _states(self, state) -> list:
        """The parts' states; ``()`` stands for every part's ``()``."""
        if isinstance(state, tuple) and not state:
            return [()] * len(self._sizes)
        return _split(self._spec(), state, "state", type(self).__name__)

    def _call_parts(
        self, state, params, rollout_extras, masks: list, deterministic: bool | None
    ) -> list[StatefulModuleOutput]:
        """Each part's output on its slice of ``params``, in call order."""
        params = _checks.float_array("params", params)
        if params.ndim < 1 or params.shape[-1] != self.num_params:
            raise ValueError(
                f"{type(self).__name__} expects params of shape [*batch, {self.num_params}] "
                f"(head.num_params, the parts' {list(self._sizes)} one after the other), got "
                f"{params.shape}; size the network's last layer to head.num_params."
            )
        spec, heads = self._spec(), self._heads()
        states = self._states(state)
        if rollout_extras is None:
            extras = [None] * len(heads)
        else:
            extras = _split(spec, rollout_extras, "rollout_extras", type(self).__name__)
        if deterministic is None and self.deterministic:
            deterministic = True
        outputs, start = [], 0
        for path, head, size, part_state, part_extras, mask in zip(
            _paths(spec), heads, self._sizes, states, extras, masks, strict=True
        ):
            options: dict[str, Any] = {"deterministic": deterministic}
            if mask is not None:
                if "mask" not in inspect.signature(head.__call__).parameters:
                    raise TypeError(
                        f"got a mask for part {_name(path)!r}, a {type(head).__name__}, which "
                        f"takes no mask; pass None for that part or leave it out."
                    )
                options["mask"] = mask
            part_params = params[..., start : start + size]
            out = head(part_state, part_params, part_extras, **options)
            _check_batch_shape(path, head, out, params.shape[:-1])
            outputs.append(out)
            start += size
        return outputs

    def _assemble(self, outputs, output: dict, regularization_loss) -> StatefulModuleOutput:
        """The output with the parts' states, metrics and extras in their structure."""
        spec = self._spec()
        metrics = {
            f"{_name(path)}/{name}": value
            for path, out in zip(_paths(spec), outputs, strict=True)
            for name, value in out.metrics.items()
        }
        return StatefulModuleOutput(
            next_state=_build(spec, [out.next_state for out in outputs]),
            output=output,
            regularization_loss=regularization_loss,
            metrics=metrics,
            rollout_extras=_build(spec, [out.rollout_extras for out in outputs]),
        )


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

    Streams: the composite draws one key from ``rngs`` and gives each part the
    stream ``jax.random.fold_in(key, zlib.crc32(name.encode()))`` (a tuple's name is
    ``str(i)``; a nested composite's parts fold in their own names in turn),
    replacing the stream the part was built with. A part's noise therefore does not
    change when another part is added or removed by name; in a tuple, removing a
    part renames the parts after it. The state is the parts' states in their
    structure (:meth:`initialize_state`); a call takes ``()`` for every part's
    ``()``. The parts must agree on ``per_env_streams``.

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
        >>> from samplers.heads.composite import CompositeSampler
        >>> from samplers.heads.discrete import CategoricalSampler
        >>> from samplers.heads.squashed_normal import SquashedNormalSampler
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
        if isinstance(parts, Mapping):
            bad = [key for key in parts if not isinstance(key, str)]
            if bad:
                raise TypeError(
                    f"CompositeSampler needs str keys (they name the parts' metrics and "
                    f"streams), got {bad!r}; use e.g. {{str(key): head}}."
                )
            self._names = tuple(parts)
            self._is_dict = True
            self.parts = nnx.data(dict(parts))
        elif isinstance(parts, (tuple, list)):
            self._names = tuple(str(i) for i in range(len(parts)))
            self._is_dict = False
            self.parts = nnx.data(tuple(parts))
        else:
            raise TypeError(
                f"CompositeSampler takes a dict or a tuple of heads, got "
                f"{type(parts).__name__}; pass e.g. {{'move': head_a, 'fire': head_b}}."
            )
        if not self._names:
            raise TypeError(
                "CompositeSampler needs at least one part, got none; pass a dict or tuple of heads."
            )
        self._setup(rngs, rng_collection, "CompositeSampler")

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

    def __call__(
        self,
        state: Any,
        params: Float[Array, "*batch params"],
        rollout_extras: Any = None,
        *,
        mask: Any = None,
        deterministic: bool | None = None,
    ) -> StatefulModuleOutput:
        """Samples every part, or replays the parts' stored extras.

        Args:
            state: ``()``, or the parts' states in their structure (with
                ``per_env_streams``, from :meth:`initialize_state` or the last
                call's ``next_state``).
            params: The network output, ``[*batch, num_params]``.
            rollout_extras: ``None`` to sample; the ``rollout_extras`` of an
                earlier call to replay it.
            mask: ``None``, or the parts' masks in their structure (see the class).
            deterministic: Passed to every part (see the class).

        Returns:
            ``output``: ``{"action", "log_likelihood", "log_likelihoods"}``;
            ``regularization_loss``, ``metrics``, ``rollout_extras`` and
            ``next_state`` as described in the class.

        Raises:
            ValueError: ``params``' last axis is not ``num_params``, or the state,
                extras or mask do not have the parts' structure.
            TypeError: ``params`` is not floating, or a part that takes no mask
                gets one; and what the parts raise.
        """
        outputs = self._call_parts(state, params, rollout_extras, self._masks(mask), deterministic)
        # The barrier keeps XLA from fusing a part's last step into the sum (a multiply
        # and an add into one FMA, say): the sum is exactly that of the values output.
        log_likelihoods = jax.lax.optimization_barrier(
            [out.output["log_likelihood"] for out in outputs]
        )
        log_likelihood = log_likelihoods[0]
        regularization_loss = outputs[0].regularization_loss
        for part_log_likelihood, out in zip(log_likelihoods[1:], outputs[1:], strict=True):
            log_likelihood = log_likelihood + part_log_likelihood
            regularization_loss = regularization_loss + out.regularization_loss
        spec = self._spec()
        output = {
            "action": _build(spec, [out.output["action"] for out in outputs]),
            "log_likelihood": log_likelihood,
            "log_likelihoods": _build(spec, log_likelihoods),
        }
        return self._assemble(outputs, output, regularization_loss)

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
        return _split(self._spec(), mask, "mask", "CompositeSampler")


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
    log-likelihood and from the entropy (its ``p(k)`` is 0). Streams, state,
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
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from samplers.heads.composite import ParameterizedSampler
        >>> from samplers.heads.discrete import CategoricalSampler
        >>> from samplers.heads.squashed_normal import SquashedNormalSampler
        >>> rngs = nnx.Rngs(0)
        >>> head = ParameterizedSampler(
        ...     CategoricalSampler(rngs, 0.01, num_actions=2),
        ...     (
        ...         SquashedNormalSampler(rngs, 0.01, action_dim=2),  # dash(power, direction)
        ...         SquashedNormalSampler(rngs, 0.01, action_dim=2),  # kick(power, direction)
        ...     ),
        ...     rngs=rngs,
        ... )
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
        if not isinstance(parameters, (tuple, list)):
            raise TypeError(
                f"parameters must be a tuple of heads, one per discrete action, got "
                f"{type(parameters).__name__}."
            )
        if len(parameters) != choice.num_actions:
            raise ValueError(
                f"ParameterizedSampler needs one parameter head per discrete action: the "
                f"choice has num_actions={choice.num_actions}, got {len(parameters)} "
                f"parameter heads; build the choice with num_actions={len(parameters)}."
            )
        self.choice = choice
        self.parameters = nnx.data(tuple(parameters))
        self._setup(rngs, rng_collection, "ParameterizedSampler")

    def _spec(self) -> Spec:
        return {"choice": 0, "parameters": tuple(range(1, len(self.parameters) + 1))}

    def _heads(self) -> list[Any]:
        return [self.choice, *self.parameters]

    def __call__(
        self,
        state: Any,
        params: Float[Array, "*batch params"],
        rollout_extras: Any = None,
        *,
        mask: Any = None,
        deterministic: bool | None = None,
    ) -> StatefulModuleOutput:
        """Samples a choice and every parameter head, or replays them.

        Args:
            state: ``()``, or ``{"choice": state, "parameters": (states, ...)}``.
            params: The network output, ``[*batch, num_params]``.
            rollout_extras: ``None`` to sample; the ``rollout_extras`` of an
                earlier call to replay it.
            mask: ``None``, or booleans ``[*batch, N]``, True where a discrete
                action is allowed.
            deterministic: Passed to every head (see :class:`CompositeSampler`).

        Returns:
            ``output``: ``{"action", "log_likelihood", "log_likelihoods"}``;
            ``regularization_loss``, ``metrics``, ``rollout_extras`` and
            ``next_state`` as described in the class.

        Raises:
            ValueError: ``params``' last axis is not ``num_params``, or the state
                or extras do not have the heads' structure; and what the heads
                raise.
        """
        masks = [mask] + [None] * len(self.parameters)
        outputs = self._call_parts(state, params, rollout_extras, masks, deterministic)
        choice, parts = outputs[0], outputs[1:]
        chosen = choice.output["action"]
        logits = params[..., : self._sizes[0]]
        probs = cast(MaskedCategorical, self.choice.distribution(logits, mask)).probs
        one_hot = jax.nn.one_hot(chosen, len(parts), dtype=jnp.bool_)
        part_log_likelihoods = jnp.stack([out.output["log_likelihood"] for out in parts], -1)
        # where, not a product: an unchosen head's -inf or NaN must not reach the sum.
        log_likelihood = jnp.sum(jnp.where(one_hot, part_log_likelihoods, 0.0), axis=-1)
        regularization_losses = jnp.stack([out.regularization_loss for out in parts], -1)
        # As in CompositeSampler: the sum is exactly that of the two values output.
        choice_log_likelihood, log_likelihood = jax.lax.optimization_barrier(
            (choice.output["log_likelihood"], log_likelihood)
        )
        output = {
            "action": {
                "choice": chosen,
                "parameters": tuple(out.output["action"] for out in parts),
            },
            "log_likelihood": choice_log_likelihood + log_likelihood,
            "log_likelihoods": {"choice": choice_log_likelihood, "parameters": log_likelihood},
        }
        regularization_loss = choice.regularization_loss + jnp.sum(
            probs * regularization_losses, axis=-1
        )
        return self._assemble(outputs, output, regularization_loss)


def _paths(spec: Spec, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The path of names of each leaf of ``spec``, in leaf order (a tuple's: ``str(i)``)."""
    items = spec.items() if isinstance(spec, dict) else enumerate(spec)
    for name, sub in items:
        path = (*prefix, str(name))
        if isinstance(sub, (dict, tuple)):
            yield from _paths(sub, path)
        else:
            yield path


def _build(spec: Spec, values: list) -> Any:
    """``spec`` with each leaf ``i`` replaced by ``values[i]``."""
    if isinstance(spec, dict):
        return {name: _build(sub, values) for name, sub in spec.items()}
    if isinstance(spec, tuple):
        return tuple(_build(sub, values) for sub in spec)
    return values[spec]


def _split(spec: Spec, value: Any, what: str, owner: str) -> list:
    """The leaves of ``value``, a structure like ``spec``, in leaf order."""
    leaves: list = [None] * len(list(_paths(spec)))

    def walk(spec, value, path):
        where = f"{what}[{_name(path)!r}]" if path else what
        if isinstance(spec, dict):
            if not isinstance(value, Mapping) or set(value) != set(spec):
                got = sorted(value, key=str) if isinstance(value, Mapping) else type(value).__name__
                raise ValueError(
                    f"{where} must be a dict with the keys {list(spec)} of {owner}'s parts, "
                    f"got {got}; pass the {what} in the parts' structure."
                )
            for name, sub in spec.items():
                walk(sub, value[name], (*path, name))
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
            leaves[spec] = value

    walk(spec, value, ())
    return leaves


def _name(path: tuple[str, ...]) -> str:
    return "/".join(path)


def _size(what: str, path: tuple[str, ...], head: Any) -> int:
    """Checks that ``head`` is a head with a ``num_params``, and returns it."""
    if not isinstance(head, ActionSampler):
        raise TypeError(
            f"{what}'s part {_name(path)!r} must be a policy head (a samplers.ActionSampler "
            f"with num_params), got {type(head).__name__}."
        )
    try:
        size = head.num_params  # pyright: ignore[reportAttributeAccessIssue]
    except AttributeError as error:
        raise ValueError(
            f"{what} slices the network output by each part's num_params, and part "
            f"{_name(path)!r} ({type(head).__name__}) has none ({error}); build the part "
            f"with its size (e.g. SquashedNormalSampler(..., action_dim=n)), or give a head "
            f"of your own a num_params."
        ) from None
    return _checks.positive_int(f"num_params of part {_name(path)!r}", size)


def _check_batch_shape(path, head, out: StatefulModuleOutput, batch_shape) -> None:
    """Refuses a part whose log-likelihood or loss is not one value per batch element:
    summed with the others, it would broadcast into a wrong sum."""
    for name, value in (
        ("log_likelihood", out.output["log_likelihood"]),
        ("regularization_loss", out.regularization_loss),
    ):
        if jnp.shape(value) != batch_shape:
            raise ValueError(
                f"part {_name(path)!r} ({type(head).__name__}) returned a {name} of shape "
                f"{jnp.shape(value)} for params of batch shape {batch_shape}; a head gives one "
                f"value per batch element, summed over its action's own axes."
            )


def _refuse_shared(what: str, leaves: Iterator[tuple[tuple[str, ...], Any]]) -> None:
    """Refuses a head that appears at two paths: one stream cannot be two parts'."""
    seen: dict[int, tuple[str, ...]] = {}
    for path, head in leaves:
        if id(head) in seen:
            raise TypeError(
                f"{what}'s parts {_name(seen[id(head)])!r} and {_name(path)!r} are the same "
                f"{type(head).__name__}; build one head per part."
            )
        seen[id(head)] = path
