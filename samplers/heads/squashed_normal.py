"""The squashed-Normal heads: ``f(x)``, ``x ~ N(mean, std)``, sampled or replayed.

The replay data is the pre-image ``x``: a replay scores the stored ``x`` under the
current parameters, never ``f^-1(action)``, which is infinite once ``f`` saturates.
The call is :class:`samplers.ActionSampler`'s, the entropy choice and bound metrics
:class:`samplers.heads.pre_image.PreImageSampler`'s.
"""

import math
from collections.abc import Callable
from typing import cast

import distrax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import checkify
from jaxtyping import Array, Float

from samplers import _checks
from samplers.distributions.bijectors import Tanh
from samplers.distributions.constructors import squashed_normal, squashed_normal_from_log_std
from samplers.distributions.squashed_normal import SquashedNormal
from samplers.heads.pre_image import Entropy, PreImageSampler
from samplers.heads.static import Static


class SquashedNormalSampler(PreImageSampler):
    """Samples ``f(x)``, ``x ~ N(mean, std)``, for an elementwise distrax bijector ``f``.

    The input's last axis is ``[mean | raw_std]`` and
    ``std = (softplus(raw_std) + min_std) * std_scale``; the distribution is
    :func:`samplers.squashed_normal`. The output is
    ``{"action": f(x), "log_likelihood": log p(f(x))}``, with ``x`` in
    ``rollout_extras`` and the log-likelihood computed from ``x``. The
    ``regularization_loss`` is ``-entropy_weight * H`` for the entropy chosen by
    ``entropy`` (by default a one-sample reparameterised estimate, unbiased, not
    exact). ``metrics``: ``mu``, ``sigma`` and, for a bounded squashing (tanh,
    ``BoundedTanh``, sigmoid), ``saturation`` and ``bound_distance`` (see
    :class:`samplers.heads.pre_image.PreImageSampler`). The options below are those
    of every squashed-Normal head.

    Args:
        rngs: The ``nnx.Rngs`` to draw from (positional or ``rngs=``, flax's
            name), or one ``nnx.RngStream`` of it; the sampler keeps and advances it.
        entropy_weight: Weight of the entropy bonus, finite (required).
        min_std: Floor added to the softplus, ``>= 0``.
        std_scale: Factor applied to the std, ``> 0``.
        action_dim: The number of action dimensions, if known: then
            :attr:`num_params` is ``2 * action_dim`` and a call refuses an input of
            another width. ``None`` (the default) takes it from each input.
        bijector: Elementwise squashing: ``samplers.Tanh()`` (the default),
            ``samplers.BoundedTanh(low, high)``, ``distrax.Sigmoid()``,
            ``distrax.Lambda(lambda x: x)``, ...
        entropy: ``"sample"`` (the default: one reparameterised sample, the
            specified estimate; ``("sample", n)`` the mean of ``n``);
            ``"quadrature"``: 8-node Gauss-Hermite (``("quadrature", n)``: ``n``
            nodes), deterministic but biased low for wide stds (for tanh at 8 nodes:
            under 4e-3 nats up to std 1.3, up to 0.21 nats at std 4); ``"exact"``:
            ``dist.entropy()`` (tanh, ``BoundedTanh`` and sigmoid), deterministic and
            differentiable (its cost beside the others': the speed guide); ``"base"``:
            the Normal's entropy alone, biased upwards for tanh. Only ``"sample"``
            draws a key: with another, a replay or an ``eval()`` call draws none.
        reparameterized: If True, the action keeps its pathwise gradient: a fresh
            sample and its log-likelihood are differentiable functions of ``mean``
            and ``std`` through ``x = mean + std * eps``, and the deterministic action
            ``f(mean)`` through ``x = mean``, with ``d f(x) / dx = f'(x)`` also where
            float32 ``f(x)`` rounds onto a bound (SAC's actor, TD3's ``-Q(s,
            f(mean))`` on the ``eval()`` head). If False (the default, PPO), the
            action is a constant and gradients reach ``mean`` and ``std`` only
            through its log-density. Values do not depend on the flag.
        per_env_streams: If True, each environment has its own random stream in
            the carry state (:meth:`initialize_state`): its samples then do not
            depend on how the batch is split; pass the state that the rollout call
            received to its replay to replay the entropy noise too.
        log_ratio_metrics: If True, the rollout emits ``{"pre_image",
            "log_likelihood"}`` and a replay of it adds ``log_ratio`` and
            ``approx_kl`` to ``metrics`` (see :class:`samplers.ActionSampler`).
        checked: If True, each call (and :meth:`distribution`) checks that its
            input is finite with ``jax.experimental.checkify`` and reports the first
            offending batch index (run the step under ``checkify.checkify``; eager
            calls raise at once). Off by default: NaN or inf inputs then give NaN or
            inf outputs, never finite wrong numbers.
        rng_collection: The name of the stream keys are drawn from; an
            ``nnx.Rngs`` without it falls back to its ``default`` stream.
        rng: Deprecated, the old name of ``rngs``.
        entropy_points: Deprecated: pass ``entropy=(name, n)``.

    Raises:
        TypeError: no stream, or not an ``nnx.Rngs`` or ``nnx.RngStream``, or an
            option is not a number, or an unknown keyword.
        ValueError: an option is out of range or not finite, ``entropy`` is not
            one of the choices above, or the ``nnx.Rngs`` has neither the
            ``rng_collection`` stream nor ``default``.
        flax.errors.TraceContextError: at a call under ``jax.grad`` or ``jax.jit``
            (not nnx's) that needs a key: a sample, or a replay with
            ``entropy="sample"``; the message names ``entropy="exact"``.

    Example:
        >>> import distrax, jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> head = samplers.SquashedNormalSampler(nnx.Rngs(0), 0.01, bijector=distrax.Sigmoid())
        >>> out = head((), jnp.zeros((5, 4)))
        >>> out.output["action"].shape, out.rollout_extras.shape
        ((5, 2), (5, 2))
    """

    _key_free_entropy = "build the head with entropy='exact' (or 'quadrature' or 'base')"

    def __init__(
        self,
        rngs: nnx.Rngs | nnx.RngStream | None = None,
        entropy_weight: float | None = None,
        min_std: float = 1e-3,
        std_scale: float = 1.0,
        *,
        action_dim: int | None = None,
        bijector: distrax.Bijector | Callable | None = None,
        entropy: Entropy = "sample",
        reparameterized: bool = False,
        per_env_streams: bool = False,
        log_ratio_metrics: bool = False,
        checked: bool = False,
        rng_collection: str = "action",
        rng: nnx.Rngs | nnx.RngStream | None = None,
        entropy_points: int | None = None,
    ):
        self._init_squashed(
            rngs,
            entropy_weight,
            bijector=bijector,
            checked=checked,
            entropy=entropy,
            reparameterized=reparameterized,
            per_env_streams=per_env_streams,
            log_ratio_metrics=log_ratio_metrics,
            rng_collection=rng_collection,
            rng=rng,
            entropy_points=entropy_points,
        )
        self.min_std = _checks.real_number("min_std", min_std, minimum=0.0)
        self.std_scale = _checks.real_number("std_scale", std_scale, above=0.0)
        self.action_dim = (
            None if action_dim is None else _checks.positive_int("action_dim", action_dim)
        )

    def _init_squashed(self, rngs, entropy_weight, *, bijector, checked, **options) -> None:
        """The options of every squashed-Normal head, checked (``options``: the shell's)."""
        PreImageSampler.__init__(self, rngs, entropy_weight, **options)
        self._bijector = Static(distrax.as_bijector(Tanh() if bijector is None else bijector))
        self.checked = bool(checked)

    @property
    def bijector(self) -> distrax.Bijector:
        """The elementwise bijector; its parameters are constants, not module state."""
        return self._bijector.value

    def _distribution(self, inputs: Float[Array, "*batch params"], mask=None) -> SquashedNormal:
        if self.checked:
            _check_finite(inputs)
        if self.action_dim is not None:
            self._check_width(inputs, "[mean | raw_std]", "2 * action_dim")
        return squashed_normal(
            inputs, self.bijector, min_std=self.min_std, std_scale=self.std_scale
        )

    def _metrics(self, inputs, dist, scored) -> dict:
        return {"mu": dist.loc, "sigma": dist.scale, **super()._metrics(inputs, dist, scored)}


