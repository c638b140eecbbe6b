"""The locustfile `specdec loadtest` runs (absolute imports: Locust loads it by path)."""

from specdec.loadtest.users import GrpcStreamUser, HttpSseUser  # noqa: F401
