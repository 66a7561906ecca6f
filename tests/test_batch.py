"""Sequences and batches (colibri_batch, colibri_seq_*): many sequences in one context over
a paged KV cache, and the guarantee that a sequence's logits are bitwise the same whatever
it is batched with, however its prompt is chunked, and with any thread count (the batch
API's one test of it, exact and fast precision; the fused forward's is
tests/test_threads_kernels.py's).

The reference for every sequence is the single-sequence forward of the same tokens, which
tests/test_parity_*.py hold equal to transformers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import colibri_lab
from colibri_lab import (ColibriInvalidArgError, ColibriNoMemoryError, ColibriSeqTooLongError,
                         ColibriTokenRangeError, Engine)

REPO = Path(__file__).resolve().parents[1]


class _Files(dict):
    """name -> .colibri file, each converted the first time a test asks for it."""

    def __init__(self, folder, make):
        super().__init__()
        self.folder, self.make = folder, make

    def __missing__(self, name):
        self[name] = self.make(name, self.folder)
        return self[name]


def _make(name: str, out: Path, make_model) -> Path:
    """The tiny Mixtral in f32, bf16 and q8_0; a random 256-wide Mixtral in q4_k_m (Q4_K, Q5_K,
    Q6_K and Q8_0 tensors); a gpt-oss in bf16 (sinks, windows of 6, heads of 16: fast mode's
    attention); a Qwen2-MoE with dense and shared-expert layers, biases and a sliding window
    (every option of the forward pass on one path)."""
    if name in ("f32", "bf16", "q8_0"):
        return colibri_lab.convert(REPO / "data" / "tiny-mixtral", out / f"tiny-{name}.colibri", dtype=name,
                                   progress=False)
    pytest.importorskip("torch")
    from colibri_lab.bench.models import FamilyShape, build_model, save_checkpoint

    if name == "q4_k_m":
        return make_model(vocab=1024, hidden=256, inter=256, experts=8, top_k=2, heads=4, kv_heads=2, seed=3,
                          dtype="q4_k_m")[1]
    if name == "gptoss_bf16":
        shape = FamilyShape("gpt_oss", vocab=301, hidden=64, inter=32, layers=2, heads=4, kv_heads=2, head_dim=16,
                            experts=4, top_k=2, sliding_window=6, seed=31)
        return colibri_lab.convert(save_checkpoint(build_model(shape), out / "hf-gpt-oss"), out / "go.colibri",
                                   dtype="bf16", progress=False)
    assert name == "qwen2", name
    shape = FamilyShape("qwen2_moe", layers=3, mlp_only_layers=(1,), sliding_window=6, max_window_layers=1,
                        seed=5)
    return colibri_lab.convert(save_checkpoint(build_model(shape), out / "hf-q2"), out / "q2.colibri", dtype="f32",
                               progress=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory, make_model):
    return _Files(tmp_path_factory.mktemp("batch"), lambda name, out: _make(name, out, make_model))


def _prompts(vocab: int, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).astype(np.int32) for n in lengths]


def _alone(path, prompts, **kw):
    """Every prompt's logits (all rows) by the single-sequence forward."""
    with Engine(path, **kw) as eng:
        return [eng.forward(p) for p in prompts]


@pytest.mark.parametrize("model, precision", [
    ("f32", "exact"), ("bf16", "exact"), ("qwen2", "exact"),
    ("bf16", "fast"), ("q8_0", "fast"), ("q4_k_m", "fast"), ("gptoss_bf16", "fast"),
])  # fmt: skip
def test_batch_invariance(models, model, precision):
    """Prompts of 4 sequences run together on 2 threads, cut into chunks at different places,
    mixed with each other's chunks, through small internal chunks (max_batch 7) and small
    blocks (5): every row equals the sequence's forward alone on 1 thread, bit for bit; and
    so does a decode step of all four at once."""
    path = models[model]
    lengths = [19, 1, 33, 8]
    with Engine(path, num_threads=1) as eng:
        prompts = _prompts(eng.vocab_size, lengths)
    ref = _alone(path, prompts, num_threads=1, precision=precision)
    with Engine(path, num_threads=2, precision=precision, max_seqs=4, max_batch=7, kv_block_tokens=5) as eng:
        got = [[] for _ in prompts]
        cuts = [[0, 5, 19], [0, 1], [0, 11, 12, 33], [0, 8]]
        for step in range(3):
            work = []
            for s, c in enumerate(cuts):
                if step + 1 < len(c):
                    work.append((s, prompts[s][c[step]:c[step + 1]]))
            work = work[::-1] if step % 2 else work  # a different order of sequences each call
            for (s, _), lg in zip(work, eng.batch(work, logits="all")):
                got[s].append(lg)
        for s in range(4):
            out = np.concatenate(got[s])
            assert out.shape == ref[s].shape
            assert np.array_equal(out, ref[s]), f"sequence {s} differs from its forward alone"
        assert [len(eng.sequence(s)) for s in range(4)] == lengths
        # decode steps of all four at once against each one's own next step alone
        nxt = [int(np.argmax(r[-1])) for r in ref]
        out = eng.batch([(s, [nxt[s]]) for s in range(4)])
    with Engine(path, num_threads=1, precision=precision) as eng:
        for s in range(4):
            eng.forward(prompts[s])
            assert np.array_equal(out[s][0], eng.forward([nxt[s]], start_pos=lengths[s])[0]), s


