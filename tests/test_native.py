"""The native decoder (`core/models/native`) against the eager layers it replaces, and when it runs."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import save_file

from specdec.core.models import native
from specdec.core.models.checkpoint import load_model, load_weights
from specdec.core.models.config import LlamaConfig
from specdec.core.models.heads import EagleHead
from specdec.core.models.linear import InferenceLinear
from specdec.core.models.llama import run_decoder
from tiny_checkpoints import make_hf_checkpoint


@pytest.fixture(autouse=True)
def every_row_count_native(monkeypatch):
    """The kernels are checked at every row count on every CPU: without AVX-512 at most 64 rows
    run natively in use (`native.NATIVE_MAX_ROWS`), but the kernels take any count there too."""
    monkeypatch.setattr(native, "NATIVE_MAX_ROWS", 1024)


def test_without_avx512_at_most_64_rows_run_natively(monkeypatch):
    monkeypatch.setattr(native, "_cpu_signature", lambda: "x86_64flags\t: fpu avx2 fma")
    assert native._max_rows() == 64
    monkeypatch.setattr(native, "_cpu_signature", lambda: "x86_64flags\t: fpu avx2 avx512f avx512bw")
    assert native._max_rows() == 1024


def test_without_avx512_a_wider_forward_runs_natively_at_one_thread_while_its_rows_are_short(monkeypatch):
    """Prefills of the load test's prompts (24-165 tokens) ran eager past 64 rows on an AVX2 CPU,
    where the native forward is 1.2-1.5x faster at one thread; a row of 512 tokens, or two threads,
    is faster eager (`native.runs_natively`)."""
    monkeypatch.setattr(native, "NATIVE_MAX_ROWS", 64)
    monkeypatch.setattr(native, "_threads", 1)
    assert native.runs_natively(64, 64)
    assert native.runs_natively(80, 80) and native.runs_natively(4 * 80, 80) and native.runs_natively(8 * 128, 128)
    assert not native.runs_natively(300, 300)
    assert not native.runs_natively(1025, 100)
    monkeypatch.setattr(native, "_threads", 2)
    assert native.runs_natively(64, 64) and not native.runs_natively(80, 80)


def test_the_pool_threads_set_are_the_ones_that_decide(monkeypatch):
    monkeypatch.setattr(native, "_threads", native._threads)
    native.set_threads(2)
    try:
        assert native._threads == 2
    finally:
        native.set_threads(1)
    assert native._threads == 1


PREFIX = [37, 21]  # two sequences' committed lengths (different: per-row starts and masks; the
# attention scores a committed prefix 16 keys at a time with AVX-512, else 8, then key by key:
# both run in each)


@pytest.fixture(scope="module", params=[64, 128, 256], ids=["head_dim 16", "head_dim 32", "head_dim 64"])
def target(request, tiny_target, tmp_path_factory, tokenizer_dir):
    """The tiny target, and targets as small with the head sizes the attention has its own code for."""
    if request.param == 64:
        return tiny_target
    return make_hf_checkpoint(tmp_path_factory.mktemp("target"), tokenizer_dir, layers=2, hidden=request.param, seed=1)


def prefilled(model, slots):
    """A cache with two different prompts prefilled eagerly (many rows: never native) in `slots`."""
    cache = model.new_cache(4, 48)
    torch.manual_seed(0)
    for slot, n in zip(slots, PREFIX):
        model(torch.randint(0, 300, (1, n)), torch.arange(n)[None], cache, [slot], [0])
    return cache


def tree(parents):
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    return mask


CASES = {
    # name: (tokens per row, positions offsets, tree mask or None, lengths or None)
    "one token": (1, [0], None, None),
    "causal chain": (4, [0, 1, 2, 3], None, None),
    "tree": (4, [0, 1, 1, 2], tree([-1, 0, 0, 1]), None),
    "padded rows": (3, [0, 1, 2], None, [3, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("slots", [[0, 1], [3, 1]], ids=["contiguous", "scattered"])
def test_native_layers_equal_the_eager_ones(target, case, slots):
    """Hidden states and every cache entry the forward writes agree with the eager layers (float
    rounding apart), for decode, chain and tree verification and padded rows."""
    model = load_model(target)
    assert model.native is not None, "the tiny targets' dimensions are multiples of 16: they must run natively"
    T, offsets, mask, lengths = CASES[case]
    tokens = torch.tensor([[7, 11, 13, 17][:T], [19, 23, 29, 31][:T]])
    positions = torch.tensor([[n + o for o in offsets] for n in PREFIX])
    masks = None if mask is None else mask.expand(2, -1, -1)
    out = {}
    for name, nat in (("native", model.native), ("eager", None)):
        model.native = nat
        cache = prefilled(model, slots)
        with torch.no_grad():
            hidden = model(tokens, positions, cache, slots, PREFIX, masks, lengths)
        out[name] = hidden, cache
    (h_native, c_native), (h_eager, c_eager) = out["native"], out["eager"]
    real = [lengths[b] if lengths else T for b in range(2)]
    assert not h_native[1, real[1]:].any()  # padding is not computed
    for b in range(2):
        assert rounding_apart(h_native[b, : real[b]], h_eager[b, : real[b]]), case
        end = PREFIX[b] + real[b]
        assert rounding_apart(c_native.k[:, slots[b], :end], c_eager.k[:, slots[b], :end])
        assert rounding_apart(c_native.v[:, slots[b], :end], c_eager.v[:, slots[b], :end])


@pytest.fixture(scope="module")
def wide_vocab_target(tmp_path_factory, tokenizer_dir):
    """The tiny target's shape with a vocabulary the native output head takes (a multiple of 16:
    5 blocks of 64 columns and one of 16); the tokenizer's 300 is not, and stays on F.linear."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("target"), tokenizer_dir, layers=2, hidden=64, seed=1, vocab=336)


