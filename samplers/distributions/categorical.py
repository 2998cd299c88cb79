"""A categorical distribution over the actions that a boolean mask allows."""

from typing import Any

import distrax
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float
from tensorflow_probability.substrates import jax as tfp

from samplers import _checks
from samplers.distributions.replay import ActionReplay

tfd = tfp.distributions


class MaskedCategorical(distrax.Categorical, ActionReplay):
    """``distrax.Categorical`` over the actions that ``mask`` allows.

    A masked action has probability exactly 0 and log-probability ``-inf``;
    :meth:`sample` and :meth:`mode` never return one. The probabilities are the
    softmax of the allowed logits, so the entropy is over the allowed actions.
    Masked logits may hold anything, NaN and infinities included: they reach no
    output, and their gradients are exactly 0 (the gradients of the allowed ones
    stay finite).

    A row that allows no action has no distribution: its probabilities,
    log-probabilities and entropy are NaN, and :meth:`sample` and :meth:`mode`
    give action 0 there (``distrax.Categorical`` samples ``-1``, which indexes the
    last action). An allowed logit of NaN or ``+inf`` makes its row NaN the same
    way; an allowed ``-inf`` is an action of probability 0.

    Args:
        logits: Unnormalised log-probabilities, shape ``[*batch, num_actions]``:
            floating, or integers as ``distrax.Categorical`` takes them (float32,
            float64 for int64 under ``jax_enable_x64``); float16 and bfloat16
            are computed, and returned, in float32.
        mask: Booleans of ``logits``' shape, True where the action is allowed;
            ``None`` allows every action.
        dtype: The dtype of the sampled actions, as in ``distrax.Categorical``.

    Raises:
        TypeError: ``logits`` is boolean or not numbers, or ``mask`` is not boolean.
        ValueError: ``logits`` has no action axis, or ``mask``'s shape differs.

    Example:
        >>> import jax, jax.numpy as jnp, samplers
        >>> dist = samplers.MaskedCategorical(jnp.zeros(3), mask=jnp.array([True, False, True]))
        >>> dist.probs
        Array([0.5, 0. , 0.5], dtype=float32)
        >>> dist.log_prob(1), dist.entropy()
        (Array(-inf, dtype=float32), Array(0.6931472, dtype=float32))
    """

    def __init__(
        self,
        logits: Float[ArrayLike, "*batch actions"],
        mask: Bool[ArrayLike, "*batch actions"] | None = None,
        dtype: Any = int,
    ):
        axis = "an action axis, shape [*batch, num_actions]"
        logits = _checks.logits_array("logits", logits, axis)
        if mask is None:
            mask = jnp.ones(logits.shape, bool)
        mask = _checks.boolean_mask(mask, logits.shape, hint=", logits' shape")
        super().__init__(logits=jnp.where(mask, logits, -jnp.inf), dtype=dtype)
        self._mask = mask

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """The shape of ``logits`` without its action axis."""
        return self.logits.shape[:-1]

    @property
    def mask(self) -> Bool[Array, "*batch actions"]:
        """True where the action is allowed, ``[*batch, num_actions]``."""
        return self._mask

    @property
    def probs(self) -> Float[Array, "*batch actions"]:
        """``exp(logits)`` of the normalised logits: exactly 0 for a masked action, NaN
        in a row without an allowed action (distrax's would softmax them again)."""
        return jnp.exp(self.logits)

    def _sample_n(self, key, n: int) -> Array:
        # A row without a distribution is NaN throughout (its normaliser is NaN:
        # jax.nn.log_softmax's rows are NaN everywhere or nowhere), and argmax,
        # which the Gumbel draw takes, gives a NaN row's first index: 0.
        draws = jax.random.categorical(key, self.logits, shape=(n, *self.logits.shape[:-1]))
        return draws.astype(self._dtype)

    def log_prob(self, value: ArrayLike) -> Float[Array, "*broadcast_batch"]:
        """Log-probability of action indices, shape broadcastable with ``[*batch]``.

        ``-inf`` for a masked action or an index outside ``[0, num_actions)``; NaN
        in a row without an allowed action, and for a float value that is not a
        whole number (NaN included). Unlike ``distrax.Categorical``'s, it
        broadcasts explicitly, so a leading sample axis also works under
        ``jax_numpy_rank_promotion="raise"``.

        Example:
            >>> import jax, jax.numpy as jnp, samplers
            >>> mask = jnp.array([[True, True, True], [True, False, True]])
            >>> dist = samplers.MaskedCategorical(jnp.zeros((2, 3)), mask)
            >>> dist.log_prob(jnp.array([[0, 1], [2, 1]]))  # [sample, batch]
            Array([[-1.0986123, -inf],
                   [-1.0986123, -inf]], dtype=float32)
        """
        value = jnp.asarray(value)
        shape = jnp.broadcast_shapes(value.shape, self.batch_shape)
        log_probs = jnp.broadcast_to(self.logits, (*shape, self.num_categories))
        index = jnp.broadcast_to(value, shape)
        # A float that is not a whole number (NaN included) is no action: NaN, where
        # distrax.Categorical gives it 0.0.
        not_an_index = False
        if jnp.issubdtype(index.dtype, jnp.floating):
            not_an_index = index != jnp.floor(index)
        inside = (index >= 0) & (index < self.num_categories)
        # Selected by comparison, not gathered: a gather along a short minor axis is
        # slow on a TPU, and a sum of one term and zeros is that term exactly.
        chosen = index[..., None] == jnp.arange(self.num_categories).reshape(
            (1,) * index.ndim + (-1,)
        )
        picked = jnp.sum(jnp.where(chosen, log_probs, 0.0), axis=-1)
        return jnp.where(not_an_index, jnp.nan, jnp.where(inside, picked, -jnp.inf))

    def cdf(self, value: ArrayLike) -> Float[Array, "*broadcast_batch"]:
        """``P(action <= value)``, shape broadcastable with ``[*batch]``.

        0 below 0 and 1 from the last action on; a float value counts as its
        floor. NaN in a row without an allowed action, where
        ``distrax.Categorical`` gives 0 and 1 at the ends, and for a NaN value.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> mask = jnp.array([True, False, True, True])
            >>> samplers.MaskedCategorical(jnp.zeros(4), mask).cdf(jnp.array([0, 1, 2.5, 3]))
            Array([0.3333333, 0.3333333, 0.6666666, 1.       ], dtype=float32)
        """
        value = jnp.asarray(value)
        if jnp.issubdtype(value.dtype, jnp.floating):
            value = jnp.floor(value)
        shape = jnp.broadcast_shapes(value.shape, self.batch_shape)
        last = self.num_categories - 1
        index = jnp.broadcast_to(value, shape)
        cumulative = jnp.cumsum(jnp.broadcast_to(self.probs, (*shape, last + 1)), axis=-1)
        inside = jnp.clip(index, 0, last).astype(jnp.int32)
        picked = jnp.take_along_axis(cumulative, inside[..., None], axis=-1)[..., 0]
        cdf = jnp.where(index < 0, 0.0, jnp.where(index >= last, 1.0, picked))
        defined = jnp.broadcast_to(_has_distribution(self.logits), shape) & (index == index)
        return jnp.where(defined, cdf, jnp.nan)

    def log_cdf(self, value: ArrayLike) -> Float[Array, "*broadcast_batch"]:
        """``log(cdf(value))``."""
        return jnp.log(self.cdf(value))

    def prob(self, value: ArrayLike) -> Float[Array, "*broadcast_batch"]:
        """``exp(log_prob(value))``: exactly 0 for a masked action."""
        return jnp.exp(self.log_prob(value))

    def entropy(self) -> Float[Array, "*batch"]:
        """``-sum p log p`` over the allowed actions; NaN for a row without one.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> dist = samplers.MaskedCategorical(jnp.array([0.0, 5.0]), jnp.array([True, False]))
            >>> dist.entropy()
            Array(0., dtype=float32)
        """
        # Terms of zero probability (masked, or an allowed logit of -inf or far below
        # the others) are 0 * 0, not 0 * -inf, so that their gradients are 0, not NaN.
        positive = jnp.exp(self.logits) > 0
        log_probs = jnp.where(positive, self.logits, 0.0)
        probs = jnp.where(positive, jnp.exp(log_probs), 0.0)
        nan = jnp.where(_has_distribution(self.logits), 0.0, jnp.nan)
        return nan - jnp.sum(probs * log_probs, axis=-1)

    def mode(self) -> Array:
        """The most probable allowed action; 0 for a row without one.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> dist = samplers.MaskedCategorical(jnp.array([0.0, 5.0]), jnp.array([True, False]))
            >>> dist.mode()
            Array(0, dtype=int32)
        """
        return jnp.argmax(self.logits, axis=-1).astype(self._dtype)  # 0 in a NaN row (above)

    def __getitem__(self, index) -> "MaskedCategorical":
        """Indexes the batch (never the action axis), keeping the mask.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> dist = samplers.MaskedCategorical(jnp.zeros((4, 3)), jnp.eye(4, 3, dtype=bool))
            >>> dist[1:3].batch_shape, dist[..., 0].mask
            ((2,), Array([ True, False, False], dtype=bool))
        """
        size = self.logits.size // self.num_categories
        rows = jnp.arange(size).reshape(self.batch_shape)[index]
        flat = (a.reshape(size, self.num_categories) for a in (self.logits, self._mask))
        logits, mask = (a[rows] for a in flat)
        return MaskedCategorical(logits, mask, dtype=self._dtype)


