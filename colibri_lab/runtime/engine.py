"""The Python face of the Colibri engine: Engine, Tokenizer, Token, EngineConfig.

Handle classes over :mod:`colibri_lab.runtime._native`: each owns one C object, frees it in
``close()`` (idempotent, also run by ``__del__`` and by ``with``), and raises
:class:`ColibriClosedError` when used afterwards. Every C status goes through
``_native.check``, so failures surface as :class:`ColibriError` subclasses carrying the
engine's own message.

    with Engine("model.colibri") as eng:
        logits = eng.forward(eng.tokenizer.encode("Hello"))   # [n, vocab] float32
        for tok in eng.generate("Once upon a time", max_new_tokens=20):
            print(tok.text, end="", flush=True)
"""

from __future__ import annotations

import ctypes
import numbers
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from . import _native
from .ids import ENTRY_DTYPE, INT32_MAX, INT32_MIN, as_ids
from .trace import ALL_STAGES, STAGES, Trace
from ._native import (
    ColibriClosedError,
    ColibriTokenRangeError,
    check,
    lib,
)

_INT32_MIN, _INT32_MAX = INT32_MIN, INT32_MAX
_FFFD = "\ufffd"


@dataclass(frozen=True)
class Token:
    """One generated token: its id and the text it added to the output."""

    id: int
    text: str


# The numeric modes, in the order of their COLIBRI_PRECISION_* codes (colibri.h).
PRECISIONS = ("exact", "fast")
#: Expert-cache policies (``Engine(expert_cache_policy=)``; colibri.h ``COLIBRI_CACHE_*``), in
#: the order of their C values.
CACHE_POLICIES = ("lru", "lfu", "pinned", "predict")
#: Backends (``Engine(backend=)``; colibri.h ``COLIBRI_BACKEND_*``, docs/backends.md), in the
#: order of their C values: the CPU's cores, or an NVIDIA GPU (a build with -DCOLIBRI_CUDA=ON).
BACKENDS = ("cpu", "cuda")

_CUPY_HINT = ("Engine stage tensors on the device (device=True) are CuPy arrays: "
              "pip install colibri-lab[gpu] (cupy-cuda13x, or the cupy build of your CUDA)")


@dataclass(frozen=True)
class EngineConfig:
    """What the engine reports about the loaded model and its run settings."""

    path: str
    family: str
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    max_seq_len: int  # effective, as chosen at init
    file_max_seq_len: int
    max_batch: int
    num_threads: int  # as resolved at init (0 in the options = physical cores)
    threads_used: int  # threads of the engine's pool that run the forward
    group_pad: int
    sliding_window: int
    norm_topk_prob: bool
    tie_word_embeddings: bool
    router_int8: bool
    rope_theta: float
    rms_norm_eps: float
    weight_dtype: str
    router_dtype: str
    kernels: str  # the kernel table chosen at run time: "avx512", "avx2", "neon" or "reference" (+ " fast(...)")
    precision: str  # "exact" or "fast" (Engine(precision=...); docs/kernels.md "Numeric modes")
    bos_id: int
    eos_id: int
    arena_bytes: int
    file_size: int
    format_version: int
    max_seqs: int  # sequences the context holds at once (Engine.batch, Engine.sequence)
    kv_block_tokens: int  # positions per block of the paged KV cache
    kv_blocks_total: int  # blocks in the KV cache, shared by every sequence
    kv_bytes_per_token: int  # cache bytes per position, all layers (MLA: the latent rows only)
    expert_cache_slots: int = 0  # expert-cache slots per MoE layer (0: no cache, experts mapped)
    expert_cache_policy: str = ""  # "lru", "lfu", "pinned" or "predict"; "" without a cache
    expert_cache_slot_bytes: int = 0  # bytes of one slot (the largest expert, 4 KiB-aligned regions)
    expert_cache_direct: bool = False  # the cache reads with O_DIRECT (else buffered, pages dropped)
    backend: str = "cpu"  # where the stages run: "cpu" or "cuda" (Engine(backend=); docs/backends.md)
    backend_device: str = ""  # the backend's device, e.g. "cpu: avx512 (2 threads)", "NVIDIA H200 (sm_90, ...)"
    backend_device_bytes: int = 0  # device memory the backend took (0: the CPU, host memory only)
    backend_weight_bytes: int = 0  # weight bytes resident on the device (0 for the CPU: mapped)
    backend_experts_resident: int = 0  # routed experts resident on the device, all MoE layers
    backend_experts_host: int = 0  # routed experts a device backend computes on the CPU (did not fit)


_CONFIG_INTS = (
    "vocab_size", "hidden_size", "intermediate_size", "n_layers", "n_heads", "n_kv_heads",
    "head_dim", "n_experts", "top_k", "max_seq_len", "file_max_seq_len", "max_batch",
    "num_threads", "threads_used", "group_pad", "sliding_window", "bos_id", "eos_id", "arena_bytes",
    "file_size", "format_version", "max_seqs", "kv_block_tokens", "kv_blocks_total",
    "kv_bytes_per_token", "expert_cache_slots", "expert_cache_slot_bytes",
    "backend_device_bytes", "backend_weight_bytes", "backend_experts_resident", "backend_experts_host",
)  # fmt: skip
_CONFIG_BOOLS = ("norm_topk_prob", "tie_word_embeddings", "router_int8", "expert_cache_direct")
_CONFIG_FLOATS = ("rope_theta", "rms_norm_eps")
_CONFIG_STRINGS = {"family": "architecture", "name": "name",
                   "weight_dtype": "weight_dtype", "router_dtype": "router_dtype",
                   "kernels": "kernels", "precision": "precision",
                   "backend": "backend", "backend_device": "backend_device"}  # fmt: skip


# colibri_batch_entry (colibri.h) as a numpy record: 24 bytes, the C layout.
_ENTRY_DTYPE = ENTRY_DTYPE  # the names the engine's callers (and tests) use
_as_ids = as_ids


def _i32_ptr(arr: np.ndarray):
    return arr.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))


