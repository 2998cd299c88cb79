"""GRPO on a tiny transformer that learns to reverse digits, with top-p sampling.

Run ``python -m samplers.examples.grpo`` (``--help`` lists the flags). The prompt is
four random digits and a separator; the model writes four tokens, and the reward is
the fraction of them that match the prompt's digits reversed (``3 1 4 1 |`` asks for
``1 4 1 3``), in ``[0, 1]``. The task is checked exactly, gives partial credit (so
the completions of a group differ in reward from the start), and needs what a
language model needs: each written token must attend to one position of the prompt.
The vocabulary has 16 tokens: the ten digits, the separator and five tokens that
never earn a reward. A uniform policy earns 1/16 per token; a two-layer transformer
with ``d_model`` 64 learns the task from scratch in about a minute on two CPU cores.

The model is causal self-attention with tied embeddings: the unembedding is the
embedding table transposed, and the head takes the table itself
(``TokenCategorical(hidden, embedding=table)``), whose rows a support gathers. The
rollout is a ``lax.scan`` decode loop, one token a step (the model reads the whole
buffer each step: no key-value cache), each token drawn from a
:class:`samplers.TokenCategorical` with temperature 1 and ``top_p`` 0.9; it stores per
token the token and its support (the kept ids).
The GRPO update normalises each completion's reward within its group of
``group_size`` completions of the same prompt, and minimises the clipped PPO loss for
a few epochs, the ratio being ``exp(replay log-prob - stored)``: the stored token
scored on its stored support under the current weights. The old log-probabilities are
taken as trainers take them, by the model's forward pass over the written sequences
(the decode loop's own, from hidden states the model computed in another program, can
differ in their last bits: ``decode_ratio_error``). Before the first step the weights
are the rollout's, and the replay gives the ratio exactly 1 (``replay_ratio_error``,
the largest ``|ratio - 1|``, is 0.0), and so are the loss's first-epoch ratios,
computed in the program that differentiates them (``loss_ratio_error``, 0.0). Scored
on the whole vocabulary instead, ``exp(full_log_prob - stored)`` is the mass the top-p
kept (``full_vocabulary_ratio``), below 1 even before any update.

``--sampler plain`` runs the same example as plain JAX writes it: ``lax.top_k`` of the
logits with top-p renormalised over them, ``jax.random.categorical``, and the token's
log-probability over the whole vocabulary (``jax.nn.log_softmax``) in the rollout and
the loss. ``--large`` takes a language model's proportions (``d_model`` 512, 8 heads,
a vocabulary of 32,768, 64 digits written, ``max_kept`` 256) to time an iteration.

``main`` prints one JSON line per seed: the mean reward of the first and the last ten
iterations, the two ratio figures, the time taken, and the median time of an
iteration's rollout and update (``rollout_ms``, ``update_ms``; the first iteration,
which compiles, left out).
"""

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import samplers

