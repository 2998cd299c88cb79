"""Vectors of discrete actions: :class:`MultiDiscrete` and :class:`MultiBinary`.

Both are ``distrax.Independent`` over one distribution per sub-action (a
:class:`MaskedCategorical`, a Bernoulli), so that the log-probability and the
entropy are sums over the sub-actions and the masking rules of
:class:`MaskedCategorical` hold per sub-action.
"""

from collections.abc import Sequence
from typing import Any, cast

import distrax
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float
from tensorflow_probability.substrates import jax as tfp

from samplers import _checks
from samplers.distributions.categorical import MaskedCategorical
from samplers.distributions.replay import ActionReplay

tfd = tfp.distributions


class _SubActions(distrax.Independent, ActionReplay):
    """``distrax.Independent`` over one distribution per sub-action."""

    def __getitem__(self, index):
        """Indexes the batch (never the sub-actions), keeping the class and the mask."""
        sliced = super().__getitem__(index)
        indexed = object.__new__(type(self))
        vars(indexed).update({**vars(self), **vars(sliced)})
        return indexed


class MultiDiscrete(_SubActions):
    """Independent categorical sub-actions of uneven sizes ``nvec``, one event.

    The network output is flat, ``[*batch, sum(nvec)]``: the logits of the
    first sub-action, then of the second, and so on (the layout of gymnasium's
    ``MultiDiscrete`` and SB3's). An action is ``[*batch, len(nvec)]`` integers,
    sub-action ``i`` in ``[0, nvec[i])``. :meth:`log_prob` and :meth:`entropy` are
    sums over the sub-actions; :meth:`mode` is each sub-action's mode.

    The sub-actions are padded to the largest size with masked choices, as one
    :class:`MaskedCategorical` of batch shape ``[*batch, len(nvec)]``
    (:attr:`distribution`), so the masking rules are that class's, per
    sub-action: a masked choice has probability 0, is never sampled and scores
    ``-inf``; a sub-action with no allowed choice makes the row's
    log-probability and entropy NaN and is sampled as 0.

    Args:
        logits: ``[*batch, sum(nvec)]``, the sub-actions' logits one after the other.
        nvec: The number of choices of each sub-action, positive integers.
        mask: ``None`` (all allowed), booleans of ``logits``' shape (flat, True
            where the choice is allowed), or a sequence of ``len(nvec)`` boolean
            arrays ``[*batch, nvec[i]]``, one per sub-action.
        dtype: The dtype of the sampled actions.

    Raises:
        TypeError: ``logits`` is not floating, or a mask is not boolean.
        ValueError: ``nvec`` is empty or not positive integers, ``logits``' last
            axis is not ``sum(nvec)``, or a mask's shape differs.

    Example:
        >>> import jax, jax.numpy as jnp, samplers
        >>> dist = samplers.MultiDiscrete(jnp.zeros(5), nvec=(3, 2))
        >>> dist.event_shape, dist.log_prob(jnp.array([2, 1])), dist.entropy()
        ((2,), Array(-1.7917595, dtype=float32), Array(1.7917595, dtype=float32))
        >>> mask = (jnp.array([True, False, False]), jnp.array([True, True]))
        >>> samplers.MultiDiscrete(jnp.zeros(5), (3, 2), mask).log_prob(jnp.array([0, 1]))
        Array(-0.6931472, dtype=float32)
    """

    def __init__(
        self,
        logits: Float[ArrayLike, "*batch choices"],
        nvec: Sequence[int],
        mask: Bool[ArrayLike, "*batch choices"] | Sequence[ArrayLike] | None = None,
        dtype: Any = int,
    ):
        nvec = _checks.nvec(nvec)
        logits = _checks.logits_array("logits", logits)
        total = sum(nvec)
        if logits.ndim < 1 or logits.shape[-1] != total:
            raise ValueError(
                f"logits must have shape [*batch, {total}] (sum(nvec) for nvec={nvec}), got "
                f"{logits.shape}; the network output needs one logit per choice."
            )
        if mask is None:
            mask = jnp.ones(logits.shape, bool)
        elif isinstance(mask, (list, tuple)):
            mask = _per_part_mask(mask, nvec, logits.shape[:-1])
        mask = _checks.boolean_mask(mask, logits.shape)
        # Each sub-action's slice, padded to the largest with forbidden choices.
        padded_logits = _pad_parts(logits, nvec, -jnp.inf)
        padded_mask = _pad_parts(mask, nvec, False)
        super().__init__(MaskedCategorical(padded_logits, padded_mask, dtype=dtype), 1)
        self._nvec = nvec

    @property
    def nvec(self) -> tuple[int, ...]:
        """The number of choices of each sub-action."""
        return self._nvec


