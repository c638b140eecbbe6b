"""The plain-torch Llama family against transformers' implementation, and the KV cache."""

from __future__ import annotations

import pytest
import torch

from specdec.core.models.checkpoint import CheckpointError, load_model
from specdec.core.models.linear import InferenceLinear, one_row_packed
from tiny_checkpoints import make_hf_checkpoint


def hf_logits(folder, tokens):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


VARIANTS = {
    "llama": {},
    "llama_tied": dict(tie=True),
    "llama_mha": dict(kv_heads=4),
    "llama3_rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(model_type="qwen2"),
    "mistral": dict(model_type="mistral"),
    "sharded_safetensors": dict(sharded=True),
    "pytorch_bin": dict(bin_format=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_with_transformers_prefill_and_incremental(variant, tmp_path, tokenizer_dir):
    folder = make_hf_checkpoint(tmp_path / variant, tokenizer_dir, seed=3, **VARIANTS[variant])
    torch.manual_seed(0)
    tokens = torch.randint(0, 300, (2, 40))
    ref = hf_logits(folder, tokens)
    model = load_model(folder)
    with torch.no_grad():
        cache = model.new_cache(num_slots=3, capacity=64)
        slots = [2, 0]  # non-contiguous slots exercise the gather path
        # prefill the first 30 tokens, then decode 10 one at a time, then compare all logits
        pos = torch.arange(30).expand(2, -1)
        out = [model.logits(model(tokens[:, :30], pos, cache, slots, [0, 0]))]
        for t in range(30, 40):
            out.append(model.logits(model(tokens[:, t : t + 1], torch.full((2, 1), t), cache, slots, [t, t])))
        ours = torch.cat(out, dim=1)
        plain = model.logits(model(tokens))  # training path: no cache
    assert (ours - ref).abs().max().item() <= 1e-4
    assert (plain - ref).abs().max().item() <= 1e-4


def test_tree_mask_equals_separate_chains(tiny_target):
    """Two branches verified in one tree forward give the logits each branch gets on its own."""
    model = load_model(tiny_target, dtype=torch.float64)
    prefix = torch.tensor([[5, 17, 42, 9, 100]])
    branch_a, branch_b = [7, 8, 9], [11, 12]
    with torch.no_grad():
        def chain_logits(branch):
            cache = model.new_cache(1, 32)
            toks = torch.tensor([prefix[0].tolist() + branch])
            return model.logits(model(toks, torch.arange(toks.shape[1])[None], cache, [0], [0]))[0, 5:]

        cache = model.new_cache(1, 32)
        model(prefix, torch.arange(5)[None], cache, [0], [0])
        # tree nodes: a0 a1 a2 b0 b1 ; parents: -1 0 1 -1 3
        tokens = torch.tensor([branch_a + branch_b])
        parents = [-1, 0, 1, -1, 3]
        mask = torch.zeros(1, 5, 5, dtype=torch.bool)
        depth = []
        for i, p in enumerate(parents):
            mask[0, i, i] = True
            d, a = 0, p
            while a >= 0:
                mask[0, i, a] = True
                a, d = parents[a], d + 1
            depth.append(d)
        pos = 5 + torch.tensor([depth])
        tree = model.logits(model(tokens, pos, cache, [0], [5], tree_mask=mask))[0]
        assert torch.allclose(tree[:3], chain_logits(branch_a), atol=1e-10)
        assert torch.allclose(tree[3:], chain_logits(branch_b), atol=1e-10)
        # compacting branch b to the front of the new region equals a fresh prefill of prefix+b
        cache.compact(0, 5, [3, 4])
        fresh = model.new_cache(1, 32)
        toks = torch.tensor([prefix[0].tolist() + branch_b])
        model(toks, torch.arange(7)[None], fresh, [0], [0])
        assert torch.allclose(cache.k[:, 0, :7], fresh.k[:, 0, :7], atol=1e-12)
        assert torch.allclose(cache.v[:, 0, :7], fresh.v[:, 0, :7], atol=1e-12)


@pytest.mark.parametrize("prefix_lengths", [[5], [5, 3]])
def test_a_tree_grown_one_depth_per_forward_equals_the_whole_tree_in_one(tiny_target, prefix_lengths):
    """EAGLE-2's way: the second forward runs only the new depth, its mask reaching back to the
    nodes the first wrote; the same logits as one forward over every node (one sequence: the
    cache's plain window; two with different prefixes: indexed writes)."""
    model = load_model(tiny_target, dtype=torch.float64)
    # nodes a0 b0 (depth 1), then a1 (child of a0) and b1 (child of b0)
    tokens, parents = [7, 11, 8, 12], [-1, -1, 0, 1]
    full = torch.zeros(4, 4, dtype=torch.bool)
    for i, p in enumerate(parents):
        full[i, i] = True
        if p >= 0:
            full[i, p] = True
    B, slots = len(prefix_lengths), list(range(len(prefix_lengths)))
    with torch.no_grad():
        def prefilled():
            cache = model.new_cache(B, 32)
            for slot, n in zip(slots, prefix_lengths):
                model(torch.arange(3, 3 + n)[None], torch.arange(n)[None], cache, [slot], [0])
            return cache

        def run(cache, nodes, mask):
            pos = torch.tensor([[n + (parents[i] >= 0) for i in nodes] for n in prefix_lengths])
            toks = torch.tensor([[tokens[i] for i in nodes]] * B)
            return model.logits(model(toks, pos, cache, slots, prefix_lengths, tree_mask=mask.expand(B, -1, -1)))

        whole = run(prefilled(), [0, 1, 2, 3], full)
        cache = prefilled()
        first = run(cache, [0, 1], full[:2, :2])
        second = run(cache, [2, 3], full[2:, :])
    assert torch.allclose(torch.cat([first, second], 1), whole, atol=1e-10)


def test_missing_weights_is_a_clear_error(tmp_path, tiny_target):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_target, bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(bad)


def test_a_large_model_sends_single_rows_to_its_packed_weights_a_small_one_keeps_them_plain(monkeypatch):
    """Without the native matmul (no compiler): one row of a model whose weights outgrow the CPU's
    caches goes to oneDNN's packed weights (faster there); one row of a small model stays on
    F.linear's matrix-vector kernel; more rows go packed either way. Same numbers up to float
    rounding."""
    from specdec.core.models import native

    monkeypatch.setattr(native, "blocked", lambda weight: None)
    big, small = torch.nn.Linear(1024, 1024), torch.nn.Linear(256, 512)  # 4 MiB and 512 KiB of weights
    assert one_row_packed(big) and not one_row_packed(small)
    packed_calls = []
    pointwise = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: packed_calls.append(1) or pointwise(*a))
    with torch.no_grad():
        for model, want in ((big, [1, 1]), (small, [0, 1])):
            layer = InferenceLinear(model.weight, model.bias, one_row_packed(model))
            assert layer.packed is not None  # both are packable
            got = []
            for rows in (1, 3):
                x = torch.randn(rows, model.in_features)
                before = len(packed_calls)
                assert torch.allclose(layer(x), torch.nn.functional.linear(x, model.weight, model.bias), atol=1e-4)
                got.append(len(packed_calls) - before)
            assert got == want


def test_loading_a_checkpoint_leaves_torch_dynamo_unimported(tiny_target):
    """Loading builds the model on the meta device without its default init: nn.Embedding's
    `normal_` on a meta tensor imported torch._dynamo, most of a second of every process that
    loads a model (a Triton model's stub, the bench). In a fresh process, as a stub loads one."""
    import subprocess
    import sys

    code = ("import sys; from specdec.core.models.checkpoint import load_model; "
            f"m = load_model({str(tiny_target)!r}); "
            "assert m.model.embed_tokens.weight.abs().sum() > 0; "
            "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_native_calls_get_the_rope_tables_and_cache_addresses_they_would_read_off_the_tensors(tiny_target):
    """A native call is handed the rotary tables' and the KV cache's addresses as ints kept since
    they were made (`RopeTable.addresses`, `KVCache.native_args`): they must be those of float32
    CPU tables covering the bound, also after the tables grew or were made in another dtype (the
    float32 ones stay alive however the eager path remakes its own), and a cache that a native
    forward cannot take has none."""
    from specdec.core.models.kv_cache import KVCache

    model = load_model(tiny_target)
    rope = model.rope
    cos, sin = rope.table(300, torch.empty(0))
    assert rope.addresses(300) == (cos.data_ptr(), sin.data_ptr())
    rope.table(10, torch.empty(0, dtype=torch.float64))  # the eager path in float64 remakes the tables
    grown = rope.addresses(len(cos) + 1)  # past the float32 tables: made again, in float32
    kept = rope.native
    assert len(kept[0]) > len(cos) and kept[0].dtype == torch.float32 and grown == (kept[0].data_ptr(), kept[1].data_ptr())
    assert torch.equal(kept[0][: len(cos)], cos) and torch.equal(kept[1][: len(sin)], sin)
    assert rope.addresses(5) == grown  # a shorter bound reads the same tables

    cache = KVCache(2, 3, 16, 2, 8)
    assert cache.native_args == (cache.k.data_ptr(), cache.v.data_ptr(), cache.k.stride(0), cache.k.stride(1))
    assert KVCache(2, 3, 16, 2, 8, dtype=torch.float64).native_args is None
