"""The autoregressive head: sub-actions in order, each conditioned on the earlier ones.

:class:`AutoregressiveSampler` is the shell of :class:`samplers.ActionSampler` around
a :class:`samplers.Autoregressive` distribution whose steps are small NNX
conditioners, owned by the head: each maps the network's features and the earlier
sub-actions to the parameters of one sub-action's head.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

import distrax
import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from samplers import _checks
from samplers.distributions import replay
from samplers.distributions.autoregressive import Autoregressive, support
from samplers.distributions.bijectors import squashing
from samplers.distributions.composite import Composite, leaves, ordered_sum, spec_of
from samplers.distributions.discrete import MultiBinary, MultiDiscrete
from samplers.heads.action_sampler import ActionSampler
from samplers.heads.composite import part_size


class _Conditioner(nnx.Module):
    """The default conditioner: ``Linear -> tanh -> Linear``, the last layer scaled by
    0.01 at initialisation so that every sub-action starts near its head's zero input."""

    def __init__(self, in_features: int, out_features: int, rngs: nnx.Rngs, hidden: int = 64):
        self.hidden = nnx.Linear(in_features, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, out_features, rngs=rngs)
        self.out.kernel[...] = 0.01 * self.out.kernel[...]

    def __call__(self, x: Float[Array, "*batch features"]) -> Float[Array, "*batch params"]:
        return self.out(jnp.tanh(self.hidden(x)))


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


