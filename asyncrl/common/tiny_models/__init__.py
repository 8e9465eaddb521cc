"""Tiny models and synthetic messages for the demo, the tests and the benchmarks, built locally and never
fetched: a character-level Llama (:mod:`.character`), chat models with a real BPE tokenizer (:mod:`.chat`), a
tool-using agent (:mod:`.agent`) and messages of realistic shape (:mod:`.synthetic`). Nothing else imports them.
"""
