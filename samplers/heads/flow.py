"""The flow head: a squashed Normal with learned, state-conditioned layers between.

The network output is ``[mean | raw_std | features]``; coupling layers whose
conditioners (MLPs held by the head) see the untouched action dimensions and the
features move the Normal's sample before the squashing. The replay data is the
squashing's pre-image, scored by inverting the layers (:class:`samplers.SquashedFlow`).
The call is :class:`samplers.ActionSampler`'s.
"""

import dataclasses
import itertools
from collections.abc import Sequence

import distrax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from samplers import _checks
from samplers.distributions.bijectors import Tanh
from samplers.distributions.constructors import squashed_flow
from samplers.distributions.flow import SquashedFlow, coupling_layer
from samplers.heads.action_sampler import Scored
from samplers.heads.pre_image import Entropy, PreImageSampler
from samplers.heads.static import Static

_TRANSFORMS = ("affine", "spline")


class FlowSampler(PreImageSampler):
    """Samples ``f(g_K(... g_1(x0)))``, ``x0 ~ N(mean, std)``, with learned coupling
    layers ``g_k`` conditioned on state features.

    The input's last axis is ``[mean | raw_std | features]``: the base Normal's
    parameters (``std`` as in :class:`samplers.SquashedNormalSampler`), then
    ``feature_dim`` features of the state. Layer ``k`` is
    :func:`samplers.distributions.flow.coupling_layer`: the dimensions its mask keeps
    pass through, each other one goes through an elementwise transform whose
    parameters an MLP (this module's ``nnx.Param``) computes from the kept dimensions
    and the features. The MLPs' last layer starts at zero: a new head is the
    squashed-Normal head.

    The replay data is the squashing's pre-image ``x_K``; a replay scores it by
    inverting the layers under the current parameters (never the squashing), so a
    saturated action stays finite. A rollout's sample is scored the same way (the
    layers' inverse after their forward pass); its replay reproduces it to float32
    rounding (different XLA programs round matrix products differently), which
    spline layers amplify where a bin is nearly flat (the flow guide gives the
    bound). With ``reparameterized=True`` (SAC) a fresh sample is scored forward,
    as ``dist.sample_with_pre_image`` scores it, no inverse run; its replay agrees
    to float rounding. The entropy has no closed form: ``"sample"`` (the default:
    the Normal's entropy plus the log-determinant at one draw, unbiased),
    ``("sample", n)`` or ``"base"`` (the Normal's entropy alone). Non-finite inputs
    (a mean, raw std or feature), or a NaN conditioner output, make that batch
    element's outputs NaN.

    Args:
        rngs: The ``nnx.Rngs`` that initialises the MLPs (its ``params`` stream) and
            that the head draws from (its ``rng_collection`` stream, see
            :class:`samplers.ActionSampler`).
        entropy_weight: Weight of the entropy bonus, finite (required).
        action_dim: The action dimension (required).
        feature_dim: The width of the features after ``[mean | raw_std]``; 0 for a
            flow that does not see the state.
        num_layers: How many coupling layers, at least 1.
        transform: ``"affine"`` (a shift and a softly clamped scale) or
            ``("spline", num_bins)`` (``"spline"``: 8 bins), a rational-quadratic
            spline on ``[-spline_range, spline_range]``, the identity outside. With
            ``action_dim=1`` affine layers make a squashed Normal whose mean and std
            they move; take splines for any other shape.
        spline_range: The half-width of the interval a spline acts on, positive
            (5.0); pre-images outside it pass the spline layers unchanged.
        hidden_sizes: The MLPs' hidden widths.
        min_std: Floor added to the softplus.
        std_scale: Multiplies the std.
        bijector: The elementwise squashing (``samplers.Tanh()`` by default).
        entropy: ``"sample"``, ``("sample", n)`` or ``"base"``, as above.
        reparameterized: If True, a fresh sample keeps its pathwise gradient and is
            scored forward (SAC).
        per_env_streams: One random stream per environment in the carry state; an
            environment's base draw does not depend on the rest of the batch, its
            action to rounding (the conditioners' matrix products round by batch size).
        log_ratio_metrics: As in :class:`samplers.SquashedNormalSampler`.
        rng_collection: The stream keys are drawn from.

    Raises:
        TypeError: ``rngs`` is not an ``nnx.Rngs``.
        ValueError: an option is out of range, or ``entropy`` is ``"exact"`` or
            ``"quadrature"``, which a flow does not have.
        flax.errors.TraceContextError: at a call under ``jax.grad`` or ``jax.jit``
            (not nnx's) that needs a key: the message names ``entropy="base"``.

    Example:
        >>> import jax.numpy as jnp, samplers
        >>> from flax import nnx
        >>> head = samplers.FlowSampler(nnx.Rngs(0), 0.01, action_dim=2, feature_dim=3)
        >>> head.num_params
        7
        >>> out = head((), jnp.zeros((5, 7)))
        >>> again = head((), jnp.zeros((5, 7)), out.rollout_extras)
        >>> bool(jnp.all(again.output["log_likelihood"] == out.output["log_likelihood"]))
        True
    """

    _key_free_entropy = "build the head with entropy='base'"  # for the key error

    def __init__(
        self,
        rngs: nnx.Rngs | None = None,
        entropy_weight: float | None = None,
        *,
        action_dim: int | None = None,
        feature_dim: int = 0,
        num_layers: int = 2,
        transform: str | tuple[str, int] = "affine",
        spline_range: float = 5.0,
        hidden_sizes: Sequence[int] = (64, 64),
        min_std: float = 1e-3,
        std_scale: float = 1.0,
        bijector: distrax.Bijector | None = None,
        entropy: Entropy = "sample",
        reparameterized: bool = False,
        per_env_streams: bool = False,
        log_ratio_metrics: bool = False,
        rng_collection: str = "action",
    ):
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(
                f"FlowSampler needs an nnx.Rngs (it initialises its MLPs from it), got "
                f"{type(rngs).__name__}; pass e.g. nnx.Rngs(0)."
            )
        if action_dim is None:
            raise ValueError("FlowSampler needs action_dim=, the action dimension.")
        super().__init__(
            rngs,
            entropy_weight,
            entropy=entropy,
            reparameterized=reparameterized,
            per_env_streams=per_env_streams,
            log_ratio_metrics=log_ratio_metrics,
            rng_collection=rng_collection,
        )
        if self.entropy[0] not in ("sample", "base"):
            raise ValueError(
                f"a flow has no closed-form or quadrature entropy; pass entropy='sample', "
                f"('sample', n) or 'base', got {entropy!r}."
            )
        self.action_dim = _checks.positive_int("action_dim", action_dim)
        self.min_std = _checks.real_number("min_std", min_std, minimum=0.0)
        self.std_scale = _checks.real_number("std_scale", std_scale, above=0.0)
        self._bijector = Static(distrax.as_bijector(Tanh() if bijector is None else bijector))
        if isinstance(feature_dim, bool) or not isinstance(feature_dim, (int, np.integer)):
            raise TypeError(f"feature_dim must be an integer >= 0, got {feature_dim!r}.")
        if feature_dim < 0:
            raise ValueError(f"feature_dim must be an integer >= 0, got {feature_dim}.")
        self.feature_dim = int(feature_dim)
        num_layers = _checks.positive_int("num_layers", num_layers)
        self.transform = _transform_choice(transform)
        self.spline_range = _checks.real_number("spline_range", spline_range, above=0.0)
        action = self.action_dim
        width = 2 if self.transform[0] == "affine" else 3 * self.transform[1] + 1
        self.conditioners = nnx.List(
            [
                _Conditioner(action + self.feature_dim, hidden_sizes, action * width, rngs)
                for _ in range(num_layers)
            ]
        )

    @property
    def bijector(self) -> distrax.Bijector:
        """The elementwise squashing; its parameters are constants, not module state."""
        return self._bijector.value

    @property
    def num_params(self) -> int:
        """``2 * action_dim + feature_dim``: ``[mean | raw_std | features]``."""
        return super().num_params + self.feature_dim

    def _distribution(self, inputs: Float[Array, "*batch params"], mask=None) -> SquashedFlow:
        self._check_width(inputs, "[mean | raw_std | features]", "2 * action_dim + feature_dim")
        split = self.num_params - self.feature_dim
        # A non-finite feature is NaN to the conditioners, whose outputs it makes NaN
        # (an infinite one could give a finite but meaningless scale), and with them the
        # log-likelihood and every dimension a layer transforms (_sample: the others).
        features = _nan_where_not_finite(inputs[..., split:])
        layers = [
            coupling_layer(
                k, self.action_dim, conditioner, features, self.transform, self.spline_range
            )
            for k, conditioner in enumerate(self.conditioners)
        ]
        return squashed_flow(
            inputs[..., :split],
            layers,
            self.bijector,
            min_std=self.min_std,
            std_scale=self.std_scale,
        )

    def _sample(self, inputs, dist, modes, key) -> Scored:
        scored = super()._sample(inputs, dist, modes, key)
        if len(self.conditioners) > 1 or self.action_dim == 1:
            return scored
        # One layer keeps half of the dimensions as drawn: where a non-finite feature or
        # conditioner output made the log-likelihood NaN, the whole draw is NaN. (Setting
        # the base Normal's parameters to NaN instead made a one-layer rollout 1.5 times
        # slower on a TPU: the flow guide.)
        nan = jnp.isnan(scored.log_likelihood)[..., None]
        return dataclasses.replace(
            scored,
            data=jnp.where(nan, jnp.nan, scored.data),
            action=jnp.where(nan, jnp.nan, scored.action),
        )

    def _metrics(self, inputs, dist, scored) -> dict:
        return {"mu": dist.loc, "sigma": dist.scale, **super()._metrics(inputs, dist, scored)}


def _nan_where_not_finite(x: Array) -> Array:
    return jnp.where(jnp.isfinite(x), x, jnp.nan)


class _Conditioner(nnx.Module):
    """An MLP whose last layer starts at zero (its layer starts as the identity)."""

    def __init__(self, size_in: int, hidden_sizes: Sequence[int], size_out: int, rngs):
        sizes = [size_in, *(int(h) for h in hidden_sizes)]
        self.hidden = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])
        zeros = nnx.initializers.zeros_init()
        self.out = nnx.Linear(sizes[-1], size_out, kernel_init=zeros, bias_init=zeros, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        for layer in self.hidden:
            x = jax.nn.relu(layer(x))
        return self.out(x)


def _transform_choice(transform) -> tuple[str, int]:
    """``transform`` as ``(name, num_bins)`` (0 bins for ``"affine"``)."""
    if transform == "affine":
        return "affine", 0
    if transform == "spline":
        return "spline", 8
    if isinstance(transform, tuple) and len(transform) == 2 and transform[0] == "spline":
        return "spline", _checks.positive_int("the bins in transform", transform[1])
    raise ValueError(
        f"transform must be 'affine', 'spline' or ('spline', num_bins), got {transform!r}."
    )