class AutoregressiveSampler(ActionSampler):
    """Sub-actions in order, each conditioned on the network features and the earlier ones.

    ``steps`` maps each sub-action's name, in order, to the head that turns its
    parameters into its distribution: any head of this library with
    ``num_params`` (a masked discrete head, a squashed Normal with ``action_dim``, a
    Beta, a composite). The network output ``inputs`` is a feature vector ``[*batch,
    features]``; sub-action ``k``'s parameters are ``conditioners[k](concat(features,
    e_1, ..., e_{k-1}))``, where ``e_j`` is the embedding of sub-action ``j``'s
    replay data:

    - a discrete sub-action: one-hot (one per sub-action of a ``MultiDiscrete``,
      the bits of a ``MultiBinary``); the conditioner's first linear layer makes it a
      learned embedding (one column per choice);
    - a squashed one: ``tanh(x / k)`` of its pre-image ``x``, the action rescaled to
      ``[-1, 1]`` (``k`` its squashing's pre-image scale; an unsquashed one: ``x``);
    - a composite: its parts' embeddings, concatenated in the parts' order.

    Because the conditioners read the stored data, not the actions computed from it,
    a replay builds every sub-action's distribution at once (teacher forcing), with
    no sequential loop, and reproduces the rollout's log-likelihood bit for bit for
    the same inputs, masks and batch shape.

    Output: ``{"action": {name: ...}, "log_likelihood": the sum [*batch],
    "log_likelihoods": {name: log p(a_k | a_<k)}}``; ``rollout_extras`` the
    sub-actions' replay data by name. ``mask`` is a dict by sub-action name; each
    entry an array for that sub-action's head, of its shape at the batch shape of
    the features (refused otherwise, a ``[1, n]`` mask included), or a function of
    the earlier sub-actions' replay data (a dict by name; a discrete one's is its
    action) that returns it, e.g. ``lambda prefix: legal_targets_of[prefix["unit"]]``,
    or a :class:`MaskTable`, the same as arrays that a rollout can store. A function
    sees batch-shaped prefixes ``[*batch]`` only: the exact entropy maps it with
    ``jax.vmap`` over the prefixes it enumerates. For a per-state table ``legal``
    ``[B, units, targets]``, ``legal[jnp.arange(B), prefix["unit"]]`` is the gather
    that also works in a step of :class:`samplers.Autoregressive`, which sees the
    prefixes stacked, ``[P, B]``.
    ``deterministic`` (``eval()``) takes each sub-action's deterministic action given
    the earlier ones (a discrete one's most probable choice, a squashed Normal's
    ``f(mean)``): greedy decoding, not the joint mode.

    The entropy cost is ``-entropy_weight * H``: with ``entropy="exact"`` the joint
    entropy ``sum_k E[H(a_k | a_<k)]``, every prefix of the sub-actions before the
    last enumerated (they must be discrete, at most ``max_prefixes`` prefixes);
    with ``"along_sample"`` the sum of the exact conditional entropies along the
    sampled (rollout) or stored (replay) prefix, an estimate unbiased for a fresh
    sample, drawing no key (see :meth:`samplers.Autoregressive.entropy_along`). Metrics:
    ``"<name>/log_likelihood"`` and ``"<name>/entropy"`` (the conditional entropy
    along the prefix) per sub-action.

    The step heads give only their distribution: the stream, the entropy weight,
    ``deterministic``, ``reparameterized``, ``per_env_streams`` and
    ``rng_collection`` are this head's, and a step head (or a part of one) that sets
    one of them to another value than its default or this head's is refused: an
    entropy weight per sub-action would otherwise vanish without a word. The step
    heads' own streams are never drawn from (pass them this head's ``rngs``). Keys
    are drawn as by every head and given to each sub-action by its name, as
    :class:`CompositeSampler` gives its parts theirs.

    Args:
        steps: The sub-actions' heads by name, in order.
        features: The width of the network output.
        entropy_weight: Weight of the entropy bonus.
        rngs: The stream, and the conditioners' initial parameters.
        conditioners: Optional modules by name, each mapping ``[*, features +
            embeddings so far]`` to ``[*, steps[name].num_params]``; the others are a
            ``Linear -> tanh -> Linear`` of width ``hidden``, its last layer
            scaled by 0.01 at initialisation (every sub-action starts near its head's
            zero input). A conditioner sees ``[*batch, in]`` in the rollout and the
            replay, and the prefixes stacked in front, ``[P, *batch, in]``, in the
            exact entropy: it must act on the last axis alone, as ``nnx.Linear``
            does; one written for 2-D inputs flattens and restores the leading
            axes, ``f(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)``.
        hidden: The default conditioners' hidden width.
        entropy: ``"exact"`` or ``"along_sample"``.
        max_prefixes: The most prefixes the exact entropy enumerates.
        reparameterized: If True, a fresh sample keeps its pathwise gradient (through
            the later sub-actions' conditioning too).
        per_env_streams: One key per environment in the state.
        rng_collection: The stream the keys are drawn from.

    Raises:
        TypeError: ``steps`` is not a non-empty dict of heads, or an option is of the
            wrong kind; at the call, an array mask of a wrong dtype.
        ValueError: ``entropy="exact"`` with a sub-action before the last that is not
            discrete or too many prefixes, an unknown ``entropy``, or a step head
            with an option of its own (above); at the call, an array mask of a wrong
            shape, or a :class:`MaskTable` indexed by a sub-action that is not an
            earlier categorical one, or whose table's axes do not match.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> rngs = nnx.Rngs(0)
        >>> head = samplers.AutoregressiveSampler(
        ...     {"unit": samplers.CategoricalSampler(rngs, 0.0, num_actions=2),
        ...      "target": samplers.CategoricalSampler(rngs, 0.0, num_actions=3)},
        ...     features=8, entropy_weight=0.01, rngs=rngs,
        ... )
        >>> legal = jnp.array([[True, False, False], [True, True, True]])  # unit 0 waits
        >>> mask = {"target": lambda prefix: legal[prefix["unit"]]}
        >>> out = head((), jnp.ones((4, 8)), mask=mask)
        >>> again = head((), jnp.ones((4, 8)), out.rollout_extras, mask=mask)
        >>> bool(jnp.all(again.output["log_likelihood"] == out.output["log_likelihood"]))
        True
    """

    takes_mask = True

    def __init__(
        self,
        steps: Mapping[str, ActionSampler],
        *,
        features: int,
        entropy_weight: float,
        rngs: nnx.Rngs,
        conditioners: Mapping[str, Callable] | None = None,
        hidden: int = 64,
        entropy: Literal["exact", "along_sample"] = "exact",
        max_prefixes: int = 4096,
        reparameterized: bool = False,
        per_env_streams: bool = False,
        rng_collection: str = "action",
    ):
        if not isinstance(steps, Mapping) or not steps or not all(map(_is_str, steps)):
            raise TypeError(
                f"AutoregressiveSampler takes a non-empty dict of heads by sub-action name, "
                f"got {type(steps).__name__}; pass e.g. {{'unit': head_a, 'target': head_b}}."
            )
        self.features = _checks.positive_int("features", features)
        self.entropy_weight = _checks.real_number("entropy_weight", entropy_weight)
        if entropy not in ("exact", "along_sample"):
            raise ValueError(f"entropy must be 'exact' or 'along_sample', got {entropy!r}.")
        self.entropy = entropy
        self.max_prefixes = _checks.positive_int("max_prefixes", max_prefixes)
        self.reparameterized = bool(reparameterized)
        self._names = tuple(steps)
        self.steps = nnx.data(dict(steps))
        self._sizes = tuple(part_size("AutoregressiveSampler", (n,), steps[n]) for n in self._names)
        # Each sub-action's embedding of its replay data, and the number of values it
        # takes (None: not discrete), from its head's distribution.
        kinds = [_kind(steps[n], size) for n, size in self._steps()]
        self._embedders = tuple(embed for embed, _, _ in kinds)
        self._supports = tuple(count for _, _, count in kinds)
        # A categorical sub-action: discrete, one value per batch element.
        self._categorical = tuple(n is not None and d.ndim == 1 for _, d, n in kinds)
        widths = [jax.eval_shape(embed, data).shape[-1] for embed, data, _ in kinds]
        conditioners = dict(conditioners or {})
        unknown = sorted(set(conditioners) - set(self._names))
        if unknown:
            raise ValueError(
                f"conditioners has names {unknown} that are no sub-actions {list(self._names)}."
            )
        self.conditioners = nnx.data(
            {
                name: conditioners.get(name)
                or _Conditioner(self.features + sum(widths[:k]), size, rngs, hidden)
                for k, (name, size) in enumerate(self._steps())
            }
        )
        self._init_stream(rngs, rng_collection, per_env_streams)
        self._check_steps(_STEP_OPTIONS)
        if entropy == "exact":
            self._check_enumerable()

    def _steps(self) -> list[tuple[str, int]]:
        return list(zip(self._names, self._sizes, strict=True))

    @property
    def num_params(self) -> int:
        """``features``: the width of the network output."""
        return self.features

    def _check_steps(self, options) -> None:
        """Refuses a step head, or a part of one, whose ``options`` this head would
        ignore: each must be its default or this head's (``deterministic``: this
        head's, which ``eval()`` and ``train()`` set on the steps too)."""
        for name, step in self.steps.items():
            for path, module in nnx.iter_graph(step):
                if not isinstance(module, ActionSampler):
                    continue
                for option in options:
                    value, own, default = (
                        getattr(x, option) for x in (module, self, ActionSampler)
                    )
                    if value != own and (option == "deterministic" or value != default):
                        fix = _STEP_OPTIONS[option] or (
                            f"build the step head with {option}={default!r} and pass "
                            f"{option} to the AutoregressiveSampler"
                        )
                        raise ValueError(
                            f"the step head {'/'.join((name, *map(str, path)))!r} "
                            f"({type(module).__name__}) has {option}={value!r}, which "
                            f"AutoregressiveSampler ignores (it uses its own, {own!r}, for "
                            f"every sub-action); {fix}."
                        )

    def _modes(self, deterministic: bool | None) -> Any:
        self._check_steps(("deterministic",))
        return super()._modes(deterministic)

    def _check_enumerable(self) -> None:
        """Refuses ``entropy="exact"`` where it cannot be computed."""
        count = 1
        for name, values in zip(self._names[:-1], self._supports[:-1], strict=True):
            if values is None:
                raise ValueError(
                    f"entropy='exact' enumerates the sub-actions before the last, and "
                    f"{name!r} ({type(self.steps[name]).__name__}) is not discrete (a "
                    f"categorical, multi-discrete or multi-binary head); pass "
                    f"entropy='along_sample', or make it the last sub-action."
                )
            count *= values
        if count > self.max_prefixes:
            raise ValueError(
                f"entropy='exact' would enumerate {count} prefixes, more than "
                f"max_prefixes={self.max_prefixes}; pass entropy='along_sample' or a larger "
                f"max_prefixes."
            )

    def _distribution(self, inputs, mask) -> Autoregressive:
        features = _checks.float_parameters("inputs", inputs)
        self._check_width(features, "features", "head.num_params, the features")
        batch = features.shape[:-1]
        masks = self._masks(mask, batch)
        steps = {
            name: self._step(k, features, masks[k], batch) for k, name in enumerate(self._names)
        }
        return Autoregressive(steps, max_prefixes=self.max_prefixes)

    def _step(self, k: int, features, mask, batch):
        name = self._names[k]
        head, conditioner = self.steps[name], self.conditioners[name]
        earlier = self._names[:k]

        def step(prefix: dict) -> distrax.Distribution:
            embeddings = [self._embedders[j](prefix[n]) for j, n in enumerate(earlier)]
            lead = embeddings[0].shape[:-1] if embeddings else batch
            x = jnp.broadcast_to(features, (*lead, features.shape[-1]))
            x = jnp.concatenate([x, *(e.astype(x.dtype) for e in embeddings)], -1)
            part_mask = mask
            if callable(mask):  # prefixes stacked in front of the batch are mapped over
                part_mask = jax.vmap(mask)(prefix) if len(lead) > len(batch) else mask(prefix)
            elif mask is not None:
                part_mask = jnp.broadcast_to(mask, (*lead, *jnp.shape(mask)[len(batch) :]))
            return head.distribution(conditioner(x), part_mask)

        return step

    def _masks(self, mask, batch: tuple[int, ...]) -> list:
        if mask is None:
            return [None] * len(self._names)
        if not isinstance(mask, Mapping):
            raise TypeError(
                f"AutoregressiveSampler's mask is a dict by sub-action name, got "
                f"{type(mask).__name__}; pass e.g. {{'target': legal_targets}}."
            )
        unknown = sorted(set(mask) - set(self._names))
        if unknown:
            raise ValueError(
                f"mask has names {unknown} that are no sub-actions {list(self._names)}."
            )
        for k, name in enumerate(self._names):
            if isinstance(mask.get(name), MaskTable):
                self._check_table(k, mask[name], batch)
            elif mask.get(name) is not None and not callable(mask[name]):
                self._check_array_mask(k, mask[name], batch)
        return [mask.get(name) for name in self._names]

    def _check_array_mask(self, k: int, mask, batch: tuple[int, ...]) -> None:
        """Refuses an array mask that sub-action ``k``'s head refuses at ``batch``
        (it would otherwise be broadcast over the prefixes, or fail inside JAX)."""
        name = self._names[k]
        head = self.steps[name]
        inputs = jax.ShapeDtypeStruct((*batch, self._sizes[k]), jnp.float32)
        try:
            jax.eval_shape(lambda x: head.distribution(x, mask), inputs)
        except (TypeError, ValueError) as error:
            raise type(error)(
                f"mask[{name!r}], the mask of sub-action {name!r} ({type(head).__name__}) "
                f"at the features' batch shape {batch}, is refused: {error}"
            ) from None

    def _check_table(self, k: int, table: MaskTable, batch: tuple[int, ...]) -> None:
        """Refuses a table indexed by what is not an earlier categorical sub-action,
        or whose axes after the batch are not those sub-actions' numbers of choices."""
        counts = []
        for name in table.names:
            j = self._names.index(name) if name in self._names else len(self._names)
            if j >= k or not self._categorical[j]:
                raise ValueError(
                    f"the MaskTable of {self._names[k]!r} is indexed by {name!r}, which is "
                    f"not a categorical sub-action before it (those are "
                    f"{[n for i, n in enumerate(self._names[:k]) if self._categorical[i]]})."
                )
            counts.append(self._supports[j])
        shape = jnp.shape(table.table)
        found = shape[len(batch) : len(batch) + len(counts)]
        if shape[: len(batch)] != batch or list(found) != counts:
            raise ValueError(
                f"the MaskTable of {self._names[k]!r} has shape {shape}; it needs the "
                f"batch shape {batch}, then {counts} (the choices of {list(table.names)}), "
                f"then the mask's shape."
            )

    def _replay(self, dist: Autoregressive, data) -> tuple[dict, dict]:
        action, log_likelihoods = dist.replay_parts(data)
        output = {
            "action": action,
            "log_likelihood": ordered_sum(list(log_likelihoods.values())),
            "log_likelihoods": log_likelihoods,
        }
        return output, dist.conditional_entropies(data)

    def _regularization(self, dist: Autoregressive, key, data) -> Array:
        if self.entropy == "exact":
            return -self.entropy_weight * dist.entropy()
        return -self.entropy_weight * dist.entropy_along(data)

    def _metrics(self, inputs, dist, output, own, old_log_likelihood) -> dict:
        """Each sub-action's log-likelihood and conditional entropy along the prefix."""
        metrics = {}
        for name in self._names:
            metrics[f"{name}/log_likelihood"] = output["log_likelihoods"][name]
            metrics[f"{name}/entropy"] = own[name]
        return metrics


