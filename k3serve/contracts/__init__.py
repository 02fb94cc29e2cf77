"""The contracts floor: plain data every layer of k3serve agrees on.

Requests, the one representation of sampling parameters (from the public proto to the sampler), the
prefill -> decode handoff and its ticket, the error codes (an enum mapped once to gRPC status codes), and the
prefix cache's policy (the engine runs it, the router estimates uncached tokens with it).
Everything here is a frozen dataclass or an enum; this package imports nothing of k3serve's roles or core
(only the generated public proto, for the one conversion from and to the wire), so `model/`, `engine/` and every
role may import it.
"""
