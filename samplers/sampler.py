"""The NNX layer: a policy head's last layer, drawing from the ``nnx.Rngs`` it holds.

Behaviour is driven by ``rollout_extras``:

- ``None`` (rollout, inference): sample a fresh pre-image ``x`` and emit it as
  ``rollout_extras`` so that a later loss pass can replay it.
- an array (loss replay): score that stored pre-image under the current
  parameters. The stream still advances by the same keys as in the rollout, so
  other stochastic layers stay in lockstep.

``deterministic`` (set by ``module.eval()``) replaces the fresh sample by the
mean, so the action is ``f(mean)``; a replayed pre-image is still scored as given.
Each call draws one key for the sample (none when deterministic) and then one
for the entropy estimate. With ``per_env_streams=True`` the keys live in the
carry state instead, one per environment, and the module's stream is not used
by calls.
"""

import abc
import math
from collections.abc import Callable

import distrax
import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import checkify
from jaxtyping import Array, Float, PRNGKeyArray

from samplers import _checks
from samplers._numerics import k3
from samplers.bijectors import Tanh, squashing
from samplers.distributions import SquashedNormal, squashed_normal, squashed_normal_from_log_std
from samplers.types import StatefulModule, StatefulModuleOutput, Static

# Each entropy estimator and its default number of samples or quadrature nodes.
# Each entropy choice and its default number of samples or nodes; the closed forms
# take none.
_ENTROPY_POINTS = {"sample": 1, "quadrature": 8, "exact": 1, "base": 1}
_CLOSED_FORMS = ("exact", "base")


class ActionSampler(StatefulModule, abc.ABC):
    """A policy head: distribution parameters in, an action out.

    Subclasses hold the ``nnx.Rngs`` they draw from as ``rng`` and take their
    keys from its stream named ``rng_collection`` (``"action"`` by default), which
    falls back to the ``default`` stream as flax's own layers do: with
    ``nnx.Rngs(0)`` the keys come from ``default``; with
    ``nnx.Rngs(params=0, action=1)`` from ``action``.

    Attributes:
        deterministic: If True (``module.eval()``), act with the distribution's
            deterministic action instead of sampling.
        per_env_streams: If True, the carry state holds one key per environment
            (see :meth:`initialize_state`); otherwise it is ``()``.
    """

    rng: nnx.Rngs
    rng_collection: str = "action"
    deterministic: bool = False
    per_env_streams: bool = False

    @abc.abstractmethod
    def __call__(
        self,
        state: tuple[()] | PRNGKeyArray,
        inputs: Float[Array, "*batch params"],
        rollout_extras: Float[Array, "*batch action"] | None = None,
    ) -> StatefulModuleOutput:
        """Samples (``rollout_extras is None``) or replays an action."""

    def initialize_state(self, batch_size: int) -> tuple[()] | PRNGKeyArray:
        """``()``, or with ``per_env_streams`` one new key per environment.

        The keys are split from one key drawn from the module's stream, so each
        call returns new ones.

        Example:
            >>> import jax.numpy as jnp, samplers
            >>> from flax import nnx
            >>> head = samplers.NormalTanhSampler(nnx.Rngs(0), 0.01, per_env_streams=True)
            >>> keys = head.initialize_state(8)
            >>> whole = head(keys, jnp.zeros((8, 4)))
            >>> half = head(keys[4:], jnp.zeros((4, 4)))
            >>> bool(jnp.array_equal(whole.output["action"][4:], half.output["action"]))
            True
        """
        if not self.per_env_streams:
            return ()
        batch_size = _checks.positive_int("batch_size", batch_size)
        return jax.random.split(self._draw(), batch_size)

    def reset_state(self, prev_state: tuple[()] | PRNGKeyArray) -> tuple[()] | PRNGKeyArray:
        """``()``, or with ``per_env_streams`` the same keys: a stream runs across episodes."""
        return prev_state if self.per_env_streams else ()

    def _keys(self, state, batch_shape: tuple[int, ...]):
        """``(next_state, sample key, entropy key)`` for one call.

        From the per-environment keys in ``state``, or from the module's stream:
        one key for the sample (``None`` when deterministic), drawn in replay too
        so that the stream advances the same way in both passes, then one for the
        entropy estimate.
        """
        if self.per_env_streams:
            return _split_env_keys(state, batch_shape)
        sample_key = None if self.deterministic else self._draw()
        return (), sample_key, self._draw()

    def _draw(self) -> PRNGKeyArray:
        return self.rng[self.rng_collection]()