STEP_CASES = CASES | {"short first row": (3, [0, 1, 2], None, [1, 3])}


@pytest.mark.parametrize("kind", ["greedy", "logits"])
@pytest.mark.parametrize("case", list(STEP_CASES))
def test_a_step_in_one_call_equals_the_forward_and_head(wide_vocab_target, case, kind):
    """Bit for bit, for decode, chain and tree verification and padded rows: `greedy_step`
    (embeddings, layers, head and argmax in one native call) gives the hidden states, cache
    entries and argmax ids of `forward`, `logits` and torch's argmax over the real tokens;
    `logits_step` (a step whose rows sample) the same hidden states and cache entries and the
    logits of `forward` then `logits` ([B, T, V], or [real tokens, V] for padded rows, as the
    engine's eager path returns them)."""
    model = load_model(wide_vocab_target)
    assert model.native_step is not None
    T, offsets, mask, lengths = STEP_CASES[case]
    tokens = torch.tensor([[7, 11, 13, 17][:T], [19, 23, 29, 31][:T]])
    positions = torch.tensor([[n + o for o in offsets] for n in PREFIX])
    masks = None if mask is None else mask.expand(2, -1, -1)
    real = torch.arange(T) < torch.tensor(lengths or [T, T])[:, None]
    step = model.greedy_step if kind == "greedy" else model.logits_step
    with torch.no_grad():
        cache = prefilled(model, [0, 1])
        hidden = model(tokens, positions, cache, [0, 1], PREFIX, masks, lengths)
        argmax = model.logits(hidden[real]).argmax(-1).tolist()
        logits = model.logits(hidden if lengths is None else hidden[real])
        one_call = prefilled(model, [0, 1])
        h, out = step(tokens.flatten().tolist(), positions.flatten().tolist(), 2, T, one_call, [0, 1], PREFIX, masks,
                      lengths)
    assert torch.equal(h, hidden)
    if kind == "greedy":
        assert out == argmax
    else:
        assert out.shape == logits.shape and torch.equal(out, logits)
    assert torch.equal(one_call.k, cache.k) and torch.equal(one_call.v, cache.v)


def test_a_greedy_step_without_a_native_head_is_left_to_the_caller(tiny_target):
    """A vocabulary the native head does not take (300: not a multiple of 16) has no one-call step."""
    model = load_model(tiny_target)
    assert model.native_step is None
    assert model.greedy_step([7], [0], 1, 1, model.new_cache(1, 8), [0], [0]) is None


def test_a_greedy_step_over_a_token_outside_the_vocabulary_is_refused(wide_vocab_target):
    model = load_model(wide_vocab_target)
    cache = model.new_cache(1, 8)
    with pytest.raises(RuntimeError, match="code -3"):
        model.greedy_step([model.config.vocab_size], [0], 1, 1, cache, [0], [0])


def rounding_apart(native_values, eager_values) -> bool:
    """Equal up to float32 rounding at the values' scale (sums over 256 inputs of values up to
    8 differ in the 5th decimal)."""
    return torch.allclose(native_values, eager_values, rtol=0, atol=4e-6 * float(eager_values.abs().max()))


