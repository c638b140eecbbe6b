"""Integration tests against the real tritonserver binary (nvidia-pytriton wheel) with tiny
checkpoints: every model streams the in-process engine's greedy text over gRPC and HTTP, bad inputs
get named errors while the server keeps serving, metrics count accepted tokens, cancellation frees
the slot, a full model queues and times out, 32 concurrent mixed streams reproduce their solo runs.

The models run in float64 with a fixed draft length (policy "fixed"): batch shape then cannot
change rounding, and a seeded request consumes its random numbers the same way alone or batched.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from specdec.serving.client import grpc_tensors, main as client_main, request_inputs
from specdec.core.engine_config import build_engine
from specdec.core.sampling import SamplingParams
from specdec.serving.config import engine_config_for
from specdec.serving.repository import write_repository
from specdec.serving.server import TritonServer, free_ports
from tiny_checkpoints import make_tiny_kit

pytestmark = pytest.mark.slow

MODELS = ["baseline", "spec_draft", "spec_medusa", "spec_eagle", "spec_ngram"]
SLOT1 = "slots1_spec_eagle"  # one KV slot, 1 s queue timeout: for cancellation and queueing
PROMPTS = ["def add(a, b):", "Grüße, naïve café — 日本語", "import os\nimport sys\n", "class Point:\n    def"]
STREAMED = 400  # tokens of each request that checks streaming
LONG = 1500  # tokens; the 1-slot model needs seconds for this, far more than its queue timeout (480
# took under a second once detokenizing no longer cost O(length) a step)


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("triton")
    kit = make_tiny_kit(root / "kit", tokenizer_dir)
    repo = root / "model_repository"
    write_repository(repo, **kit, dtype="float64", policy="fixed", k=4, max_batch=4, max_context=512)
    write_repository(repo, kit["target"], models=["spec_ngram"], dtype="float64", policy="fixed", k=4, max_batch=4,
                     max_context=512, stream_interval=3)  # streamed responses carry >= 3 tokens
    # the EAGLE-2 tree (slower per token than the chain spec_eagle now serves) keeps LONG requests
    # well over the 1 s queue timeout, as the queueing test needs
    write_repository(repo, kit["target"], eagle=kit["eagle"], models=["spec_eagle"], prefix="slots1_",
                     dtype="float64", policy="fixed", max_batch=1, max_context=LONG + 32, queue_timeout_s=1.0,
                     eagle_tree=(4, 5, 24))
    with TritonServer(repo, exit_timeout_s=3, log_file=root / "tritonserver.log") as server:
        yield server


@pytest.fixture(scope="module")
def engines(served):
    """The same engines in this process, from the same config files."""
    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = build_engine(engine_config_for(served.model_repository / model))
        return cache[model]
    return get


# ---- helpers -------------------------------------------------------------------------------------
def grpc_request(url, model, inputs, parameters=None, timeout=120):
    """One request over a gRPC stream -> (chunks, error message or None)."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result=None, error=None: responses.put((result, error)))
    try:
        tensors = grpc_tensors(inputs)
        client.async_stream_infer(model, tensors, parameters=parameters, enable_empty_final_response=True)
        chunks = []
        while True:
            result, error = responses.get(timeout=timeout)
            if error is not None:
                return chunks, error.message()
            if result.as_numpy("text_output") is not None:
                chunks.append({
                    "text": result.as_numpy("text_output")[0].decode(),
                    "ids": result.as_numpy("output_ids").tolist(),
                    "draft": int(result.as_numpy("total_draft_tokens")[0]),
                    "accepted": int(result.as_numpy("total_accepted_draft_tokens")[0]),
                    "rate": float(result.as_numpy("acceptance_rate")[0]),
                    "reason": result.as_numpy("finish_reason")[0].decode(),
                })
            if result.get_response().parameters["triton_final_response"].bool_param:
                return chunks, None
    finally:
        client.stop_stream()
        client.close()


def joined(chunks):
    return "".join(c["text"] for c in chunks), [i for c in chunks for i in c["ids"]]


