"""A value an ``nnx.Module`` holds as configuration, not as state."""


class Static:
    """Keeps a value out of a module's state: nnx treats it as static configuration.

    Bounds and other bijector parameters are settings, like ``min_std``; held as
    state they would block ``nnx.update`` (distrax bijectors are immutable pytrees).
    Compared by identity, so ``nnx.jit`` traces once per sampler.
    """

    def __init__(self, value):
        self.value = value