class Tokenizer:
    """The engine's tokenizer: SentencePiece BPE (byte-exact with ``sentencepiece``) or
    byte-level BPE (byte-exact with Hugging Face ``tokenizers``), as the file holds.

    Either the tokenizer of an :class:`Engine` (``engine.tokenizer``, valid while the
    engine is open) or a standalone one over the bytes of a tokenizer section
    (:meth:`from_section_bytes`).
    """

    def __init__(self, handle, *, owner=None, data=None, owned: bool = False):
        # Use Engine.tokenizer or Tokenizer.from_section_bytes instead.
        self._handle = handle
        self._owner = owner  # the Engine whose context owns the handle
        self._data = data  # keeps the section bytes alive for a standalone tokenizer
        self._owned = owned

    @classmethod
    def from_section_bytes(cls, data: bytes | bytearray | memoryview) -> "Tokenizer":
        """A tokenizer over a copy of ``data``, the bytes of a tokenizer section."""
        raw = bytes(data)
        buf = (ctypes.c_char * max(len(raw), 1)).from_buffer_copy(raw or b"\0")
        handle = _native.tok_p()
        err = ctypes.create_string_buffer(1024)
        status = lib.colibri_tokenizer_from_memory(
            ctypes.cast(buf, ctypes.c_void_p), len(raw), ctypes.byref(handle), err, len(err)
        )
        check(status, err=err)
        return cls(handle, data=buf, owned=True)

    # -- lifetime -------------------------------------------------------------------

    def close(self) -> None:
        """Free a standalone tokenizer (an engine's one is freed with the engine)."""
        handle, self._handle = self._handle, None
        if handle and self._owned:
            lib.colibri_tokenizer_free(handle)
        self._data = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> "Tokenizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return not self._handle or (self._owner is not None and self._owner.closed)

    def _h(self):
        if self.closed:
            raise ColibriClosedError("the tokenizer is closed (or its Engine is)")
        return self._handle

    # -- facts ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(lib.colibri_tokenizer_vocab_size(self._h()))

    @property
    def bos_id(self) -> int:
        """The BOS id, -1 if the tokenizer has none."""
        return int(lib.colibri_tokenizer_bos_id(self._h()))

    @property
    def eos_id(self) -> int:
        """The EOS id, -1 if the tokenizer has none."""
        return int(lib.colibri_tokenizer_eos_id(self._h()))

    # -- encode / decode ------------------------------------------------------------

    def encode(self, text: str | bytes, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``, with BOS first when ``add_bos`` (and the tokenizer has one).

        A ``str`` is encoded as UTF-8. ``bytes`` (or a ``bytearray`` / ``memoryview``) go
        to the tokenizer as they are, so malformed UTF-8 can be tokenized too, handled as
        the reference tokenizer handles it: each malformed byte becomes U+FFFD
        (sentencepiece), or each maximal malformed subpart does, as
        ``bytes.decode("utf-8", "replace")`` (byte-level BPE). Anything else raises
        :class:`ColibriInvalidArgError`.
        """
        h = self._h()
        if isinstance(text, str):
            data = text.encode("utf-8", "surrogatepass")
        elif isinstance(text, (bytes, bytearray, memoryview)):
            data = bytes(text)
        else:
            raise _native.ColibriInvalidArgError(
                f"text must be str or bytes, got {type(text).__name__}"
            )
        cap = len(data) // 2 + 8
        n = ctypes.c_int64(0)
        while True:
            out = (ctypes.c_int32 * cap)()
            status = lib.colibri_tokenize(h, data, len(data), int(bool(add_bos)), out, cap,
                                          ctypes.byref(n))  # fmt: skip
            if status == _native.E_BUFFER_TOO_SMALL and n.value > cap:
                cap = n.value
                continue
            check(status, tok=h)
            return list(out[: n.value])

    def decode_bytes(self, ids: Sequence[int] | np.ndarray) -> bytes:
        """The UTF-8 bytes that ``ids`` decode to (as the reference tokenizer decodes)."""
        h = self._h()
        arr = _as_ids(ids)
        cap = max(16, 8 * len(arr))
        n = ctypes.c_uint64(0)
        while True:
            out = ctypes.create_string_buffer(cap)
            status = lib.colibri_detokenize(h, _i32_ptr(arr), len(arr), out, cap,
                                            ctypes.byref(n))  # fmt: skip
            if status == _native.E_BUFFER_TOO_SMALL and n.value > cap:
                cap = n.value
                continue
            check(status, tok=h)
            return out.raw[: n.value]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text that ``ids`` decode to (as the reference tokenizer decodes)."""
        return self.decode_bytes(ids).decode("utf-8", "replace")

    def piece_bytes(self, token_id: int) -> bytes:
        """The raw piece of one id, e.g. b'\\xe2\\x96\\x81Hello', b'<0x0A>', b'<s>'."""
        h = self._h()
        if not _INT32_MIN <= int(token_id) <= _INT32_MAX:
            raise ColibriTokenRangeError(f"token id {token_id} does not fit in int32")
        p = ctypes.POINTER(ctypes.c_char)()
        n = ctypes.c_uint64(0)
        check(lib.colibri_token_piece(h, int(token_id), ctypes.byref(p), ctypes.byref(n)), tok=h)
        return ctypes.string_at(p, n.value) if n.value else b""

    def piece(self, token_id: int) -> str:
        """The raw piece of one id as text, e.g. '▁Hello', '<0x0A>', '<s>'."""
        return self.piece_bytes(token_id).decode("utf-8", "replace")

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        if self.closed:
            return "Tokenizer(closed)"
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id})")


