"""The autoregressive head: sub-actions in order, each conditioned on the earlier ones.

:class:`AutoregressiveSampler` is the shell of :class:`samplers.ActionSampler` around
a :class:`samplers.Autoregressive` distribution whose steps are small NNX
conditioners, owned by the head: each maps the network's features and the earlier
sub-actions to the parameters of one sub-action's head. The guide
(``docs/guides/autoregressive.md``) explains the conditioning, the masks and the
entropy at length.
"""

from collections.abc import Callable, Mapping
from typing import Any, Literal

import distrax
import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from samplers import _checks
from samplers.distributions import replay
from samplers.distributions.autoregressive import (
    Autoregressive,
    MaskTable,
    replay_embedding,
    support,
)
from samplers.distributions.composite import ordered_sum
from samplers.heads.action_sampler import ActionSampler, Scored
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


class AutoregressiveSampler(ActionSampler):
    """Sub-actions in order, each conditioned on the network features and the earlier ones.

    ``steps`` maps each sub-action's name, in order, to the head that turns its
    parameters into its distribution: any head of this library with ``num_params``.
    The network output is a feature vector ``[*batch, features]``; sub-action ``k``'s
    parameters are ``conditioners[k](concat(features, e_1, ..., e_{k-1}))``, ``e_j``
    the embedding of sub-action ``j``'s replay data
    (:func:`samplers.distributions.autoregressive.replay_embedding`). A replay builds
    every sub-action's distribution at once from the stored data (teacher forcing)
    and reproduces the rollout's log-likelihood bit for bit for the same inputs,
    masks and batch shape.

    Output: ``{"action": {name: ...}, "log_likelihood": the sum [*batch],
    "log_likelihoods": {name: log p(a_k | a_<k)}}``; ``rollout_extras`` the
    sub-actions' replay data by name. ``mask`` is a dict by sub-action name: an array
    for that sub-action's head at the features' batch shape, a function of the earlier
    sub-actions' replay data (``lambda prefix: legal[prefix["unit"]]``; it sees
    prefixes ``[*batch]``, mapped with ``jax.vmap`` in the exact entropy), or a
    :class:`MaskTable`, the same as arrays a rollout can store. ``eval()`` decodes
    greedily. The entropy cost is ``-entropy_weight * H``: ``entropy="exact"``, the
    joint entropy, every prefix of the sub-actions before the last enumerated (they
    must be discrete, at most ``max_prefixes``); ``"along_sample"``, the exact
    conditional entropies summed along the sampled or stored prefix, unbiased for a
    fresh sample. Metrics: ``"<name>/log_likelihood"`` and ``"<name>/entropy"`` (the
    conditional entropy along the prefix). The step heads give only their
    distribution: a step head (or a part of one) whose stream options, entropy weight
    or ``deterministic`` differ from its default and this head's is refused; keys go
    to the sub-actions by name, as :class:`CompositeSampler` gives its parts theirs.

    Args:
        steps: The sub-actions' heads by name, in order.
        features: The width of the network output.
        entropy_weight: Weight of the entropy bonus.
        rngs: The stream, and the conditioners' initial parameters.
        conditioners: Optional modules by name, each mapping ``[*, features +
            embeddings so far]`` to ``[*, steps[name].num_params]``, acting on the last
            axis alone (the exact entropy stacks prefixes in front: ``[P, *batch,
            in]``); the others are a ``Linear -> tanh -> Linear`` of width ``hidden``.
        hidden: The default conditioners' hidden width.
        entropy: ``"exact"`` or ``"along_sample"``.
        max_prefixes: The most prefixes the exact entropy enumerates.
        reparameterized: If True, a fresh sample keeps its pathwise gradient.
        per_env_streams, log_ratio_metrics, rng_collection: As in
            :class:`samplers.ActionSampler`.

    Raises:
        TypeError: ``steps`` is not a non-empty dict of heads, or an option is of the
            wrong kind; at the call, an array mask of a wrong dtype.
        ValueError: ``entropy="exact"`` that cannot be enumerated, an unknown
            ``entropy``, or a step head with an option of its own; at the call, an
            array mask of a wrong shape, or a :class:`MaskTable` not indexed by earlier
            categorical sub-actions or whose axes do not match.

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
        log_ratio_metrics: bool = False,
        rng_collection: str = "action",
    ):
        if not isinstance(steps, Mapping) or not steps or not all(map(_is_str, steps)):
            raise TypeError(
                f"AutoregressiveSampler takes a non-empty dict of heads by sub-action name, "
                f"got {type(steps).__name__}; pass e.g. {{'unit': head_a, 'target': head_b}}."
            )
        super().__init__(
            rngs,
            entropy_weight,
            reparameterized=reparameterized,
            per_env_streams=per_env_streams,
            log_ratio_metrics=log_ratio_metrics,
            rng_collection=rng_collection,
        )
        self.features = _checks.positive_int("features", features)
        if entropy not in ("exact", "along_sample"):
            raise ValueError(f"entropy must be 'exact' or 'along_sample', got {entropy!r}.")
        self.entropy = entropy
        self.max_prefixes = _checks.positive_int("max_prefixes", max_prefixes)
        self._names = tuple(steps)
        self.steps = nnx.data(dict(steps))
        sizes = [part_size("AutoregressiveSampler", (n,), steps[n]) for n in self._names]
        self._sizes = tuple(sizes)
        # Each sub-action's embedding, a stand-in for its replay data, and how many values
        # it takes (None: not discrete), from its head's distribution.
        kinds = [_kind(steps[n], size) for n, size in zip(self._names, sizes, strict=True)]
        self._embedders = tuple(embed for embed, _, _ in kinds)
        self._supports = tuple(count for _, _, count in kinds)
        # A categorical sub-action: discrete, one value per batch element.
        self._categorical = tuple(n is not None and d.ndim == 1 for _, d, n in kinds)
        widths = [jax.eval_shape(embed, data).shape[-1] for embed, data, _ in kinds]
        self.conditioners = nnx.data(_conditioners(self, conditioners, widths, rngs, hidden))
        _check_steps(self, _STEP_OPTIONS)
        if entropy == "exact":
            _check_enumerable(self)

    @property
    def num_params(self) -> int:
        """``features``: the width of the network output."""
        return self.features

    def _distribution(self, inputs, mask) -> Autoregressive:
        _check_steps(self, ("deterministic",))  # eval() and train() reach the steps too
        features = _checks.float_parameters("inputs", inputs)
        self._check_width(features, "features", "head.num_params, the features")
        batch = features.shape[:-1]
        masks = _masks(self, mask, batch)
        steps = {
            name: self._step(k, features, masks[k], batch) for k, name in enumerate(self._names)
        }
        return Autoregressive(steps, max_prefixes=self.max_prefixes)

    def _step(self, k: int, features, mask, batch) -> Callable:
        """Sub-action ``k``'s step: its distribution given the earlier ones' data."""
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

    def _replay(self, dist: Autoregressive, data) -> Scored:
        action, log_likelihoods, entropies = dist.replay_with_entropies(data)
        log_likelihood = ordered_sum(list(log_likelihoods.values()))
        return Scored(data, action, log_likelihood, log_likelihoods, entropy=entropies)

    def _regularization(self, dist: Autoregressive, key, scored: Scored) -> Array:
        if self.entropy == "exact":
            return -self.entropy_weight * dist.entropy()
        return -self.entropy_weight * ordered_sum(list(scored.entropy.values()))

    def _metrics(self, inputs, dist, scored: Scored) -> dict:
        """Each sub-action's log-likelihood and conditional entropy along the prefix."""
        metrics = {}
        for name in self._names:
            metrics[f"{name}/log_likelihood"] = scored.log_likelihoods[name]
            metrics[f"{name}/entropy"] = scored.entropy[name]
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
    "log_ratio_metrics": "",
    "rng_collection": "",
}


