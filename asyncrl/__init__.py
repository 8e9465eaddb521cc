"""asyncrl: asynchronous actor-learner reinforcement learning for LLM post-training.

The distribution installs this one package. Its three parts live in the repository's top-level folders of the same
names, mapped here by ``pyproject.toml``:

- :mod:`asyncrl.common` (``common/``): what both sides need — configuration, the wire, the Redis plane, transports,
  the weight group, observability, data. It imports neither vLLM nor DeepSpeed.
- :mod:`asyncrl.actors` (``actors/``): rollout actors on vLLM and reward workers.
- :mod:`asyncrl.learner` (``learner/``): the DeepSpeed learner, its loop and its owners.

``actors`` and ``learner`` both use ``common`` and never import each other.
"""

__version__ = "0.1.0"
