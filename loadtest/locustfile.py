"""Locust entry point: `locust -f loadtest/locustfile.py` (web UI) or add `--headless`.

    locust -f loadtest/locustfile.py GrpcStreamUser --host http://localhost:8000 --grpc-url localhost:8001 \
        --model spec_eagle --max-tokens 64
    locust -f loadtest/locustfile.py HttpSseUser --host http://localhost:8000 --model baseline

The users live in the specdec package (specdec.tools.loadtest.users); see loadtest/README.md for the
options, distributed mode and how `specdec loadtest` runs a whole matrix with them.
"""

from specdec.tools.loadtest.users import GrpcStreamUser, HttpSseUser  # noqa: F401
