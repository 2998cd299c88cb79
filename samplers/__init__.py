"""Policy heads from distribution objects, for reinforcement learning in JAX.

The pure layer (:func:`normal_tanh`, :func:`squashed_normal`,
:class:`SquashedNormal`, :class:`BoundedTanh`) turns network outputs into real
``distrax`` distributions; the NNX layer (:class:`NormalTanhSampler`,
:class:`SquashedNormalSampler`) wraps them with the RNG stream, deterministic
mode and replay of stored pre-images.
"""

from samplers.bijectors import BoundedTanh, Tanh
from samplers.distributions import SquashedNormal, normal_tanh, squashed_normal
from samplers.sampler import ActionSampler, NormalTanhSampler, SquashedNormalSampler, functional
from samplers.types import StatefulModule, StatefulModuleOutput

__all__ = [
    "ActionSampler",
    "BoundedTanh",
    "NormalTanhSampler",
    "SquashedNormal",
    "SquashedNormalSampler",
    "StatefulModule",
    "StatefulModuleOutput",
    "Tanh",
    "functional",
    "normal_tanh",
    "squashed_normal",
]
