"""The wire: every message that crosses a process boundary (:mod:`.messages`), its codec (:mod:`.codec`), the seal
that proves a message comes from the run (:mod:`.seal`), and the check that a rollout answers a group the run issued
(:mod:`.provenance`). Imports only the standard library, numpy and msgpack, and :mod:`asyncrl.common.config`.
"""
