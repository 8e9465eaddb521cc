"""Prometheus metrics shared by every process, named ``asyncrl_<component>_<what>_<unit>``.

Counters live in the default registry; a process exposes them with :func:`serve`.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram, start_http_server

WIRE_MALFORMED = Counter(
    "asyncrl_wire_malformed_messages_total",
    "Messages refused by a decoder, by channel and offending field.",
    ["channel", "field"],
)
CHANNEL_SENT = Counter("asyncrl_channel_sent_messages_total", "Messages sent on a ZeroMQ channel.", ["channel"])
CHANNEL_SENT_BYTES = Counter("asyncrl_channel_sent_bytes_total", "Bytes sent on a ZeroMQ channel.", ["channel"])
CHANNEL_RECEIVED = Counter(
    "asyncrl_channel_received_messages_total", "Well-formed messages received on a ZeroMQ channel.", ["channel"]
)
REPLAY_ENTRIES_ADDED = Counter("asyncrl_replay_entries_added_total", "Scored groups added to the replay stream.")
REPLAY_ENTRIES_READ = Counter("asyncrl_replay_entries_read_total", "Scored groups read from the replay stream.")
REPLAY_DEAD_LETTERS = Counter(
    "asyncrl_replay_dead_letters_total", "Replay entries moved to the dead-letter stream.", ["field"]
)

REWARD_SCORED_GROUPS = Counter(
    "asyncrl_reward_scored_groups_total", "Rollout groups scored by a reward worker and written to the replay stream."
)
REWARD_DEAD_LETTERED_GROUPS = Counter(
    "asyncrl_reward_dead_lettered_groups_total",
    "Rollout groups a reward worker could not score, moved to the dead-letter stream, by reward function.",
    ["function"],
)
REWARD_FAILED_CALLS = Counter(
    "asyncrl_reward_failed_calls_total",
    "Reward-function calls that raised or returned unusable scores (timeouts are counted apart).",
    ["function"],
)
REWARD_TIMED_OUT_CALLS = Counter(
    "asyncrl_reward_timed_out_calls_total", "Reward-function calls abandoned at the time limit.", ["function"]
)
REWARD_SCORING_SECONDS = Histogram(
    "asyncrl_reward_scoring_seconds",
    "Seconds to score one rollout group with every reward function, retries included.",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)


DISPATCHER_RELEASED_GROUPS = Counter(
    "asyncrl_dispatcher_released_groups_total",
    "Prompt groups released into the prompt queue by admission control (replacements of lost groups included).",
)
DISPATCHER_REISSUED_GROUPS = Counter(
    "asyncrl_dispatcher_reissued_groups_total",
    "Prompt groups re-issued because their actor died or they missed the deadline.",
)
DISPATCHER_LOST_GROUPS = Counter(
    "asyncrl_dispatcher_lost_groups_total",
    "Prompt groups given up on after missing the deadline (or losing their actor) once more after re-issue.",
)
DISPATCHER_DUPLICATE_GROUPS = Counter(
    "asyncrl_dispatcher_duplicate_groups_total",
    "Scored groups the learner dropped because the same group id was already trained (a re-issued group's twin).",
)


def serve(port: int = 0, addr: str = "0.0.0.0") -> int:
    """Serve ``/metrics`` over HTTP on ``port`` (0 = a free one); returns the port."""
    server, _thread = start_http_server(port, addr)
    return int(server.server_port)