def test_a_tokens_numbers_do_not_depend_on_what_else_the_forward_runs(target):
    """Bit for bit: a token decoded alone, as the root of a 4-token draft and beside another
    sequence gives the same hidden state, so verification sees the plain step's numbers."""
    model = load_model(target)
    with torch.no_grad():
        cache = prefilled(model, [0, 1])
        alone = model(torch.tensor([[7]]), torch.tensor([[PREFIX[0]]]), cache, [0], [PREFIX[0]])
        chain = model(torch.tensor([[7, 1, 2, 3]]), PREFIX[0] + torch.arange(4)[None], cache, [0], [PREFIX[0]])
        batch = model(torch.tensor([[7], [9]]), torch.tensor([[PREFIX[0]], [PREFIX[1]]]), cache, [0, 1], PREFIX)
    assert torch.equal(alone[0, 0], chain[0, 0])
    assert torch.equal(alone[0, 0], batch[0, 0])


def test_a_drafted_token_gets_the_numbers_of_its_later_plain_step(target):
    """Bit for bit: the last token of a 4-token chain verified at start 45 and the same token's
    plain step once the chain is committed (start 48). Keys 40-47 (8-float vectors; 32-47 with
    16-float ones) are scored one by one in the first and a block at a time in the second: a
    block's sums must add in the single key's order, or a verified token and its plain step differ
    in the last bits and greedy speculation stops being the baseline's."""
    model = load_model(target)
    start, chain = 45, torch.tensor([[7, 1, 2, 3]])
    with torch.no_grad():
        cache = model.new_cache(1, 64)
        torch.manual_seed(0)
        model(torch.randint(0, 300, (1, start)), torch.arange(start)[None], cache, [0], [0])
        verified = model(chain, start + torch.arange(4)[None], cache, [0], [start])
        plain = model(chain[:, 3:], torch.tensor([[start + 3]]), cache, [0], [start + 3])
    assert torch.equal(verified[0, 3], plain[0, 0])


@pytest.fixture
def threads():
    """Sets the native pool's threads; one again after the test."""
    yield native.set_threads
    native.set_threads(1)


@pytest.mark.parametrize("case", list(CASES))
def test_more_threads_give_the_one_thread_numbers_bit_for_bit(tiny_target, case, threads):
    """Split over threads (matmul column blocks, attention's row and head pairs), every hidden
    state and cache entry is the one-thread one exactly, for an even and an uneven split."""
    model = load_model(tiny_target)
    T, offsets, mask, lengths = CASES[case]
    tokens = torch.tensor([[7, 11, 13, 17][:T], [19, 23, 29, 31][:T]])
    positions = torch.tensor([[n + o for o in offsets] for n in PREFIX])
    masks = None if mask is None else mask.expand(2, -1, -1)
    out = []
    for n in (1, 2, 3):
        threads(n)
        cache = prefilled(model, [0, 1])
        with torch.no_grad():
            out.append((model(tokens, positions, cache, [0, 1], PREFIX, masks, lengths), cache.k, cache.v))
    for other in out[1:]:
        for a, b in zip(out[0], other):
            assert torch.equal(a, b), case


def test_a_prefill_runs_at_prefill_threads_and_decode_at_threads(tiny_target, monkeypatch, threads):
    """`prefill_threads` sets the native pool for a prompt's prefill only (a prompt's rows split
    well over threads: 1.7x-1.8x at two on the demo kit's 24-165 token prompts), back to
    `threads` for the decode steps; the tokens are the one-thread ones, as every split's numbers are."""
    from specdec.core.config import EngineConfig
    from specdec.core.engine_config import build_engine
    from specdec.core.errors import ConfigurationError
    from specdec.core.models.llama import LlamaForCausalLM
    from specdec.core.sampling import SamplingParams

    seen = []  # the pool's threads at each forward of the target
    forward = LlamaForCausalLM.forward

    def spy(self, *args, **kwargs):
        seen.append(native._threads)
        return forward(self, *args, **kwargs)

    prompts, params = ["def add(a, b):\n", "import os\n"], SamplingParams(max_tokens=6, ignore_eos=True)
    texts = {}
    for n in (0, 2):  # 0: as `threads`
        engine = build_engine(EngineConfig.of(target=str(tiny_target), method="baseline", max_batch=2, prefill_threads=n))
        monkeypatch.setattr(LlamaForCausalLM, "forward", spy)
        seen.clear()
        texts[n] = [r.text for r in engine.generate(prompts, params)]
        monkeypatch.setattr(LlamaForCausalLM, "forward", forward)
        assert seen[0] == (n or 1) and native._threads == 1  # the prefill's forward; after it, `threads` again
    assert texts[0] == texts[2]
    with pytest.raises(ConfigurationError, match="prefill_threads >= 0"):
        build_engine(EngineConfig.of(target=str(tiny_target), method="baseline", prefill_threads=-1))


