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

Nothing a request carries can raise out of ``prefill`` / ``generate``, leak cache or touch another request's rows:
every field is validated before admission (``validate.py``); a prefix handle is looked up in this engine's own table
by (engine id, handle id), ids are never reused, so a released, foreign or forged handle is an error for its request
alone; a request that fails inside admission, growth, fork or a step is failed alone, and its slot and pages go
back. A failed step's sequences drop their cache (the step may have written part of it) and are recomputed, each
alone in its steps until it finishes: the culprit then fails by itself. Sticky on purpose: letting a sequence rejoin
batches after one good solo step would loop forever on a request whose later chunk fails.

(Over 350 lines: scheduling, preemption and the per-request failure paths share the engine's state; request field
checks already live in validate.py, text prompts in text.py, the pool in cache.py.)
"""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from minidi.model.model import Transformer

from . import validate
from .batch import StepItem, build_step
from .cache import CacheFull, CacheManager, SeqCache
from .compile import compile as minidi_compile
from .compile import dynamic_shape_config
from .text import encode_prompts


@dataclass(frozen=True)
class PrefixHandle:
    """A cached, pinned prefix; requests that name it continue it without recomputing or copying it.

    Only ``(engine_id, handle_id)`` is trusted: the engine keeps the prefix's tokens and cache itself and looks the
    handle up by them. ``handle_id`` counts up per engine and is never reused (a generation counter), so a handle
    released earlier cannot alias a newer prefix that took over its slot and pages."""

    tokens: tuple[int, ...]
    seq: SeqCache = field(repr=False, compare=False)  # the engine's own record; read-only for callers
    engine_id: str = ""
    handle_id: int = -1


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

    def __repr__(self) -> str:
        """One line: id, error, tokens, the logits' shape and dtype (not their values)."""
        lg = None if self.logits is None else f"{list(self.logits.shape)} {str(self.logits.dtype)[6:]}"
        toks = self.tokens
        if len(toks) > 16:
            toks = f"[{', '.join(map(str, toks[:16]))}, ...] ({len(toks)} tokens)"
        return (f"Result(request_id={self.request_id!r}, error={self.error!r}, tokens={toks}, logits={lg}, "
                f"preemptions={self.preemptions})")


