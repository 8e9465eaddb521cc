"""The Redis plane: the names of a run's keys and the connection (:mod:`.keys`), the prompt queue and in-flight
ledger (:mod:`.prompt_ledger`), the process registry and heartbeats, the replay stream, the run record the learner
publishes, dead letters, living through a Redis outage, and the embedded ``redis-server``. :mod:`.control` gathers
them for a process. May import the wire, observability and configuration; never a transport or the weight group.
"""