DIGITS, SEP = 10, 10  # token ids: the digits, then the separator


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters; the command-line flags override ``iterations``, ``seed``,
    ``sampler`` and, with ``--large``, the sizes of :data:`LARGE`."""

    iterations: int = 150
    seed: int = 0
    digits: int = 4  # in a prompt; a completion has as many tokens
    prompts: int = 32
    group_size: int = 8
    epochs: int = 2
    learning_rate: float = 3e-3
    clip: float = 0.2
    top_p: float = 0.9
    dim: int = 64
    layers: int = 2
    heads: int = 4
    vocab: int = 16
    max_kept: int = 16  # the width of a stored support
    sampler: str = "samplers"  # or "plain": plain JAX's sampling and scoring


# A language model's proportions, to time an iteration on an accelerator.
LARGE = {"digits": 64, "dim": 512, "heads": 8, "vocab": 32768, "max_kept": 256}


class Block(nnx.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
        self.attention_norm = nnx.LayerNorm(dim, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
        self.mlp_norm = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attention(self.attention_norm(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.mlp_norm(x))))


class Transformer(nnx.Module):
    """Token ids ``[B, T]`` to hidden states ``[B, T, dim]``; tied embeddings.

    Example:
        >>> from flax import nnx
        >>> model = Transformer(Config(dim=32, layers=1), nnx.Rngs(0))
        >>> model(jnp.zeros((3, 9), jnp.int32)).shape, model.table().shape
        ((3, 9, 32), (16, 32))
    """

    def __init__(self, config: Config, rngs: nnx.Rngs):
        self.embed = nnx.Embed(config.vocab, config.dim, rngs=rngs)
        length = 2 * config.digits + 1
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (length, config.dim)))
        self.blocks = nnx.List(
            [Block(config.dim, config.heads, rngs) for _ in range(config.layers)]
        )
        self.norm = nnx.LayerNorm(config.dim, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.position[...][None, : tokens.shape[-1]]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x)

    def table(self) -> jax.Array:
        """``[vocab, dim]``: the embedding table, the unembedding's transpose."""
        return self.embed.embedding[...]


def reward(prompts: jax.Array, completions: jax.Array) -> jax.Array:
    """The fraction of a completion's tokens equal to the prompt's digits reversed."""
    return jnp.mean(completions == prompts[:, ::-1], axis=-1)


def policy(model: Transformer, hidden: jax.Array, config: Config) -> samplers.TokenCategorical:
    """The next token's distribution: temperature 1, top-p over the whole vocabulary."""
    return samplers.TokenCategorical(
        hidden, embedding=model.table(), top_p=config.top_p, max_kept=config.max_kept
    )


def plain_draw(model: Transformer, hidden: jax.Array, key: jax.Array, config: Config):
    """A draw as plain JAX writes it: ``lax.top_k`` of the logits, top-p renormalised
    over them, and the token's log-probability over the whole vocabulary."""
    logits = jnp.dot(hidden, model.table().T, preferred_element_type=jnp.float32)
    values, ids = jax.lax.top_k(logits, config.max_kept)
    probs = jax.nn.softmax(values, axis=-1)
    kept = jnp.where(jnp.cumsum(probs, axis=-1) - probs < config.top_p, values, -jnp.inf)
    token = jnp.take_along_axis(ids, jax.random.categorical(key, kept)[:, None], -1)[:, 0]
    log_probs = jax.nn.log_softmax(logits)
    return token, token, jnp.take_along_axis(log_probs, token[:, None], -1)[:, 0]


def rollout(model: Transformer, prompts: jax.Array, key: jax.Array, config: Config) -> dict:
    """Writes a completion of each prompt in a ``lax.scan`` decode loop, a token a step,
    storing what the loss replays, and the old log-probabilities as a trainer takes
    them: the model's forward pass over the written sequences, the stored tokens
    replayed (``log_prob``). The decode loop's own are ``decoded_log_prob``: the model's
    hidden states there, computed in another program (a loop's body), may differ from
    the forward pass's in their last bits (on the CPU, XLA rounds a fused kernel's
    ``exp`` and sums by its shape), which no head can undo."""
    n, digits = prompts.shape
    tokens = jnp.concatenate(
        [prompts, jnp.full((n, 1), SEP), jnp.zeros((n, digits), jnp.int32)], axis=1
    )

    def step(tokens, xs):
        t, step_key = xs
        hidden = jax.lax.dynamic_index_in_dim(model(tokens), digits + t, axis=1, keepdims=False)
        if config.sampler == "plain":
            token, data, log_prob = plain_draw(model, hidden, step_key, config)
        else:
            token, data, log_prob = policy(model, hidden, config).sample_with_replay(seed=step_key)
        tokens = jax.lax.dynamic_update_index_in_dim(tokens, token, digits + 1 + t, axis=1)
        return tokens, (data, log_prob)

    steps = (jnp.arange(digits), jax.random.split(key, digits))
    tokens, (data, decoded) = jax.lax.scan(step, tokens, steps)
    data, decoded = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), (data, decoded))
    completions = tokens[:, digits + 1 :]
    batch = {"tokens": tokens, "replay": data, "reward": reward(prompts, completions)}
    batch["log_prob"] = replay_log_prob(model, batch, config)[0]
    batch["decoded_log_prob"] = decoded
    return batch