class _SquashedNormalHead(ActionSampler):
    """What the squashed-Normal heads share: the call, replay, metrics and entropy.

    A subclass says how its inputs become a distribution (:meth:`distribution`).
    """

    def __init__(
        self,
        rng,
        entropy_weight,
        *,
        bijector,
        entropy,
        entropy_points,
        checked,
        per_env_streams,
        log_ratio_metrics,
        reparameterized,
        rngs,
        rng_collection,
    ):
        self.rng = _checks.rngs(rng, rngs, rng_collection)
        self.rng_collection = rng_collection
        self.entropy_weight = _checks.real_number("entropy_weight", entropy_weight)
        if entropy not in _ENTROPY_POINTS:
            raise ValueError(f"entropy must be one of {sorted(_ENTROPY_POINTS)}, got {entropy!r}.")
        if entropy in _CLOSED_FORMS and entropy_points is not None:
            raise ValueError(
                f"entropy={entropy!r} is a closed form and takes no "
                f"entropy_points, got {entropy_points!r}; drop it, or use entropy='sample' "
                f"or 'quadrature'."
            )
        self.entropy = entropy
        self.entropy_points = _checks.positive_int(
            "entropy_points", _ENTROPY_POINTS[entropy] if entropy_points is None else entropy_points
        )
        self._bijector = Static(distrax.as_bijector(bijector))
        self.checked = bool(checked)
        self.per_env_streams = bool(per_env_streams)
        self.log_ratio_metrics = bool(log_ratio_metrics)
        self.reparameterized = bool(reparameterized)
        self.deterministic = False

    @property
    def bijector(self) -> distrax.Bijector:
        """The elementwise bijector; its parameters are constants, not module state."""
        return self._bijector.value

    @abc.abstractmethod
    def distribution(self, inputs: Float[Array, "*batch params"], /) -> SquashedNormal:
        """The distribution this sampler draws from for the given inputs."""

    def __call__(
        self,
        state: tuple[()] | PRNGKeyArray,
        mean_and_std: Float[Array, "*batch params"],
        rollout_extras: Float[Array, "*batch action"] | dict | None = None,
    ) -> StatefulModuleOutput:
        """Samples a fresh action, or replays the pre-image in ``rollout_extras``.

        Args:
            state: ``()``, or with ``per_env_streams`` one key per batch element
                (from :meth:`initialize_state` or the last call's ``next_state``).
            mean_and_std: ``[mean | raw_std]``, shape ``[*batch, 2 * action]``
                (for :class:`StateIndependentSampler`, the mean alone).
            rollout_extras: ``None`` to sample; the ``rollout_extras`` of an
                earlier call (shape ``[*batch, action]``, or the dict emitted
                with ``log_ratio_metrics``) to replay it.

        Raises:
            ValueError: the replayed pre-image's shape is not the action shape,
                or the per-environment keys do not match the batch shape.
            TypeError: the replayed pre-image (or, with ``log_ratio_metrics``,
                the stored log-likelihood) is not floating or has fewer bits than
                the dtype the distribution computes in (float32, or float64 for
                float64 parameters under ``jax_enable_x64``): a pre-image stored
                in bfloat16 or float16 is no longer the sampled one, and its
                replay would not reproduce the log-likelihood. Also when
                ``state`` is not a key array and ``per_env_streams`` is set.
        """
        if self.checked:
            _check_finite(mean_and_std)
        dist = self.distribution(mean_and_std)
        next_state, sample_key, entropy_key = self._keys(state, dist.batch_shape)
        old_log_likelihood = None
        if rollout_extras is None:
            if self.deterministic or sample_key is None:
                pre_image = dist.loc
            else:
                pre_image = dist.sample_pre_image(seed=sample_key)
            if not self.reparameterized:
                pre_image = jax.lax.stop_gradient(pre_image)
        else:
            pre_image, old_log_likelihood = self._unpack(
                rollout_extras, dist.loc.shape, dist.loc.dtype
            )
            pre_image = jax.lax.stop_gradient(pre_image)
        action, log_likelihood = dist.forward_and_log_prob(pre_image)
        entropy = self._entropy(dist, entropy_key)
        metrics = self._metrics(dist, action, log_likelihood, old_log_likelihood)
        pre_image = jax.lax.stop_gradient(pre_image)
        if self.log_ratio_metrics:
            rollout_extras = {
                "pre_image": pre_image,
                "log_likelihood": jax.lax.stop_gradient(log_likelihood),
            }
        else:
            rollout_extras = pre_image
        return StatefulModuleOutput(
            next_state=next_state,
            output={"action": action, "log_likelihood": log_likelihood},
            regularization_loss=-self.entropy_weight * entropy,
            metrics=metrics,
            rollout_extras=rollout_extras,
        )

    def _metrics(self, dist, action, log_likelihood, old_log_likelihood) -> dict:
        metrics = {"mu": dist.loc, "sigma": dist.scale}
        bounds = squashing(self.bijector)
        if bounds is not None:
            distances = bounds.distances(action)
            # A NaN action is neither on a bound nor off it: its saturation is NaN.
            on_bound = jnp.where(jnp.isnan(distances), jnp.nan, distances <= 0)
            metrics["saturation"] = jnp.mean(on_bound, axis=-1, dtype=action.dtype)
            metrics["bound_distance"] = jnp.min(distances, axis=-1)
        if old_log_likelihood is not None:
            log_ratio = log_likelihood - old_log_likelihood
            metrics["log_ratio"] = log_ratio
            metrics["approx_kl"] = k3(log_ratio)
        return metrics

    def _unpack(self, rollout_extras, action_shape, dtype):
        """The stored pre-image, and the rollout's log-likelihood if it was stored."""
        if not self.log_ratio_metrics:
            if isinstance(rollout_extras, dict):
                raise TypeError(
                    f"rollout_extras is a dict with keys {sorted(rollout_extras)}, but this "
                    f"sampler replays the stored pre-image array alone; pass "
                    f"log_ratio_metrics=True to the sampler that emitted it."
                )
            return _replayed(rollout_extras, action_shape, dtype), None
        if not isinstance(rollout_extras, dict) or set(rollout_extras) != {
            "pre_image",
            "log_likelihood",
        }:
            raise TypeError(
                f"with log_ratio_metrics=True, rollout_extras must be the dict "
                f"{{'pre_image', 'log_likelihood'}} that the rollout call emitted, got "
                f"{type(rollout_extras).__name__}."
            )
        old = rollout_extras["log_likelihood"]
        old = _checks.float_array("rollout_extras['log_likelihood']", old)
        _check_precision("rollout_extras['log_likelihood']", old, dtype)
        if old.shape != action_shape[:-1]:
            raise ValueError(
                f"rollout_extras['log_likelihood'] must have the batch shape "
                f"{action_shape[:-1]}, got {old.shape}."
            )
        return _replayed(rollout_extras["pre_image"], action_shape, dtype), old

    def _entropy(self, dist: SquashedNormal, key) -> Float[Array, "*batch"]:
        if self.entropy == "sample":
            return dist.entropy_estimate(seed=key, num_samples=self.entropy_points)
        if self.entropy == "quadrature":
            return dist.entropy_quadrature(self.entropy_points)
        if self.entropy == "exact":
            return dist.entropy()
        return jnp.asarray(dist.distribution.entropy())


