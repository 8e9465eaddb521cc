"""Environments for multi-turn episodes: the protocol and registry (:mod:`.protocol`), tool calls in a
model's turn (:mod:`.tool_calls`), an episode as token ids (:mod:`.turns`), the built-in Python tool
(:mod:`.python_tool`) and adapters for reasoning-gym, skyrl-gym and TextArena (:mod:`.gyms`). Nothing here drives an
episode: the actor does (``asyncrl.actors.episodes``).
"""
