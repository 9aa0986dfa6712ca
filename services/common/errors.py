"""Domain errors every service raises; one interceptor (grpc_server.py) maps them to gRPC status codes."""


class InvalidRequest(ValueError):
    """Malformed input: answered INVALID_ARGUMENT with this message, which should name the field."""


class OutOfCapacity(RuntimeError):
    """The request can never fit, or no room now: answered RESOURCE_EXHAUSTED with this message."""


class NotReady(RuntimeError):
    """Still warming up or shutting down: answered UNAVAILABLE."""


class Unauthenticated(PermissionError):
    """No valid API key: answered UNAUTHENTICATED (the message never says which part was wrong)."""