class SquashedNormalSampler(_SquashedNormalHead):
    """Samples ``f(x)``, ``x ~ N(mean, std)``, for an elementwise distrax bijector ``f``.

    The input's last axis is ``[mean | raw_std]`` and
    ``std = (softplus(raw_std) + min_std) * std_scale``; the distribution is
    :func:`samplers.squashed_normal`. The output is
    ``{"action": f(x), "log_likelihood": log p(f(x))}``, with ``x`` in
    ``rollout_extras`` and the log-likelihood computed from ``x`` (never from
    ``f^-1(action)``, which is infinite once ``f`` saturates). The
    ``regularization_loss`` is ``-entropy_weight * H`` for a one-sample
    reparameterised entropy estimate ``H`` (unbiased, not exact).

    ``metrics`` holds ``mu`` and ``sigma`` and, for a bounded squashing (tanh,
    ``BoundedTanh``, sigmoid), per batch element: ``saturation``, the fraction of
    action dimensions exactly on a bound (for tanh: the pre-image is past float32
    saturation, where only the stored pre-image can be scored), and
    ``bound_distance``, the smallest distance of the action to a bound (see
    :func:`samplers.bound_distance`). With ``log_ratio_metrics=True``, a replay
    also reports ``log_ratio`` (current minus rollout log-likelihood) and
    ``approx_kl``, the per-element k3 estimate ``expm1(log_ratio) - log_ratio``
    of ``KL(rollout || current)``; :func:`samplers.ppo_log_ratio_stats` turns
    them into clip fractions.

    Args:
        rng: The ``nnx.Rngs`` to draw from (or pass it as ``rngs=``, flax's
            keyword); the sampler keeps and advances it.
        entropy_weight: Weight of the entropy bonus, finite (required).
        bijector: Elementwise squashing, e.g. ``samplers.BoundedTanh(low, high)``,
            ``distrax.Sigmoid()`` or ``distrax.Lambda(lambda x: x)``.
        min_std: Floor added to the softplus, ``>= 0``.
        std_scale: Factor applied to the std, ``> 0``.
        entropy: How ``H`` is computed. ``"sample"`` (the default): the mean of
            ``entropy_points`` reparameterised samples (default 1, the specified
            one-sample estimate); unbiased. ``"quadrature"``: Gauss-Hermite with
            ``entropy_points`` nodes (default 8); deterministic and zero-variance,
            but biased low for wide stds (for tanh at 8 nodes: under 4e-3 nats up
            to std 1.3, up to 0.21 nats at std 4). ``"exact"``: ``dist.entropy()``, the
            exact entropy (tanh, ``BoundedTanh`` and sigmoid), deterministic and
            differentiable. ``"base"``: the Normal's entropy alone, ignoring the
            squashing; biased upwards for tanh. Every choice draws the same key,
            so the stream does not depend on it.
        entropy_points: Samples or nodes for ``"sample"`` and ``"quadrature"``;
            ``None`` for the default.
        checked: If True, each call checks that ``mean_and_std`` is finite with
            ``jax.experimental.checkify`` and reports the first offending batch
            index. Run the step under ``checkify.checkify`` (eager calls raise at
            once). Off by default: NaN or inf inputs then propagate to NaN or inf
            outputs, never to finite wrong numbers.
        per_env_streams: If True, each environment has its own random stream in
            the carry state: :meth:`initialize_state` returns one key per
            environment (drawn from ``rng``), each call splits every key into the
            next state's key, a sample key and an entropy key, and
            :meth:`reset_state` keeps the keys. An environment's samples then do
            not depend on how the batch is split into minibatches or devices, and
            ``eval()`` consumes the keys the same way. Pass the state that the
            rollout call received to its replay to replay the entropy noise too.
        log_ratio_metrics: If True, the rollout emits ``{"pre_image",
            "log_likelihood"}`` as ``rollout_extras`` (instead of the pre-image
            alone) and a replay of it adds ``log_ratio`` and ``approx_kl`` to
            ``metrics``.
        reparameterized: If True, the action keeps its pathwise gradient: a
            fresh sample and its log-likelihood are differentiable functions of
            ``mean`` and ``std`` through ``x = mean + std * eps`` (the noise
            ``eps`` is a constant), and after ``eval()`` the deterministic action
            ``f(mean)`` and its log-likelihood keep their gradient through
            ``x = mean`` (the pathwise gradient at ``eps = 0``), with
            ``d f(mean) / d mean = f'(mean)``. This is what an
            SAC-style actor loss ``alpha * log_likelihood - Q(s, action)`` and a
            TD3-style one, ``-Q(s, f(mean))`` on the ``eval()`` head, need. For
            the tanh and sigmoid families, where float32 ``f(x)`` rounds to a
            bound the gradient is still ``f'(x) * dQ/da`` (``f'(10) ~ 8e-9`` for
            tanh), not 0. If False (the default, as specified for PPO-style replay),
            the fresh sample and the deterministic action ``f(mean)`` are
            constants: gradients reach ``mean`` and ``std`` only through the
            log-density of that fixed action, and ``-Q(s, f(mean))`` has no
            gradient at all. The values do not depend on the flag, and a
            replayed pre-image is scored as given in both modes. In both modes
            ``rollout_extras`` is the pre-image, without gradient: what a PPO
            loss replays, and what an off-policy buffer may keep beside the
            action.
        rngs: The ``nnx.Rngs``, as flax's keyword; give it or ``rng``, not both.
        rng_collection: The name of the stream keys are drawn from; an
            ``nnx.Rngs`` without it falls back to its ``default`` stream.

    Raises:
        TypeError: no stream, or both ``rng`` and ``rngs``, or not an
            ``nnx.Rngs``, or an option is not a number.
        ValueError: an option is out of range or not finite, or the
            ``nnx.Rngs`` has neither the ``rng_collection`` stream nor ``default``.

    Example:
        >>> import distrax, jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> head = samplers.SquashedNormalSampler(nnx.Rngs(0), 0.01, bijector=distrax.Sigmoid())
        >>> out = head((), jnp.zeros((5, 4)))
        >>> out.output["action"].shape, out.rollout_extras.shape
        ((5, 2), (5, 2))
    """

    def __init__(
        self,
        rng: nnx.Rngs | None = None,
        entropy_weight: float | None = None,
        *,
        bijector: distrax.Bijector | Callable,
        min_std: float = 1e-3,
        std_scale: float = 1.0,
        entropy: str = "sample",
        entropy_points: int | None = None,
        checked: bool = False,
        per_env_streams: bool = False,
        log_ratio_metrics: bool = False,
        reparameterized: bool = False,
        rngs: nnx.Rngs | None = None,
        rng_collection: str = "action",
    ):
        super().__init__(
            rng,
            entropy_weight,
            bijector=bijector,
            entropy=entropy,
            entropy_points=entropy_points,
            checked=checked,
            per_env_streams=per_env_streams,
            log_ratio_metrics=log_ratio_metrics,
            reparameterized=reparameterized,
            rngs=rngs,
            rng_collection=rng_collection,
        )
        self.min_std = _checks.real_number("min_std", min_std, minimum=0.0)
        self.std_scale = _checks.real_number("std_scale", std_scale, above=0.0)

    def distribution(self, mean_and_std: Float[Array, "*batch params"]) -> SquashedNormal:
        """The distribution this sampler draws from for the given network output."""
        return squashed_normal(
            mean_and_std, self.bijector, min_std=self.min_std, std_scale=self.std_scale
        )


