"""The actors' side of a run: rollout actors, reward workers and the environments' processes.

Importing it registers the reward function the actors' code provides: ``environment`` scores each episode by replaying
it in the run's environment, which drives episodes as the actor does, so it is the actors' code, imported by name only
when a run uses it (on a reward worker, or ``rl-actor eval``)."""

from asyncrl.common.rewards.functions import REWARDS

REWARDS.register_path("environment", "asyncrl.actors.episode_scoring:environment_reward")
