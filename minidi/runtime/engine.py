"""The prefill engine: ragged batches of packed tokens, shared cached prefixes, chunked prefill, preemption,
greedy generation, one (optionally compiled) model step.

    engine = Engine(model, max_batch_tokens=4096, max_seqs=16, cache_tokens=1 << 20, compile=True)
    prefix = engine.cache_prefix(system_prompt_ids)              # prefilled once, shared without copying
    results = engine.prefill([Request(ids_a, prefix=prefix), Request(ids_b)])   # logits of each last position
    results = engine.generate([prompt_1, prompt_2], max_new_tokens=32)   # ids or text: "Hello" -> .text

Each step packs chunks of several sequences (no padding) up to ``max_batch_tokens``; all metadata is built on the
host before the step (``batch.build_step``). When the cache budget runs out, the most recently admitted sequence
that is not in the step is preempted: its cache is dropped and it is later recomputed from its tokens (exact, since
the cache holds only what a recomputation rebuilds). Bad requests get an error naming the request and the problem;
the others still complete.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from minidi.model.model import Transformer

from .batch import StepItem, build_step
from .cache import CacheFull, CacheManager, SeqCache


@dataclass
class PrefixHandle:
    """A cached, pinned prefix; requests that name it continue it without recomputing or copying it."""

    tokens: list[int]
    seq: SeqCache


@dataclass
class Request:
    tokens: list[int] | torch.Tensor
    prefix: PrefixHandle | None = None
    all_logits: bool = False  # return logits of every new position, not only the last
    max_new_tokens: int = 0  # > 0: greedy generation after the prompt
    request_id: Any = None
    stop_tokens: tuple[int, ...] = ()  # generation ends after one of these (EOS for text prompts)


@dataclass
class Result:
    request_id: Any
    logits: torch.Tensor | None = None  # [V] (last position) or [n, V] (all_logits), fp32, on the CPU
    tokens: list[int] = field(default_factory=list)  # generated tokens
    error: str | None = None
    preemptions: int = 0
    text: str | None = None  # the generated tokens decoded (text prompts, or ids when the model has a tokenizer)


@dataclass
class _Seq:
    req: Request
    result: Result
    tokens: list[int]  # prefix + prompt + generated so far
    start: int  # position where the request's own tokens begin (= prefix length)
    cache: SeqCache = field(default_factory=SeqCache)
    logits: list[torch.Tensor] = field(default_factory=list)
    order: int = 0


class Engine:
    def __init__(
        self,
        model: Transformer,
        *,
        max_batch_tokens: int = 4096,
        max_seqs: int = 16,
        cache_tokens: int = 1 << 16,
        page_size: int = 64,
        compile: bool = False,
        compile_kwargs: dict | None = None,
        passes: str | list[str] | None = "none",
    ) -> None:
        self.model, self.cfg = model, model.cfg
        self.tokenizer = getattr(model, "tokenizer", None)  # runtime.tokenizer.TextTokenizer (load_model sets it)
        self.device = model.embed.weight.device
        self.max_batch_tokens = max_batch_tokens
        self.cache = CacheManager(self.cfg, max_slots=max_seqs, max_tokens=cache_tokens, page_size=page_size,
                                  device=self.device)
        self.step_fn: Callable = model.step
        self.pass_manager = None
        if compile:  # minidi.compile: torch.compile(fullgraph, dynamic) with the passes (minidi/passes) installed
            from minidi.passes import compile as minidi_compile

            kwargs = {"fullgraph": True, "dynamic": True, **(compile_kwargs or {})}
            self.step_fn = minidi_compile(model, passes, **kwargs)
            self.pass_manager = self.step_fn.pass_manager
        self.compiled = compile
        self._ids = itertools.count()
        self.steps = 0

    # ---- validation ------------------------------------------------------------------------------------------------
    def _check(self, req: Request) -> str | None:
        toks = req.tokens.tolist() if isinstance(req.tokens, torch.Tensor) else list(req.tokens)
        if len(toks) == 0:
            return "empty prompt"
        for i, t in enumerate(toks):
            if not isinstance(t, int) or not 0 <= t < self.cfg.vocab_size:
                return f"token id {t!r} at position {i} is outside the vocabulary [0, {self.cfg.vocab_size})"
        total = (len(req.prefix.tokens) if req.prefix else 0) + len(toks) + req.max_new_tokens
        if total > self.cfg.max_position_embeddings:
            return (f"length {total} (prefix + prompt + max_new_tokens) exceeds max_position_embeddings "
                    f"{self.cfg.max_position_embeddings}")
        if total > self.cache.max_tokens:
            return f"length {total} exceeds the cache budget of {self.cache.max_tokens} tokens"
        return None

    # ---- public API ----------------------------------------------------------------------------------------------
    def cache_prefix(self, tokens: list[int] | torch.Tensor) -> PrefixHandle:
        """Prefill ``tokens`` once and keep the cache pinned until ``release_prefix``."""
        req = Request(tokens)
        err = self._check(req)
        if err:
            raise ValueError(f"prefix: {err}")
        seq = self._new_seq(req)
        self._run([seq], keep=True)
        if seq.result.error:
            raise RuntimeError(f"prefix: {seq.result.error}")
        return PrefixHandle(tokens=list(seq.tokens), seq=seq.cache)

    def release_prefix(self, handle: PrefixHandle) -> None:
        self.cache.release(handle.seq)

    def prefill(self, requests: list[Request]) -> list[Result]:
        """Prefill every request (a batch of different lengths, possibly continuing cached prefixes) and return
        the logits of its last position (or all of its positions), plus generated tokens when asked."""
        seqs, out = [], []
        for req in requests:
            seq = self._new_seq(req)
            err = self._check(req)
            if err:
                seq.result.error = f"request {seq.result.request_id}: {err}"
            else:
                seqs.append(seq)
            out.append(seq.result)
        self._run(seqs, keep=False)
        return out

    def generate(self, prompts: list[list[int] | str], max_new_tokens: int, prefix: PrefixHandle | None = None,
                 stop_at_eos: bool | None = None) -> list[Result]:
        """Greedy generation (decoding as one-token steps) for several prompts at once.

        A prompt is token ids or a ``str``: text is encoded by the model's tokenizer (BOS first unless it continues
        ``prefix``) and results carry ``.text``, the generated tokens decoded without special tokens. Generation
        stops after EOS when ``stop_at_eos`` (default: for text prompts only; id prompts keep their exact count).
        """
        from .text import text_requests

        reqs = text_requests(self.tokenizer, prompts, max_new_tokens, prefix, stop_at_eos)
        return self._with_text(self.prefill(reqs))

    def _with_text(self, results: list[Result]) -> list[Result]:
        if self.tokenizer is not None:
            for r in results:
                if r.error is None:
                    r.text = self.tokenizer.decode(r.tokens)
        return results

    # ---- scheduling --------------------------------------------------------------------------------------------
    def _new_seq(self, req: Request) -> _Seq:
        toks = req.tokens.tolist() if isinstance(req.tokens, torch.Tensor) else list(req.tokens)
        rid = req.request_id if req.request_id is not None else next(self._ids)
        pre = list(req.prefix.tokens) if req.prefix else []
        return _Seq(req=req, result=Result(request_id=rid), tokens=pre + toks, start=len(pre))

    def _admit(self, seq: _Seq) -> None:
        """Give the sequence its starting cache: a fork of its prefix, or nothing."""
        if seq.req.prefix is not None and seq.cache.slot < 0:
            seq.cache = self.cache.fork(seq.req.prefix.seq)

    def _preempt(self, seq: _Seq) -> None:
        self.cache.release(seq.cache)
        seq.cache = SeqCache()
        seq.logits.clear()
        seq.result.preemptions += 1

    def _done(self, seq: _Seq) -> bool:
        if seq.result.tokens and seq.result.tokens[-1] in seq.req.stop_tokens:
            return True  # stopped (EOS): the stop token itself is not prefilled
        return seq.cache.length == len(seq.tokens) and len(seq.result.tokens) >= seq.req.max_new_tokens

    def _run(self, seqs: list[_Seq], keep: bool) -> None:
        for i, s in enumerate(seqs):
            s.order = i
        active = list(seqs)
        while active:
            items, chosen, budget = [], [], self.max_batch_tokens
            for seq in sorted(active, key=lambda s: s.order):
                if budget == 0:
                    break
                if seq.cache.slot < 0 and seq.req.prefix is not None:
                    try:
                        self._admit(seq)
                    except CacheFull:
                        continue
                n = min(len(seq.tokens) - seq.cache.length, budget)
                while not self.cache.can_grow(seq.cache, seq.cache.length + n):
                    victims = [s for s in active if s not in chosen and s is not seq and s.cache.slot >= 0]
                    if not victims:
                        break
                    self._preempt(max(victims, key=lambda s: s.order))
                if not self.cache.can_grow(seq.cache, seq.cache.length + n):
                    continue
                self.cache.grow(seq.cache, seq.cache.length + n)
                p0 = seq.cache.length
                items.append(StepItem(seq.cache, seq.tokens[p0:p0 + n], seq.tokens[max(0, p0 - 3):p0],
                                      all_logits=seq.req.all_logits))
                chosen.append(seq)
                budget -= n
            if not items:
                for seq in active:  # nothing fits even alone: fail them rather than loop forever
                    seq.result.error = f"request {seq.result.request_id}: does not fit the cache"
                break
            logits = self._step(items)
            row = 0
            for seq, it in zip(chosen, items):
                n_rows = len(it.new_tokens) if it.all_logits else 1
                seq_logits = logits[row:row + n_rows]
                row += n_rows
                seq.cache.length += len(it.new_tokens)
                own_start = max(seq.start, seq.cache.length - len(it.new_tokens))
                if it.all_logits:  # keep only rows of the request's own prompt / generated tokens
                    seq.logits.append(seq_logits[own_start - (seq.cache.length - len(it.new_tokens)):])
                else:
                    seq.logits = [seq_logits]
                if seq.cache.length == len(seq.tokens):
                    if len(seq.result.tokens) < seq.req.max_new_tokens:
                        nxt = int(seq_logits[-1].argmax())
                        seq.tokens.append(nxt)
                        seq.result.tokens.append(nxt)
            for seq in [s for s in active if self._done(s)]:
                active.remove(seq)
                lg = torch.cat(seq.logits) if seq.req.all_logits else seq.logits[-1][-1]
                seq.result.logits = lg.cpu()
                if not keep:
                    self.cache.release(seq.cache)

    def _step(self, items: list[StepItem]) -> torch.Tensor:
        meta = build_step(self.cache, items)
        self.steps += 1
        with torch.no_grad(), dynamic_shape_config():
            return self.step_fn(meta, self.cache.tensors)


def dynamic_shape_config():
    """Shapes of one step vary in many dims (tokens, entries, view rows, pending rows...). Two symbolic-shape
    settings keep one compiled graph for all of them: no duck sizing (two dims that happen to be equal in the first
    batch must not be assumed equal) and size-oblivious reasoning for sizes 0 and 1 (which Dynamo would otherwise
    specialise, recompiling for every batch that has, say, one sequence or no pending rows). And Python floats stay
    constants (``specialize_float``): with ``dynamic=True`` Dynamo would otherwise trace the model's float constants
    (norm eps, the e2m1 grid) as symbolic inputs, then specialise them after the backend ran and trace the whole graph
    a second time (on the H200 this compiled every layer kind twice)."""
    import contextlib

    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config

    stack = contextlib.ExitStack()
    stack.enter_context(fx_config.patch(backed_size_oblivious=True, use_duck_shape=False))
    stack.enter_context(dynamo_config.patch(specialize_float=True))
    return stack
