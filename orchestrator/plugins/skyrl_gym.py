"""skyrl-gym's registered environments by id (``rl.environment=skyrl_gym:<id>``), run unchanged
behind the environment interface (plugins/environments.py), as SkyRL's own generator runs them.

An instance is ``skyrl_gym.make(<id>, env_config=..., extras=...)``: ``env_config`` is
``rl.environment_args`` (an OmegaConf config, as SkyRL's ``environment.skyrl_gym.<id>``
section: ``db_path`` for ``text2sql``), ``extras`` the task's columns but ``prompt`` and
``env_class`` (skyrl's dataset format: ``reward_spec``, ``extra_info``, ``db_id``, ...) with
``max_turns`` (``rl.max_turns``). A task's ``env_class`` column, when it has one, names its
environment instead of ``<id>``, as in SkyRL. ``init(prompt)`` opens the sample; each turn is
handed to ``step`` as the model wrote it: a turn that a stop string ended gets the string back
(SkyRL's generator keeps it too: its environments parse ``<sql>...</sql>``), and the
environment's ``BaseTextEnvStepOutput`` and ``get_metrics()`` become the step and its metrics.
"""

from __future__ import annotations

PREFIX = "skyrl_gym:"
_NOT_EXTRAS = ("prompt", "env_class")


def names(spec: str) -> bool:
    """Whether ``spec`` (``rl.environment``) names a skyrl-gym environment by id."""
    return spec.startswith(PREFIX)


def environment(spec: str) -> type:
    """The environment class that runs skyrl-gym's ``skyrl_gym:<id>``; ValueError when skyrl-gym
    is not installed or has no such id."""
    env_id = spec[len(PREFIX):]
    try:
        import skyrl_gym
    except ImportError as e:
        raise ValueError(f"rl.environment={spec} needs skyrl-gym, which this Python cannot import ({e}): "
                         f"pip install 'orchestrator[envs]' (or skyrl-gym) on every node") from None
    if env_id not in skyrl_gym.registry:
        raise ValueError(f"rl.environment={spec}: skyrl-gym has no environment {env_id!r}; its ids are "
                         f"{', '.join(sorted(skyrl_gym.registry))}")
    return type(f"SkyrlGym_{env_id}", (SkyrlGymEnvironment,), {"env_id": env_id, "__module__": __name__})


class SkyrlGymEnvironment:
    """One sample's skyrl-gym environment (``env_id`` set by :func:`environment`)."""

    env_id: str

    def __init__(self, task: dict, *, max_turns: int, **env_config):
        import skyrl_gym
        from omegaconf import OmegaConf

        extras = {k: v for k, v in task.items() if k not in _NOT_EXTRAS} | {"max_turns": max_turns}
        self.prompt = task["prompt"] if isinstance(task["prompt"], list) else [{"role": "user", "content": task["prompt"]}]
        self.env = skyrl_gym.make(task.get("env_class") or self.env_id, env_config=OmegaConf.create(env_config), extras=extras)

    def reset(self) -> list[dict]:
        prompt, _ = self.env.init(self.prompt)
        return list(prompt)

    def step(self, completion: str) -> dict:
        """skyrl-gym's own ``BaseTextEnvStepOutput`` (the rollout takes it for a Step), its
        ``metadata`` joined by the episode's ``get_metrics()`` (numbers become the step's metrics)."""
        output = self.env.step(completion + (getattr(completion, "stop", None) or ""))
        metrics = self.env.get_metrics() if callable(getattr(self.env, "get_metrics", None)) else {}
        if isinstance(output, dict) and metrics:
            output = {**output, "metadata": {**(output.get("metadata") or {}), **metrics}}
        return output

    def close(self) -> None:
        self.env.close()