@pytest.mark.parametrize("n", [2, 3, 5])
def test_a_matmul_split_over_threads_equals_the_one_thread_one(n, threads):
    """Column splits fall on 64- and 16-column block boundaries, the remainder included."""
    torch.manual_seed(0)
    w, bias, x = torch.randn(3 * 64 + 2 * 16, 48), torch.randn(3 * 64 + 2 * 16), torch.randn(5, 48)
    packed = native.blocked(w)
    threads(1)
    one = native.matmul(x, packed, bias, w.shape[0])
    threads(n)
    assert torch.equal(native.matmul(x, packed, bias, w.shape[0]), one)
    assert torch.allclose(one, x @ w.T + bias, atol=1e-4)


def test_weights_that_are_all_float16_values_are_kept_as_float16_with_the_same_numbers(tiny_target, tmp_path, monkeypatch):
    """A checkpoint saved in half precision (the demo kit's) keeps its blocked weights as float16,
    half the bytes a one-row step streams: the kernel widens them exactly, so hidden states and
    logits equal the float32-stored ones bit for bit. A float32 checkpoint's stay float32."""
    half = tmp_path / "half"
    shutil.copytree(tiny_target, half)
    weights = load_weights(half)
    for f in half.glob("*.safetensors"):
        f.unlink()
    save_file({k: v.half().contiguous() for k, v in weights.items()}, str(half / "model.safetensors"))
    assert load_model(tiny_target).model.layers[0].self_attn.qkv.blocked.dtype == torch.float32
    models = {"float16": load_model(half)}
    wide = native.blocked
    monkeypatch.setattr(native, "blocked", lambda w: None if (b := wide(w)) is None else b.float())
    models["float32"] = load_model(half)
    for name, model in models.items():
        assert model.native is not None
        assert {x.blocked.dtype for x in (model.model.layers[0].mlp.down, model.model.layers[1].self_attn.qkv)} == {getattr(torch, name)}
    out = {}
    for name, model in models.items():
        with torch.no_grad():
            cache = prefilled(model, [0, 1])
            hidden = model(torch.tensor([[7, 11, 13, 17], [19, 23, 29, 31]]),
                           torch.tensor(PREFIX)[:, None] + torch.arange(4), cache, [0, 1], PREFIX)
            out[name] = (hidden, model.logits(hidden), cache.k.clone())
    for a, b in zip(out["float16"], out["float32"]):
        assert torch.equal(a, b)


def test_the_eagle_heads_layers_run_natively_without_an_input_norm(tiny_target):
    config = LlamaConfig.from_file(tiny_target / "config.json")
    config.num_hidden_layers = 2
    torch.manual_seed(1)
    head = EagleHead(config).eval()
    head.prepare_inference()
    assert head.native is not None
    x = torch.randn(2, 3, config.hidden_size)
    runs = []
    for nat in (head.native, None):
        cache = head.new_cache(2, 16)
        with torch.no_grad():
            runs.append(run_decoder(head.layers, head.rope, x, torch.arange(3).expand(2, -1), cache, [0, 1], [0, 0],
                                    native=nat))
    assert torch.allclose(*runs, atol=1e-5)


def test_a_linear_sends_few_rows_to_the_native_matmul_and_many_to_onednn(monkeypatch):
    """Same numbers either way (float rounding apart); outputs not a multiple of 16 stay off it."""
    calls = []
    matmul = native.matmul
    monkeypatch.setattr(native, "matmul", lambda *a: calls.append(1) or matmul(*a))
    torch.manual_seed(0)
    for out_features, want in ((1040, [1, 1, 0]), (1000, [0, 0, 0])):
        model = torch.nn.Linear(256, out_features)
        layer = InferenceLinear(model.weight, model.bias)
        got = []
        for rows in (1, native.NATIVE_MAX_ROWS, native.NATIVE_MAX_ROWS + 1):
            x = torch.randn(rows, 256)
            before = len(calls)
            with torch.no_grad():
                assert torch.allclose(layer(x), model(x), atol=1e-4)
            got.append(len(calls) - before)
        assert got == want, out_features