class MultiBinary(_SubActions):
    """Independent bits, bit ``i`` one with probability ``sigmoid(logits[i])``.

    An action is ``[*batch, num_bits]`` integers 0 or 1; :meth:`log_prob` and
    :meth:`entropy` are sums over the bits. It is
    ``distrax.Independent(distrax.Bernoulli(logits), 1)`` with the mask applied
    to the log-odds: ``mask[..., i, v]`` says whether bit ``i`` may take the
    value ``v``, so a bit with one allowed value gets the log-odds ``+inf`` or
    ``-inf`` and takes that value with probability 1 (log-probability 0, entropy
    0, ``-inf`` for the other value), whatever its logit holds, with zero
    gradient. Log-odds of ``+-inf`` in ``logits`` are such sure bits too. A bit
    with neither value allowed gets NaN log-odds: the row's log-probability and
    entropy are NaN and the bit is sampled as 0.

    Args:
        logits: ``[*batch, num_bits]``, the log-odds of each bit being 1.
        mask: ``None`` (both values allowed), or booleans ``[*batch, num_bits,
            2]``: ``mask[..., i, 0]`` allows bit ``i`` to be 0, ``mask[..., i, 1]``
            to be 1.
        dtype: The dtype of the sampled actions.

    Raises:
        TypeError: ``logits`` is not floating, or ``mask`` is not boolean.
        ValueError: ``logits`` has no bit axis, or ``mask``'s shape is not
            ``logits.shape + (2,)``.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> dist = samplers.MultiBinary(jnp.array([0.0, 2.0]))
        >>> dist.probs, dist.log_prob(jnp.array([1, 0]))
        (Array([0.5      , 0.8807971], dtype=float32), Array(-2.8200753, dtype=float32))
        >>> forced = jnp.array([[True, True], [False, True]])  # bit 1 must be 1
        >>> samplers.MultiBinary(jnp.array([0.0, 2.0]), forced).log_prob(jnp.array([1, 1]))
        Array(-0.6931472, dtype=float32)
    """

    def __init__(
        self,
        logits: Float[ArrayLike, "*batch bits"],
        mask: Bool[ArrayLike, "*batch bits 2"] | None = None,
        dtype: Any = int,
    ):
        logits = _checks.logits_array("logits", logits, "a bit axis, shape [*batch, num_bits]")
        if mask is not None:
            mask = _checks.boolean_mask(
                mask, (*logits.shape, 2), hint=" (bit i may be 0, bit i may be 1)"
            )
            may_be_zero, may_be_one = mask[..., 0], mask[..., 1]
            forced = jnp.where(may_be_one, jnp.inf, jnp.where(may_be_zero, -jnp.inf, jnp.nan))
            logits = jnp.where(may_be_zero & may_be_one, logits, forced)
        super().__init__(_Bernoulli(logits=logits, dtype=dtype), 1)
        self._mask = mask

    @property
    def mask(self) -> Bool[Array, "*batch bits 2"] | None:
        """The allowed values of each bit, ``[*batch, num_bits, 2]``, or ``None``."""
        return self._mask

    @property
    def logits(self) -> Float[Array, "*batch bits"]:
        """The log-odds after the mask: ``+-inf`` for a forced bit, NaN for a bit
        without an allowed value."""
        return jnp.asarray(cast(distrax.Bernoulli, self.distribution).logits)

    @property
    def probs(self) -> Float[Array, "*batch bits"]:
        """The probability of each bit being 1, after the mask."""
        return jnp.asarray(cast(distrax.Bernoulli, self.distribution).probs)


