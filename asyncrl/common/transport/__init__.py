"""Transports between processes: ZeroMQ PUSH/PULL channels for the data plane (:mod:`.channel`), requests and
replies (:mod:`.rpc`), and the one address a process advertises (:mod:`.net`). May import the wire and observability.
"""