def replay_log_prob(model: Transformer, batch: dict, config: Config):
    """The stored tokens' log-probabilities under the current weights (on their stored
    supports; plain: over the whole vocabulary), and the distribution."""
    hidden = model(batch["tokens"])[:, config.digits : 2 * config.digits]
    dist = policy(model, hidden, config)
    if config.sampler == "plain":
        logits = jnp.dot(hidden, model.table().T, preferred_element_type=jnp.float32)
        log_probs = jax.nn.log_softmax(logits)
        return jnp.take_along_axis(log_probs, batch["replay"][..., None], -1)[..., 0], dist
    return dist.replay(batch["replay"])[1], dist


def grpo_loss(model: Transformer, batch: dict, config: Config):
    """The clipped PPO loss of the group-normalised advantages, and the ratios."""
    ratio = jnp.exp(replay_log_prob(model, batch, config)[0] - batch["log_prob"])
    advantage = batch["advantage"][:, None]
    clipped = jnp.clip(ratio, 1 - config.clip, 1 + config.clip)
    return -jnp.mean(jnp.minimum(ratio * advantage, clipped * advantage)), ratio


def advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """Each reward less its group's mean, over the group's standard deviation."""
    groups = rewards.reshape(-1, group_size)
    centred = groups - groups.mean(axis=1, keepdims=True)
    return (centred / (groups.std(axis=1, keepdims=True) + 1e-6)).reshape(-1)


@nnx.jit(static_argnums=3)
def sample(model: Transformer, prompts: jax.Array, key: jax.Array, config: Config) -> dict:
    """``group_size`` completions of each prompt, their rewards and advantages."""
    batch = rollout(model, jnp.repeat(prompts, config.group_size, axis=0), key, config)
    batch["advantage"] = advantages(batch["reward"], config.group_size)
    return batch


@nnx.jit(static_argnums=2)
def score(model: Transformer, batch: dict, config: Config) -> dict:
    """The ratios of the stored tokens before the first step, when the weights are the
    rollout's: on the stored supports (exactly 1), and on the whole vocabulary (the
    mass the top-p kept)."""
    log_prob, dist = replay_log_prob(model, batch, config)
    token = batch["replay"]["token"] if config.sampler != "plain" else batch["replay"]
    full = jnp.exp(dist.full_log_prob(token) - batch["log_prob"])
    decoded = jnp.exp(batch["log_prob"] - batch["decoded_log_prob"])
    return {
        "replay_ratio_error": jnp.max(jnp.abs(jnp.exp(log_prob - batch["log_prob"]) - 1)),
        "decode_ratio_error": jnp.max(jnp.abs(decoded - 1)),
        "full_vocabulary_ratio": full.mean(),
    }


@nnx.jit(static_argnums=3)
def update(model: Transformer, optimizer: nnx.Optimizer, batch: dict, config: Config) -> dict:
    """``epochs`` steps of the GRPO loss on one batch.

    The loss's first ratios, taken with their gradient, are exactly 1
    (``loss_ratio_error`` is 0.0), as :func:`score`'s are without one.
    """
    grad_fn = nnx.value_and_grad(grpo_loss, has_aux=True)
    metrics = {}
    for epoch in range(config.epochs):
        (metrics["loss"], ratio), grads = grad_fn(model, batch, config)
        optimizer.update(model, grads)
        if epoch == 0:
            metrics["loss_ratio_error"] = jnp.max(jnp.abs(ratio - 1))
    return metrics