# The options a step head leaves to this head, and the fix where it is not the
# default one (build the step head with the default, pass the option to this head).
_STEP_OPTIONS = {
    "entropy_weight": (
        "build the step head with entropy_weight=0.0: this head weighs the joint entropy, "
        "one weight for every sub-action; for a weight per sub-action, build this head "
        "with entropy_weight=0.0 and add -weight * out.metrics['<name>/entropy'] (the "
        "conditional entropy along the prefix) to the loss"
    ),
    "deterministic": (
        "flip the flag on this head, not on a step head: head.eval() and head.train() "
        "set it on the steps too (or pass deterministic= at the call)"
    ),
    "reparameterized": "",
    "per_env_streams": "",
    "rng_collection": "",
}


def _is_str(name) -> bool:
    return isinstance(name, str)


def _kind(head: ActionSampler, size: int) -> tuple[Callable, Any, int | None]:
    """``(embed, data, count)`` of a step head, from its distribution of a zero input:
    the embedding of its replay data, a stand-in for that data (shape and dtype), and
    how many values it takes (None where it is not discrete)."""
    found: list = []

    def example():
        dist = head.distribution(jnp.zeros((1, size)))
        found.append(_embedding(dist))
        return replay.deterministic_replay_data(dist), support(dist)

    data, values = jax.eval_shape(example)
    return found[0], data, None if values is None else values.shape[0]


def _embedding(dist: distrax.Distribution) -> Callable:
    """The embedding of ``dist``'s replay data, from its kind alone (no parameters)."""
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
        parts = [_embedding(part) for part in leaves(spec, dist.parts, "parts", "Composite")]
        return lambda data: jnp.concatenate(
            [e(x) for e, x in zip(parts, leaves(spec, data, "data", "Composite"), strict=True)],
            -1,
        )
    if isinstance(dist, replay.PreImageReplay):
        bounds = squashing(dist.bijector)
        if bounds is not None:
            scale = bounds.pre_image_scale
            return lambda x: jnp.tanh(x / scale)
    return lambda x: jnp.asarray(x)