class _Bernoulli(distrax.Bernoulli):
    """``distrax.Bernoulli`` that broadcasts a sample axis explicitly.

    So that ``log_prob(sample(seed=k, sample_shape=n))`` works under
    ``jax_numpy_rank_promotion="raise"``; a value other than 0 or 1 scores
    ``-inf``, and one that is not a whole number NaN, as in
    :class:`MaskedCategorical`.
    """

    def __getitem__(self, index) -> "_Bernoulli":
        """Indexes the batch, keeping the class (distrax's returns a ``distrax.Bernoulli``)."""
        return _Bernoulli(logits=jnp.asarray(self.logits)[index], dtype=self._dtype)

    def _sample_n(self, key, n: int) -> Array:
        probs = self.probs
        uniform = jax.random.uniform(key, (n, *probs.shape), probs.dtype)
        return (uniform < jnp.broadcast_to(probs, uniform.shape)).astype(self._dtype)

    def log_prob(self, value: ArrayLike) -> Array:
        value = jnp.asarray(value)
        shape = jnp.broadcast_shapes(value.shape, self.batch_shape)
        logits, value = jnp.broadcast_to(self.logits, shape), jnp.broadcast_to(value, shape)
        not_a_value = False
        if jnp.issubdtype(value.dtype, jnp.floating):
            not_a_value = value != jnp.floor(value)
        one, zero = jax.nn.log_sigmoid(logits), jax.nn.log_sigmoid(-logits)
        log_prob = jnp.where(value == 1, one, jnp.where(value == 0, zero, -jnp.inf))
        return jnp.where(not_a_value, jnp.nan, log_prob)

    def prob(self, value: ArrayLike) -> Array:
        return jnp.exp(self.log_prob(value))

    def entropy(self) -> Array:
        # -sum p log p over the two values, from log_prob's own terms (the backward
        # pass then shares them); a value of probability 0 adds 0 * 0, not 0 * -inf,
        # so that a certain bit has entropy 0 and gradient 0.
        logits = jnp.asarray(self.logits)
        entropy = jnp.zeros_like(logits)
        for log_p in (jax.nn.log_sigmoid(logits), jax.nn.log_sigmoid(-logits)):
            possible = log_p != -jnp.inf  # NaN stays NaN
            safe = jnp.where(possible, log_p, 0.0)
            entropy -= jnp.where(possible, jnp.exp(safe) * safe, 0.0)
        return entropy


def _bernoulli_kl(p, q, *_, **__) -> Array:
    """``KL(p || q)`` of two bits, registered with TFP for :class:`_Bernoulli`.

    Summed over the values ``p`` gives positive probability, so a certain bit
    (log-odds ``+-inf``, as a mask forces) has finite gradients: ``+inf`` where
    ``q`` rules out a value ``p`` can take, NaN where either has NaN log-odds.
    """
    kl = 0.0
    for sign in (1.0, -1.0):
        log_p = jax.nn.log_sigmoid(sign * p.logits)
        log_q = jax.nn.log_sigmoid(sign * q.logits)
        possible = log_p != -jnp.inf  # NaN stays NaN
        safe = jnp.where(possible, log_p, 0.0)
        kl += jnp.where(possible, jnp.exp(safe) * (safe - log_q), 0.0)
    return kl


def _pad_parts(flat, nvec, fill) -> Array:
    """``[*batch, sum(nvec)]`` as ``[*batch, len(nvec), max(nvec)]``, padded with ``fill``."""
    width, start, parts = max(nvec), 0, []
    for n in nvec:
        pad = [(0, 0)] * (flat.ndim - 1) + [(0, width - n)]
        parts.append(jnp.pad(flat[..., start : start + n], pad, constant_values=fill))
        start += n
    return jnp.stack(parts, axis=-2)


def _per_part_mask(parts, nvec, batch_shape) -> Array:
    if len(parts) != len(nvec):
        raise ValueError(
            f"a per-sub-action mask needs one array per sub-action ({len(nvec)} for "
            f"nvec={nvec}), got {len(parts)}."
        )
    checked = [
        _checks.boolean_mask(part, (*batch_shape, n), hint=f" for sub-action {i}")
        for i, (part, n) in enumerate(zip(parts, nvec, strict=True))
    ]
    return jnp.concatenate(checked, axis=-1)


tfd.RegisterKL(_Bernoulli, _Bernoulli)(_bernoulli_kl)
