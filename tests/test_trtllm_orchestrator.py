"""The orchestrated path through real tritonserver on the CPU: `specdec build-repo --runtime
trtllm-contract` writes spec_draft (the rounds engine over target_trtllm + draft_trtllm through BLS)
and baseline (the target alone); spec_draft must stream exactly the baseline's greedy tokens (and
the in-process engine's), reproduce seeded runs under concurrency, stop calling the inner models
after a cancel, surface an inner error, and sample first tokens from the target's distribution.

Float64 models: batch shapes then cannot change rounding. The draft is the target with noise on
every weight, so rounds accept some draft tokens and reject others.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import torch
import tritonclient.grpc as grpcclient
from scipy.stats import chisquare

from specdec.core.engine_config import EngineConfig, build_engine
from specdec.core.models.checkpoint import load_model
from specdec.core.models.tokenizer import Tokenizer
from specdec.core.sampling import SamplingParams, probs
from specdec.serving.client import grpc_tensors, request_inputs
from specdec.serving.config import read_parameters
from specdec.serving.repository import config_pbtxt, main as build_repo
from specdec.serving.server import TritonServer
from test_triton_server import grpc_request, http_stream, joined, metric, scrape, wait_for
from tiny_checkpoints import make_hf_checkpoint, make_perturbed_copy

pytestmark = pytest.mark.slow

WORDS = ["def", "class", "import", "for", "return", "self", "print", "x", "(a, b)", "os", "\n", "    ", "café",
         "range(10)", "Point", "main", "sys", "if", "=", "+"]
PROMPTS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(1 + i % 5)) for i in range(30)]
LONG = 400


@pytest.fixture(scope="module")
def kit(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("trtllm-kit")
    target = make_hf_checkpoint(root / "target", tokenizer_dir, layers=2, hidden=64, seed=1)
    return {"target": target, "draft": make_perturbed_copy(target, root / "draft", noise=0.1, seed=5)}


def variant(repo, source, name, **parameters):
    """Another orchestrator over the same inner models: spec_draft's parameters, some changed."""
    (repo / name / "1").mkdir(parents=True)
    params = {**read_parameters(repo / source / "config.pbtxt"), **parameters}
    (repo / name / "config.pbtxt").write_text(config_pbtxt(name, params))


@pytest.fixture(scope="module")
def served(tmp_path_factory, kit):
    root = tmp_path_factory.mktemp("trtllm-repo")
    repo = root / "model_repository"
    assert build_repo(["--runtime", "trtllm-contract", "--target", str(kit["target"]), "--draft", str(kit["draft"]),
                       "--out", str(repo), "--dtype", "float64", "--max-batch", "8", "--max-context", "512",
                       "--tokens-per-block", "4"]) == 0
    assert sorted(p.name for p in repo.iterdir()) == ["baseline", "draft_trtllm", "spec_draft", "target_trtllm"]
    # the inner calls keep the prompt in output_ids and the orchestrator slices it off
    variant(repo, "spec_draft", "spec_draft_incl", inner_exclude_input_in_output="false")
    # drafts longer than the target's max_draft_len (4): every round fails in target_trtllm
    variant(repo, "spec_draft", "spec_draft_too_long", max_draft_len=6, policy="fixed")
    with TritonServer(repo, exit_timeout_s=3, log_file=root / "tritonserver.log") as server:
        yield server


def inner_requests(server) -> dict[str, int]:
    """Requests each inner model received (Triton's own statistics, not ours)."""
    counts = {}
    for model in ("target_trtllm", "draft_trtllm"):
        stats = requests.get(f"http://{server.http_url}/v2/models/{model}/stats", timeout=10).json()
        counts[model] = int(stats["model_stats"][0]["inference_stats"]["success"]["count"])
    return counts


def test_spec_draft_streams_the_baselines_greedy_tokens(served, kit):
    engine = build_engine(EngineConfig.of(target=str(kit["target"]), dtype="float64"))
    accepted = rejected = 0
    for i, prompt in enumerate(PROMPTS):
        options = dict(max_tokens=24 + i % 3 * 8, stream=True, exclude_input_in_output=bool(i % 2))
        base, error = grpc_request(served.grpc_url, "baseline", request_inputs(prompt, **options))
        assert error is None, error
        model = "spec_draft_incl" if i % 3 == 0 else "spec_draft"
        spec, error = grpc_request(served.grpc_url, model, request_inputs(prompt, **options))
        assert error is None, error
        assert joined(spec) == joined(base), (i, model, prompt)
        assert spec[-1]["reason"] == base[-1]["reason"]
        assert joined(spec)[0].startswith("" if options["exclude_input_in_output"] else prompt)
        accepted += spec[-1]["accepted"]
        rejected += spec[-1]["draft"] - spec[-1]["accepted"]
        if i < 6:  # and both are the in-process engine's greedy output
            (result,) = engine.generate([prompt], SamplingParams(max_tokens=options["max_tokens"]))
            assert joined(base)[1] == result.token_ids
    assert accepted > 0 and rejected > 0  # the test covers accepted and rejected drafts


