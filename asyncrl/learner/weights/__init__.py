"""New weights after a step, to every live rollout actor."""