@dataclass
class _Seq:
    req: Request
    result: Result
    tokens: list[int]  # prefix + prompt + generated so far
    start: int  # position where the request's own tokens begin (= prefix length)
    cache: SeqCache = field(default_factory=SeqCache)
    logits: list[torch.Tensor] = field(default_factory=list)
    order: int = 0
    solo: bool = False  # was in a step that raised: runs alone until it completes or fails by itself


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
        faithful_rounding: bool | str = True,
        compile_cache: str | None = None,
        debug: bool = False,
    ) -> None:
        """``debug``: check the cache pool's invariants (no duplicate free ids, refcounts match) after every change.
        ``compile_cache``: a folder of compiled artifacts for warm starts (``minidi.compile``'s option, with
        ``compile=True``: loaded when an entry for this model and these settings exists, else written after the
        first step; ``runtime/compile_cache.py``)."""
        self.model, self.cfg = model, model.cfg
        self.tokenizer = getattr(model, "tokenizer", None)  # runtime.tokenizer.TextTokenizer (load_model sets it)
        self.device = model.embed.weight.device
        self.max_batch_tokens = max_batch_tokens
        self.cache = CacheManager(self.cfg, max_slots=max_seqs, max_tokens=cache_tokens, page_size=page_size,
                                  device=self.device, debug=debug)
        self.engine_id = uuid.uuid4().hex  # whose handles these are
        self._prefixes: dict[int, PrefixHandle] = {}  # live handles by handle_id
        self._next_handle_id = 0  # ids below it were issued; never reused
        self.step_fn: Callable = model.step
        self.pass_manager = None
        if not compile:  # eager: bounded temporaries at long contexts (the model's chains are built in pieces)
            model.set_eager_budget()
        if compile:  # minidi.compile: torch.compile(fullgraph, dynamic) with the passes (minidi/passes) installed;
            # faithful_rounding: compiled graphs round where eager does (runtime/compile.py), so tokens match eager
            kwargs = {"fullgraph": True, "dynamic": True, "faithful_rounding": faithful_rounding,
                      "compile_cache": compile_cache, **(compile_kwargs or {})}
            self.step_fn = minidi_compile(model, passes, **kwargs)
            self.pass_manager = self.step_fn.pass_manager
        self.compiled = compile
        self._ids = itertools.count()
        self.steps = 0

    # ---- validation ------------------------------------------------------------------------------------------------
    def _check(self, req: Any, min_new_tokens: int = 0) -> tuple[Request | None, str | None]:
        """The request with every field normalised (tokens a list of ints, the prefix this engine's own live
        handle), or the problem in words. Nothing here raises: any field may hold anything."""
        if not isinstance(req, Request):
            return None, f"expected a Request, got {type(req).__name__}"
        prefix, err = self._lookup_prefix(req.prefix)
        if err:
            return None, err
        toks, err = validate.token_list(req.tokens, self.cfg.vocab_size, self.cfg.max_position_embeddings)
        if err:
            return None, err
        new, err = validate.max_new_tokens(req.max_new_tokens, min_new_tokens)
        if err:
            return None, err
        all_logits, err = validate.flag("all_logits", req.all_logits)
        if err:
            return None, err
        total = (len(prefix.tokens) if prefix else 0) + len(toks) + new
        if total > self.cfg.max_position_embeddings:
            return None, (f"length {total} (prefix + prompt + max_new_tokens) exceeds max_position_embeddings "
                          f"{self.cfg.max_position_embeddings}")
        if total > self.cache.max_tokens:
            return None, f"length {total} exceeds the cache budget of {self.cache.max_tokens} tokens"
        return dataclasses.replace(req, tokens=toks, prefix=prefix, max_new_tokens=new, all_logits=all_logits), None

    def _lookup_prefix(self, handle: Any) -> tuple[PrefixHandle | None, str | None]:
        """This engine's record of ``handle``, or why it is not one: the record, never the caller's copy, is used."""
        if handle is None:
            return None, None
        if not isinstance(handle, PrefixHandle):
            return None, f"prefix must be a PrefixHandle from Engine.cache_prefix, got {type(handle).__name__}"
        if handle.engine_id != self.engine_id:
            return None, "prefix handle belongs to another engine (its cache rows are not in this engine's pool)"
        hid = handle.handle_id
        if not isinstance(hid, int) or isinstance(hid, bool) or not 0 <= hid < self._next_handle_id:
            return None, f"prefix handle id {hid!r} was never issued by this engine"
        live = self._prefixes.get(hid)
        if live is None:
            return None, f"prefix handle {hid} was released (release_prefix); cache it again"
        if handle is not live and tuple(handle.tokens) != live.tokens:
            return None, f"prefix handle {hid} was altered: its tokens differ from the cached prefix's"
        return live, None

    # ---- public API ----------------------------------------------------------------------------------------------
    def cache_prefix(self, tokens: list[int] | torch.Tensor) -> PrefixHandle:
        """Prefill ``tokens`` once and keep the cache pinned until ``release_prefix``.

        Raises ``ValueError`` for bad tokens and ``RuntimeError`` if the prefill failed; either way nothing stays
        allocated."""
        req, err = self._check(Request(tokens))
        if err:
            raise ValueError(f"prefix: {err}")
        seq = self._new_seq(req)
        self._guarded_run([seq], keep=True)
        if seq.result.error:
            self.cache.release(seq.cache)
            raise RuntimeError(f"prefix: {seq.result.error}")
        hid = self._next_handle_id
        self._next_handle_id += 1
        handle = PrefixHandle(tokens=tuple(seq.tokens), seq=seq.cache, engine_id=self.engine_id, handle_id=hid)
        self._prefixes[hid] = handle
        return handle

    def release_prefix(self, handle: PrefixHandle) -> None:
        """Unpin a cached prefix (requests already running on it keep their shared pages by refcount).

        Raises ``ValueError`` naming the problem, changing nothing, for a handle released before, of another
        engine, or not a handle at all."""
        live, err = self._lookup_prefix(handle)
        if err or live is None:
            raise ValueError(f"release_prefix: {err or 'no handle given'}")
        del self._prefixes[live.handle_id]
        self.cache.release(live.seq)

    def live_caches(self) -> list[SeqCache]:
        """The caches this engine holds between calls (its pinned prefixes), for ``cache.check(held=...)``."""
        return [h.seq for h in self._prefixes.values()]

    def prefill(self, requests: list[Request]) -> list[Result]:
        """Prefill every request (a batch of different lengths, possibly continuing cached prefixes) and return
        the logits of its last position (or all of its positions), plus generated tokens when asked."""
        return self._prefill(requests, min_new_tokens=0)

    def generate(self, prompts: list[list[int] | str], max_new_tokens: int, prefix: PrefixHandle | None = None,
                 stop_at_eos: bool | None = None) -> list[Result]:
        """Greedy generation (decoding as one-token steps) for several prompts at once; ``max_new_tokens >= 1``
        (else every prompt's result carries the error).

        A prompt is token ids or a ``str``: text is encoded by the model's tokenizer (BOS first unless it continues
        ``prefix``) and results carry ``.text``, the generated tokens decoded without special tokens. Generation
        stops after EOS when ``stop_at_eos`` (default: for text prompts only; id prompts keep their exact count).
        """
        if isinstance(prompts, (str, bytes, Request)) or not isinstance(prompts, (list, tuple)):
            raise TypeError(f"generate takes a list of prompts, got {type(prompts).__name__}")
        reqs = [Request(ids, prefix=prefix, max_new_tokens=max_new_tokens, stop_tokens=eos)
                for ids, eos in encode_prompts(self.tokenizer, prompts, prefix is not None, stop_at_eos)]
        return self._with_text(self._prefill(reqs, min_new_tokens=1))

    def _with_text(self, results: list[Result]) -> list[Result]:
        if self.tokenizer is not None:
            for r in results:
                if r.error is None:
                    r.text = self.tokenizer.decode(r.tokens)
        return results

    def _prefill(self, requests: list[Request], min_new_tokens: int) -> list[Result]:
        if isinstance(requests, Request) or not isinstance(requests, (list, tuple)):
            # the one programming error that cannot be a per-request result: there is no list to put it in
            raise TypeError(f"prefill takes a list of Request, got {type(requests).__name__}")
        seqs, out = [], []
        for req in requests:
            checked, err = self._check(req, min_new_tokens)
            if err or checked is None:
                rid = getattr(req, "request_id", None) if isinstance(req, Request) else None
                result = Result(request_id=rid if rid is not None else next(self._ids))
                result.error = f"request {result.request_id}: {err}"
                out.append(result)
                continue
            seq = self._new_seq(checked)
            seqs.append(seq)
            out.append(seq.result)
        self._guarded_run(seqs, keep=False)
        return out

    def _guarded_run(self, seqs: list[_Seq], keep: bool) -> None:
        """``_run``, and if anything escapes it (a bug: failures are handled per request inside), fail the
        unfinished requests and hand their cache back rather than lose the batch or leak."""
        try:
            self._run(seqs, keep)
        except Exception as e:  # noqa: BLE001 - the engine's last line: the caller gets results, never a traceback
            for seq in seqs:
                if seq.result.logits is None and seq.result.error is None:
                    seq.result.error = f"request {seq.result.request_id}: internal error: {type(e).__name__}: {e}"
                if seq.result.error is not None or not keep:
                    self._release_quietly(seq)

    # ---- scheduling --------------------------------------------------------------------------------------------
    def _new_seq(self, req: Request) -> _Seq:
        """``req`` has passed ``_check`` (tokens a list of ints, prefix this engine's live record)."""
        toks = list(req.tokens)
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

    def _release_quietly(self, seq: _Seq) -> None:
        try:
            self.cache.release(seq.cache)
        except Exception:  # noqa: BLE001 - already failing this request; the pool check in debug mode catches it
            pass
        seq.cache = SeqCache()

    def _fail(self, seq: _Seq, active: list[_Seq], why: str) -> None:
        """Fail one request alone: its error names it, its slot and pages go back, its batch-mates go on."""
        seq.result.error = f"request {seq.result.request_id}: {why}"
        seq.logits.clear()
        self._release_quietly(seq)
        if seq in active:
            active.remove(seq)

    def _reserve(self, seq: _Seq, n: int, active: list[_Seq]) -> bool:
        """Reserve the cache for ``n`` more positions of ``seq``; False: no room now (or it failed alone)."""
        if not self.cache.can_grow(seq.cache, seq.cache.length + n):
            return False
        try:
            self.cache.grow(seq.cache, seq.cache.length + n)
        except Exception as e:  # noqa: BLE001 - grow changes nothing when it raises
            self._fail(seq, active, f"cache reservation failed: {type(e).__name__}: {e}")
            return False
        return True

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
                if chosen and (seq.solo or chosen[0].solo):
                    continue  # suspected of failing a step: runs alone
                if seq.cache.slot < 0 and seq.req.prefix is not None:
                    try:
                        self._admit(seq)
                    except CacheFull:
                        continue
                    except Exception as e:  # noqa: BLE001 - fork changes nothing when it raises
                        self._fail(seq, active, f"admission failed: {type(e).__name__}: {e}")
                        continue
                n = min(len(seq.tokens) - seq.cache.length, budget)
                while not self.cache.can_grow(seq.cache, seq.cache.length + n):
                    victims = [s for s in active if s not in chosen and s is not seq and s.cache.slot >= 0]
                    if not victims:
                        break
                    self._preempt(max(victims, key=lambda s: s.order))
                if not self._reserve(seq, n, active):
                    continue
                p0 = seq.cache.length
                hist = seq.tokens[max(0, p0 - (self.cfg.engram_max_ngram - 1)):p0]  # Engram K-gram: K - 1 before p0
                items.append(StepItem(seq.cache, seq.tokens[p0:p0 + n], hist, all_logits=seq.req.all_logits))
                chosen.append(seq)
                budget -= n
            if not items:
                for seq in list(active):  # nothing fits even alone: fail them rather than loop forever
                    self._fail(seq, active, "does not fit the cache")
                break
            try:
                logits = self._step(items)
            except Exception as e:  # noqa: BLE001 - isolate the request that makes the step fail
                # The step may have written part of its rows (ring, pending, pages) into these sequences' cache:
                # drop it (recomputed from the tokens); alone, the sequence is the culprit and fails by itself.
                for seq in chosen:
                    if len(chosen) == 1:
                        self._fail(seq, active, f"step failed: {type(e).__name__}: {e}")
                    else:
                        self._release_quietly(seq)
                        seq.logits.clear()
                        seq.solo = True
                continue
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

