"""The prefix cache (colibri_seq_reuse_prefix, Sequence.reuse_prefix, Engine.generate): every
logit is bitwise the same whether a prompt's leading blocks come from the cache (a full hit, a
partial hit) or are computed (a miss, or the cache off), for every family — GQA, DeepSeek's
latent (MLA) cache, gpt-oss's sliding windows and sinks — in exact and fast precision, with 1
and 2 threads, prompts chunked and batched with others. The block table itself (hashes,
eviction, copy-on-write) is native/tests/test_prefix_cache.c.
"""

from __future__ import annotations

import numpy as np
import pytest

import colibri_lab
from colibri_lab import ColibriSeqTooLongError, Engine

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss")
BLOCK = 8


@pytest.fixture(scope="module")
def family_files(tmp_path_factory):
    pytest.importorskip("torch")
    from colibri_lab.bench.models import TINY_FAMILY_CONFIGS, make_family_model

    root = tmp_path_factory.mktemp("prefix")
    files = {}

    def get(family):
        if family not in files:
            hf = make_family_model(root / family, family, TINY_FAMILY_CONFIGS[family], seed=11, tokenizer="none")
            files[family] = colibri_lab.convert(hf, root / f"{family}.colibri", dtype="bf16", progress=False)
        return files[family]

    return get


def _ids(n, seed, vocab=512):
    return np.random.default_rng(seed).integers(3, vocab, size=n).astype(np.int32)


def _open(path, precision, threads, prefix_cache=True, **kw):
    return Engine(path, precision=precision, num_threads=threads, max_seqs=4, kv_block_tokens=BLOCK,
                  max_seq_len=128, max_batch=16, prefix_cache=prefix_cache, **kw)


def _run(seq, ids, follow):
    """Prompt `ids` on the emptied `seq` (all rows' logits), then `follow` tokens one by one:
    the rows, stacked."""
    seq.clear()
    rows = [seq.append(ids, logits="all")]
    rows += [seq.append([t], logits="all") for t in follow]
    return np.concatenate(rows)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision, threads", [("exact", 1), ("exact", 2), ("fast", 1), ("fast", 2)])
def test_hit_partial_hit_and_miss_are_bitwise_a_full_computation(family_files, family, precision, threads):
    path = family_files(family)
    p = _ids(41, 1)                                        # 5 full blocks and one position
    q = np.concatenate([p[:20], _ids(21, 2)])              # the first 2 blocks of p, then others
    r = _ids(30, 3)                                        # nothing in common
    follow = _ids(8, 4)                                    # p + follow: 6 full blocks and one
    with _open(path, precision, threads, prefix_cache=False) as eng:
        ref = {k: _run(eng.sequence(0), ids, follow) for k, ids in (("p", p), ("q", q), ("r", r))}
        assert eng.sequence(1).reuse_prefix(p) == 0  # the cache is off: nothing to reuse
    with _open(path, precision, threads) as eng:
        s0, s1, s2, s3 = (eng.sequence(i) for i in range(4))
        # p computed twice at once in one batch (the two copies of each block become one)
        a, b = eng.batch([(0, p), (2, p)], logits="all")
        assert np.array_equal(a, ref["p"][:41]) and np.array_equal(b, ref["p"][:41])
        s0.clear()
        s2.clear()
        # a full hit: every full block but the one holding the last position
        assert s1.reuse_prefix(p) == 40 and len(s1) == 40
        got = np.concatenate([s1.append(p[40:], logits="all")] + [s1.append([t], logits="all") for t in follow])
        assert np.array_equal(got, ref["p"][40:]), "a full hit changed logits"
        # a partial hit, while s1 holds p's blocks
        assert s3.reuse_prefix(q) == 16
        got = np.concatenate([s3.append(q[16:], logits="all")] + [s3.append([t], logits="all") for t in follow])
        assert np.array_equal(got, ref["q"][16:]), "a partial hit changed logits"
        # a miss
        assert s0.reuse_prefix(r) == 0
        assert np.array_equal(_run(s0, r, follow), ref["r"]), "a miss changed logits"
        # p again, and this time its continuation (the follow tokens' blocks) comes back too
        s1.clear()
        pf = np.concatenate([p, follow])
        assert s2.reuse_prefix(pf) == 48
        assert np.array_equal(s2.append(pf[48:], logits="all"), ref["p"][48:])
        stats = eng.prefix_cache_stats()
        assert stats["hit_tokens"] == 40 + 16 + 48 and stats["query_tokens"] == len(p) + len(q) + len(r) + len(pf)