@pytest.mark.parametrize("half", [False, True])
def test_a_rows_matmul_numbers_do_not_depend_on_the_rows_beside_it(half):
    """Bit for bit: each row of a matmul of 2-8 rows is that row's matmul alone, float16 and
    float32 weights, 64-column blocks and a 16-column remainder. With AVX-512 on Zen 4 a one-row
    pass converts and multiplies 8 floats at a time and passes of more rows 16: each output's sum
    must still add the same FMAs in the same order, or verification stops seeing the plain step's
    numbers."""
    torch.manual_seed(0)
    weight = torch.randn(2 * 64 + 16, 96)
    weight = weight.half().float() if half else weight
    packed, bias, x = native.blocked(weight), torch.randn(weight.shape[0]), torch.randn(8, 96)
    assert packed.dtype == (torch.float16 if half else torch.float32)
    alone = torch.cat([native.matmul(x[r:r + 1], packed, bias, weight.shape[0]) for r in range(8)])
    for rows in range(2, 9):
        assert torch.equal(native.matmul(x[:rows], packed, bias, weight.shape[0]), alone[:rows]), rows
    assert torch.allclose(alone, x @ weight.T + bias, atol=1e-4)


def needs_kernel(dtype: str):
    """Skips, saying so, where this CPU has no `dtype` kernel (the library builds none)."""
    feature = {"bfloat16": "AVX512-BF16", "int8": "AVX512-VNNI"}[dtype]
    return pytest.mark.skipif(not native.kernel_available(dtype), reason=f"this CPU has no {feature}: no {dtype} kernel is built")


@needs_kernel("bfloat16")
def test_bfloat16_weights_multiply_rounded_values_and_a_rows_numbers_do_not_depend_on_the_rows_beside_it():
    """A drafter's bfloat16 matmul (`native.blocked(..., "bfloat16")`): the products of x and
    the weight rounded to bfloat16, summed in float32, each row's the same bit for bit whatever
    rows run beside it (64-column blocks and a 16-column remainder); an odd input width is left
    to the float32 kernels."""
    torch.manual_seed(0)
    weight, bias, x = torch.randn(2 * 64 + 16, 96), torch.randn(2 * 64 + 16), torch.randn(8, 96)
    packed = native.blocked(weight, "bfloat16")
    assert packed.dtype == torch.bfloat16
    alone = torch.cat([native.matmul(x[r:r + 1], packed, bias, weight.shape[0]) for r in range(8)])
    for rows in range(2, 9):
        assert torch.equal(native.matmul(x[:rows], packed, bias, weight.shape[0]), alone[:rows]), rows
    rounded = x.bfloat16().double() @ weight.bfloat16().double().T + bias.double()
    assert torch.allclose(alone.double(), rounded, atol=1e-5)
    assert not torch.allclose(alone, x @ weight.T + bias, atol=1e-4)  # rounded: not the float32 products
    assert native.blocked(torch.randn(64, 95), "bfloat16") is None


@needs_kernel("int8")
def test_int8_weights_multiply_quantized_values_and_a_rows_numbers_do_not_depend_on_the_rows_beside_it():
    """A drafter's int8 matmul (`native.blocked(..., "int8")`): each weight column scaled by its
    largest magnitude over 127 and rounded, each input row likewise by its own, the integer
    products summed exactly and scaled back; each row's the same bit for bit whatever rows run
    beside it (64-column blocks and a 16-column remainder), a row of zeros gives the bias; an
    input width not a multiple of 16 is left to the wider kernels."""
    torch.manual_seed(0)
    weight, bias, x = torch.randn(2 * 64 + 16, 96), torch.randn(2 * 64 + 16), torch.randn(8, 96) * 3
    x[5] = 0
    packed = native.blocked(weight, "int8")
    assert packed.dtype == torch.int8
    alone = torch.cat([native.matmul(x[r:r + 1], packed, bias, weight.shape[0]) for r in range(8)])
    for rows in range(2, 9):
        assert torch.equal(native.matmul(x[:rows], packed, bias, weight.shape[0]), alone[:rows]), rows
    w_scale = weight.abs().amax(1).double() / 127
    x_scale = (x.abs().amax(1, keepdim=True).double() / 127).clamp(min=1e-30)
    w8, x8 = torch.round(weight.double() / w_scale[:, None]), torch.round(x.double() / x_scale)
    assert w8.abs().max() == 127 and x8.abs().max() == 127
    quantized = (x8 @ w8.T) * x_scale * w_scale + bias.double()
    assert torch.allclose(alone.double(), quantized, rtol=1e-5, atol=1e-5)
    assert torch.equal(alone[5], bias)
    exact = x @ weight.T + bias
    assert not torch.allclose(alone, exact, atol=1e-2)  # quantized: not the float32 products
    assert (alone - exact).norm() / exact.norm() < 0.02  # but near them
    assert native.blocked(torch.randn(64, 88), "int8") is None