def _is_str(name) -> bool:
    return isinstance(name, str)


def _conditioners(head, given, widths: list[int], rngs, hidden: int) -> dict:
    """The given conditioners by name, and the default one for each other sub-action."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(head._names))
    if unknown:
        raise ValueError(
            f"conditioners has names {unknown} that are no sub-actions {list(head._names)}."
        )
    return {
        name: given.get(name) or _Conditioner(head.features + sum(widths[:k]), size, rngs, hidden)
        for k, (name, size) in enumerate(zip(head._names, head._sizes, strict=True))
    }


def _check_steps(head: AutoregressiveSampler, options) -> None:
    """Refuses a step head, or a part of one, whose ``options`` the head would ignore:
    each must be its default or the head's (``deterministic``: the head's, which
    ``eval()`` and ``train()`` set on the steps too)."""
    for name, step in head.steps.items():
        for path, module in nnx.iter_graph(step):
            if not isinstance(module, ActionSampler):
                continue
            for option in options:
                value, own, default = (getattr(x, option) for x in (module, head, ActionSampler))
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


def _check_enumerable(head: AutoregressiveSampler) -> None:
    """Refuses ``entropy="exact"`` where it cannot be computed."""
    count = 1
    for name, values in zip(head._names[:-1], head._supports[:-1], strict=True):
        if values is None:
            raise ValueError(
                f"entropy='exact' enumerates the sub-actions before the last, and "
                f"{name!r} ({type(head.steps[name]).__name__}) is not discrete (a "
                f"categorical, multi-discrete or multi-binary head); pass "
                f"entropy='along_sample', or make it the last sub-action."
            )
        count *= values
    if count > head.max_prefixes:
        raise ValueError(
            f"entropy='exact' would enumerate {count} prefixes, more than "
            f"max_prefixes={head.max_prefixes}; pass entropy='along_sample' or a larger "
            f"max_prefixes."
        )


def _masks(head: AutoregressiveSampler, mask, batch: tuple[int, ...]) -> list:
    """The sub-actions' masks in order, the arrays and tables checked."""
    names = head._names
    if mask is None:
        return [None] * len(names)
    if not isinstance(mask, Mapping):
        raise TypeError(
            f"AutoregressiveSampler's mask is a dict by sub-action name, got "
            f"{type(mask).__name__}; pass e.g. {{'target': legal_targets}}."
        )
    unknown = sorted(set(mask) - set(names))
    if unknown:
        raise ValueError(f"mask has names {unknown} that are no sub-actions {list(names)}.")
    for k, name in enumerate(names):
        if isinstance(mask.get(name), MaskTable):
            _check_table(head, k, mask[name], batch)
        elif mask.get(name) is not None and not callable(mask[name]):
            _check_array_mask(head, k, mask[name], batch)
    return [mask.get(name) for name in names]


