"""What a run leaves for people to read: metrics.jsonl, Prometheus series, samples.jsonl, experiment trackers, the
learner's memory, and a profile of one step."""