def test_http_sse_and_generate_match_the_baseline(served):
    for prompt in PROMPTS[:4]:
        body = {"text_input": prompt, "max_tokens": 20, "stream": True, "exclude_input_in_output": True}
        status, events = http_stream(served, "spec_draft", body)
        status_b, events_b = http_stream(served, "baseline", body)
        assert status == status_b == 200
        ids = event_ids(events)
        assert ids == event_ids(events_b) and len(ids) == 20
        r = requests.post(f"http://{served.http_url}/v2/models/spec_draft/generate", timeout=60,
                          json={**body, "stream": False})
        assert r.status_code == 200, r.text
        assert event_ids([r.json()]) == ids and r.json()["text_output"] == "".join(e["text_output"] for e in events)


def event_ids(events):
    """Token ids of generate / generate_stream JSON events (a one-element tensor comes as a number)."""
    return [i for e in events for i in (e["output_ids"] if isinstance(e["output_ids"], list) else [e["output_ids"]])]


def test_16_concurrent_streams_reproduce_their_runs_alone(served):
    cases = []
    for i in range(16):
        options = dict(max_tokens=24, stream=True, exclude_input_in_output=True)
        if i % 2:
            options.update(temperature=[0.8, 1.2][i % 4 // 2], top_k=[0, 20][i % 3 == 0], seed=100 + i,
                           ignore_eos=True)
        cases.append(("spec_draft", PROMPTS[i], options))

    def send(case):
        model, prompt, options = case
        return grpc_request(served.grpc_url, model, request_inputs(prompt, **options))

    with ThreadPoolExecutor(len(cases)) as pool:  # all at once: spec_draft runs 8, queues 8
        together = list(pool.map(send, cases))
    for i, case in enumerate(cases):
        chunks, error = together[i]
        assert error is None, (i, error)
        solo, error = send(case)
        assert error is None
        assert joined(chunks) == joined(solo), (i, case)
    sampled = [tuple(joined(together[i][0])[1]) for i in range(1, 16, 2)]
    assert len(set(sampled)) == len(sampled) and all(len(s) == 24 for s in sampled)
    text = scrape(served)  # the metrics flusher saw several spec_draft requests in flight at once
    assert metric(text, "specdec:batch_size_count", model="spec_draft") > metric(
        text, "specdec:batch_size_bucket", model="spec_draft", le="1")


def test_a_cancelled_stream_issues_no_further_inner_requests(served):
    before = metric(scrape(served), "specdec:request_success", model="spec_draft", finished_reason="cancelled")
    start = inner_requests(served)
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(served.grpc_url)
    client.start_stream(callback=lambda result=None, error=None: responses.put((result, error)))
    client.async_stream_infer("spec_draft", grpc_tensors(request_inputs("def add(a, b):", max_tokens=LONG,
                                                                       ignore_eos=True, stream=True)))
    for _ in range(3):
        result, error = responses.get(timeout=60)
        assert error is None
    client.stop_stream(cancel_requests=True)
    client.close()
    assert wait_for(lambda: metric(scrape(served), "specdec:request_success", model="spec_draft",
                                   finished_reason="cancelled") == before + 1, timeout=10)
    after_cancel = inner_requests(served)
    time.sleep(1.0)
    assert inner_requests(served) == after_cancel  # no round started after the cancel
    rounds = after_cancel["target_trtllm"] - start["target_trtllm"]
    assert 3 <= rounds < LONG // 5  # it ran a few rounds, far fewer than the whole request needs


def test_an_inner_error_ends_the_stream_with_it_and_the_server_keeps_serving(served):
    chunks, error = grpc_request(served.grpc_url, "spec_draft_too_long",
                                 request_inputs("def add(a, b):", max_tokens=16, stream=True))
    assert error is not None and "target_trtllm" in error and "draft_input_ids has 6 tokens" in error, error
    assert "max_draft_len 4" in error
    chunks, error = grpc_request(served.grpc_url, "spec_draft", request_inputs("def add(a, b):", max_tokens=8,
                                                                             stream=True))
    assert error is None and len(joined(chunks)[1]) == 8


def test_sampled_first_tokens_follow_the_targets_distribution(served, kit):
    prompt, top_k, n = "def add(a, b):", 6, 360
    model = load_model(kit["target"], torch.float64)
    ids = Tokenizer(kit["target"]).encode(prompt)
    params = SamplingParams(temperature=1.0, top_k=top_k)
    with torch.inference_mode():
        p = probs(model.logits(model(torch.tensor([ids])))[0, -1:], params)[0]
    firsts: list = [None] * n

    def run(lo):
        for i in range(lo, n, 12):
            chunks, error = grpc_request(served.grpc_url, "spec_draft", request_inputs(
                prompt, max_tokens=3, temperature=1.0, top_k=top_k, seed=7000 + i, ignore_eos=True, stream=True))
            assert error is None, error
            firsts[i] = joined(chunks)[1][0]
    threads = [threading.Thread(target=run, args=(lo,)) for lo in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    support = torch.nonzero(p).flatten().tolist()
    assert set(firsts) <= set(support)
    observed = np.array([firsts.count(t) for t in support], dtype=float)
    expected = np.array([float(p[t]) * n for t in support])
    assert float(chisquare(observed, expected).pvalue) > 1e-3, (observed, expected)
