"""The engine-core protocol, both ends: the msgspec messages (protocol.py), the client an API server, router or
LLM uses to start and drive a core (client.py), and the CURVE keys of its tcp sockets (curve.py)."""