def http_stream(server, model, body):
    r = requests.post(f"http://{server.http_url}/v2/models/{model}/generate_stream", json=body, timeout=120)
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    return r.status_code, events


def scrape(server) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([^{\s]+)(?:\{(.*)\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


# ---- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", MODELS)
def test_every_model_streams_the_engines_greedy_text(served, engines, model):
    engine = engines(model)
    # how many responses each streamed request came back in: the sender thread merges the Outputs
    # that piled up while it waited, so on a loaded 2-core machine one request can come back whole
    # (a 400-token prompt-lookup request did once in a full-suite run: ~70 ms in which the sender
    # was not scheduled); a server that did not stream would send one response for all six
    parts = []
    for prompt in PROMPTS[:2]:
        ref = engine.generate([prompt], SamplingParams(max_tokens=STREAMED))[0]
        chunks, error = grpc_request(served.grpc_url, model, request_inputs(
            prompt, max_tokens=STREAMED, stream=True, exclude_input_in_output=True))
        assert error is None
        text, ids = joined(chunks)
        assert (text, ids) == (ref.text, ref.token_ids)
        assert chunks[-1]["reason"] == ref.finish_reason
        parts.append(len(chunks))
        assert (chunks[-1]["draft"], chunks[-1]["accepted"]) == (ref.stats.draft_tokens, ref.stats.accepted_tokens)

        status, events = http_stream(served, model, {"text_input": prompt, "max_tokens": STREAMED, "stream": True,
                                                     "exclude_input_in_output": True})
        assert status == 200 and "".join(e["text_output"] for e in events) == ref.text
        parts.append(len(events))
        status, events = http_stream(served, model, {"text_input": prompt, "max_tokens": STREAMED, "stream": True})
        assert events[0]["text_output"].startswith(prompt)  # exclude_input_in_output false: prompt first
        assert "".join(e["text_output"] for e in events) == prompt + ref.text
        parts.append(len(events))

        r = requests.post(f"http://{served.http_url}/v2/models/{model}/generate",
                          json={"text_input": prompt, "max_tokens": STREAMED}, timeout=60)  # stream false: one response
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["text_output"] == prompt + ref.text  # exclude_input_in_output defaults to false
        assert body["output_ids"] == ref.token_ids and body["finish_reason"] == ref.finish_reason
    assert max(parts) > 1, parts


def test_stop_words_seed_and_min_tokens_reach_the_engine(served, engines):
    engine = engines("spec_ngram")
    prompt = PROMPTS[2]
    full = engine.generate([prompt], SamplingParams(max_tokens=24))[0].text
    stop = full[6:9] if full[6:9].strip() else full[3:6]
    cases = [dict(stop=[stop]), dict(temperature=0.9, top_k=30, seed=5), dict(min_tokens=10, max_tokens=12)]
    for case in cases:
        params = SamplingParams(**{"max_tokens": 24, **case})
        ref = engine.generate([prompt], params)[0]
        options = {"max_tokens": params.max_tokens, "temperature": params.temperature, "top_k": params.top_k,
                   "seed": params.seed, "stop_words": params.stop or None, "min_tokens": params.min_tokens}
        chunks, error = grpc_request(served.grpc_url, "spec_ngram", request_inputs(
            prompt, stream=True, exclude_input_in_output=True, **options))
        assert error is None and joined(chunks) == (ref.text, ref.token_ids), case
        assert chunks[-1]["reason"] == ref.finish_reason
        assert all(len(c["ids"]) >= 3 for c in chunks[1:-1])  # stream_interval 3 (the first token goes at once)
        body = {"text_input": prompt, "exclude_input_in_output": True,
                **{k: v for k, v in options.items() if v is not None}}
        r = requests.post(f"http://{served.http_url}/v2/models/spec_ngram/generate", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["text_output"] == ref.text, case
        if "stop" in case:
            assert ref.finish_reason == "stop" and stop not in ref.text
        vllm_style = {"text_input": prompt, "exclude_input_in_output": True, "sampling_parameters": json.dumps(
            {"max_tokens": params.max_tokens, "temperature": params.temperature, "top_k": params.top_k,
             "seed": params.seed, "stop": params.stop, "min_tokens": params.min_tokens})}
        r = requests.post(f"http://{served.http_url}/v2/models/spec_ngram/generate", json=vllm_style, timeout=60)
        assert r.status_code == 200 and r.json()["text_output"] == ref.text, case


BAD_GRPC = [
    ({"text_input": None}, None, "text_input is missing"),
    ({"text_input": ""}, None, "text_input is empty"),
    ({"text_input": b"\xff\xfe abc"}, None, "not valid UTF-8"),
    ({"max_tokens": 0}, None, "max_tokens must be a positive integer"),
    ({"max_tokens": -3}, None, "max_tokens must be a positive integer"),
    ({"max_tokens": 100000}, None, "max_tokens 100000 exceeds the limit of 511"),
    ({"text_input": "x" * 2000, "max_tokens": 8}, None, "exceeds the context limit of 512"),
    ({"temperature": -0.5}, None, "temperature must be a finite number >= 0"),
    ({"temperature": float("nan")}, None, "temperature must be a finite number >= 0"),
    ({"top_p": 0.0}, None, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, None, "top_p must be in (0, 1]"),
    ({"top_k": -1}, None, "top_k must be an integer >= 0"),
    ({}, {"best_of": 2}, "unknown parameter 'best_of'"),
]


def test_bad_inputs_get_named_errors_and_the_server_keeps_serving(served):
    url, model = served.grpc_url, "baseline"
    good = request_inputs("def add(a, b):", max_tokens=4, stream=True)
    for overrides, parameters, message in BAD_GRPC:
        inputs = dict(good)
        if "text_input" in overrides:
            value = overrides["text_input"]
            if value is None:
                del inputs["text_input"]
            else:
                inputs["text_input"] = np.array([value if isinstance(value, bytes) else value.encode()], dtype=np.object_)
        for name in ("max_tokens", "temperature", "top_p", "top_k"):
            if name in overrides:
                inputs[name] = request_inputs("x", **{name: overrides[name]})[name]
        chunks, error = grpc_request(url, model, inputs, parameters)
        assert error is not None and message in error, (overrides, error)
        chunks, error = grpc_request(url, model, good)  # the next good request still succeeds
        assert error is None and chunks[-1]["reason"] == "length"
    # wrong dtype and shape: Triton itself rejects them, naming the input
    wrong_dtype = dict(good, temperature=np.array([0.5], dtype=np.float64))
    chunks, error = grpc_request(url, model, wrong_dtype)
    assert error is not None and "temperature" in error and "FP64" in error.upper()
    wrong_shape = dict(good, max_tokens=np.array([4, 4], dtype=np.int32))
    chunks, error = grpc_request(url, model, wrong_shape)
    assert error is not None and "max_tokens" in error and "shape" in error
    # HTTP: errors as JSON, and as an SSE event on generate_stream
    for body, message in [({"text_input": "x", "max_tokens": 0}, "max_tokens"),
                          ({"text_input": "x", "top_k": -2}, "top_k"),
                          ({"text_input": "x", "no_such_option": 1}, "unknown parameter 'no_such_option'"),
                          ({"max_tokens": 3}, "text_input is missing")]:
        r = requests.post(f"http://{served.http_url}/v2/models/{model}/generate", json=body, timeout=30)
        assert r.status_code >= 400 and message in r.json()["error"]
        status, events = http_stream(served, model, body)
        assert events and message in events[-1]["error"]
    r = requests.post(f"http://{served.http_url}/v2/models/{model}/generate",
                      json={"text_input": "def", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3


def test_each_models_ready_line_names_the_type_its_drafters_matmuls_take(served):
    """A served model's log line at start-up says which type its drafter's matmuls took
    (`draft_dtype`, or the next wider type this CPU has: `linear.narrow`), so a user can see the
    drafter they measure; these float64 models keep float64, and models without a drafter model
    (the baseline, prompt lookup) name none."""
    log = served.log_path.read_text(errors="replace")
    ready = {m: line for line in log.splitlines() for m in re.findall(r"specdec: (\S+) ready \(", line)}
    assert {"baseline", "spec_draft", "spec_medusa", "spec_eagle", "spec_ngram"} <= set(ready), sorted(ready)
    for model in ("spec_draft", "spec_medusa", "spec_eagle"):
        assert "); its drafter's matmuls take float64" in ready[model], ready[model]
    for model in ("baseline", "spec_ngram"):
        assert "drafter's matmuls" not in ready[model], ready[model]


def test_metrics_count_accepted_tokens(served):
    model = "spec_draft"  # the draft is a copy of the target: every greedy draft token is accepted
    before = scrape(served)
    chunks, error = grpc_request(served.grpc_url, model, request_inputs(
        "import os\n", max_tokens=30, stream=True, ignore_eos=True))
    assert error is None
    accepted, drafted = chunks[-1]["accepted"], chunks[-1]["draft"]
    assert accepted > 0 and accepted == drafted and chunks[-1]["rate"] == 1.0

    def grown(name, by, **labels):
        return metric(scrape(served), name, model=model, **labels) - metric(before, name, model=model, **labels) == by
    assert wait_for(lambda: grown("specdec:spec_decode_num_accepted_tokens", accepted))
    after = scrape(served)
    assert grown("specdec:spec_decode_num_draft_tokens", drafted)
    assert grown("specdec:generation_tokens", 30)
    per_pos = sum(metric(after, "specdec:spec_decode_num_accepted_tokens_per_pos", model=model, position=str(p))
                  - metric(before, "specdec:spec_decode_num_accepted_tokens_per_pos", model=model, position=str(p))
                  for p in range(4))
    assert per_pos == accepted
    assert metric(after, "specdec:spec_decode_num_drafts", model=model) > 0
    for name in ("specdec:time_to_first_token_seconds_count", "specdec:inter_token_latency_seconds_count",
                 "specdec:request_queue_time_seconds_count", "specdec:e2e_request_latency_seconds_count"):
        assert metric(after, name, model=model) > 0, name
    assert metric(after, "specdec:request_success", model=model, finished_reason="length") > 0
    assert metric(after, "specdec:kv_slots", model=model) == 4
    # the rate guard's vetoes, present (at 0) before any
    assert re.search(rf'^specdec:drafting_vetoes\{{[^}}]*model="{model}"[^}}]*\}} \d', after, re.M), after
    # the sender thread's CPU for responses, which the adaptive policy charges every row's step
    for name in ("specdec:response_seconds", "specdec:responses"):
        assert wait_for(lambda: metric(scrape(served), name, model=model) > metric(before, name, model=model)), name
    for phase in ("prefill", "draft", "forward", "verify"):  # the engine's busy time, by phase
        assert wait_for(lambda: metric(scrape(served), "specdec:engine_seconds", model=model, phase=phase) >
                        metric(before, "specdec:engine_seconds", model=model, phase=phase)), phase


def test_cancelled_stream_frees_its_slot(served):
    before = metric(scrape(served), "specdec:request_success", model=SLOT1, finished_reason="cancelled")
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(served.grpc_url)
    client.start_stream(callback=lambda result=None, error=None: responses.put((result, error)))
    inputs = request_inputs("def add(a, b):", max_tokens=LONG, ignore_eos=True, stream=True)
    tensors = grpc_tensors(inputs)
    client.async_stream_infer(SLOT1, tensors)
    result, error = responses.get(timeout=60)
    assert error is None
    client.stop_stream(cancel_requests=True)  # the client goes away mid-stream
    client.close()
    t0 = time.perf_counter()
    # the model's only slot must come free long before the cancelled request would have ended;
    # otherwise this request times out in the queue after 1 s
    chunks, error = grpc_request(served.grpc_url, SLOT1, request_inputs("def", max_tokens=4, stream=True))
    assert error is None, error
    assert time.perf_counter() - t0 < 1.0
    assert wait_for(lambda: metric(scrape(served), "specdec:request_success", model=SLOT1,
                                   finished_reason="cancelled") == before + 1)


def test_dropped_sse_connection_frees_its_slot(served):
    before = metric(scrape(served), "specdec:request_success", model=SLOT1, finished_reason="cancelled")
    r = requests.post(f"http://{served.http_url}/v2/models/{SLOT1}/generate_stream", stream=True, timeout=60,
                      json={"text_input": "def", "max_tokens": LONG, "ignore_eos": True, "stream": True})
    assert next(line for line in r.iter_lines() if line).startswith(b"data:")
    r.close()  # the client goes away
    t0 = time.perf_counter()
    r = requests.post(f"http://{served.http_url}/v2/models/{SLOT1}/generate", timeout=30,
                      json={"text_input": "def", "max_tokens": 4})
    assert r.status_code == 200, r.text  # else: queue timeout after 1 s, the slot still taken
    assert time.perf_counter() - t0 < 1.0
    assert wait_for(lambda: metric(scrape(served), "specdec:request_success", model=SLOT1,
                                   finished_reason="cancelled") == before + 1)


def test_cancelled_request_leaves_the_queue(served):
    """A request waiting for a slot sends nothing, so the backend's watcher must notice its client
    leaving: it ends as cancelled, not by the 1 s queue timeout."""
    text = scrape(served)
    cancelled = metric(text, "specdec:request_success", model=SLOT1, finished_reason="cancelled")
    errors = metric(text, "specdec:request_success", model=SLOT1, finished_reason="error")

    def open_stream(inputs):
        responses: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(served.grpc_url)
        client.start_stream(callback=lambda result=None, error=None: responses.put((result, error)))
        tensors = grpc_tensors(inputs)
        client.async_stream_infer(SLOT1, tensors)
        return client, responses
    busy, busy_responses = open_stream(request_inputs("def", max_tokens=LONG, ignore_eos=True, stream=True))
    assert busy_responses.get(timeout=60)[1] is None  # it holds the only slot
    waiting, _ = open_stream(request_inputs("x", max_tokens=4, stream=True))
    time.sleep(0.2)  # it waits in the queue (and would time out there after 1 s)
    waiting.stop_stream(cancel_requests=True)
    waiting.close()
    assert wait_for(lambda: metric(scrape(served), "specdec:request_success", model=SLOT1,
                                   finished_reason="cancelled") == cancelled + 1, 0.9)
    busy.stop_stream(cancel_requests=True)
    busy.close()
    assert wait_for(lambda: metric(scrape(served), "specdec:request_success", model=SLOT1,
                                   finished_reason="cancelled") == cancelled + 2)
    assert metric(scrape(served), "specdec:request_success", model=SLOT1, finished_reason="error") == errors


def test_full_model_queues_then_times_out_with_a_clear_error(served):
    results = {}

    def long_request():
        results["long"] = grpc_request(served.grpc_url, SLOT1, request_inputs(
            "def add(a, b):", max_tokens=LONG, ignore_eos=True, stream=True))
    t = threading.Thread(target=long_request)
    t.start()
    assert wait_for(lambda: metric(scrape(served), "specdec:num_requests_running", model=SLOT1) == 1, 30)
    t0 = time.perf_counter()
    chunks, error = grpc_request(served.grpc_url, SLOT1, request_inputs("def", max_tokens=4, stream=True))
    waited = time.perf_counter() - t0
    assert error is not None and "no KV slot became free" in error, error
    assert 0.9 < waited < 5
    t.join(120)
    chunks, error = results["long"]
    assert error is None and len(joined(chunks)[1]) == LONG  # the running request was not disturbed
    chunks, error = grpc_request(served.grpc_url, SLOT1, request_inputs("def", max_tokens=4, stream=True))
    assert error is None


def test_32_concurrent_mixed_streams_match_their_solo_runs(served):
    cases = []
    for i in range(32):
        options = dict(max_tokens=32, stream=True, exclude_input_in_output=True)
        if i % 2:
            options.update(temperature=[0.7, 1.0, 1.3][i % 3], top_p=[1.0, 0.9][i % 4 // 2],
                           top_k=[0, 20][i % 8 // 4], seed=1000 + i, ignore_eos=i % 3 != 0)
        cases.append((MODELS[i % len(MODELS)], PROMPTS[i % len(PROMPTS)], options))
    together: list = [None] * len(cases)
    barrier = threading.Barrier(len(cases))

    def run(i):
        model, prompt, options = cases[i]
        barrier.wait()
        together[i] = grpc_request(served.grpc_url, model, request_inputs(prompt, **options))
    before = scrape(served)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, (model, prompt, options) in enumerate(cases):
        chunks, error = together[i]
        assert error is None, (i, error)
        solo, error = grpc_request(served.grpc_url, model, request_inputs(prompt, **options))  # sent alone
        assert error is None
        assert joined(chunks) == joined(solo), (i, model, options)
        assert chunks[-1]["reason"] == solo[-1]["reason"]
    sampled = [joined(together[i][0])[1] for i in range(1, len(cases), 2)]
    assert sum(map(len, sampled)) > 8 * len(sampled) and len({tuple(s) for s in sampled}) > len(sampled) // 2

    def batched(text, model):  # streamed chunks that went out while more than one request ran
        return (metric(text, "specdec:batch_size_count", model=model)
                - metric(text, "specdec:batch_size_bucket", model=model, le="1"))
    after = scrape(served)
    assert sum(batched(after, m) - batched(before, m) for m in MODELS) > 0  # they really ran together


def test_specdec_client_over_grpc_and_http(served, capsys):
    assert client_main(["def add(a, b):", "--model", "spec_ngram", "--url", served.grpc_url, "--max-tokens", "8"]) == 0
    out = capsys.readouterr()
    assert "tokens/s" in out.err and "acceptance rate" in out.err
    assert client_main(["def add(a, b):", "--model", "spec_ngram", "--protocol", "http", "--url", served.http_url,
                        "--max-tokens", "8", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["tokens"] == 8 and summary["finish_reason"] == "length"
    assert client_main(["x", "--model", "baseline", "--url", served.grpc_url, "--top-p", "2"]) == 1
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    assert client_main(["x", "--model", "baseline", "--protocol", "http", "--url", served.http_url,
                        "--temperature", "-1"]) == 1
    assert "temperature" in capsys.readouterr().err


def test_serve_command_prints_endpoints_and_stops_on_ctrl_c(served):
    ports = [str(p) for p in free_ports(3)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec.serving.server", "--model-repository", str(served.model_repository),
         "--models", "spec_ngram", "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2],
         "--exit-timeout-secs", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C"):
                break
        text = "".join(lines)
        assert f"localhost:{ports[1]}" in text and f"http://localhost:{ports[0]}" in text and "spec_ngram" in text
        r = requests.post(f"http://localhost:{ports[0]}/v2/models/spec_ngram/generate",
                          json={"text_input": "def", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("model", MODELS)
def test_a_long_stream_and_long_prompts_up_to_the_context_limit_run_together(served, engines, model):
    """A long-running stream, then prompts that fill the 512-token context admitted next to it: the
    proposers' catch-up once wrote past the long stream's cache slot and every request of the
    batch failed. Each output equals its run alone."""
    tokenizer = engines(model).tokenizer
    text = "".join(PROMPTS) * 40

    def prompt_of(n):  # a prompt of at most n tokens
        ids = tokenizer.encode(text)[:n]
        return tokenizer.decode(ids)

    long_run = ("def main():", dict(max_tokens=400, ignore_eos=True))
    newcomers = [(prompt_of(n), dict(max_tokens=512 - len(tokenizer.encode(prompt_of(n))), ignore_eos=True))
                 for n in (420, 300, 200)]
    started, results = threading.Event(), {}

    def run(i, prompt, options):
        chunks, error = [], None
        client = grpcclient.InferenceServerClient(served.grpc_url)
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result=None, error=None: responses.put((result, error)))
        try:
            client.async_stream_infer(model, grpc_tensors(request_inputs(prompt, stream=True, **options)),
                                      enable_empty_final_response=True)
            while True:
                result, error = responses.get(timeout=300)
                if error is not None:
                    break
                chunks += result.as_numpy("output_ids").tolist()
                if len(chunks) >= 150:  # the long stream is well past its prompt
                    started.set()
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
        finally:
            client.stop_stream()
            client.close()
        results[i] = (chunks, None if error is None else error.message())

    threads = [threading.Thread(target=run, args=(0, *long_run))]
    threads[0].start()
    assert started.wait(120)
    threads += [threading.Thread(target=run, args=(i + 1, *c)) for i, c in enumerate(newcomers)]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(400)
    for i, (prompt, options) in enumerate([long_run] + newcomers):
        ids, error = results[i]
        assert error is None, (i, error)
        solo, error = grpc_request(served.grpc_url, model, request_inputs(prompt, stream=True, **options))
        assert error is None and ids == joined(solo)[1], i


def test_a_20_mb_prompt_is_refused_at_once_and_delays_no_one(served):
    small = request_inputs("def add(a, b):", max_tokens=16, ignore_eos=True)
    t0 = time.monotonic()
    assert grpc_request(served.grpc_url, "spec_draft", small)[1] is None
    alone = time.monotonic() - t0
    results = {}

    def run(name, inputs):
        t = time.monotonic()
        results[name] = (grpc_request(served.grpc_url, "spec_draft", inputs)[1], time.monotonic() - t)
    huge = threading.Thread(target=run, args=("huge", request_inputs("x" * 20_000_000, max_tokens=16)))
    huge.start()
    time.sleep(0.05)
    run("small", small)
    huge.join(60)
    error, seconds = results["huge"]
    assert error is not None and "text_input has 20000000 characters" in error
    assert seconds < 1.5  # 20 MB over local gRPC plus the check; tokenizing it took 16-18 s
    assert results["small"][0] is None and results["small"][1] < alone + 1.0


def test_free_ports_picked_together_are_distinct():
    """The three ports a TritonServer picks (`free_ports`): picked one at a time, a port freed by
    the first could come back for the next (2 of 20000 triples on this machine), and a load test's
    second server life was refused for listening twice on one port."""
    for _ in range(5000):
        assert len(set(free_ports(3))) == 3


def test_a_server_killed_by_a_signal_while_loading_is_started_again(served, tmp_path):
    """`start_retrying` (`specdec serve`'s supervisor, each of a load test's server lives): Triton
    2.51's Python backend can abort tritonserver while the models load; a server killed so is
    started again, and says why. Here the first tritonserver is killed (SIGKILL) as it starts."""
    from specdec.serving.server import start_retrying

    server = TritonServer(served.model_repository, exit_timeout_s=2, log_file=tmp_path / "tritonserver.log")
    killed = []

    def kill_the_first() -> None:
        deadline = time.monotonic() + 60
        while server.proc is None and time.monotonic() < deadline:
            time.sleep(0.001)
        if server.proc is not None:
            os.kill(server.proc.pid, signal.SIGKILL)
            killed.append(server.proc.pid)

    said = []
    thread = threading.Thread(target=kill_the_first, daemon=True)
    thread.start()
    try:
        start_retrying(server, 300, said.append)
        thread.join(5)
        assert len(killed) == 1 and server.proc.pid != killed[0]
        assert len(said) == 1 and "killed by signal 9" in said[0] and "starting it again (2/3)" in said[0]
        assert requests.get(f"http://{server.http_url}/v2/health/ready", timeout=10).status_code == 200
    finally:
        server.stop()
