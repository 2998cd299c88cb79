"""PPO on gymnax's ``Pendulum-v1`` with a ``samplers`` policy head.

Run ``python -m samplers.examples.pendulum`` (``--help`` lists the flags). A small
actor-critic (two MLPs on the scaled observation, one for ``[mean | raw_std]`` and
one for the value) is trained by the examples' PPO trainer, ``_ppo.train``, on
vectorised environments. The policy head is a
:class:`samplers.SquashedNormalSampler`: the rollout stores the raw pre-squash
action it emits in ``rollout_extras``, and the PPO loss replays that stored array,
so the ratio is computed from the exact pre-image even where the squashing
saturates.

At the end it evaluates the deterministic policy (``model.eval()``, action
``f(mean)``) against a uniformly random policy on the same episodes, prints a
summary, and writes ``pendulum.png`` (learning curve and the learned action
distribution in a few states) and ``summary.json`` to ``--out``.

``--bijector`` picks how the Normal sample becomes a torque in ``[-2, 2]``:

- ``tanh-bounds``: ``samplers.BoundedTanh(-2, 2)``; the action is the torque.
- ``tanh``: ``samplers.NormalTanhSampler``; the action in ``[-1, 1]`` is
  multiplied by 2. The constant factor cancels in the PPO ratio.
- ``identity``: ``distrax.Lambda(lambda x: x)``, an unsquashed Normal; the action
  is clipped to ``[-2, 2]`` before the environment sees it, and the ratio is
  computed for the unclipped action.

``--head beta`` replaces the squashed Normal by :class:`samplers.BetaSampler` on
``[-2, 2]``: the action is the torque, a Beta sample that the rollout stores as its
pre-image ``z`` (the Beta's logit), so that a torque that rounded onto a bound is
replayed from ``z``, never scored as the rounded value. ``--bijector`` then does not
apply.
"""

import argparse
import dataclasses
import time
from collections.abc import Sequence

import distrax
import jax
import jax.numpy as jnp
from flax import nnx

import samplers
from samplers.examples import _common, _ppo

BIJECTORS = ("tanh-bounds", "tanh", "identity")
HEADS = ("squashed-normal", "beta")


@dataclasses.dataclass(frozen=True)
class Config(_ppo.Config):
    """Hyperparameters: ``_ppo.Config``'s with Pendulum's defaults, and the head's choice.

    The command-line flags override ``total_steps``, ``seed``, ``num_envs``,
    ``rollout_length``, ``bijector``, ``head`` and ``eval_episodes``.
    """

    total_steps: int = 1_000_000
    num_envs: int = 64
    rollout_length: int = 128
    epochs: int = 10
    minibatches: int = 8
    gamma: float = 0.95
    entropy_weight: float = 0.0
    # Pendulum rewards lie in [-16.3, 0]; a tenth keeps value targets near unit scale.
    reward_scale: float = 0.1
    bijector: str = "tanh-bounds"
    head: str = "squashed-normal"


Head = samplers.SquashedNormalSampler | samplers.BetaSampler


def make_head(
    bijector: str, entropy_weight: float, rngs: nnx.Rngs, head: str = "squashed-normal"
) -> Head:
    """The policy head for a ``--head`` and ``--bijector`` choice, on one action dimension.

    Args:
        bijector: One of ``BIJECTORS``, for the squashed Normal.
        entropy_weight: Weight of the head's entropy bonus.
        rngs: The sampling stream the head keeps.
        head: One of ``HEADS``; ``"beta"`` takes no bijector (it must be the default).

    Returns:
        The head; the environment gets ``clip(torque_scale(config) * action, -2, 2)``.

    Raises:
        ValueError: ``head`` or ``bijector`` is not one of the choices, or a
            bijector other than the default is asked of the Beta head.

    Example:
        >>> from flax import nnx
        >>> type(make_head("tanh", 0.0, nnx.Rngs(0))).__name__
        'NormalTanhSampler'
        >>> type(make_head("tanh-bounds", 0.0, nnx.Rngs(0), head="beta")).__name__
        'BetaSampler'
    """
    torque = _common.MAX_TORQUE
    if head == "beta":
        if bijector != Config.bijector:
            raise ValueError(
                f"the Beta head maps onto [-2, 2] itself and takes no bijector, got "
                f"bijector={bijector!r}; leave --bijector at its default."
            )
        return samplers.BetaSampler(rngs, entropy_weight, action_dim=1, low=-torque, high=torque)
    if head != "squashed-normal":
        raise ValueError(f"head must be one of {HEADS}, got {head!r}; pick one of those.")
    if bijector == "tanh-bounds":
        bounds = samplers.BoundedTanh(-torque, torque)
        return samplers.SquashedNormalSampler(rngs, entropy_weight, bijector=bounds, action_dim=1)
    if bijector == "tanh":
        return samplers.NormalTanhSampler(rngs, entropy_weight, action_dim=1)
    if bijector == "identity":
        identity = distrax.Lambda(lambda x: x)
        return samplers.SquashedNormalSampler(rngs, entropy_weight, bijector=identity, action_dim=1)
    raise ValueError(f"bijector must be one of {BIJECTORS}, got {bijector!r}; pick one of those.")


