"""Rewards, used alike by the learner's checks and by the reward workers: the reward functions and their
registry (:mod:`.functions`), the verifiers that judge an answer (:mod:`.verifiers`), the sandbox that runs
model-written code (:mod:`.sandbox`), and the rule that a reward reads the text of the tokens trained
(:mod:`.response_text`). The ``environment`` reward replays episodes on a reward worker and is imported from
``asyncrl.actors`` by name only when a run uses it.
"""