class NormalTanhSampler(SquashedNormalSampler):
    """Samples ``tanh(x)``, ``x ~ N(mean, std)``: :class:`SquashedNormalSampler` with tanh.

    Args:
        rng: The ``nnx.Rngs`` to draw from (or ``rngs=``); the sampler keeps and
            advances it.
        entropy_weight: Weight of the entropy bonus, finite (required).
        min_std: Floor added to the softplus, ``>= 0``.
        std_scale: Factor applied to the std, ``> 0``.
        entropy: ``"sample"``, ``"quadrature"``, ``"exact"`` or ``"base"``; see
            :class:`SquashedNormalSampler`.
        entropy_points: Samples or nodes for ``"sample"`` and ``"quadrature"``;
            ``None`` for the default.
        checked: Check inputs for NaN and inf; see :class:`SquashedNormalSampler`.
        per_env_streams: One random stream per environment in the carry state;
            see :class:`SquashedNormalSampler`.
        log_ratio_metrics: Store the rollout's log-likelihood and report PPO
            log-ratio metrics in replay; see :class:`SquashedNormalSampler`.
        reparameterized: Keep the pathwise gradient of a fresh sample and of the
            deterministic action ``f(mean)`` (SAC- and TD3-style actor losses);
            see :class:`SquashedNormalSampler`.
        rngs: The ``nnx.Rngs``, as flax's keyword; give it or ``rng``.
        rng_collection: The stream keys are drawn from, falling back to
            ``default``; see :class:`ActionSampler`.

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

    def __init__(
        self,
        rng: nnx.Rngs | None = None,
        entropy_weight: float | None = None,
        min_std: float = 1e-3,
        std_scale: float = 1.0,
        *,
        entropy: str = "sample",
        entropy_points: int | None = None,
        checked: bool = False,
        per_env_streams: bool = False,
        log_ratio_metrics: bool = False,
        reparameterized: bool = False,
        rngs: nnx.Rngs | None = None,
        rng_collection: str = "action",
    ):
        super().__init__(
            rng,
            entropy_weight,
            bijector=Tanh(),
            min_std=min_std,
            std_scale=std_scale,
            entropy=entropy,
            entropy_points=entropy_points,
            checked=checked,
            per_env_streams=per_env_streams,
            log_ratio_metrics=log_ratio_metrics,
            reparameterized=reparameterized,
            rngs=rngs,
            rng_collection=rng_collection,
        )


class StateIndependentSampler(_SquashedNormalHead):
    """A squashed Normal whose std is a learned parameter, not a network output.

    The input is the mean alone, shape ``[*batch, action_dim]``; the std is
    ``exp(log_std)``, one ``nnx.Param`` per action dimension shared by every
    state, as many PPO implementations use. Sampling, replay, the stream, the
    entropy estimators and the bijector work as in :class:`SquashedNormalSampler`.

    Args:
        rng: The ``nnx.Rngs`` to draw from (or ``rngs=``); the sampler keeps and
            advances it.
        action_dim: Number of action dimensions (required).
        entropy_weight: Weight of the entropy bonus, finite (required).
        bijector: Elementwise squashing (default ``samplers.Tanh()``).
        initial_std: The std before training, ``> 0``.
        entropy: ``"sample"``, ``"quadrature"``, ``"exact"`` or ``"base"``; see
            :class:`SquashedNormalSampler`.
        entropy_points: Samples or nodes for ``"sample"`` and ``"quadrature"``;
            ``None`` for the default.
        checked: Check inputs for NaN and inf; see :class:`SquashedNormalSampler`.
        per_env_streams: One random stream per environment in the carry state;
            see :class:`SquashedNormalSampler`.
        log_ratio_metrics: Store the rollout's log-likelihood and report PPO
            log-ratio metrics in replay; see :class:`SquashedNormalSampler`.
        reparameterized: Keep the pathwise gradient of a fresh sample and of the
            deterministic action ``f(mean)`` (SAC- and TD3-style actor losses);
            see :class:`SquashedNormalSampler`.
        rngs: The ``nnx.Rngs``, as flax's keyword; give it or ``rng``.
        rng_collection: The stream keys are drawn from, falling back to
            ``default``; see :class:`ActionSampler`.

    Raises:
        TypeError: an option is not a number of the right kind.
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
        rng: nnx.Rngs | None = None,
        action_dim: int | None = None,
        entropy_weight: float | None = None,
        *,
        bijector: distrax.Bijector | Callable | None = None,
        initial_std: float = 1.0,
        entropy: str = "sample",
        entropy_points: int | None = None,
        checked: bool = False,
        per_env_streams: bool = False,
        log_ratio_metrics: bool = False,
        reparameterized: bool = False,
        rngs: nnx.Rngs | None = None,
        rng_collection: str = "action",
    ):
        super().__init__(
            rng,
            entropy_weight,
            bijector=Tanh() if bijector is None else bijector,
            entropy=entropy,
            entropy_points=entropy_points,
            checked=checked,
            per_env_streams=per_env_streams,
            log_ratio_metrics=log_ratio_metrics,
            reparameterized=reparameterized,
            rngs=rngs,
            rng_collection=rng_collection,
        )
        self.action_dim = _checks.positive_int("action_dim", action_dim)
        initial_std = _checks.real_number("initial_std", initial_std, above=0.0)
        self.log_std = nnx.Param(jnp.full((self.action_dim,), math.log(initial_std)))

    def distribution(self, mean: Float[Array, "*batch action"]) -> SquashedNormal:
        """The distribution for the given means, with the learned std."""
        mean = _checks.float_array("mean", mean)
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


