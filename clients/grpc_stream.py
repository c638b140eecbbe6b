"""Stream a completion from a specdec model on Triton over gRPC (copy me: needs only tritonclient[grpc]).

    python clients/grpc_stream.py "def fibonacci(n):" --model spec_eagle --url localhost:8001
"""

import argparse
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("prompt")
    ap.add_argument("--model", default="spec_eagle")
    ap.add_argument("--url", default="localhost:8001")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()

    def tensor(name, value, dtype):
        array = np.array([value], dtype=dtype)
        t = grpcclient.InferInput(name, list(array.shape), {np.object_: "BYTES", np.int32: "INT32",
                                                            np.float32: "FP32", np.bool_: "BOOL"}[dtype])
        t.set_data_from_numpy(array)
        return t

    inputs = [
        tensor("text_input", args.prompt.encode(), np.object_),
        tensor("max_tokens", args.max_tokens, np.int32),
        tensor("temperature", args.temperature, np.float32),
        tensor("stream", True, np.bool_),
        tensor("exclude_input_in_output", True, np.bool_),
    ]
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    # tritonclient calls the callback with keyword arguments result= and error=
    client.start_stream(callback=lambda result=None, error=None: responses.put((result, error)))
    client.async_stream_infer(args.model, inputs, enable_empty_final_response=True)
    try:
        while True:
            result, error = responses.get()
            if error is not None:
                print(f"\nerror: {error}", file=sys.stderr)
                return 1
            text = result.as_numpy("text_output")
            if text is not None:
                print(text[0].decode(), end="", flush=True)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        print(f"\n[draft tokens {result.as_numpy('total_draft_tokens')[0]}, "
              f"accepted {result.as_numpy('total_accepted_draft_tokens')[0]}, "
              f"acceptance rate {result.as_numpy('acceptance_rate')[0]:.2f}]")
        return 0
    finally:
        client.stop_stream()
        client.close()


if __name__ == "__main__":
    sys.exit(main())
