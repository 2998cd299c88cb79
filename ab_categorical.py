import sys

import jax
import jax.numpy as jnp

import samplers.distributions.categorical as c
from benchmarks import discrete, implementations, timing

timing.set_timing(in_loop=True, only=("samplers (pure layer)",))
variant = sys.argv[1]
if variant == "reduce":
    c._defined_rows = lambda logits: ~jnp.any(jnp.isnan(logits), axis=-1)
names = ("Categorical", "Categorical, masked", "MultiDiscrete")
for case in [x for x in implementations.discrete_cases() if x.name in names]:
    for batch in (1048576, 262144):
        loss_inputs = discrete.inputs(case, batch, jax.random.key(0))
        impls = implementations.discrete_implementations(case)
        steps = {i.name: timing.jitted_steps(i, loss_inputs[:2], loss_inputs)[1] for i in impls}
        samples = timing.interleaved(steps, 3)
        cells = {n: tuple(round(x, 4) for x in timing.summary(v)) for n, v in samples.items()}
        print(variant, case.name, batch, cells, flush=True)