def _split_env_keys(keys, batch_shape: tuple[int, ...]):
    """Splits one key per batch element into (next keys, sample keys, entropy keys)."""
    if not isinstance(keys, jax.Array) or not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"with per_env_streams=True the state must be one key per environment, got "
            f"{type(keys).__name__}; pass sampler.initialize_state(batch_size) to the first "
            f"call and each call's next_state to the next."
        )
    if keys.shape != batch_shape:
        raise ValueError(
            f"the state must hold one key per batch element, shape {batch_shape}, got "
            f"{keys.shape}; slice the keys with the inputs when splitting a batch."
        )
    split = jax.vmap(lambda key: jax.random.split(key, 3))(keys.reshape(-1))
    return tuple(split[:, i].reshape(batch_shape) for i in range(3))


def _replayed(
    rollout_extras, action_shape: tuple[int, ...], dtype
) -> Float[Array, "*batch action"]:
    """Checks a replayed pre-image against the action shape and dtype of this call."""
    pre_image = _checks.float_array(
        "rollout_extras", rollout_extras, hint=" (the stored pre-tanh action)"
    )
    _check_precision("rollout_extras", pre_image, dtype)
    if pre_image.shape != action_shape:
        raise ValueError(
            f"rollout_extras must have the action shape {action_shape} (the stored raw "
            f"action of this batch), got {pre_image.shape}; pass the rollout_extras that "
            f"the rollout call returned for these inputs."
        )
    return pre_image


