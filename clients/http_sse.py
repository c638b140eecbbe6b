"""Stream a completion from a specdec model on Triton over HTTP server-sent events (copy me: needs
only `requests`). Triton's generate extension: POST /v2/models/<model>/generate_stream with the
inputs as JSON fields; each `data: {...}` event holds one step's new text.

    python clients/http_sse.py "def fibonacci(n):" --model spec_eagle --url http://localhost:8000
"""

import argparse
import json
import sys

import requests


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("prompt")
    ap.add_argument("--model", default="spec_eagle")
    ap.add_argument("--url", default="http://localhost:8000")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()

    body = {"text_input": args.prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "stream": True, "exclude_input_in_output": True}
    event = {}
    with requests.post(f"{args.url}/v2/models/{args.model}/generate_stream", json=body, stream=True) as r:
        for line in r.iter_lines(decode_unicode=True):
            if not line.startswith("data:"):
                continue
            event = json.loads(line[len("data:"):])
            if "error" in event:  # errors arrive as an event (the HTTP status may be 200 or 400)
                print(f"\nerror: {event['error']}", file=sys.stderr)
                return 1
            print(event["text_output"], end="", flush=True)
    print(f"\n[draft tokens {event.get('total_draft_tokens')}, accepted {event.get('total_accepted_draft_tokens')}, "
          f"acceptance rate {event.get('acceptance_rate', 0):.2f}, finish {event.get('finish_reason')}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