@needs_kernel("bfloat16")
def test_a_drafter_takes_the_next_wider_kernel_where_the_cpu_lacks_the_one_asked_for(monkeypatch):
    """`draft_dtype` is the narrowest type asked for (`linear.narrow`): int8 on a CPU without
    AVX512-VNNI gives bfloat16, and without AVX512-BF16 too, float32; a group converts all or
    none (a projection int8 cannot take, its input width not a multiple of 16, keeps the group
    at bfloat16)."""
    from specdec.core.models.linear import InferenceLinear, narrow

    torch.manual_seed(0)

    def group(*shapes):
        return [InferenceLinear(torch.randn(out, inp)) for out, inp in shapes]

    assert narrow(group((64, 96), (32, 64)), "int8") == ("int8" if native.kernel_available("int8") else "bfloat16")
    mixed = group((64, 96), (32, 72))  # 72 inputs: no int8 layout
    assert narrow(mixed, "int8") == "bfloat16" and {x.blocked.dtype for x in mixed} == {torch.bfloat16}
    available = native.kernel_available
    monkeypatch.setattr(native, "kernel_available", lambda dtype: dtype != "int8" and available(dtype))
    linears = group((64, 96), (32, 64))
    assert narrow(linears, "int8") == "bfloat16" and {x.blocked.dtype for x in linears} == {torch.bfloat16}
    monkeypatch.setattr(native, "kernel_available", lambda dtype: dtype == "float32" and available(dtype))
    linears = group((64, 96), (32, 64))
    before = [x.blocked for x in linears]
    assert narrow(linears, "int8") == "float32" and all(x.blocked is b for x, b in zip(linears, before))
    assert narrow(group((64, 96)), "float32") == "float32"


def drafter_weight_types(proposer) -> list[int]:
    """The `decoder.c` weight types of a drafter's native matmuls: Medusa's heads; the draft
    model's layers and head; EAGLE's layers, output head and fc."""
    if hasattr(proposer, "heads"):  # Medusa
        return [native.weight_type(x.blocked) for blocks, vocab in proposer.heads.inference
                for x in [b.inference for b in blocks] + [vocab]]
    drafter = getattr(proposer, "model", None) or proposer.head
    heads = [drafter.head] if hasattr(proposer, "model") else [proposer.vocab, drafter.fc_inference]
    return [drafter.native.decoder.wtype] + [native.weight_type(x.blocked) for x in heads]


# decoder.c's weight types of each drafter's matmuls (`drafter_weight_types`) by `draft_dtype`:
# EAGLE's fc stays bfloat16 under int8 (`EagleHead.draft_in`)
DRAFTER_TYPES = {"bfloat16": {"draft": [2, 2], "eagle": [2, 2, 2], "medusa": 2},
                 "int8": {"draft": [3, 3], "eagle": [3, 3, 2], "medusa": 3}}
# the rounded `draft_dtype`s, each test of one skipped where this CPU has no kernel for it
ROUNDED_DTYPES = [pytest.param(d, marks=needs_kernel(d)) for d in DRAFTER_TYPES]


@pytest.mark.parametrize("dtype", ROUNDED_DTYPES)
@pytest.mark.parametrize("method", ["draft", "eagle", "eagle2", "medusa"])
def test_rounded_drafters_propose_through_their_kernels_and_the_output_is_the_baselines(method, dtype):
    """`draft_dtype` bfloat16 or int8 (the default) puts a drafter's native matmuls on that
    kernel (its layers, output head, EAGLE's fc, bfloat16 under int8, and a copy of the target's
    output head, Medusa's heads); the target verifies as before, so greedy output is the
    baseline's token for token, as it is with float32 drafters."""
    from specdec.core.config import EngineConfig
    from specdec.core.engine_config import build_engine
    from specdec.core.sampling import SamplingParams
    from specdec.paths import DEMO_KIT
    from specdec.tools.bench import kit_paths
    from specdec.tools.prompts import heldout_prompts

    prompts, params = heldout_prompts(3), SamplingParams(max_tokens=48, ignore_eos=True)
    outputs = {}
    for method_, draft_dtype in (("baseline", "float32"), (method, "float32"), (method, dtype)):
        eng = build_engine(EngineConfig.of(method=method_, max_batch=3, policy="fixed", k=4, draft_dtype=draft_dtype,
                                           **kit_paths(DEMO_KIT)))
        if method_ != "baseline":  # float32 drafters keep their float32 or float16 kernels
            types = drafter_weight_types(eng.proposer)
            assert eng.proposer.drafts_in == draft_dtype  # what the served model's ready line names
            if draft_dtype == "float32":
                assert set(types) <= {0, 1}, types
            else:
                expected = DRAFTER_TYPES[dtype][method.rstrip("2")]
                assert set(types) == {expected} if method == "medusa" else types == expected, types
            assert eng.target.native.decoder.wtype in (0, 1) and native.weight_type(eng.target.head.blocked) in (0, 1)
        outputs[method_, draft_dtype] = [r.token_ids for r in eng.generate(prompts, params)]
        if method_ != "baseline":
            assert eng.metrics.accepted_tokens > 0
    assert outputs[method, dtype] == outputs["baseline", "float32"] == outputs[method, "float32"]