def _check_precision(name: str, stored: Array, dtype) -> None:
    """Refuses a stored value rounded to fewer bits than the distribution computes in."""
    if jnp.finfo(stored.dtype).bits < jnp.finfo(dtype).bits:
        raise TypeError(
            f"{name} must be stored in {dtype} (or wider), the dtype this sampler "
            f"computes in, got {stored.dtype}: the rounded value is not the one the rollout "
            f"emitted, so its log-likelihood and the PPO ratio change; store rollout_extras "
            f"in {dtype}, as the rollout call emitted them."
        )


def functional(sampler: ActionSampler) -> tuple[Callable, dict]:
    """Splits a sampler once into a jitted pure function and its state.

    Calling a module through ``nnx.jit`` re-walks its graph on every call, which
    dominates at small batch sizes. ``apply(state, inputs, rollout_extras=None,
    carry=())`` runs the sampler under ``jax.jit`` on the carry state ``carry``
    and returns ``(output, next_state)``: thread ``next_state`` into the next call
    as a training loop threads any other state (and ``output.next_state`` into
    ``carry``). The state is a plain nested dict of arrays (``nnx.to_pure_dict``);
    ``nnx.update(sampler, state)`` writes it back into the module.
    ``deterministic`` is read when ``functional`` is called: call it again after
    ``eval()`` or ``train()``.

    Args:
        sampler: Any :class:`ActionSampler`.

    Returns:
        ``(apply, state)``: the jitted function and the sampler's current state.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> head = samplers.NormalTanhSampler(nnx.Rngs(0), 0.01)
        >>> apply, state = samplers.functional(head)
        >>> out, state = apply(state, jnp.zeros((8, 4)))
        >>> replay, state = apply(state, jnp.zeros((8, 4)), out.rollout_extras)
        >>> nnx.update(head, state)
        >>> int(head.rng.default.count[...])
        4
    """
    graphdef, state = nnx.split(sampler)

    @jax.jit
    def apply(state, inputs, rollout_extras=None, carry=()):
        module = nnx.merge(graphdef, state)
        out = module(carry, inputs, rollout_extras)
        return out, nnx.to_pure_dict(nnx.state(module))

    return apply, nnx.to_pure_dict(state)