class Engine:
    """A loaded ``.colibri`` model: one C context (mmap'd weights, arena, KV cache).

    Options left as ``None`` take the engine's defaults (colibri.h, ``colibri_options``).
    One Engine is used by one thread at a time; distinct Engines are independent.

    ``expert_cache_mb`` (or ``expert_cache_slots`` per MoE layer) puts the routed experts in a
    cache of that size, read from the file on a miss, for models larger than memory;
    ``expert_cache_policy`` is one of :data:`CACHE_POLICIES` (docs/expert_cache.md). The
    logits are bitwise those of the fully mapped run.

    ``prefix_cache`` (on by default) keeps every full KV block after its sequence lets it go,
    found again by its tokens and everything before them: a sequence whose prompt starts with
    cached blocks takes them instead of computing them (:meth:`Sequence.reuse_prefix`;
    :meth:`generate` and :meth:`generate_many` do it themselves). Cached blocks are evicted,
    least recently used first, only when a sequence needs room, and every logit is bitwise
    the same with the cache on or off (docs/serving.md, "Prefix caching").

    ``backend`` is one of :data:`BACKENDS`: ``"cpu"`` (the default) or ``"cuda"``, the stages on
    NVIDIA GPU ``gpu_device`` (a library built with ``-DCOLIBRI_CUDA=ON``; otherwise opening
    raises :class:`ColibriUnsupportedError` saying so). ``gpu_memory_fraction`` (``None``: 0.9)
    is the share of the device's memory the engine may take: the dense weights, activations and
    KV cache must fit, then as many routed experts as fit; the rest run on the CPU
    (``config.backend_experts_host``). docs/backends.md.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        num_threads: int | None = None,
        max_seq_len: int | None = None,
        max_batch: int | None = None,
        group_pad: int | None = None,
        populate: bool | None = None,
        verify_checksums: bool = False,
        max_seqs: int | None = None,
        kv_tokens: int | None = None,
        kv_block_tokens: int | None = None,
        precision: str = "exact",
        expert_cache_mb: int = 0,
        expert_cache_policy: str = "lru",
        expert_cache_slots: int = 0,
        backend: str = "cpu",
        gpu_memory_fraction: float | None = None,
        gpu_device: int = 0,
        prefix_cache: bool = True,
    ):
        self._ctx = None
        self.path = os.fspath(path)
        opt = _native.ColibriOptions()
        lib.colibri_options_init(ctypes.byref(opt))
        if num_threads is not None:
            opt.num_threads = int(num_threads)
        if max_seq_len is not None:
            opt.max_seq_len = int(max_seq_len)
        if max_batch is not None:
            opt.max_batch = int(max_batch)
        if group_pad is not None:
            opt.group_pad = int(group_pad)
        # populate: None = the engine's auto (pre-fault the file when it is under half of
        # MemAvailable, the benchmark's load path), True/False = on/off
        if populate is None:
            opt.populate = -1  # COLIBRI_POPULATE_AUTO
        elif populate in (True, False):
            opt.populate = int(populate)
        else:
            raise _native.ColibriInvalidArgError(
                f"populate must be None (auto), True or False, got {populate!r}"
            )
        opt.verify_checksums = int(bool(verify_checksums))
        if max_seqs is not None:
            opt.max_seqs = int(max_seqs)
        if kv_tokens is not None:
            opt.kv_tokens = int(kv_tokens)
        if kv_block_tokens is not None:
            opt.kv_block_tokens = int(kv_block_tokens)
        if precision not in PRECISIONS:
            raise _native.ColibriInvalidArgError(
                f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}"
            )
        opt.precision = PRECISIONS.index(precision)
        # the expert cache (docs/expert_cache.md): routed experts in this many MiB of slots
        if isinstance(expert_cache_mb, bool) or int(expert_cache_mb) != expert_cache_mb or expert_cache_mb < 0:
            raise _native.ColibriInvalidArgError(
                f"expert_cache_mb must be a whole number of MiB >= 0 (0: no cache), got {expert_cache_mb!r}"
            )
        if expert_cache_policy not in CACHE_POLICIES:
            raise _native.ColibriInvalidArgError(
                f"expert_cache_policy must be one of {', '.join(map(repr, CACHE_POLICIES))}, "
                f"got {expert_cache_policy!r}"
            )
        if isinstance(expert_cache_slots, bool) or int(expert_cache_slots) != expert_cache_slots or (
            expert_cache_slots < 0
        ):
            raise _native.ColibriInvalidArgError(
                f"expert_cache_slots must be a whole number >= 0 (0: from expert_cache_mb), got {expert_cache_slots!r}"
            )
        opt.expert_cache_slots = int(expert_cache_slots)
        opt.expert_cache_mb = int(expert_cache_mb)
        opt.expert_cache_policy = CACHE_POLICIES.index(expert_cache_policy)
        # the backend (docs/backends.md): checked here, before the library sees it
        if not isinstance(backend, str) or backend not in BACKENDS:
            raise _native.ColibriInvalidArgError(
                f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}"
            )
        if gpu_memory_fraction is not None:
            ok = isinstance(gpu_memory_fraction, numbers.Real) and not isinstance(gpu_memory_fraction, bool)
            if not ok or not 0.0 < float(gpu_memory_fraction) <= 1.0:
                raise _native.ColibriInvalidArgError(
                    f"gpu_memory_fraction must be None (the default, 0.9) or a number in (0, 1], "
                    f"got {gpu_memory_fraction!r}"
                )
        if isinstance(gpu_device, bool) or not isinstance(gpu_device, numbers.Integral) or not (
            0 <= int(gpu_device) <= _INT32_MAX
        ):
            raise _native.ColibriInvalidArgError(
                f"gpu_device must be a CUDA device ordinal, an int >= 0, got {gpu_device!r}"
            )
        if backend != "cuda" and (gpu_memory_fraction is not None or gpu_device != 0):
            raise _native.ColibriInvalidArgError(
                f"gpu_memory_fraction and gpu_device set up the CUDA backend; they need backend='cuda', "
                f"got backend={backend!r}"
            )
        opt.backend = BACKENDS.index(backend)
        opt.gpu_memory_fraction = 0.0 if gpu_memory_fraction is None else float(gpu_memory_fraction)
        opt.gpu_device = int(gpu_device)
        if prefix_cache not in (True, False):
            raise _native.ColibriInvalidArgError(f"prefix_cache must be True or False, got {prefix_cache!r}")
        opt.prefix_cache = int(prefix_cache)
        self.last_cached_tokens = 0  # prompt positions the last generate() took from the prefix cache

        ctx = _native.ctx_p()
        err = ctypes.create_string_buffer(1024)
        status = lib.colibri_init_ex(os.fsencode(self.path), ctypes.byref(opt), ctypes.byref(ctx),
                                     err, len(err))  # fmt: skip
        check(status, err=err)
        self._ctx = ctx
        self._vocab = self._get_int("vocab_size")
        self._config: EngineConfig | None = None
        self._tokenizer: Tokenizer | None = None
        self._moe_layers: np.ndarray | None = None
        self._interventions: list = []  # the active Engine.intervene blocks

    # -- lifetime -------------------------------------------------------------------

    def close(self) -> None:
        """Free the context (weights unmapped, arena freed). Safe to call twice."""
        ctx, self._ctx = self._ctx, None
        if ctx:
            lib.colibri_free(ctx)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return not self._ctx

    def _c(self):
        if not self._ctx:
            raise ColibriClosedError(f"the Engine for {self.path!r} is closed")
        return self._ctx

    # -- facts ----------------------------------------------------------------------

    def _get_int(self, name: str) -> int:
        ctx = self._c()
        out = ctypes.c_int64(0)
        check(lib.colibri_get_int(ctx, name.encode(), ctypes.byref(out)), ctx=ctx)
        return int(out.value)

    def _layer_int(self, layer: int, name: str) -> int:
        ctx = self._c()
        v = ctypes.c_int64()
        check(lib.colibri_get_layer_int(ctx, int(layer), name.encode(), ctypes.byref(v)), ctx=ctx)
        return int(v.value)

    def _layer_is_moe(self) -> np.ndarray:
        """[n_layers] bool: False for the dense-MLP layers (read once, then cached)."""
        if self._moe_layers is None:
            n = self.config.n_layers
            self._moe_layers = np.array([self._layer_int(i, "moe") for i in range(n)], dtype=bool)
        return self._moe_layers.copy()

    def _get_float(self, name: str) -> float:
        ctx = self._c()
        out = ctypes.c_double(0)
        check(lib.colibri_get_float(ctx, name.encode(), ctypes.byref(out)), ctx=ctx)
        return float(out.value)

    def _get_string(self, name: str) -> str:
        ctx = self._c()
        out = ctypes.c_char_p()
        check(lib.colibri_get_string(ctx, name.encode(), ctypes.byref(out)), ctx=ctx)
        return (out.value or b"").decode("utf-8", "replace")

    @property
    def config(self) -> EngineConfig:
        """The model's shape and the run settings, read from the engine once."""
        self._c()
        if self._config is None:
            kw: dict = {"path": self.path}
            kw.update({k: self._get_int(k) for k in _CONFIG_INTS})
            kw.update({k: bool(self._get_int(k)) for k in _CONFIG_BOOLS})
            kw.update({k: self._get_float(k) for k in _CONFIG_FLOATS})
            kw.update({k: self._get_string(v) for k, v in _CONFIG_STRINGS.items()})
            pol = self._get_int("expert_cache_policy")
            kw["expert_cache_policy"] = CACHE_POLICIES[pol] if pol >= 0 else ""
            self._config = EngineConfig(**kw)
        return self._config

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (valid while the engine is open)."""
        ctx = self._c()
        if self._tokenizer is None:
            handle = lib.colibri_get_tokenizer(ctx)
            if not handle:
                raise _native.ColibriUnsupportedError(
                    f"{self.path!r} has no tokenizer: pass token ids instead of text"
                )
            self._tokenizer = Tokenizer(handle, owner=self)
        return self._tokenizer

    @property
    def cached_len(self) -> int:
        """Positions currently in the KV cache of sequence 0 (the single-sequence calls')."""
        return int(lib.colibri_cached_len(self._c()))

    @property
    def kv_blocks_used(self) -> int:
        """KV-cache blocks held by the sequences now (of ``config.kv_blocks_total``)."""
        return self._get_int("kv_blocks_used")

    def prefix_cache_stats(self) -> dict:
        """The prefix cache since load: ``hit_tokens`` (positions reused) of ``query_tokens``
        (positions offered to :meth:`Sequence.reuse_prefix`), ``hit_rate``, and
        ``cached_blocks`` (blocks no sequence holds, kept until a sequence needs room)."""
        hits, queries = self._get_int("prefix_cache_hit_tokens"), self._get_int("prefix_cache_query_tokens")
        return {"enabled": bool(self._get_int("prefix_cache")), "hit_tokens": hits, "query_tokens": queries,
                "hit_rate": hits / queries if queries else 0.0, "cached_blocks": self._get_int("kv_blocks_cached")}

    # -- several sequences ----------------------------------------------------------

    def sequence(self, seq: int) -> "Sequence":
        """A handle on sequence ``seq`` (0 .. max_seqs-1) of this context."""
        seq = int(seq)
        if not 0 <= seq < self.config.max_seqs:
            raise _native.ColibriInvalidArgError(
                f"sequence {seq} is not in [0, {self.config.max_seqs}); open the Engine with a "
                f"larger max_seqs"
            )
        return Sequence(self, seq)

    def batch(self, work, *, logits: str = "last") -> list:
        """One forward over several sequences, each continued at its end::

            a, b = eng.batch([(0, prompt_ids), (1, [next_id])])   # logits of each item

        ``work`` is a list of ``(seq, token_ids)``; the tokens of every item are run in
        one batch (in ``max_batch`` chunks): attention per sequence, routing and the
        expert FFN over all of them at once. ``logits`` says which rows come back for each
        item: ``"last"`` ([1, vocab]), ``"all"`` ([n, vocab]) or ``"none"`` (None). A
        sequence's logits are bitwise the same as alone, whatever else is in the batch.
        """
        if logits not in ("last", "all", "none"):
            raise _native.ColibriInvalidArgError(f"logits must be 'last', 'all' or 'none', got {logits!r}")
        items = [(int(seq), _as_ids(ids)) for seq, ids in work]
        ctx = self._c()
        n = sum(len(ids) for _, ids in items)
        if n == 0:
            raise _native.ColibriInvalidArgError("the batch has no tokens")
        entries = np.zeros(n, dtype=_ENTRY_DTYPE)
        nxt: dict[int, int] = {}
        i = 0
        for seq, ids in items:
            k = len(ids)
            if k == 0:
                continue
            start = nxt.get(seq)
            if start is None:
                start = int(lib.colibri_seq_len(ctx, seq))
                if start < 0:
                    raise _native.ColibriInvalidArgError(
                        f"sequence {seq} is not in [0, {self.config.max_seqs}); open the Engine with a "
                        f"larger max_seqs"
                    )
            e = entries[i:i + k]
            e["token"], e["seq"], e["pos"] = ids, seq, np.arange(start, start + k)
            if logits == "all":
                e["logits"] = 1
            elif logits == "last":
                e["logits"][-1] = 1
            nxt[seq] = start + k
            i += k
        n_out = int(entries["logits"].sum())
        out = np.empty((n_out, self._vocab), dtype=np.float32)
        ptr = out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if n_out else None
        check(lib.colibri_batch(ctx, entries.ctypes.data, n, ptr), ctx=ctx)
        res, r = [], 0
        for _, ids in items:
            rows = 0 if logits == "none" or len(ids) == 0 else (1 if logits == "last" else len(ids))
            res.append(out[r:r + rows] if logits != "none" else None)
            r += rows
        return res

    # -- running --------------------------------------------------------------------

    def forward(self, token_ids: Sequence[int] | np.ndarray, start_pos: int = 0, *,
                last_only: bool = False) -> np.ndarray:
        """Logits after each token, float32 ``[len(token_ids), vocab_size]``.

        ``start_pos`` 0 starts a new sequence; a larger value continues the one in the
        KV cache (``start_pos <= cached_len``), as ``colibri_forward_at``.
        ``last_only=True`` computes only the last token's logits (``[1, vocab_size]``):
        the LM head then runs on one row, which is what generation needs.
        """
        ctx = self._c()
        ids = _as_ids(token_ids)
        logits = np.empty((1 if last_only else len(ids), self._vocab), dtype=np.float32)
        out = logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        fn = lib.colibri_forward_last if last_only else lib.colibri_forward_at
        status = fn(ctx, _i32_ptr(ids), len(ids), int(start_pos), out)
        check(status, ctx=ctx)
        return logits

    def _sample(self, row: np.ndarray, temperature: float, top_k: int, top_p: float,
                rng: ctypes.c_uint64) -> int:  # fmt: skip
        ctx = self._c()
        row = np.ascontiguousarray(row, dtype=np.float32)
        if row.shape != (self._vocab,):
            raise _native.ColibriInvalidArgError(
                f"a logits row must have shape ({self._vocab},), got {row.shape}"
            )
        out = ctypes.c_int32(0)
        status = lib.colibri_sample(ctx, row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                    float(temperature), int(top_k), float(top_p),
                                    ctypes.byref(rng), ctypes.byref(out))  # fmt: skip
        check(status, ctx=ctx)
        return int(out.value)

    def sample(self, logits_row, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed: int = 0) -> int:  # fmt: skip
        """Sample one id from one row of logits with the engine's sampler."""
        return self._sample(np.asarray(logits_row), temperature, top_k, top_p,
                            ctypes.c_uint64(int(seed) & 0xFFFFFFFFFFFFFFFF))  # fmt: skip

    def sampler(self, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                repetition_last_n: int = 0, ignore_eos: bool = False, logit_bias=None, stop_ids=(),
                json_schema=None, grammar_prefix: str = "", grammar_suffix: str = ""):  # fmt: skip
        """A :class:`~colibri_lab.runtime.sampling.Sampler` for this model's vocabulary: the
        library's per-sequence sampler with these settings. ``json_schema`` (a dict, JSON
        text, or True for any JSON object) attaches a grammar compiled for the tokenizer."""
        from .sampling import Grammar, Sampler

        self._c()
        tok = self.tokenizer if self._has_tokenizer() else None
        grammar = None
        if json_schema is not None and json_schema is not False:
            if tok is None:
                raise NotImplementedError("json_schema needs the model's tokenizer; this file has none")
            grammar = Grammar(tok, json_schema, prefix=grammar_prefix, suffix=grammar_suffix)
        return Sampler(self._vocab, tok.eos_id if tok is not None else -1, temperature=temperature, top_k=top_k,
                       top_p=top_p, min_p=min_p, presence_penalty=presence_penalty,
                       frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                       repetition_last_n=repetition_last_n, ignore_eos=ignore_eos, logit_bias=logit_bias,
                       stop_ids=stop_ids, grammar=grammar, end_ids=self.end_ids)  # fmt: skip

    @property
    def end_ids(self) -> tuple[int, ...]:
        """The ids after which a generation ends (``colibri_get_end_ids``): EOS first, then
        the other end tokens the file names (metadata ``tokenizer.end_ids``: its checkpoint's
        ``generation_config.json`` ``eos_token_id`` list, or the end-of-generation tokens of
        its GGUF, e.g. Qwen's ``<|im_end|>`` and ``<|endoftext|>``). :meth:`generate`,
        :meth:`generate_many`, ``colibri_cli`` and ``colibri_server`` stop at any of them."""
        ctx = self._c()
        ids = ctypes.POINTER(ctypes.c_int32)()
        n = ctypes.c_int32()
        check(lib.colibri_get_end_ids(ctx, ctypes.byref(ids), ctypes.byref(n)), ctx=ctx)
        return tuple(int(ids[i]) for i in range(n.value))

    def generate(
        self,
        prompt: str | Sequence[int] | np.ndarray,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_at_eos: bool = True,
        reuse_prefix: bool = True,
        *,
        min_p: float = 0.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        repetition_last_n: int = 0,
        logit_bias=None,
        stop_ids=(),
        ignore_eos: bool = False,
        json_schema=None,
    ) -> Iterator[Token]:
        """Yield generated tokens one by one.

        ``prompt`` is text (encoded with BOS) or a list of ids. The prompt is run once,
        then one forward per new token; each token is chosen by the library's per-sequence
        sampler (``colibri_sampler_sample``) with one xorshift state seeded by ``seed``, so
        ``colibri_cli`` and ``colibri_server`` with the same settings yield the same ids.
        Without penalties, bias, min-p or a schema the ids are ``colibri_sample``'s.
        ``logit_bias`` maps ids to additive biases (±100 forces / bans), ``stop_ids`` end
        generation (yielded last), ``ignore_eos`` keeps going after EOS (as vLLM), the penalties are
        OpenAI's (presence, frequency: over generated tokens) and HF's (repetition: over the
        prompt and the generated tokens, the last ``repetition_last_n``, 0 = all), and
        ``json_schema`` (a dict, JSON text, or True for any JSON object) constrains the output
        to compact JSON that validates against it (the JSON ends with EOS).
        Generation ends after ``max_new_tokens`` or, when ``stop_at_eos``, with EOS or another
        of the model's :attr:`end_ids` (yielded as the last token). ``Token.text`` is the text the token adds; bytes of a character
        split over byte-fallback tokens are held back until it is complete (the last token
        gets whatever is left).

        With ``reuse_prefix`` (and the engine's ``prefix_cache`` on) the prompt's leading
        blocks already in the prefix cache are taken instead of computed; the tokens are
        bitwise the same. ``last_cached_tokens`` says how many prompt positions came from the
        cache; pass ``reuse_prefix=False`` to trace the routing of every prompt position.
        """
        from .sampling import FINISH_EOS, FINISH_GRAMMAR, FINISH_STOP_ID

        self._c()
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt, add_bos=True)
        else:
            prompt_ids = [int(x) for x in _as_ids(prompt)]
        if not prompt_ids:
            raise _native.ColibriInvalidArgError("the prompt is empty: give text or an id")
        max_new_tokens = int(max_new_tokens)
        if max_new_tokens <= 0:
            return
        tok = self.tokenizer if self._has_tokenizer() else None
        sampler = self.sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                               presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                               repetition_penalty=repetition_penalty, repetition_last_n=repetition_last_n,
                               ignore_eos=ignore_eos, logit_bias=logit_bias, stop_ids=stop_ids,
                               json_schema=json_schema)  # fmt: skip
        sampler.add_prompt(prompt_ids)
        rng = ctypes.c_uint64(int(seed) & 0xFFFFFFFFFFFFFFFF)

        text = _TextStream(tok, prompt_ids)
        seq0 = Sequence(self, 0)
        seq0.clear()
        n_cached = seq0.reuse_prefix(prompt_ids) if reuse_prefix else 0
        self.last_cached_tokens = n_cached
        row = self.forward(prompt_ids[n_cached:], n_cached, last_only=True)[0]
        pos = len(prompt_ids)
        for i in range(max_new_tokens):
            next_id = sampler.sample(row, rng)
            fin = sampler.finished
            last = (i == max_new_tokens - 1 or (stop_at_eos and fin == FINISH_EOS)
                    or fin in (FINISH_STOP_ID, FINISH_GRAMMAR))  # fmt: skip
            yield Token(next_id, text.push(next_id, final=last))
            if last:
                return
            row = self.forward([next_id], pos)[0]
            pos += 1

    def generate_many(self, prompts, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                      top_p: float = 1.0, seeds=None, stop_at_eos: bool = True, *, min_p: float = 0.0,
                      presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                      repetition_penalty: float = 1.0, repetition_last_n: int = 0, logit_bias=None,
                      stop_ids=(), ignore_eos: bool = False, json_schema=None) -> list[list[int]]:  # fmt: skip
        """Generate for several prompts at once, one sequence each (0 .. len(prompts)-1, which
        are cleared first): every step is one :meth:`batch` with the prompts still going, and
        each sequence samples with its own sampler (the settings of :meth:`generate`: min-p,
        penalties, ``logit_bias``, ``stop_ids``, ``ignore_eos``, ``json_schema``, the same for
        every prompt; the schema compiled once) and its own xorshift state seeded by
        ``seeds[i]`` (default ``i``), so every prompt gets exactly the ids :meth:`generate`
        gives it alone with that seed and those settings. A prompt ends as in :meth:`generate`
        (``max_new_tokens``; EOS when ``stop_at_eos``; a stop id; the end of the schema's
        JSON). Returns the generated ids of each prompt."""
        from .sampling import FINISH_EOS, FINISH_GRAMMAR, FINISH_STOP_ID, Grammar, Sampler

        self._c()
        n = len(prompts)
        if n == 0:
            return []
        if n > self.config.max_seqs:
            raise _native.ColibriInvalidArgError(
                f"{n} prompts need {n} sequences; open the Engine with max_seqs >= {n}")
        seeds = list(range(n)) if seeds is None else [int(s) for s in seeds]
        if len(seeds) != n:
            raise _native.ColibriInvalidArgError(f"{len(seeds)} seeds for {n} prompts")
        ids = [self.tokenizer.encode(p, add_bos=True) if isinstance(p, str) else [int(x) for x in _as_ids(p)]
               for p in prompts]
        if any(not p for p in ids):
            raise _native.ColibriInvalidArgError("a prompt is empty: give text or an id")
        max_new_tokens = int(max_new_tokens)
        if max_new_tokens <= 0:
            return [[] for _ in range(n)]
        tok = self.tokenizer if self._has_tokenizer() else None
        grammar = None
        if json_schema is not None and json_schema is not False:
            if tok is None:
                raise NotImplementedError("json_schema needs the model's tokenizer; this file has none")
            grammar = Grammar(tok, json_schema)
        samplers, end_ids = [], self.end_ids
        for s in range(n):
            sp = Sampler(self._vocab, tok.eos_id if tok is not None else -1, temperature=temperature, top_k=top_k,
                         top_p=top_p, min_p=min_p, presence_penalty=presence_penalty,
                         frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                         repetition_last_n=repetition_last_n, ignore_eos=ignore_eos, logit_bias=logit_bias,
                         stop_ids=stop_ids, grammar=grammar, end_ids=end_ids)  # fmt: skip
            sp.add_prompt(ids[s])
            samplers.append(sp)
        rngs = [ctypes.c_uint64(s & 0xFFFFFFFFFFFFFFFF) for s in seeds]
        cached = []
        for s in range(n):
            self.sequence(s).clear()
            cached.append(self.sequence(s).reuse_prefix(ids[s]))
        out: list[list[int]] = [[] for _ in range(n)]
        rows = dict(zip(range(n), (r[0] for r in self.batch([(s, ids[s][cached[s]:]) for s in range(n)]))))
        while rows:
            work = []
            for s, row in rows.items():
                nxt = samplers[s].sample(row, rngs[s])
                fin = samplers[s].finished
                out[s].append(nxt)
                done = (len(out[s]) >= max_new_tokens or (stop_at_eos and fin == FINISH_EOS)
                        or fin in (FINISH_STOP_ID, FINISH_GRAMMAR))  # fmt: skip
                if not done:
                    work.append((s, [nxt]))
            rows = dict(zip((s for s, _ in work), (r[0] for r in self.batch(work)))) if work else {}
        return out

    # -- the expert cache -------------------------------------------------------------

    def expert_cache_stats(self) -> dict:
        """The expert cache's counters since load: totals (``hits``, ``misses``,
        ``prefetches``, ``prefetch_hits``, ``wasted_prefetches``, ``bytes_read``) and per
        layer (``layer_hits``, ... as [n_layers] int64 arrays). Zeros without a cache."""
        names = ("hits", "misses", "prefetches", "prefetch_hits", "wasted_prefetches")
        out: dict = {n: self._get_int("expert_cache_" + n) for n in names}
        out["bytes_read"] = self._get_int("expert_cache_bytes_read")
        L = self.config.n_layers
        for n in names:
            out["layer_" + n] = np.array([self._layer_int(i, "cache_" + n) for i in range(L)], np.int64)
        return out

    def backend_stats(self) -> dict:
        """What the backend says of itself now (colibri_get_string ``backend`` /
        ``backend_device``, colibri_get_int ``backend_*``): ``backend``, ``device``,
        ``device_bytes``, ``weight_bytes``, ``experts_resident``, ``experts_host``, and the
        counters that move, ``graphs_captured`` and ``graph_replays`` (CUDA graphs of decode
        steps; 0 on the CPU)."""
        out: dict = {"backend": self._get_string("backend"), "device": self._get_string("backend_device")}
        for n in ("device_bytes", "weight_bytes", "experts_resident", "experts_host", "graphs_captured",
                  "graph_replays"):
            out[n] = self._get_int("backend_" + n)
        return out

    def pin_experts(self, layer: int, experts) -> None:
        """Pin ``experts`` of MoE ``layer`` in the expert cache (replacing its pinned set; an
        empty list unpins): read now if not resident, never evicted. They must leave one of the
        layer's ``config.expert_cache_slots`` slots free. For the ``"pinned"`` policy, e.g.
        from a trace's most used experts (``colibri_lab.analysis.cachesim``)."""
        ctx = self._c()
        ids = np.ascontiguousarray(np.asarray(list(experts), dtype=np.int32).ravel())
        ptr = ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)) if ids.size else None
        check(lib.colibri_expert_cache_pin(ctx, int(layer), ptr, int(ids.size)), ctx=ctx)

    # -- observation ----------------------------------------------------------------

    def trace(self, capacity: int | None = None) -> "_TraceRecorder":
        """Record what the forward passes inside a ``with`` block do::

            with eng.trace() as tr:
                eng.forward(ids)
            tr.topk_ids          # [layers, tokens, k], filled when the block exits

        ``capacity`` is the most tokens recorded (default: ``max_seq_len``); later tokens
        are counted in ``tr.dropped`` and not recorded. The engine records into buffers of
        its own made once here; outside the block it does no tracing work at all.
        """
        return _TraceRecorder(self, capacity)

    def stages(self, token_ids: Sequence[int] | np.ndarray, start_pos: int = 0) -> "StageRun":
        """Run one forward (at most ``max_batch`` tokens) one stage at a time; see :class:`StageRun`."""
        return StageRun(self, token_ids, start_pos)

    # -- interventions --------------------------------------------------------------

    def intervene(self, *, ablate=None, zero=None, mode: str = "exclude", force=None, router_bias=None,
                  patch=None, add=None, record=None, seq: int | None = None):  # fmt: skip
        """Interventions applied by the engine inside a ``with`` block: expert masks
        (``ablate``, ``zero``), forced routing (``force``), router bias (``router_bias``) and
        activation patching (``patch``, ``add``, ``record``), for every sequence or one
        (``seq``); see :class:`colibri_lab.runtime.interventions.Intervention`."""
        from .interventions import Intervention

        return Intervention(self, ablate=ablate, zero=zero, mode=mode, force=force, router_bias=router_bias,
                            patch=patch, add=add, record=record, seq=seq)  # fmt: skip

    def logprobs(self, work) -> list:
        """Log-probabilities of given target tokens, computed by the engine (no logits row
        comes back): ``work`` is a list of ``(seq, token_ids, targets)``, each continued at
        the sequence's end as in :meth:`batch`; see
        :func:`colibri_lab.runtime.interventions.target_logprobs`."""
        from .interventions import target_logprobs

        return target_logprobs(self, work)

    def lens(self, resid) -> np.ndarray:
        """Final norm and LM head on residual rows ``[n, hidden]`` (the logit lens), by the
        engine; see :func:`colibri_lab.runtime.interventions.lens`."""
        from .interventions import lens

        return lens(self, resid)

    def _has_tokenizer(self) -> bool:
        return bool(lib.colibri_get_tokenizer(self._c()))

    # -- checks ---------------------------------------------------------------------

    def verify(self) -> None:
        """Check every per-tensor and weight-section CRC-32 (reads the whole file)."""
        ctx = self._c()
        check(lib.colibri_verify(ctx), ctx=ctx)

    def verify_router(self) -> None:
        """Recompute each router tensor's L2 norm and compare it with the stored one."""
        ctx = self._c()
        check(lib.colibri_verify_router(ctx), ctx=ctx)

    def __repr__(self) -> str:
        if self.closed:
            return f"Engine({self.path!r}, closed)"
        c = self.config
        return (
            f"Engine({self.path!r}, family={c.family!r}, layers={c.n_layers}, "
            f"hidden={c.hidden_size}, experts={c.n_experts}, top_k={c.top_k}, "
            f"vocab={c.vocab_size}, weights={c.weight_dtype}, max_seq_len={c.max_seq_len}, "
            f"cached={self.cached_len})"
        )


