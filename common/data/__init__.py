"""Prompt sources and evaluation: tasks and user data files (:mod:`.tasks`), from an example to the prompt the
model sees (:mod:`.prompts`), and held-out evaluation rounds (:mod:`.evaluation`).
"""
