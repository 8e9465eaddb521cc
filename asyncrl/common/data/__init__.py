"""Prompt sources and evaluation: tasks and their registry (:mod:`.tasks`), user data files read and checked row by
row (:mod:`.task_files`) and served as the ``file`` task (:mod:`.file_task`), from an example to the prompt the model
sees (:mod:`.prompts`), and held-out evaluation rounds (:mod:`.evaluation`).
"""