@pytest.mark.parametrize("out_features", [16, 32, 48, 80])
@pytest.mark.parametrize("half", [False, True])
def test_outputs_narrower_than_a_64_column_block_are_computed(out_features, half):
    """Outputs of 16-48 columns are remainder blocks only: the matmul once split them into no
    parts at all and returned uninitialized memory (a 32-wide model's projections)."""
    torch.manual_seed(0)
    weight = torch.randn(out_features, 96)
    weight = weight.half().float() if half else weight
    layer = InferenceLinear(weight)
    assert layer.blocked.dtype == (torch.float16 if half else torch.float32)
    for rows in (1, 7, 200):
        x = torch.randn(rows, 96)
        assert torch.allclose(layer(x), x @ weight.T, atol=1e-4)


def test_prefill_float64_and_odd_shapes_stay_eager(tiny_target, tiny_draft):
    model = load_model(tiny_target)
    x = torch.zeros(1, native.NATIVE_MAX_ROWS + 1, 64)
    assert not model.native.accepts(x, model.new_cache(1, 8))
    assert model.native.accepts(x[:, :1], model.new_cache(1, 8))
    assert load_model(tiny_target, dtype=torch.float64).native is None
    assert load_model(tiny_draft).native is None  # head_dim 8: not a multiple of 16


def test_prompts_of_different_lengths_prefill_natively_by_their_real_tokens(monkeypatch):
    """A batch of prompts is prefilled without its padding, and the native forward takes it by
    its real tokens (NATIVE_MAX_ROWS lowered to 64 here; prompts of 24 and 165 tokens had run 330
    rows, not 189, and 8 prompts, one of them past 128 tokens, went to the eager layers); each
    prompt's greedy output is the one it gets alone."""
    from specdec.core.config import EngineConfig
    from specdec.core.engine_config import build_engine
    from specdec.core.sampling import SamplingParams
    from specdec.paths import DEMO_KIT
    from specdec.tools.bench import kit_paths

    monkeypatch.setattr(native, "NATIVE_MAX_ROWS", 64)
    eng = build_engine(EngineConfig.of(method="baseline", max_batch=2, **kit_paths(DEMO_KIT)))
    seen, accepts = [], eng.target.native.accepts
    eng.target.native.accepts = lambda x, cache, lengths=None: seen.append(
        (x.shape[0] * x.shape[1], lengths, accepts(x, cache, lengths))) or seen[-1][2]
    prompts = [list(range(5, 15)), list(range(100, 150))]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    together = [r.token_ids for r in eng.generate(prompts, params)]
    assert any(padded > 64 and lengths == [10, 50] and ran for padded, lengths, ran in seen), seen
    assert together == [eng.generate([p], params)[0].token_ids for p in prompts]


@pytest.mark.parametrize("method", ["baseline", "ngram", "draft", "eagle", "medusa", "eagle2"])
def test_engines_with_the_one_call_greedy_step_stream_what_they_do_without_it(method):
    """On the demo kit (whose vocabulary the native head takes) every method's decode and
    verification steps of greedy rows past min_tokens run as one native call
    (`LlamaForCausalLM.greedy_step`); the tokens, the drafts' acceptance and every cache entry are
    the ones the forward, head and argmax give called apart. A request owing min_tokens and a
    sampled one make their steps take that path, as they must (they read logits)."""
    from specdec.core.config import EngineConfig
    from specdec.core.engine_config import build_engine
    from specdec.core.sampling import SamplingParams
    from specdec.paths import DEMO_KIT
    from specdec.tools.bench import kit_paths
    from specdec.tools.prompts import heldout_prompts

    prompts = heldout_prompts(3)
    params = [SamplingParams(max_tokens=40, ignore_eos=True), SamplingParams(max_tokens=40, min_tokens=30),
              SamplingParams(max_tokens=40, temperature=0.8, seed=5, ignore_eos=True)]
    runs = []
    for one_call in (True, False):
        eng = build_engine(EngineConfig.of(method=method, max_batch=3, policy="fixed", k=4, **kit_paths(DEMO_KIT)))
        assert eng.target.native_step is not None
        calls = []
        if one_call:
            step = eng.target.greedy_step
            eng.target.greedy_step = lambda *a: calls.append(step(*a)) or calls[-1]
        else:
            eng.target.native_step = None
        alone = [r.token_ids for r in eng.generate(prompts[:1], params[0])]
        if one_call:  # every step greedy: every step in one call
            assert len(calls) == eng.metrics.steps and all(c is not None for c in calls)
        mixed = [r.token_ids for r in eng.generate(prompts, params)]
        if one_call:  # the sampled row's steps read logits
            assert len(calls) < eng.metrics.steps
        runs.append((alone, mixed, eng.metrics.accepted_tokens, eng.cache.k.clone()))
    assert runs[0][:3] == runs[1][:3]
    assert torch.equal(runs[0][3], runs[1][3])