class NormalTanhSampler(SquashedNormalSampler):
    """Samples ``tanh(x)``, ``x ~ N(mean, std)``: the specified sampler.

    :class:`SquashedNormalSampler` under its specified name, called as specified,
    ``NormalTanhSampler(rngs, entropy_weight, min_std, std_scale)``, with the same
    options (its ``bijector`` defaults to ``samplers.Tanh()``).

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> head = samplers.NormalTanhSampler(nnx.Rngs(0), entropy_weight=0.01)
        >>> out = head((), jnp.zeros(4))
        >>> again = head((), jnp.zeros(4), out.rollout_extras)
        >>> bool(jnp.allclose(again.output["log_likelihood"], out.output["log_likelihood"]))
        True
        >>> head.eval()
        >>> head((), jnp.zeros(4)).output["action"]
        Array([0., 0.], dtype=float32)
    """


class StateIndependentSampler(SquashedNormalSampler):
    """A squashed Normal whose std is a learned parameter, not a network output.

    The input is the mean alone, shape ``[*batch, action_dim]``; the std is
    ``exp(log_std)``, one ``nnx.Param`` per action dimension shared by every
    state, as many PPO implementations use. Everything else is
    :class:`SquashedNormalSampler`'s, and so are the other options.

    Args:
        rngs: The ``nnx.Rngs`` to draw from, or one ``nnx.RngStream`` of it.
        action_dim: Number of action dimensions (required).
        entropy_weight: Weight of the entropy bonus, finite (required).
        initial_std: The std before training, ``> 0``.
        bijector: As :class:`SquashedNormalSampler` takes it, and so are
            ``entropy``, ``reparameterized``, ``per_env_streams``,
            ``log_ratio_metrics``, ``checked``, ``rng_collection``, and the
            deprecated ``rng`` and ``entropy_points``.

    Raises:
        TypeError: an option is not a number of the right kind, or an unknown
            keyword (``min_std`` and ``std_scale`` too: the std is learned).
        ValueError: ``action_dim < 1``, ``initial_std <= 0``, or (when called)
            the input's last axis is not ``action_dim``.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> head = samplers.StateIndependentSampler(nnx.Rngs(0), 2, 0.01, initial_std=0.5)
        >>> out = head((), jnp.zeros((4, 2)))
        >>> out.metrics["sigma"][0]
        Array([0.5, 0.5], dtype=float32)
    """

    def __init__(
        self,
        rngs: nnx.Rngs | nnx.RngStream | None = None,
        action_dim: int | None = None,
        entropy_weight: float | None = None,
        *,
        initial_std: float = 1.0,
        bijector: distrax.Bijector | Callable | None = None,
        entropy: Entropy = "sample",
        reparameterized: bool = False,
        per_env_streams: bool = False,
        log_ratio_metrics: bool = False,
        checked: bool = False,
        rng_collection: str = "action",
        rng: nnx.Rngs | nnx.RngStream | None = None,
        entropy_points: int | None = None,
    ):
        self._init_squashed(
            rngs,
            entropy_weight,
            bijector=bijector,
            checked=checked,
            entropy=entropy,
            reparameterized=reparameterized,
            per_env_streams=per_env_streams,
            log_ratio_metrics=log_ratio_metrics,
            rng_collection=rng_collection,
            rng=rng,
            entropy_points=entropy_points,
        )
        self.action_dim = _checks.positive_int("action_dim", action_dim)
        initial_std = _checks.real_number("initial_std", initial_std, above=0.0)
        self.log_std = nnx.Param(jnp.full((self.action_dim,), math.log(initial_std)))

    @property
    def num_params(self) -> int:
        """``action_dim``: the input is the mean alone."""
        return cast(int, self.action_dim)  # set by __init__

    def _distribution(self, inputs: Float[Array, "*batch action"], mask=None) -> SquashedNormal:
        """The distribution for the given means, with the learned std."""
        if self.checked:
            _check_finite(inputs)
        mean = _checks.float_array("mean", inputs)
        if mean.ndim < 1 or mean.shape[-1] != self.action_dim:
            raise ValueError(
                f"the input must be the mean, shape [*batch, {self.action_dim}], got "
                f"{mean.shape}; this sampler learns its std itself."
            )
        # The constructor's dtype rules, std floor and NaN policy, as squashed_normal's.
        log_std = jnp.broadcast_to(self.log_std[...], mean.shape)
        return squashed_normal_from_log_std(mean, log_std, self.bijector)


def _check_finite(mean_and_std) -> None:
    """A ``checkify`` check naming the first batch element with a non-finite input."""
    mean_and_std = jnp.asarray(mean_and_std)
    finite = jnp.all(jnp.isfinite(mean_and_std), axis=-1)
    batch_shape = finite.shape
    index = jnp.argmin(finite.reshape(-1)) if finite.size else jnp.int32(0)
    checkify.check(
        jnp.all(finite),
        f"mean_and_std has a non-finite value at flat batch index {{index}} of batch "
        f"shape {batch_shape}; check the network that produced it (e.g. for an "
        f"exploding gradient or a division by zero).",
        index=index,
    )
