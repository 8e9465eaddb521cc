"""Where episodes' environments run: a process of their own behind a fence (the host and its fence), or on the run's
reward workers (the service and the actor's client of it), and a reward worker's signature on what an environment
that cannot be replayed said."""
