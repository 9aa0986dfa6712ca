"""The KV block manager: a pure core (no torch, no grpc) and its gRPC sidecar (server.py)."""