class _TextStream:
    """Turns generated ids into text deltas: decodes prompt + generated ids and returns
    what is new, holding back a trailing U+FFFD (a character whose bytes are still
    arriving through byte-fallback tokens)."""

    def __init__(self, tok: Tokenizer | None, prompt_ids: list[int]):
        self.tok = tok
        self.ids = list(prompt_ids)
        if tok is None:
            self.done = 0
            return
        base = tok.decode(self.ids)
        self.done = len(base.rstrip(_FFFD))

    def push(self, token_id: int, final: bool = False) -> str:
        if self.tok is None:
            return ""
        self.ids.append(token_id)
        full = self.tok.decode(self.ids)
        upto = len(full) if final else len(full.rstrip(_FFFD))
        if upto <= self.done:
            return ""
        delta, self.done = full[self.done : upto], upto
        return delta


# ---------------------------------------------------------------------------------------
# Observation: traces and stage-by-stage runs.

# colibri_dtype (colibri.h) -> numpy; bf16 arrays are handed out as their raw uint16 bits.
_NP_DTYPES = {0: np.float32, 1: np.float16, 2: np.uint16, 3: np.int8, 4: np.int32, 5: np.int64,
              6: np.uint64}


def _c_array(ptr: int | None, dtype: int, ndim: int, shape) -> np.ndarray:
    """A numpy view of engine memory (no copy)."""
    shp = tuple(int(shape[i]) for i in range(ndim))
    dt = np.dtype(_NP_DTYPES[dtype])
    n = int(np.prod(shp)) if shp else 1
    if n == 0 or not ptr:
        return np.empty(shp, dtype=dt)
    buf = (ctypes.c_char * (n * dt.itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype=dt).reshape(shp)


def _device_array(ptr: int | None, dtype: int, ndim: int, shape, owner):
    """A cupy view of the backend's device memory at ``ptr`` (no copy); ``owner`` is kept
    alive by the array."""
    try:
        import cupy
    except ImportError as e:
        raise ImportError(_CUPY_HINT) from e
    shp = tuple(int(shape[i]) for i in range(ndim))
    dt = np.dtype(_NP_DTYPES[dtype])
    n = int(np.prod(shp)) if shp else 1
    if n == 0 or not ptr:
        return cupy.empty(shp, dtype=dt)
    mem = cupy.cuda.UnownedMemory(int(ptr), n * dt.itemsize, owner)
    return cupy.ndarray(shp, dtype=dt, memptr=cupy.cuda.MemoryPointer(mem, 0))


class _TraceRecorder:
    """The context manager of :meth:`Engine.trace`: attaches a C trace on enter and
    fills the :class:`Trace` it returned when the block exits."""

    def __init__(self, engine: Engine, capacity: int | None):
        self._engine = engine
        self._capacity = int(capacity) if capacity is not None else None
        self._handle = None
        self.trace: Trace | None = None

    def __enter__(self) -> Trace:
        eng = self._engine
        ctx = eng._c()
        cap = self._capacity if self._capacity is not None else eng.config.max_seq_len
        h = _native.trace_p()
        err = ctypes.create_string_buffer(512)
        check(lib.colibri_trace_create(ctx, int(cap), ctypes.byref(h), err, len(err)), err=err)
        st = lib.colibri_trace_attach(ctx, h)
        if st != _native.OK:
            lib.colibri_trace_free(h)
            check(st, ctx=ctx)
        self._handle = h
        cfg = eng.config
        L, E, K = cfg.n_layers, cfg.n_experts, cfg.top_k
        self.trace = Trace(
            token_ids=np.zeros(0, np.int32), positions=np.zeros(0, np.int64),
            seq_ids=np.zeros(0, np.int32),
            router_probs=np.zeros((L, 0, E), np.float32), topk_ids=np.zeros((L, 0, K), np.int32),
            topk_weights=np.zeros((L, 0, K), np.float32), shared_gate=np.zeros((L, 0), np.float32),
            group_sizes=np.zeros((L, E), np.int64), padded_group_sizes=np.zeros((L, E), np.int64),
            layer_is_moe=np.ones(L, bool), timings_ns=np.zeros((L, len(STAGES)), np.uint64),
            group_pad=cfg.group_pad, norm_topk_prob=cfg.norm_topk_prob,
            architecture=cfg.family, model_name=cfg.name,
        )  # fmt: skip
        return self.trace

    def _array(self, name: str) -> np.ndarray:
        data, dt, nd = ctypes.c_void_p(), ctypes.c_int32(), ctypes.c_int32()
        shape = (ctypes.c_int64 * 4)()
        st = lib.colibri_trace_array(self._handle, name.encode(), ctypes.byref(data), ctypes.byref(dt),
                                     ctypes.byref(nd), shape)  # fmt: skip
        if st != _native.OK:
            raise _native.ColibriInternalError(f"the engine has no trace array {name!r}")
        return _c_array(data.value, dt.value, nd.value, shape)

    def _int(self, name: str) -> int:
        v = ctypes.c_int64()
        lib.colibri_trace_get_int(self._handle, name.encode(), ctypes.byref(v))
        return int(v.value)

    def __exit__(self, *exc) -> None:
        eng, h = self._engine, self._handle
        if h is None:
            return
        try:
            if not eng.closed:
                lib.colibri_trace_attach(eng._c(), None)
            self._fill()
        finally:
            lib.colibri_trace_free(h)
            self._handle = None

    def _fill(self) -> None:
        n = self._int("tokens")
        tr = self.trace
        a = self._array
        tr.token_ids = a("token_ids")[:n].copy()
        tr.seq_ids = a("seq_ids")[:n].copy()
        tr.positions = a("positions")[:n].copy()
        tr.router_probs = a("router_probs")[:, :n].copy()
        tr.topk_ids = a("topk_ids")[:, :n].copy()
        tr.topk_weights = a("topk_weights")[:, :n].copy()
        tr.predicted_ids = a("predicted_ids")[:, :n].copy()
        cs = a("cache_stats").copy()
        (tr.cache_hits, tr.cache_misses, tr.cache_prefetches, tr.cache_prefetch_hits,
         tr.cache_wasted_prefetches) = (cs[:, i].copy() for i in range(5))  # fmt: skip
        tr.shared_gate = a("shared_gate")[:, :n].copy()
        tr.routing_margins = a("routing_margins")[:, :n].copy()
        tr.group_sizes = a("group_sizes").copy()
        tr.padded_group_sizes = a("padded_group_sizes").copy()
        tr.timings_ns = a("layer_ns").copy()
        stage_ns = a("stage_ns")
        tr.embedding_ns = int(stage_ns[0])
        tr.lm_head_ns = int(stage_ns[len(ALL_STAGES) - 1])
        tr.n_forwards = self._int("forwards")
        tr.dropped = self._int("dropped")
        tr.prefix_cached = self._int("prefix_cached")
        tr.layer_is_moe = self._engine._layer_is_moe()
        eng = self._engine
        if not eng.closed and eng._has_tokenizer():
            tok = eng.tokenizer
            tr.token_texts = [tok.piece(int(i)) for i in tr.token_ids]
        else:
            tr.token_texts = [str(int(i)) for i in tr.token_ids]


class Sequence:
    """One sequence of an :class:`Engine` (``eng.sequence(i)``): its positions in the
    shared paged KV cache, and the calls that grow, cut, copy and free it. The handle is a
    view: two handles on one id are the same sequence."""

    def __init__(self, engine: Engine, seq: int):
        self._engine, self.id = engine, int(seq)

    def __len__(self) -> int:
        return int(lib.colibri_seq_len(self._engine._c(), self.id))

    def append(self, token_ids, *, logits: str = "last"):
        """Run ``token_ids`` at the end of this sequence alone; logits as in :meth:`Engine.batch`."""
        return self._engine.batch([(self.id, token_ids)], logits=logits)[0]

    def clear(self) -> None:
        """Forget every position; the blocks go back to the cache."""
        ctx = self._engine._c()
        check(lib.colibri_seq_clear(ctx, self.id), ctx=ctx)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions."""
        ctx = self._engine._c()
        check(lib.colibri_seq_truncate(ctx, self.id, int(n)), ctx=ctx)

    def reuse_prefix(self, token_ids) -> int:
        """Continue this sequence with the prefix cache's blocks that hold ``token_ids`` after
        its end (whole blocks, never the last id); returns how many of the ids it now holds.
        Run the rest next, e.g. ``n = s.reuse_prefix(ids); s.append(ids[n:])``: the logits
        are bitwise those of ``s.append(ids)``. 0 with the prefix cache off."""
        ctx = self._engine._c()
        ids = _as_ids(token_ids)
        out = ctypes.c_int64(0)
        check(lib.colibri_seq_reuse_prefix(ctx, self.id, _i32_ptr(ids), len(ids), ctypes.byref(out)), ctx=ctx)
        return int(out.value)

    def fork(self, dst: int) -> "Sequence":
        """Make sequence ``dst`` a copy of this one that shares its blocks (copy-on-write)."""
        ctx = self._engine._c()
        check(lib.colibri_seq_fork(ctx, self.id, int(dst)), ctx=ctx)
        return Sequence(self._engine, int(dst))

    def __repr__(self) -> str:
        return f"Sequence({self.id}, len={len(self)})"


class StageRun:
    """One forward of at most ``max_batch`` tokens, run one stage at a time.

    Stages run in order: ``embedding()``, then for each layer ``attention()``,
    ``router()``, ``grouping()``, ``expert_ffn()``, ``combine()``, and last ``lm_head()``,
    which returns the logits. Each call returns that stage's intermediate tensors as a dict
    of numpy arrays that are **zero-copy views of the engine's arena**: valid (and
    writable, to try an intervention) until the next stage or forward; ``.copy()`` what
    you keep. Running every stage gives exactly the fused forward's logits, and the KV
    cache then holds the tokens (``cached_len`` = start_pos + n), so decoding can go on.
    A stage run's blocks are never offered to the prefix cache (its tensors may have been
    edited), so a later prompt never reuses what an edited run computed.

        run = eng.stages(ids)
        run.embedding()
        run.run_to(layer=2)             # layers 0 and 1 as usual
        out = run.attention(); r = run.router()
        r["topk_ids"]                   # [tokens, k] of layer 2
        logits = run.finish()
    """

    _OUTPUTS = {
        "embedding": ("x",),
        "attention": ("q", "k", "v", "att", "x", "xn"),
        "router": ("router_logits", "router_probs", "topk_ids", "topk_weights"),
        "grouping": ("expert_count", "expert_offset", "row_token", "row_weight", "ex_in"),
        "expert_ffn": ("ex_h", "ex_out"),
        "combine": ("delta", "x"),
    }

    def __init__(self, engine: Engine, token_ids, start_pos: int = 0):
        self._engine = engine
        ctx = engine._c()
        ids = _as_ids(token_ids)
        check(lib.colibri_stage_begin(ctx, _i32_ptr(ids), len(ids), int(start_pos)), ctx=ctx)
        self.n_tokens = len(ids)
        self.start_pos = int(start_pos)
        self.logits: np.ndarray | None = None
        self._moe = engine._layer_is_moe()
        self._shared = self._has("shared_out")
        self._shared_gate = self._has("shared_gate")
        self._sinks = self._has("sink_share")   # attention sinks (gpt-oss)

    def _has(self, name: str) -> bool:
        try:
            return self.tensor(name).size > 0
        except _native.ColibriError:
            return False

    # -- where we are
    def _next(self) -> tuple[int, int]:
        st, ly = ctypes.c_int32(), ctypes.c_int32()
        lib.colibri_stage_next(self._engine._c(), ctypes.byref(st), ctypes.byref(ly))
        return st.value, ly.value

    @property
    def next_stage(self) -> str | None:
        """The stage that runs next (a name of :data:`ALL_STAGES`), None when done."""
        st, _ = self._next()
        return ALL_STAGES[st] if st >= 0 else None

    @property
    def layer(self) -> int:
        """The layer of the next stage (-1 for embedding / LM head / done)."""
        return self._next()[1]

    @property
    def done(self) -> bool:
        return self._next()[0] < 0

    def tensor(self, name: str, device: bool = False):
        """An intermediate tensor by name (colibri.h, ``colibri_stage_tensor``), zero-copy.

        ``device=False``: a numpy view of the host copy (every backend keeps one while a stage
        run is active). ``device=True``: a ``cupy.ndarray`` over the backend's own device
        memory (``colibri_stage_tensor_device``), no copy, valid until the next stage or
        forward; the CPU backend has none and raises :class:`ColibriUnsupportedError`. Needs
        CuPy (``pip install colibri-lab[gpu]``).
        """
        ctx = self._engine._c()
        data, dt, nd = ctypes.c_void_p(), ctypes.c_int32(), ctypes.c_int32()
        shape = (ctypes.c_int64 * 4)()
        check(lib.colibri_stage_tensor(ctx, name.encode(), ctypes.byref(data), ctypes.byref(dt),
                                       ctypes.byref(nd), shape), ctx=ctx)  # fmt: skip
        if not device:
            return _c_array(data.value, dt.value, nd.value, shape)
        dptr = ctypes.c_void_p()
        check(lib.colibri_stage_tensor_device(ctx, name.encode(), ctypes.byref(dptr)), ctx=ctx)
        return _device_array(dptr.value, dt.value, nd.value, shape, owner=self)

    # -- running
    def run(self, stage: str | None = None) -> dict[str, np.ndarray]:
        """Run the next stage (``stage``, if given, must name it) and return its outputs."""
        st, layer = self._next()
        if st < 0:
            raise _native.ColibriInvalidArgError("this stage run is finished (or was abandoned by a forward)")
        name = ALL_STAGES[st]
        if stage is not None and stage != name:
            where = f" of layer {layer}" if layer >= 0 else ""
            raise _native.ColibriInvalidArgError(f"stage {stage!r} was asked but {name!r}{where} runs next; "
                                                 "stages run in order")  # fmt: skip
        ctx = self._engine._c()
        if name == "lm_head":
            logits = np.empty((self.n_tokens, self._engine.vocab_size), dtype=np.float32)
            check(lib.colibri_stage_run(ctx, st, logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float))),
                  ctx=ctx)  # fmt: skip
            self.logits = logits
            return {"logits": logits}
        check(lib.colibri_stage_run(ctx, st, None), ctx=ctx)
        moe = bool(self._moe[layer]) if layer >= 0 else True
        if name in ("router", "grouping") and not moe:
            return {}
        if name == "expert_ffn" and not moe:
            return {"delta": self.tensor("delta"), "ffn_h": self.tensor("ffn_h")}
        out = {k: self.tensor(k) for k in self._OUTPUTS[name]}
        if name == "attention" and self._sinks:   # each head's sink share of its softmax
            out["sink_share"] = self.tensor("sink_share")
        if name == "expert_ffn" and self._shared:
            out["shared_out"] = self.tensor("shared_out")
            if self._shared_gate:
                out["shared_gate"] = self.tensor("shared_gate")
        return out

    def embedding(self) -> dict[str, np.ndarray]:
        return self.run("embedding")

    def attention(self) -> dict[str, np.ndarray]:
        return self.run("attention")

    def router(self) -> dict[str, np.ndarray]:
        return self.run("router")

    def grouping(self) -> dict[str, np.ndarray]:
        return self.run("grouping")

    def expert_ffn(self) -> dict[str, np.ndarray]:
        return self.run("expert_ffn")

    def combine(self) -> dict[str, np.ndarray]:
        return self.run("combine")

    def lm_head(self) -> np.ndarray:
        return self.run("lm_head")["logits"]

    def run_layer(self) -> dict[str, np.ndarray]:
        """Run what is left of the current layer; returns the last stage's outputs."""
        layer, out = self.layer, {}
        if layer < 0:
            raise _native.ColibriInvalidArgError(f"the next stage is {self.next_stage!r}, not a layer's")
        while self.layer == layer and self.next_stage is not None:
            out = self.run()
        return out

    def run_to(self, layer: int) -> None:
        """Run stages until the next one is ``attention`` of ``layer`` (``n_layers``: the LM head)."""
        n = self._engine.config.n_layers
        if not 0 <= layer <= n:
            raise _native.ColibriInvalidArgError(f"layer {layer} is not in [0, {n}]")
        while True:
            st, ly = self._next()
            if st < 0:
                raise _native.ColibriInvalidArgError(f"the run finished before reaching layer {layer}")
            if (layer == n and ALL_STAGES[st] == "lm_head") or (ly == layer and ALL_STAGES[st] == "attention"):
                return
            if ly > layer >= 0 and layer < n:
                raise _native.ColibriInvalidArgError(f"layer {layer} has already run (now at layer {ly})")
            self.run()

    def finish(self) -> np.ndarray:
        """Run every remaining stage; the logits ``[n_tokens, vocab_size]``."""
        while not self.done:
            self.run()
        return self.logits
