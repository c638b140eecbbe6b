"""The locustfile `specdec loadtest` runs (absolute imports: Locust loads it by path)."""

from specdec.tools.loadtest.users import GrpcStreamUser, HttpSseUser  # noqa: F401
