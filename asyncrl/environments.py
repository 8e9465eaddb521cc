"""What a user's environment is written against: import these, and nothing deeper in asyncrl.

An environment is a class made from one dataset row (:class:`EpisodeRow`: the prompt, the answer, the row's other
columns in ``extra`` and the episode's seed) and the config's ``environment.options``; :meth:`Environment.step` gets
the text of each model turn and answers with a :class:`Step` (the next observation as chat messages, a reward for
that turn, whether the episode is done); :meth:`Environment.score` is the episode's final reward. A question answered
with tools subclasses :class:`ToolEnvironment` and gives its tools in ``make_tools`` (offered to the model as
:func:`function_spec` entries by the classmethod ``tool_specs``). docs/environments.md is the guide.

A run names its environment in ``environment.name``: by import path (``my_pkg.envs:Guess``), or by a name an
installed package declares as an entry point, which every process of the run (the learner checking the config, the
actors and reward workers making environments) finds by itself::

    [project.entry-points."asyncrl.environments"]
    guess = "my_pkg.envs:Guess"

(reward functions, verifiers, tasks, advantage estimators and losses likewise: ``asyncrl.rewards``,
``asyncrl.verifiers``, ``asyncrl.tasks``, ``asyncrl.advantages``, ``asyncrl.losses``).
"""

from __future__ import annotations

from asyncrl.common.environments.protocol import (
    Environment,
    EnvironmentFailed,
    EpisodeRow,
    OutOfTime,
    Step,
    ToolEnvironment,
    function_spec,
    register_environment,
)

__all__ = [
    "Environment",
    "EnvironmentFailed",
    "EpisodeRow",
    "OutOfTime",
    "Step",
    "ToolEnvironment",
    "function_spec",
    "register_environment",
]
