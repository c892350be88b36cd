"""Continuous batching: several sequences decode in one llama.cpp batch per step.

Runs in a model worker, on one thread. Each step the pure scheduler
(appliance.serving.scheduler) decides which sequences join, which decode one token (first,
so running streams never stall) and which prompt chunks fill the rest of the ``n_batch``
budget; this module turns that plan into one ``llama_batch`` (a llama.cpp sequence id per
slot), decodes it, samples each sequence with its own sampler (and grammar), and frees a
sequence's KV cells when it ends. New requests join between steps.

A prompt prefix that several requests share (a common system prompt) is computed once: the
KV cache is unified, one extra llama.cpp sequence (the store, id ``n_slots``) keeps the
prefix, and each request that starts with it gets its cells by ``llama_memory_seq_cp`` at
admission (appliance.serving.prefix decides who builds, who waits and who reuses). Requests
that say they share their prompt (the ``n`` choices of one OpenAI request) go through the
same store, so the prompt is computed once for all of them.

With ``cache_prompt`` a slot keeps its cells when its sequence ends (as llama-server does):
chat clients send every earlier turn again with each new one, so the next turn's prompt
starts with the tokens a slot still holds. The scheduler gives it that slot; here the cells
after the common part are removed and prefill starts there. A sequence that failed or was
cancelled leaves cells nobody vouches for: its slot is cleared, as is a slot whose cells a
sliding window may drop (:meth:`BatchEngine._keepable`).

Logprobs, when a request asks for them, are read from the raw logits of each sampled
position before the next decode overwrites them; a request without them pays nothing.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import llama_cpp

from appliance.serving import devices, llama_log
from appliance.serving import prefix as px
from appliance.serving import scheduler as sched
from appliance.serving.catalog import verify
from appliance.serving.engine import (
    Emit,
    EngineOptions,
    Failed,
    Finished,
    GenerationRequest,
    Job,
    LlamaVocabulary,
    SlotChange,
    TextDelta,
    TokenLogprob,
    default_threads,
)
from appliance.serving.sampling import Sampler, logits_at, token_logprobs
from appliance.serving.text import TextAssembler
from shared.gguf import REPLICA_OVERHEAD_MIB, GGUFError, read_gguf, replica_mib

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable

    import numpy as np

    from appliance.state.records import ModelRecord

log = logging.getLogger(__name__)

KV_TYPES = {"q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}


def _nothing() -> None:
    pass


@dataclass
class _Sequence:
    request: GenerationRequest
    emit: Emit
    cancel: threading.Event
    started: float
    tokens: list[int]  # the prompt, then every sampled token
    assembler: TextAssembler
    sampler: Sampler | None = None
    admitted: float | None = None  # when it took a slot
    produced: int = 0
    ttft: float | None = None
    failed: bool = False  # a Failed event was sent; nothing more goes out
    cached: int = 0  # prompt tokens copied from the prefix store
    # Logprobs of tokens whose text the assembler still holds back: they go out with the
    # next delta that has text, or with the last one.
    pending: list[TokenLogprob] = field(default_factory=list)


class BatchEngine:
    """One model, ``n_slots`` sequences at a time. Blocking; owns its thread's llama.cpp state."""

    def __init__(self, record: ModelRecord, options: EngineOptions) -> None:
        self.record = record
        self.options = options
        self._gpu_layers = options.n_gpu_layers  # as loaded (_layers_that_fit)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.vocab: LlamaVocabulary | None = None
        self._model: Any = None
        self._ctx: Any = None
        self._batch: Any = None
        self._state = sched.SchedulerState(
            config=sched.SchedulerConfig(
                n_slots=options.n_slots,
                n_batch=options.n_batch,
                n_ctx_per_slot=options.n_ctx,
                reserved_slots=options.reserved_slots,
                preemption=options.preemption,
            )
        )
        self._seqs: dict[int, _Sequence] = {}
        self._parked: list[Job] = []  # waiting for the shared prefix they need to be built
        self._store = options.n_slots  # the llama.cpp sequence id that holds the prefix
        self._prefix = px.PrefixShare(min_tokens=0, max_tokens=0)  # set up by load()
        self._keep = False  # slots keep their cells when sequences end; set up by load()
        self._n_swa = 0
        self.events_out = 0
        # Counters for the worker's heartbeat: read from another thread, written by this one.
        self.prefix_tokens_reused = 0  # prompt tokens copied or kept instead of computed
        self.slot_tokens_reused = 0  # of those, kept in a slot from the sequence before
        self.tokens_generated = 0
        self.preemptions = 0
        # Each llama_decode call: its tokens, and its seconds with the sampling after it (the
        # heartbeat takes them: the batch sizes' metric, and the door's live speed).
        self.steps: deque[tuple[int, float]] = deque(maxlen=100_000)
        # For tests that compare two batch layouts: with keep_first_logits, the raw logits of
        # each sequence's first sampled position, by prompt, in the order they were sampled.
        # Off in service; then it costs one test per token.
        self.keep_first_logits = False
        self.first_logits: dict[tuple[int, ...], list[np.ndarray[Any, Any]]] = {}
        # Called on this thread after each turn of the loop (a step, or the jobs that came):
        # the worker writes the turn's events to its pipe then, in one write. Also called
        # when sequences take or leave slots, before the step's decode: on a slow host one
        # prefill may outlast a class's first-token objective, and the gateway sheds only a
        # request it does not know to be seated.
        self.flush_events: Callable[[], None] = _nothing

    def load(self) -> None:
        stamps = self.options.stamps_dir
        verify(self.record, Path(stamps) if stamps is not None else None)
        llama_log.route()  # its loader's 1,300 lines: the log's, at debug level
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        self._gpu_layers = self._layers_that_fit()
        mparams.n_gpu_layers = self._gpu_layers
        model = llama_cpp.llama_model_load_from_file(self.record.path.encode(), mparams)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {self.record.path}")
        o = self.options
        threads = o.n_threads or default_threads()
        # The store holds at most one slot's context, and on a sliding-window model less
        # than the window (appliance.serving.prefix says why).
        n_swa = int(llama_cpp.llama_model_n_swa(model))
        self._n_swa = n_swa
        # A recurrent state cannot be cut back to a common prefix: such models keep nothing.
        self._keep = o.cache_prompt and not (
            llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model)
        )
        store_max = min(o.n_ctx - 1, n_swa - 1) if n_swa > 0 else o.n_ctx - 1
        self._prefix = px.PrefixShare(min_tokens=o.prefix_min_tokens, max_tokens=store_max)
        cparams = llama_cpp.llama_context_default_params()
        # The store is there even when prefix_min_tokens is 0: siblings that share their
        # prompt (share_prompt) use it whatever the setting. Copying from the first sibling's
        # slot instead would need more and hold less: that slot may end or be preempted
        # before the others get theirs, while the store stays put as long as a reader waits;
        # and in a split KV cache a copy between sequences moves whole stream buffers. The
        # cost: the store's cells are reserved, and the cache is always unified (a copied
        # prefix shares its cells instead of filling a second stream; the store gets room of
        # its own so slots keep their full context).
        cparams.kv_unified = True
        cparams.n_ctx = o.n_ctx * o.n_slots + store_max
        cparams.n_batch = cparams.n_ubatch = o.n_batch
        cparams.n_seq_max = o.n_slots + 1
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if o.flash_attn
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        # Sliding-window layers need only their window: far less memory than full size. The
        # price: a kept slot whose sequence outgrew the window has lost its first cells
        # there, so only sequences shorter than the window are kept (_keepable).
        cparams.swa_full = False
        if o.kv_type != "f16":
            kind = KV_TYPES[o.kv_type]
            cparams.type_k = kind
            if o.flash_attn:  # llama.cpp quantises V only with flash attention
                cparams.type_v = kind
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            llama_cpp.llama_model_free(model)
            raise RuntimeError("llama.cpp could not create a context")
        self._model, self._ctx = model, ctx
        self.vocab = LlamaVocabulary.of_model(model, self.record)
        self._memory = llama_cpp.llama_get_memory(ctx)
        # Two sequence ids per token at most: a builder's slot and the store.
        self._batch = llama_cpp.llama_batch_init(o.n_batch, 0, 2)
        log.info(
            "loaded %s: %d slots x %d tokens, batch %d, %d threads, shared prefix %s",
            self.record.ref,
            o.n_slots,
            o.n_ctx,
            o.n_batch,
            threads,
            f"{o.prefix_min_tokens}..{store_max} tokens"
            if self._prefix.enabled
            else f"only for shared prompts (up to {store_max} tokens)",
        )

    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self.vocab is not None:  # the model's own: closed before the model is freed
            self.vocab.close()
            self.vocab = None
        if self._model is not None:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def layout(self) -> devices.DeviceLayout:
        """Where the model's layers run."""
        return devices.layout(self._gpu_layers, self.options.n_gpu_layers)

    def _layers_that_fit(self) -> int:
        """`model.n_gpu_layers`, or fewer where the first GPU's free memory holds fewer of
        the model's layers and their KV cache (devices.gpu_layers): loaded partly offloaded,
        and said so, not failed."""
        o = self.options
        if o.n_gpu_layers == 0 or not llama_cpp.llama_supports_gpu_offload():
            return o.n_gpu_layers
        gpus = [d for d in devices.devices() if d.kind in {"gpu", "igpu"}]
        try:
            info = read_gguf(Path(self.record.path))
        except (GGUFError, OSError):
            return o.n_gpu_layers
        if not gpus:
            return o.n_gpu_layers
        kv_type = o.kv_type if o.flash_attn else "f16"  # without it the V half stays f16
        need = replica_mib(
            info.kv_shape(), self.record.size_bytes, o.n_ctx, o.n_slots,
            n_batch=o.n_batch, kv_type=kv_type,
        ) - REPLICA_OVERHEAD_MIB  # fmt: skip
        free = gpus[0].memory_free_mib
        chosen = devices.gpu_layers(o.n_gpu_layers, info.block_count, need, free)
        if chosen != o.n_gpu_layers:
            log.warning(
                "model %s: %d of its %d layers on %s (%d MiB free; it needs about %.0f MiB "
                "in all), the rest on the CPU",
                self.record.ref, chosen, info.block_count, gpus[0].name, free, need,
            )  # fmt: skip
        return chosen

    @property
    def running(self) -> int:
        return len(self._seqs)

    @property
    def busy_slots(self) -> int:
        return len(self._state.running)

    # -- the loop ----------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Step until ``None`` arrives in ``jobs``; blocks while there is nothing to do."""
        try:
            while self._turn():
                self.flush_events()
        finally:
            self.flush_events()

    def _turn(self) -> bool:
        """Admit what arrived (waiting for it when idle), then one step; False at ``None``."""
        arrived: list[Job | None] = []
        if self._state.idle:
            arrived.append(self.jobs.get())
        with contextlib.suppress(queue.Empty):
            while True:
                arrived.append(self.jobs.get_nowait())
        for job in arrived:
            if job is None:
                self._cancel_all()
                return False
            self._admit(job)
        self._cancel_waiting()
        if self._state.idle and self._parked:  # pragma: no cover - a builder always ends
            self._unpark()
        if not self._state.idle:
            self._step()
        return True

    def _admit(self, job: Job) -> None:
        request = job.request
        seq_id = self._state.next_id  # the id submit() gives it
        where = self._prefix.place(
            seq_id,
            request.prompt_tokens,
            self._unstarted(),
            siblings=request.share_prompt,
            kept=sched.kept_prefix(self._state, request.prompt_tokens) if self._keep else 0,
        )
        if isinstance(where, px.Build):
            llama_cpp.llama_memory_seq_rm(self._memory, self._store, -1, -1)
        if isinstance(where, px.Park) or (
            isinstance(where, px.Build) and where.builder is not None
        ):
            self._parked.append(job)
            return
        cached = where.cached if isinstance(where, px.Reuse) else 0
        self._state, result = sched.submit(
            self._state,
            len(request.prompt_tokens),
            request.max_tokens,
            priority=request.priority,
            cached=cached,
            tokens=request.prompt_tokens if self._keep else (),
        )
        if isinstance(result, sched.Rejected):
            job.emit(Failed(ValueError(result.message)))
            self._prefix_ended(seq_id, rejected=True)
            return
        self._seqs[result.seq_id] = _Sequence(
            request=request,
            emit=job.emit,
            cancel=job.cancel,
            started=time.perf_counter(),
            tokens=list(request.prompt_tokens),
            assembler=TextAssembler(request.stop),
        )

    def _unstarted(self) -> set[int]:
        return {seq.seq_id for seq in self._state.waiting if seq.cached == 0}

    def _unpark(self) -> None:
        parked, self._parked = self._parked, []
        for job in parked:
            self._admit(job)

    def _prefix_ended(self, seq_id: int, *, rejected: bool = False) -> None:
        left = self._prefix.rejected(seq_id) if rejected else self._prefix.ended(seq_id)
        if left:  # the builder left before the prefix was complete
            llama_cpp.llama_memory_seq_rm(self._memory, self._store, -1, -1)
            self._unpark()

    def _cancel_waiting(self) -> None:
        for job in [job for job in self._parked if job.cancel.is_set()]:
            self._parked.remove(job)
            job.emit(
                Finished(
                    finish_reason="cancelled",
                    prompt_tokens=len(job.request.prompt_tokens),
                    completion_tokens=0,
                    ttft_s=None,
                    duration_s=0.0,
                    text="",
                )
            )
        for seq_id, seq in list(self._seqs.items()):
            state = self._state.get(seq_id)
            if seq.cancel.is_set() and state is not None and state.slot is None:
                self._state, ended = sched.cancel(self._state, seq_id)
                if ended is not None:
                    self._end(ended)

    def _step(self) -> None:
        # The builder's prefill writes the shared prefix into the store as well: it must
        # compute all of it, not start after what a kept slot holds.
        builder = self._prefix.builder
        plan = sched.plan_step(self._state, no_reuse=() if builder is None else (builder,))
        if self._enter(plan):
            self.flush_events()
        started = time.perf_counter()
        n, outputs = self._fill_batch(plan)
        finished: dict[int, Literal["stop", "cancelled"]] = {}
        code = llama_cpp.llama_decode(self._ctx, self._batch) if n else 0
        if code != 0:
            for entry in plan.entries:
                self._fail(self._seqs[entry.seq_id], RuntimeError(f"llama_decode failed ({code})"))
        else:
            for seq_id, index in outputs:
                if (reason := self._sample(self._seqs[seq_id], index)) is not None:
                    finished[seq_id] = reason
        self.steps.append((n, time.perf_counter() - started))
        # A sequence cancelled (or failed) while it runs ends with this step.
        for entry in plan.entries:
            if entry.seq_id not in finished and self._seqs[entry.seq_id].cancel.is_set():
                finished[entry.seq_id] = "cancelled"
        self._state, ended = sched.apply_step(self._state, plan, sched.StepOutcome(finished))
        self._prefix_after(plan, decoded=code == 0)
        for end in ended:
            self._end(end)

    def _enter(self, plan: sched.StepPlan) -> bool:
        """Before the batch: preempted sequences leave their slots, admitted ones take them
        (with a shared prefix copied in where they have one); whether any seat changed."""
        for preemption in plan.preempted:
            # It yields its slot; its tokens and sampler stay here for when it resumes.
            llama_cpp.llama_memory_seq_rm(self._memory, preemption.slot, -1, -1)
            self.preemptions += 1
            self._seqs[preemption.seq_id].emit(SlotChange(holds=False))
        for admission in plan.admitted:
            if self._keep:
                # Whatever the slot kept past the part this prompt shares goes; all of it
                # when nothing is reused.
                llama_cpp.llama_memory_seq_rm(self._memory, admission.slot, admission.reused, -1)
                self.prefix_tokens_reused += admission.reused
                self.slot_tokens_reused += admission.reused
            if admission.cached:
                llama_cpp.llama_memory_seq_cp(
                    self._memory, self._store, admission.slot, 0, admission.cached
                )
                self.prefix_tokens_reused += admission.cached
            self._prefix.admitted(admission.seq_id)
            seq = self._seqs[admission.seq_id]
            seq.cached += admission.cached + admission.reused
            seq.emit(SlotChange(holds=True))
            if seq.sampler is None:  # else a preempted sequence resumes, its sampler intact
                seq.admitted = time.perf_counter()
                self._start(seq)
        return bool(plan.preempted or plan.admitted)

    def _prefix_after(self, plan: sched.StepPlan, *, decoded: bool) -> None:
        """After the batch: a builder that completed the store releases the parked requests;
        one that was preempted stops building."""
        builder = self._prefix.builder
        if decoded and builder is not None:
            built = [e.start + e.count for e in plan.entries if e.seq_id == builder]
            if built and self._prefix.progress(builder, max(built)):
                self._unpark()
        for preemption in plan.preempted:
            if preemption.seq_id == self._prefix.builder:
                self._prefix_ended(preemption.seq_id)

    def _start(self, seq: _Sequence) -> None:
        vocab = self.vocab
        if vocab is None:  # pragma: no cover - load() sets it before serve_forever runs
            raise RuntimeError("the engine is not loaded")
        try:
            seq.sampler = Sampler(
                vocab.handle,
                vocab.n_vocab,
                seq.request.sampling,
                seq.request.grammar,
                n_ctx=self.options.n_ctx,
            )
        except Exception as err:  # noqa: BLE001 - reported to this request alone
            self._fail(seq, err)

    def _fill_batch(self, plan: sched.StepPlan) -> tuple[int, list[tuple[int, int]]]:
        """Write the plan into the llama_batch: its token count, and (seq_id, batch index)
        of each token whose logits are wanted."""
        batch = self._batch
        n = 0
        outputs: list[tuple[int, int]] = []
        # The builder's prompt tokens inside the shared prefix go into the store as well.
        building = len(self._prefix.target) if self._prefix.builder is not None else 0
        for entry in plan.entries:
            seq = self._seqs[entry.seq_id]
            shared = building if entry.seq_id == self._prefix.builder else 0
            for offset, position in enumerate(entry.positions):
                wants = entry.wants_logits and offset == entry.count - 1
                batch.token[n] = seq.tokens[entry.start + offset]
                batch.pos[n] = position
                batch.seq_id[n][0] = entry.slot
                if position < shared:
                    batch.n_seq_id[n] = 2
                    batch.seq_id[n][1] = self._store
                else:
                    batch.n_seq_id[n] = 1
                batch.logits[n] = 1 if wants else 0
                if wants:
                    outputs.append((entry.seq_id, n))
                n += 1
        batch.n_tokens = n
        return n, outputs

    def _fail(self, seq: _Sequence, err: BaseException) -> None:
        if not seq.failed:
            seq.failed = True
            seq.emit(Failed(err))
        seq.cancel.set()

    def _sample(self, seq: _Sequence, index: int) -> Literal["stop", "cancelled"] | None:
        vocab = self.vocab
        if vocab is None or seq.sampler is None or seq.failed:
            return "cancelled"
        if self.keep_first_logits and seq.ttft is None:
            kept = self.first_logits.setdefault(seq.request.prompt_tokens, [])
            kept.append(logits_at(self._ctx, index, vocab.n_vocab).copy())
        token = seq.sampler.sample(self._ctx, index)
        if seq.ttft is None:
            seq.ttft = time.perf_counter() - seq.started
        seq.tokens.append(token)
        self.tokens_generated += 1
        if vocab.is_eog(token):
            return "stop"
        seq.produced += 1
        if seq.request.logprobs is not None:  # the only cost here when none are asked for
            logprob, top = token_logprobs(
                logits_at(self._ctx, index, vocab.n_vocab), token, seq.request.logprobs
            )
            seq.pending.append(TokenLogprob(token, logprob, top))
        text = seq.assembler.feed(vocab.piece(token))
        if text:
            self.events_out += 1
            seq.emit(self._delta(seq, text))
        if seq.assembler.stopped:
            return "stop"
        if seq.cancel.is_set():
            return "cancelled"
        return None

    def _end(self, ended: sched.Ended) -> None:
        seq = self._seqs.pop(ended.seq_id)
        if ended.slot is not None:
            # Every token but the last sampled one went through llama_decode.
            held = tuple(seq.tokens[:-1])
            if ended.reason != "cancelled" and not seq.failed and self._keepable(ended.slot, held):
                self._state = sched.retain(self._state, ended.slot, held)
            else:
                llama_cpp.llama_memory_seq_rm(self._memory, ended.slot, -1, -1)
        self._prefix_ended(ended.seq_id)
        if seq.sampler is not None:
            seq.sampler.free()
        if seq.failed:
            return  # its error went out already
        rest = seq.assembler.flush()
        if rest or seq.pending:
            seq.emit(self._delta(seq, rest))
        self.events_out += 1
        seq.emit(
            Finished(
                finish_reason=ended.reason,
                prompt_tokens=len(seq.request.prompt_tokens),
                completion_tokens=seq.produced,
                ttft_s=seq.ttft,
                duration_s=time.perf_counter() - seq.started,
                text=seq.assembler.text,
                queue_s=None if seq.admitted is None else seq.admitted - seq.started,
                cached_tokens=seq.cached,
            )
        )

    def _keepable(self, slot: int, held: tuple[int, ...]) -> bool:
        """Whether the slot's cells are exactly ``held``, and stay so while it is free.

        llama.cpp lets another sequence overwrite a cell that its own sequence's sliding
        window has left behind (one at least the window below its last position): a kept
        slot whose tokens reach the window could lose its first cells at any step. Shorter
        ones lose none. The positions are checked too, so a sequence whose cells are not
        what its tokens say (an engine bug) costs a recomputation, not a wrong answer.
        """
        if not self._keep or not held or (self._n_swa > 0 and len(held) >= self._n_swa):
            return False
        first = llama_cpp.llama_memory_seq_pos_min(self._memory, slot)
        last = llama_cpp.llama_memory_seq_pos_max(self._memory, slot)
        return bool(first == 0 and last == len(held) - 1)

    @staticmethod
    def _delta(seq: _Sequence, text: str) -> TextDelta:
        if not seq.pending:
            return TextDelta(text)
        delta = TextDelta(text, tuple(seq.pending))
        seq.pending.clear()
        return delta

    def _cancel_all(self) -> None:
        for job in self._parked:
            job.cancel.set()
        for seq in self._seqs.values():
            seq.cancel.set()
        with contextlib.suppress(Exception):
            while self._seqs:
                self._cancel_waiting()
                if self._state.idle:
                    break
                self._step()
