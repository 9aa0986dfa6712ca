"""Domain errors every service raises; one interceptor (grpc_server.py) maps them to gRPC status codes, and the
HTTP API (frontend/http_api.py) to HTTP statuses."""


class InvalidRequest(ValueError):
    """Malformed input: answered INVALID_ARGUMENT with this message, which should name the field."""


class UnknownModel(InvalidRequest):
    """A model this server does not serve: INVALID_ARGUMENT over gRPC, 404 over HTTP (as OpenAI answers)."""


class OutOfCapacity(RuntimeError):
    """The request can never fit, or no room now: answered RESOURCE_EXHAUSTED with this message."""


class ExceedsCapacity(OutOfCapacity):
    """The request can never fit (more KV blocks than the cache holds): a retry cannot help, so HTTP answers
    400 where a full queue or too many streams (plain OutOfCapacity) is 429."""


class NotReady(RuntimeError):
    """Still warming up or shutting down: answered UNAVAILABLE."""


class Unauthenticated(PermissionError):
    """No valid API key: answered UNAUTHENTICATED (the message never says which part was wrong)."""