def test_the_start_up_calibration_times_the_call_greedy_steps_take(monkeypatch):
    """An adaptive engine's verify curve starts from forwards timed as its greedy steps run them
    (`Engine.probe_forward` through `greedy_step`): timed through the separate forward, head and
    argmax, a one-token forward carried ~0.1 ms those steps no longer pay on the demo kit, and the
    curve put 4 tokens at 1.24x one where greedy steps ran 2.4x."""
    from specdec.core.config import EngineConfig
    from specdec.core.engine_config import build_engine
    from specdec.core.models.llama import LlamaForCausalLM
    from specdec.paths import DEMO_KIT
    from specdec.tools.bench import kit_paths

    sizes, step = [], LlamaForCausalLM.greedy_step
    monkeypatch.setattr(LlamaForCausalLM, "greedy_step",
                        lambda self, tokens, *a, **k: sizes.append(len(tokens)) or step(self, tokens, *a, **k))
    eng = build_engine(EngineConfig.of(method="ngram", max_batch=2, policy="adaptive", k=4, **kit_paths(DEMO_KIT)))
    assert set(eng.policy.cost.token_counts) <= set(sizes)


def test_the_bench_curve_times_one_row_through_the_call_greedy_steps_take(monkeypatch):
    """`specdec bench`'s printed verify curve (one sequence) runs the target as its greedy steps
    do: through the separate forward, head and argmax it printed 4 tokens at 1.2-1.4x one where
    the bench's own steps over 4-5 tokens ran 2.2-2.9x."""
    from specdec.core.config import EngineConfig
    from specdec.core.engine_config import build_engine
    from specdec.core.models.llama import LlamaForCausalLM
    from specdec.paths import DEMO_KIT
    from specdec.tools.bench import kit_paths, verify_cost_curve

    shapes, step = [], LlamaForCausalLM.greedy_step
    monkeypatch.setattr(LlamaForCausalLM, "greedy_step", lambda self, tokens, positions, B, T, *a, **k:
                        shapes.append((B, T)) or step(self, tokens, positions, B, T, *a, **k))
    eng = build_engine(EngineConfig.of(method="baseline", max_batch=2, **kit_paths(DEMO_KIT)))
    curve = verify_cost_curve(eng, 8)
    assert list(curve) == [1, 2, 4, 8] and set(shapes) == {(1, n) for n in curve}


def test_switched_off_or_without_a_compiler_every_forward_is_eager(tiny_target, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    try:
        native.library.cache_clear()
        monkeypatch.setenv("SPECDEC_NATIVE", "0")
        assert load_model(tiny_target).native is None
        native.library.cache_clear()
        monkeypatch.setenv("SPECDEC_NATIVE", "1")
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        with caplog.at_level(logging.WARNING):
            assert load_model(tiny_target).native is None
        assert "native decoder not built" in caplog.text
        # a compiler whose messages do not decode (gcc's UTF-8 quotes in a Triton stub's ASCII
        # locale made the models fail to load): still eager, with its message in the warning
        failing = tmp_path / "failing-cc"
        failing.write_text("#!/bin/sh\nprintf 'decoder.c: error: impossible constraint in \\342\\200\\230asm\\377\\n' >&2\n"
                           "exit 1\n")
        failing.chmod(0o755)
        native.library.cache_clear()
        caplog.clear()
        monkeypatch.setenv("CC", str(failing))
        with caplog.at_level(logging.WARNING):
            assert load_model(tiny_target).native is None
        assert "impossible constraint in" in caplog.text
        native.library.cache_clear()
        monkeypatch.delenv("CC")
        assert load_model(tiny_target).native is not None  # built afresh into the new cache dir
        assert list((tmp_path / "native").glob("decoder-*.so"))
    finally:
        native.library.cache_clear()