@pytest.mark.parametrize("model", ["bf16", "qwen2"])
def test_decode_steps_of_many_sequences(models, model):
    """Greedy decoding of three sequences in one batch per step (with a fourth one's prompt
    arriving mid-way) gives each the tokens and logits it gets alone."""
    path = models[model]
    with Engine(path, num_threads=2) as eng:
        prompts = _prompts(eng.vocab_size, [6, 14, 3, 9], seed=1)
        alone = []
        for p in prompts:
            row = eng.forward(p, last_only=True)[0]
            ids, rows = [], []
            for i in range(6):
                nxt = int(np.argmax(row))
                ids.append(nxt)
                rows.append(row)
                row = eng.forward([nxt], len(p) + i, last_only=True)[0]
            alone.append((ids, np.stack(rows)))
    with Engine(path, num_threads=2, max_seqs=4) as eng:
        last = dict(zip(range(3), eng.batch([(s, prompts[s]) for s in range(3)])))
        ids = {s: [] for s in range(4)}
        rows = {s: [] for s in range(4)}
        for step in range(12):
            work = []
            for s, row in list(last.items()):
                if len(ids[s]) == 6:
                    continue
                nxt = int(np.argmax(row[0]))
                ids[s].append(nxt)
                rows[s].append(row[0])
                work.append((s, [nxt]))
            if step == 2:
                work.append((3, prompts[3]))  # a prompt chunk among the decode steps
            if not work:
                break
            out = eng.batch(work)
            last = {s: lg for (s, _), lg in zip(work, out)}
        for s in range(4):
            assert ids[s] == alone[s][0], f"sequence {s}: other tokens under batching"
            assert np.array_equal(np.stack(rows[s]), alone[s][1][: len(rows[s])])


def test_fork_copy_on_write_and_truncate(models):
    path = models["f32"]
    with Engine(path, num_threads=2, max_seqs=3, kv_block_tokens=4) as eng:
        prefix, x, y = _prompts(eng.vocab_size, [10, 5, 7], seed=2)
        ref_x = eng.forward(np.concatenate([prefix, x]))[len(prefix):]
        ref_y = eng.forward(np.concatenate([prefix, y]))[len(prefix):]
        eng.sequence(0).clear()
        a = eng.sequence(0)
        a.append(prefix, logits="none")
        used = eng.kv_blocks_used
        assert used == 3  # ceil(10 / 4)
        b = a.fork(1)
        assert len(b) == 10 and eng.kv_blocks_used == used  # shared, nothing copied
        lx = a.append(x, logits="all")  # writes into the shared third block: a private copy
        ly = b.append(y, logits="all")
        assert np.array_equal(lx, ref_x) and np.array_equal(ly, ref_y)
        # blocks: two shared (full) + a's copy of the third and its growth + b's third and growth
        assert eng.kv_blocks_used == 2 + 2 + 3
        # truncating and running again reproduces the same logits
        b.truncate(10)
        assert len(b) == 10
        assert np.array_equal(b.append(y, logits="all"), ref_y)
        for s in (0, 1, 2):
            eng.sequence(s).clear()
        assert eng.kv_blocks_used == 0
        with pytest.raises(ColibriInvalidArgError, match="not in"):
            b.truncate(1)  # cleared: length 0
        with pytest.raises(ColibriInvalidArgError, match="both"):
            a.fork(0)


def test_a_refused_batch_changes_nothing(models):
    """Bad entries, a full KV cache or a sequence past max_seq_len are refused before
    anything runs: lengths, blocks and later results are as if the call never happened."""
    path = models["bf16"]
    with Engine(path, num_threads=2, max_seqs=2, kv_tokens=40, kv_block_tokens=8, max_seq_len=48) as eng:
        assert eng.config.kv_blocks_total == 5 and eng.config.max_seqs == 2
        p, q = _prompts(eng.vocab_size, [20, 30], seed=3)
        first = eng.batch([(0, p)])[0]
        state = (len(eng.sequence(0)), len(eng.sequence(1)), eng.kv_blocks_used)
        with pytest.raises(ColibriNoMemoryError, match="free blocks"):
            eng.batch([(1, q)])  # 4 blocks needed, 2 free
        with pytest.raises(ColibriTokenRangeError):
            eng.batch([(1, [1, 2]), (0, [eng.vocab_size])])
        with pytest.raises(ColibriInvalidArgError, match="not in"):
            eng.batch([(2, [5])])
        with pytest.raises(ColibriInvalidArgError, match="no tokens"):
            eng.batch([(0, [])])
        assert (len(eng.sequence(0)), len(eng.sequence(1)), eng.kv_blocks_used) == state
        # the context still computes the same thing
        eng.sequence(0).clear()
        assert np.array_equal(eng.batch([(0, p)])[0], first)
    with Engine(path, max_seqs=1, max_seq_len=24) as eng:
        eng.batch([(0, p)])
        with pytest.raises(ColibriSeqTooLongError, match="max_seq_len"):
            eng.batch([(0, p[:5])])
        assert len(eng.sequence(0)) == 20