@pytest.mark.parametrize("family", ("mixtral", "deepseek_v3", "gpt_oss"))
def test_generate_turns_are_the_same_with_the_cache_on_and_off(family_files, family):
    """A conversation: each turn resends the whole history. The cache serves the history's
    blocks (from the previous turn's prompt and its generated tokens) and every token is the
    same as without it; the trace counts the cached positions and records only the rest."""
    path = family_files(family)
    turns = {}
    for on in (False, True):
        with _open(path, "exact", 2, prefix_cache=on) as eng:
            history, got, cached = [int(t) for t in _ids(27, 5)], [], []
            for turn in range(3):
                with eng.trace() as tr:
                    out = [t.id for t in eng.generate(history, 6, stop_at_eos=False)]
                got.append(out)
                cached.append(eng.last_cached_tokens)
                assert tr.prefix_cached == eng.last_cached_tokens
                assert tr.n_tokens == len(history) - eng.last_cached_tokens + 5
                history += out + [int(t) for t in _ids(9, 6 + turn)]
            turns[on] = got, cached
    assert turns[True][0] == turns[False][0]
    assert turns[False][1] == [0, 0, 0]
    assert turns[True][1][0] == 0 and all(c >= BLOCK * 4 for c in turns[True][1][1:]), turns[True][1]


def test_eviction_under_pressure_and_generate_many(family_files):
    """A pool of 10 blocks: cached blocks give way to a long prompt (least recently used
    first), nothing fails for want of room, and generate_many gives the same ids with the
    cache on and off."""
    path = family_files("mixtral")
    prompts = [_ids(20, 20 + i) for i in range(3)]
    res = {}
    for on in (False, True):
        with _open(path, "exact", 1, prefix_cache=on, kv_tokens=10 * BLOCK) as eng:
            first = eng.generate_many(prompts, 4, stop_at_eos=False)      # 3 x 3 blocks, 6 kept
            for i in range(3):
                eng.sequence(i).clear()
            long = eng.generate_many([_ids(60, 30)], 4, stop_at_eos=False)  # 8 blocks: 4 evicted
            eng.sequence(0).clear()
            again = eng.generate_many(prompts[::-1], 4, stop_at_eos=False)
            res[on] = (first, long, again), eng.prefix_cache_stats(), eng.kv_blocks_used
    assert res[True][0] == res[False][0]
    assert res[True][1]["hit_tokens"] > 0 and res[False][1]["hit_tokens"] == 0
    assert res[True][1]["cached_blocks"] > 0 and res[False][1]["cached_blocks"] == 0


def test_reuse_prefix_arguments(family_files):
    with _open(family_files("mixtral"), "exact", 1) as eng:
        s = eng.sequence(0)
        assert s.reuse_prefix([]) == 0
        with pytest.raises(ColibriSeqTooLongError):
            s.reuse_prefix(_ids(129, 0))
        s.append(_ids(12, 0))                      # ends mid-block: cannot be continued from the cache
        assert s.reuse_prefix(_ids(20, 1)) == 0
        with pytest.raises(colibri_lab.ColibriInvalidArgError):
            Engine(family_files("mixtral"), prefix_cache=2)


def test_an_edited_stage_run_is_never_reused(family_files):
    """A stage run whose residual was edited between stages leaves nothing in the prefix
    cache: the same prompt generated afterwards equals a fresh engine's generation, and took
    no position from the cache."""
    path = family_files("mixtral")
    p = _ids(16, 5)  # two full blocks; a stage run takes at most max_batch tokens
    with _open(path, "exact", 1) as eng:
        want = [t.id for t in eng.generate(p, 6, stop_at_eos=False)]
    with _open(path, "exact", 1) as eng:
        run = eng.stages(p)
        run.embedding()
        run.run_to(layer=1)
        run.tensor("x")[:] *= 3.0  # the residual entering layer 1, edited
        run.finish()
        got = [t.id for t in eng.generate(p, 6, stop_at_eos=False)]
        assert eng.last_cached_tokens == 0
    assert got == want