def _has_distribution(log_probs):
    """``[*batch]``: the rows whose log-probabilities are not NaN."""
    return ~jnp.any(jnp.isnan(log_probs), axis=-1)


def _kl_divergence(p, q, *_, **__) -> Array:
    """``KL(p || q)``, registered with TFP for masked and plain ``distrax`` Categoricals.

    Summed over the actions ``p`` gives positive probability: ``+inf`` where
    ``q`` forbids one of them, NaN where either row has no distribution.
    """
    if p.num_categories != q.num_categories:
        raise ValueError(
            f"p and q must have the same number of actions, got {p.num_categories} and "
            f"{q.num_categories}."
        )
    log_p, log_q = jnp.broadcast_arrays(p.logits, q.logits)
    positive = jnp.exp(log_p) > 0
    difference = jnp.where(positive, log_p - log_q, 0.0)
    terms = jnp.where(positive, jnp.exp(jnp.where(positive, log_p, 0.0)) * difference, 0.0)
    nan = jnp.where(_has_distribution(log_p) & _has_distribution(log_q), 0.0, jnp.nan)
    return jnp.sum(terms, axis=-1) + nan


tfd.RegisterKL(MaskedCategorical, MaskedCategorical)(_kl_divergence)
tfd.RegisterKL(MaskedCategorical, distrax.Categorical)(_kl_divergence)
tfd.RegisterKL(distrax.Categorical, MaskedCategorical)(_kl_divergence)