def iteration(model: Transformer, optimizer: nnx.Optimizer, key: jax.Array, config: Config):
    """One GRPO iteration: a rollout of ``prompts`` groups, then the update, in
    programs of their own as a sampling engine and a trainer are; with the seconds of
    each (``rollout_s``, ``update_s``)."""
    prompt_key, sample_key = jax.random.split(key)
    prompts = jax.random.randint(prompt_key, (config.prompts, config.digits), 0, DIGITS)
    start = time.perf_counter()
    batch = jax.block_until_ready(sample(model, prompts, sample_key, config))
    rollout_s = time.perf_counter() - start
    before = score(model, batch, config)
    start = time.perf_counter()
    metrics = jax.block_until_ready(update(model, optimizer, batch, config))
    update_s = time.perf_counter() - start
    seconds = {"rollout_s": rollout_s, "update_s": update_s}
    return {"reward": batch["reward"].mean(), **before, **metrics, **seconds}


def train(config: Config) -> dict:
    """Trains for ``config.iterations`` iterations: a summary, with every iteration's
    mean reward (``rewards``)."""
    rngs = nnx.Rngs(config.seed)
    model = Transformer(config, rngs)
    optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate), wrt=nnx.Param)
    keys = jax.random.split(jax.random.key(config.seed + 1000), config.iterations)
    start = time.perf_counter()
    history = [jax.device_get(iteration(model, optimizer, key, config)) for key in keys]
    train_s = time.perf_counter() - start
    rewards = np.array([float(m["reward"]) for m in history])
    window = min(10, len(rewards))
    timed = history[1:] or history  # the first iteration compiles
    return {
        "seed": config.seed,
        "sampler": config.sampler,
        "iterations": config.iterations,
        "start_reward": float(rewards[:window].mean()),
        "end_reward": float(rewards[-window:].mean()),
        "replay_ratio_error": max(float(m["replay_ratio_error"]) for m in history),
        "loss_ratio_error": max(float(m["loss_ratio_error"]) for m in history),
        "decode_ratio_error": max(float(m["decode_ratio_error"]) for m in history),
        "full_vocabulary_ratio": float(np.mean([m["full_vocabulary_ratio"] for m in history])),
        "first_full_vocabulary_ratio": float(history[0]["full_vocabulary_ratio"]),
        "last_full_vocabulary_ratio": float(history[-1]["full_vocabulary_ratio"]),
        "final_loss": float(history[-1]["loss"]),
        "rollout_ms": 1e3 * float(np.median([m["rollout_s"] for m in timed])),
        "update_ms": 1e3 * float(np.median([m["update_s"] for m in timed])),
        "rewards": rewards.tolist(),
        "train_s": train_s,
    }


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Trains once per seed and prints one JSON line per run (without the reward curve)."""
    parser = argparse.ArgumentParser(
        prog="python -m samplers.examples.grpo",
        description="GRPO with top-p sampling on a tiny transformer that reverses digits.",
    )
    parser.add_argument("--iterations", type=int, default=Config.iterations)
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--seeds", type=int, default=1, help="how many seeds")
    parser.add_argument(
        "--sampler",
        choices=("samplers", "plain"),
        default="samplers",
        help="samplers.TokenCategorical, or plain JAX's lax.top_k sampling and "
        "whole-vocabulary scoring",
    )
    parser.add_argument(
        "--large",
        action="store_true",
        help="d_model 512, 8 heads, a vocabulary of 32768, 64 digits, max_kept 256 (to time "
        "an iteration on an accelerator)",
    )
    args = parser.parse_args(argv)
    sizes = LARGE if args.large else {}
    results = []
    for seed in range(args.seed, args.seed + args.seeds):
        config = Config(iterations=args.iterations, seed=seed, sampler=args.sampler, **sizes)
        results.append(train(config))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "rewards"}), flush=True)
    return results


if __name__ == "__main__":
    main()
