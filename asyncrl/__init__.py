"""asyncrl: asynchronous actor-learner reinforcement learning for LLM post-training.

The distribution installs this one package, and each module is at the path its name says
(``asyncrl.common.plane.keys`` is ``asyncrl/common/plane/keys.py``). Its three parts, also linked at the repository's
root as ``common``, ``actors`` and ``learner`` (docs/development.md):

- :mod:`asyncrl.common` (``asyncrl/common/``): what both sides need — configuration, the wire, the Redis plane,
  transports, the weight group, observability, data. It imports neither vLLM nor DeepSpeed.
- :mod:`asyncrl.actors` (``asyncrl/actors/``): rollout actors on vLLM and reward workers.
- :mod:`asyncrl.learner` (``asyncrl/learner/``): the DeepSpeed learner, its loop and its owners.

``actors`` and ``learner`` both use ``common`` and never import each other.
"""

__version__ = "0.1.0"
