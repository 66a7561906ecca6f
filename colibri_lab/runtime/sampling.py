"""The engine's per-sequence sampler and its grammars (``colibri_sampler``, ``colibri_grammar``).

:class:`Sampler` holds one sequence's sampling state: logit bias, repetition / presence /
frequency penalties, min-p, stop ids, ``ignore_eos`` and a :class:`Grammar` mask, applied in
the library in the order colibri.h documents, then temperature, top-k, top-p and min-p.
:class:`Grammar` compiles a JSON schema (or "any JSON object") for a tokenizer; a sampler
with it attached only produces text that parses and validates against the schema.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Mapping, Sequence

import numpy as np

from . import _native
from ._native import check, lib

FINISH_NONE, FINISH_EOS, FINISH_STOP_ID, FINISH_GRAMMAR = 0, 1, 2, 3


def schema_text(json_schema) -> str | None:
    """The schema as text for ``colibri_grammar_compile``: ``True`` (or ``None``) is any
    JSON object (None), a dict is serialised, a string is taken as JSON text."""
    if json_schema is True or json_schema is None:
        return None
    if isinstance(json_schema, Mapping):
        return json.dumps(json_schema)
    if isinstance(json_schema, str):
        return json_schema
    raise TypeError("json_schema must be a dict, a JSON string or True (any JSON object)")


class Grammar:
    """A grammar compiled for ``tokenizer``: ``prefix`` (literal text), one JSON value that
    satisfies ``json_schema`` (dict, JSON text, or True / None for any object), then
    ``suffix``. Unsupported schema keywords raise ColibriUnsupportedError naming them."""

    def __init__(self, tokenizer, json_schema=True, *, prefix: str = "", suffix: str = ""):
        self._tokenizer = tokenizer  # keeps the tokenizer (and its engine) alive
        text = schema_text(json_schema)
        handle = _native.grammar_p()
        err = ctypes.create_string_buffer(1024)
        status = lib.colibri_grammar_compile(
            tokenizer._h(),
            None if text is None else text.encode(),
            prefix.encode(),
            suffix.encode(),
            ctypes.byref(handle),
            err,
            len(err),
        )
        check(status, err=err)
        self._handle = handle

    def close(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            lib.colibri_grammar_free(handle)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Sampler:
    """The sampling state of one sequence (see the module docstring). ``logit_bias`` maps
    token ids to additive biases; ``stop_ids`` end the sequence; ``end_ids`` end it as EOS does
    (a model's other end tokens: :attr:`Engine.end_ids`; ``ignore_eos`` applies to them too);
    ``grammar`` constrains it."""

    def __init__(
        self,
        n_vocab: int,
        eos_id: int = -1,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        repetition_last_n: int = 0,
        ignore_eos: bool = False,
        logit_bias: Mapping[int, float] | None = None,
        stop_ids: Sequence[int] = (),
        grammar: Grammar | None = None,
        end_ids: Sequence[int] = (),
    ):
        p = _native.ColibriSamplingParams()
        lib.colibri_sampling_params_init(ctypes.byref(p))
        p.temperature = float(temperature)
        p.top_k = int(top_k)
        p.top_p = float(top_p)
        p.min_p = float(min_p)
        p.presence_penalty = float(presence_penalty)
        p.frequency_penalty = float(frequency_penalty)
        p.repetition_penalty = float(repetition_penalty)
        p.repetition_last_n = int(repetition_last_n)
        p.ignore_eos = 1 if ignore_eos else 0
        handle = _native.sampler_p()
        err = ctypes.create_string_buffer(1024)
        check(lib.colibri_sampler_create(int(n_vocab), int(eos_id), ctypes.byref(p), ctypes.byref(handle), err,
                                         len(err)), err=err)  # fmt: skip
        self._handle = handle
        self.n_vocab = int(n_vocab)
        self._grammar = None
        try:
            if logit_bias:
                ids = np.array([int(k) for k in logit_bias], dtype=np.int32)
                vals = np.array([float(v) for v in logit_bias.values()], dtype=np.float32)
                self._check(lib.colibri_sampler_set_logit_bias(
                    handle, ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                    vals.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), len(ids)))  # fmt: skip
            if stop_ids:
                ids = np.array([int(k) for k in stop_ids], dtype=np.int32)
                self._check(lib.colibri_sampler_set_stop_ids(
                    handle, ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), len(ids)))  # fmt: skip
            if end_ids:
                ids = np.array([int(k) for k in end_ids], dtype=np.int32)
                self._check(lib.colibri_sampler_set_end_ids(
                    handle, ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), len(ids)))  # fmt: skip
            if grammar is not None:
                self._check(lib.colibri_sampler_set_grammar(handle, grammar._handle))
                self._grammar = grammar  # must outlive the sampler
        except Exception:
            self.close()
            raise

    def _check(self, status: int) -> None:
        if status != _native.OK:
            raise _native.error_for(status, lib.colibri_sampler_last_error(self._handle).decode(errors="replace"))

    def close(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            lib.colibri_sampler_free(handle)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def add_prompt(self, ids) -> None:
        arr = np.ascontiguousarray(np.asarray(list(ids), dtype=np.int32))
        self._check(lib.colibri_sampler_add_prompt(self._handle, arr.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                                   len(arr)))  # fmt: skip

    def accept(self, token_id: int) -> None:
        self._check(lib.colibri_sampler_accept(self._handle, int(token_id)))

    def sample(self, row, rng: ctypes.c_uint64) -> int:
        """Choose (and accept) the next id from one row of ``n_vocab`` logits."""
        row = np.ascontiguousarray(row, dtype=np.float32)
        if row.shape != (self.n_vocab,):
            raise _native.ColibriInvalidArgError(f"a logits row must have shape ({self.n_vocab},), got {row.shape}")
        out = ctypes.c_int32(0)
        self._check(lib.colibri_sampler_sample(self._handle, row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                               ctypes.byref(rng), ctypes.byref(out)))  # fmt: skip
        return int(out.value)

    @property
    def finished(self) -> int:
        """FINISH_* for the last accepted token."""
        return int(lib.colibri_sampler_finished(self._handle))

    @property
    def grammar_complete(self) -> bool:
        return bool(lib.colibri_sampler_grammar_complete(self._handle))

    def grammar_mask(self) -> np.ndarray:
        """The grammar's allowed tokens in the current state (bool [n_vocab])."""
        out = np.zeros(self.n_vocab, dtype=np.uint8)
        self._check(lib.colibri_sampler_grammar_mask(self._handle, out.ctypes.data_as(ctypes.c_void_p)))
        return out.astype(bool)