def test_positions_must_continue_the_sequence(models):
    """The raw entries: a position that does not continue its sequence is refused."""
    import ctypes

    from colibri_lab.runtime import _native
    from colibri_lab.runtime.engine import _ENTRY_DTYPE

    with Engine(models["f32"], max_seqs=2) as eng:
        eng.batch([(0, [5, 6, 7])], logits="none")
        e = np.zeros(2, _ENTRY_DTYPE)
        e["token"], e["seq"], e["pos"], e["logits"] = [9, 9], [0, 1], [4, 0], [0, 0]
        st = _native.lib.colibri_batch(eng._c(), e.ctypes.data, 2, None)
        assert st == _native.E_INVALID_ARG
        assert "continues at position 3" in _native.lib.colibri_last_error(eng._c()).decode()
        e["pos"][0] = 3
        e["logits"][1] = 1
        assert _native.lib.colibri_batch(eng._c(), e.ctypes.data, 2, None) == _native.E_INVALID_ARG
        assert "NULL" in _native.lib.colibri_last_error(eng._c()).decode()
        out = np.empty((1, eng.vocab_size), np.float32)
        st = _native.lib.colibri_batch(eng._c(), e.ctypes.data, 2, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
        assert st == _native.OK and len(eng.sequence(0)) == 4 and len(eng.sequence(1)) == 1


def test_trace_records_the_sequence_of_each_token(models):
    with Engine(models["bf16"], max_seqs=3) as eng:
        a, b = _prompts(eng.vocab_size, [4, 3], seed=4)
        with eng.trace() as tr:
            eng.batch([(2, a), (0, b)])
            eng.batch([(0, [7]), (2, [8])])
        assert tr.seq_ids.tolist() == [2] * 4 + [0] * 3 + [0, 2]
        assert tr.positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4]
        tr.check()


def test_single_sequence_calls_are_sequence_zero(models):
    """forward / cached_len are sequence 0: a batch on sequence 1 leaves them alone, and the
    same tokens give the same logits on either."""
    with Engine(models["f32"], max_seqs=2) as eng:
        p, q = _prompts(eng.vocab_size, [6, 9], seed=6)
        full = eng.forward(p)
        eng.batch([(1, q)], logits="none")
        assert eng.cached_len == 6 and len(eng.sequence(1)) == 9
        eng.sequence(1).clear()
        assert np.array_equal(eng.batch([(1, p)], logits="all")[0], full)
        nxt = eng.forward([int(q[0])], 6)
        assert np.array_equal(eng.batch([(1, [int(q[0])])])[0], nxt)
        assert eng.cached_len == 7 and len(eng.sequence(1)) == 7


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_generate_many_equals_generate_alone(models, temperature):
    """Each sequence samples with its own state: seeded sampling under batching gives every
    prompt the ids it gets alone."""
    path = models["bf16"]
    prompts = ["def main():", "import os\n", "class A:\n    def", "x = [i for"]
    seeds = [11, 22, 33, 44]
    with Engine(path, num_threads=2, max_seqs=4) as eng:
        alone = [[t.id for t in eng.generate(p, 12, temperature=temperature, top_k=40, top_p=0.95, seed=s)]
                 for p, s in zip(prompts, seeds)]
        many = eng.generate_many(prompts, 12, temperature=temperature, top_k=40, top_p=0.95, seeds=seeds)
    assert many == alone


@pytest.mark.parametrize("controls", [
    {"min_p": 0.05, "presence_penalty": 0.8, "frequency_penalty": 0.5, "repetition_penalty": 1.3,
     "repetition_last_n": 8, "logit_bias": {5: 4.0, 7: -100.0}, "stop_ids": [9, 17], "ignore_eos": True},
    {"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                     "required": ["a"]}},
])
def test_generate_many_sampling_controls_equal_generate_alone(models, controls):
    """generate_many takes generate's sampling controls: per prompt the same ids as alone."""
    prompts = ["def main():", "import os\n", "class A:\n    def"]
    seeds = [5, 6, 7]
    with Engine(models["bf16"], num_threads=2, max_seqs=3) as eng:
        alone = [[t.id for t in eng.generate(p, 16, temperature=0.9, top_k=40, seed=s, **controls)]
                 for p, s in zip(prompts, seeds)]
        many = eng.generate_many(prompts, 16, temperature=0.9, top_k=40, seeds=seeds, **controls)
        plain = eng.generate_many(prompts, 16, temperature=0.9, top_k=40, seeds=seeds)
    assert many == alone
    assert many != plain   # the controls changed something
    if "stop_ids" in controls:
        assert all(7 not in ids for ids in many)
        assert all(ids[-1] in (9, 17) or len(ids) == 16 for ids in many)