def _check_array_mask(head: AutoregressiveSampler, k: int, mask, batch: tuple[int, ...]) -> None:
    """Refuses an array mask that sub-action ``k``'s head refuses at ``batch`` (it would
    otherwise be broadcast over the prefixes, or fail inside JAX)."""
    name = head._names[k]
    step = head.steps[name]
    inputs = jax.ShapeDtypeStruct((*batch, head._sizes[k]), jnp.float32)
    try:
        jax.eval_shape(lambda x: step.distribution(x, mask), inputs)
    except (TypeError, ValueError) as error:
        raise type(error)(
            f"mask[{name!r}], the mask of sub-action {name!r} ({type(step).__name__}) "
            f"at the features' batch shape {batch}, is refused: {error}"
        ) from None


def _check_table(head: AutoregressiveSampler, k: int, table: MaskTable, batch) -> None:
    """Refuses a table indexed by what is not an earlier categorical sub-action, or whose
    axes after the batch are not those sub-actions' numbers of choices."""
    names = head._names
    counts = []
    for name in table.names:
        j = names.index(name) if name in names else len(names)
        if j >= k or not head._categorical[j]:
            raise ValueError(
                f"the MaskTable of {names[k]!r} is indexed by {name!r}, which is "
                f"not a categorical sub-action before it (those are "
                f"{[n for i, n in enumerate(names[:k]) if head._categorical[i]]})."
            )
        counts.append(head._supports[j])
    shape = jnp.shape(table.table)
    found = shape[len(batch) : len(batch) + len(counts)]
    if shape[: len(batch)] != batch or list(found) != counts:
        raise ValueError(
            f"the MaskTable of {names[k]!r} has shape {shape}; it needs the "
            f"batch shape {batch}, then {counts} (the choices of {list(table.names)}), "
            f"then the mask's shape."
        )


def _kind(head: ActionSampler, size: int) -> tuple[Callable, Any, int | None]:
    """``(embed, data, count)`` of a step head, from its distribution of a zero input:
    the embedding of its replay data, a stand-in for that data (shape and dtype), and
    how many values it takes (None where it is not discrete)."""
    found: list = []

    def example():
        dist = head.distribution(jnp.zeros((1, size)))
        found.append(replay_embedding(dist))
        return replay.deterministic_replay_data(dist), support(dist)

    data, values = jax.eval_shape(example)
    return found[0], data, None if values is None else values.shape[0]
