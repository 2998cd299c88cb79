"""One training step on a global batch over four CPU devices, run by ``tests/test_distributed.py``.

``python -m tests._distributed_script OUT.npz`` runs it in one process (started
with ``--xla_force_host_platform_device_count=4``);
``... OUT.npz --process-id I --num-processes 2 --port P`` runs process ``I`` of two
that join through ``jax.distributed`` on ``127.0.0.1:P`` (each started with two
devices). Every process builds the same modules from the same seeds, holds its
rows of the global batch, and runs the same jitted programs on global arrays:

- a rollout of a small policy (``nnx.Linear`` and ``NormalTanhSampler``),
- the loss pass that replays the stored pre-images and takes the gradient of the
  mean log-likelihood plus entropy cost with respect to the policy's parameters,
- two steps of a sampler with ``per_env_streams=True``, and a replay of the first.

Each process gathers the global results and writes them to ``OUT.npz``. Every
shard's rows of inputs are the same, so that only the noise can tell shards apart.
Nothing runs on import (``pytest --doctest-modules`` imports this module).
"""

import argparse

import jax
import numpy as np

DEVICES = 4
B = 8
ROWS = B // DEVICES
A = 3
OBSERVATIONS = 4
ENTROPY_WEIGHT = 0.01


def _run() -> dict[str, np.ndarray]:
    # Imported after jax.distributed.initialize, which must precede any computation.
    import jax.numpy as jnp
    from flax import nnx
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import samplers

    if jax.device_count() != DEVICES:
        raise RuntimeError(f"expected {DEVICES} devices in all, got {jax.device_count()}.")
    batch = NamedSharding(jax.make_mesh((DEVICES,), ("batch",)), P("batch"))

    def global_batch(rows: np.ndarray) -> jax.Array:
        """The global array whose addressable shards this process fills from ``rows``."""
        return jax.make_array_from_callback(rows.shape, batch, lambda index: rows[index])

    def gathered(tree) -> dict:
        return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))

    class Policy(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.linear = nnx.Linear(OBSERVATIONS, 2 * A, rngs=rngs)
            self.head = samplers.NormalTanhSampler(entropy_weight=ENTROPY_WEIGHT, rngs=rngs)

        def __call__(self, observations, rollout_extras=None):
            return self.head((), self.linear(observations), rollout_extras)

    @nnx.jit
    def rollout(policy, observations):
        out = policy(observations)
        return {
            "action": out.output["action"],
            "log_likelihood": out.output["log_likelihood"],
            "pre_image": out.rollout_extras,
            "regularization_loss": out.regularization_loss,
        }

    @nnx.jit
    def loss_and_gradient(policy, observations, pre_image):
        def loss(policy):
            out = policy(observations, pre_image)
            return jnp.mean(out.output["log_likelihood"] + out.regularization_loss), out

        (value, out), grads = nnx.value_and_grad(loss, has_aux=True)(policy)
        return {
            "loss": value,
            "replay_log_likelihood": out.output["log_likelihood"],
            "grad_kernel": grads["linear"]["kernel"][...],
            "grad_bias": grads["linear"]["bias"][...],
        }

    @nnx.jit
    def per_env_step(sampler, key_data, mean_and_std, rollout_extras=None):
        out = sampler(jax.random.wrap_key_data(key_data), mean_and_std, rollout_extras)
        return {
            "pre_image": out.rollout_extras,
            "log_likelihood": out.output["log_likelihood"],
            "regularization_loss": out.regularization_loss,
            "next_key_data": jax.random.key_data(out.next_state),
        }

    rng = np.random.default_rng(0)
    observations = np.tile(rng.normal(size=(ROWS, OBSERVATIONS)).astype(np.float32), (DEVICES, 1))
    mean_and_std = np.tile(2.0 * rng.normal(size=(ROWS, 2 * A)).astype(np.float32), (DEVICES, 1))

    results = {}
    policy = Policy(nnx.Rngs(params=0, action=1))
    stored = rollout(policy, global_batch(observations))
    results |= {f"rollout/{k}": v for k, v in gathered(stored).items()}
    step = loss_and_gradient(policy, global_batch(observations), stored["pre_image"])
    results |= {f"loss_pass/{k}": v for k, v in gathered(step).items()}
    results["stream_count"] = np.asarray(policy.head.rng.action.count[...])

    per_env = samplers.NormalTanhSampler(nnx.Rngs(2), ENTROPY_WEIGHT, per_env_streams=True)
    keys = np.asarray(jax.random.key_data(per_env.initialize_state(B)))
    first = per_env_step(per_env, global_batch(keys), global_batch(mean_and_std))
    second = per_env_step(per_env, first["next_key_data"], global_batch(mean_and_std))
    replay = per_env_step(
        per_env, global_batch(keys), global_batch(mean_and_std), first["pre_image"]
    )
    for name, out in (("first", first), ("second", second), ("replay", replay)):
        results |= {f"per_env_{name}/{k}": v for k, v in gathered(out).items()}
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--port", type=int)
    parser.add_argument("--timeout", type=int, default=60)
    args = parser.parse_args()
    # CPU collectives between processes go through gloo (jax 0.10's default; explicit
    # for versions whose default differs).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.num_processes > 1:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=args.timeout,
        )
    results = _run()
    np.savez(args.out, **results)
    if args.num_processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
