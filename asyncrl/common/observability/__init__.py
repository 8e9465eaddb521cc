"""What people watch: structured logs (:mod:`.logs`), Prometheus metrics (:mod:`.metrics`), the audit
trail (:mod:`.audit`), redaction of secrets (:mod:`.redact`), GPU figures (:mod:`.gpu`), the process tree
(:mod:`.procs`) and ``rl-top`` (:mod:`.top`). Imports nothing of asyncrl but configuration, the wire and the plane.
"""
