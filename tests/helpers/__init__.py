"""Code shared by tests: rollout-group builders and reward functions named by import path."""