def torque_scale(config: Config) -> float:
    """The torque per unit of action: 2 for the ``tanh`` bijector's actions in ``[-1, 1]``, else 1.

    Example:
        >>> torque_scale(Config(bijector="tanh")), torque_scale(Config())
        (2.0, 1.0)
    """
    tanh = config.head == "squashed-normal" and config.bijector == "tanh"
    return _common.MAX_TORQUE if tanh else 1.0


def _spread(out, torque_scale: float) -> jax.Array:
    """The std of the policy's Normal (before squashing), or of the Beta head's torque."""
    if "sigma" in out.metrics:
        return out.metrics["sigma"][..., 0]
    alpha, beta = out.metrics["alpha"][..., 0], out.metrics["beta"][..., 0]
    total = alpha + beta
    unit_std = jnp.sqrt(alpha * beta / (jnp.square(total) * (total + 1.0)))
    return 2 * _common.MAX_TORQUE * torque_scale * unit_std


def _to_torque(action: jax.Array, torque_scale: float) -> jax.Array:
    return jnp.clip(torque_scale * action, -_common.MAX_TORQUE, _common.MAX_TORQUE)


def train(config: Config, *, progress: bool = True) -> tuple[_ppo.ActorCritic, dict]:
    """Trains the actor-critic on ``Pendulum-v1`` with ``_ppo.train``.

    Args:
        config: Hyperparameters.
        progress: Show a live progress bar.

    Returns:
        ``(model, log)``: ``_ppo.train``'s log, whose ``per_iteration`` has
        ``sigma`` (the mean std of the policy, see the progress bar), and
        ``final_sigma``, the last iteration's.
    """
    scale = torque_scale(config)

    def make_model(sampling_rngs: nnx.Rngs, rngs: nnx.Rngs) -> _ppo.ActorCritic:
        head = make_head(config.bijector, config.entropy_weight, sampling_rngs, config.head)
        return _ppo.ActorCritic(3, head, hidden=config.hidden, rngs=rngs, preprocess=_common.scaled)

    env = _ppo.gymnax_env("Pendulum-v1", lambda action: _to_torque(action, scale))
    model, log = _ppo.train(
        config,
        make_model,
        env,
        column=("std", lambda metrics: f"{metrics['sigma']:.3f}"),
        rollout_metrics=lambda model, obs, out: {"sigma": _spread(out, scale)},
        progress=progress,
    )
    log["final_sigma"] = log["last_iteration"]["sigma"]
    return model, log


def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """The config a command line asks for, and its other arguments.

    Args:
        argv: Command-line arguments (``sys.argv[1:]`` when None).

    Returns:
        ``(config, args)``: ``args.out`` is the output folder and
        ``args.no_progress`` hides the progress bar.
    """
    defaults = Config()
    return _common.command_line(
        argv,
        defaults,
        prog="python -m samplers.examples.pendulum",
        description="Train PPO on gymnax Pendulum-v1 with a samplers policy head. The "
        "progress bar shows the mean return of the episodes that ended in the last "
        "iteration and the mean std of the policy's Normal (before squashing).",
        flags={
            "--rollout-length": dict(
                type=int,
                default=defaults.rollout_length,
                help="steps per environment between updates",
            ),
            "--bijector": dict(
                choices=BIJECTORS,
                default=defaults.bijector,
                help="tanh-bounds: BoundedTanh(-2, 2); tanh: tanh, torque = 2 * action; "
                "identity: no squashing, torque = clip(action, -2, 2)",
            ),
            "--head": dict(
                choices=HEADS,
                default=defaults.head,
                help="squashed-normal: a Normal through --bijector; beta: samplers.BetaSampler "
                "on [-2, 2] (the progress bar's std is then the torque's)",
            ),
        },
        out="pendulum-results",
        figure="pendulum.png",
    )


def main(argv: Sequence[str] | None = None) -> dict:
    """Trains, evaluates, prints a summary and writes the figure and ``summary.json``.

    Args:
        argv: Command-line arguments (``sys.argv[1:]`` when None).

    Returns:
        The summary written to ``summary.json``.
    """
    config, args = parse_args(argv)
    start = time.perf_counter()
    model, log = train(config, progress=not args.no_progress)
    scale = torque_scale(config)

    def torque(model: _ppo.ActorCritic, obs: jax.Array) -> jax.Array:
        return _to_torque(model.policy(obs).output["action"], scale)

    summary = {
        "config": dataclasses.asdict(config),
        "bijector": config.bijector,
        "head": config.head,
        **_common.evaluate(model, torque, num_episodes=config.eval_episodes, seed=config.seed),
        **log,
        "steps_to_minus_200": _common.first_step_at(log, -200.0),
    }
    figure = args.out / "pendulum.png"
    distributions = _common.action_distributions(model.actor, model.head, scale)
    name = "beta" if config.head == "beta" else config.bijector
    _common.plot(figure, summary, distributions, title=f"(a) PPO on Pendulum-v1, {name}")
    reached = summary["steps_to_minus_200"]
    _common.finish(
        summary,
        figure,
        start,
        header=f"Pendulum-v1, {name}, {log['steps']:,} steps, seed {config.seed}",
        details=[
            "training episodes first averaged >= -200 after "
            f"{'-' if reached is None else f'{reached:,}'} steps",
            _ppo.replay_line(log),
        ],
    )
    return summary


if __name__ == "__main__":
    main()
