"""A scripted model: replies from a JSON file, served by the same gateway, scheduler and
worker as a GGUF model, with no weights and no llama.cpp.

For what needs the whole appliance but not a language model: trying an installation on a
machine too small for one, measuring the gateway's own cost (no decode time in the
figures), and tests of authentication, errors, fleet or backup, which would otherwise start
a real model for each. Registered like a GGUF file (`kvl appliance models add FILE`); its
record's format is ``script``.

The file::

    {"kvl_script": 1,
     "reply": "Hello from a scripted model.",
     "rules": [{"contains": "ping", "reply": "pong"}],
     "step_s": 0.0,
     "chat_template": null}

A prompt gets the reply of the first rule whose ``contains`` its text contains, else
``reply``. One token is one byte of UTF-8 (so a multi-byte character arrives over several
tokens, as with a real tokenizer's byte fallback), then the end-of-generation token.
``step_s`` is slept once per decode step, the time a real model's step would take: with
it, sequences overlap, queue, and yield their slots as real ones do. ``chat_template``
(Jinja, as in a GGUF file) replaces ChatML.

Deterministic: sampling parameters, seeds and grammars are read and ignored (a grammar
still has to be one the gateway made); a logprob is the same made-up figure for every
token. Slots, priorities, preemption, queueing, context limits, stop strings and
cancellation are the real ones: the pure scheduler (appliance.serving.scheduler) and the
text assembler decide them as for a GGUF model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import queue
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from appliance.serving import scheduler as sched
from appliance.serving.devices import DeviceLayout
from appliance.serving.engine import (
    Emit,
    EngineOptions,
    Failed,
    Finished,
    GenerationRequest,
    Job,
    SlotChange,
    TextDelta,
    TokenLogprob,
)
from appliance.serving.text import TextAssembler
from shared.chat import ChatTemplate, select_template
from shared.modelfiles import model_format

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable

    from appliance.state.records import ModelRecord

log = logging.getLogger(__name__)

FORMAT = "script"
MARKER = "kvl_script"
BOS = 256
EOS = 257
N_VOCAB = 258
_SPECIAL = {BOS: b"<bos>", EOS: b"<eos>"}
MAX_SCRIPT_BYTES = 1024 * 1024
# What every token's logprob reads as; its alternatives are the next byte values, less likely.
LOGPROB = -0.25


class ScriptError(ValueError):
    """A file is not a model script, or not a valid one."""


@dataclass(frozen=True)
class Rule:
    contains: str
    reply: str


@dataclass(frozen=True)
class Script:
    reply: str
    rules: tuple[Rule, ...] = ()
    step_s: float = 0.0
    chat_template: str | None = None

    def answer(self, prompt: str) -> str:
        for rule in self.rules:
            if rule.contains in prompt:
                return rule.reply
        return self.reply

    @classmethod
    def read(cls, path: Path, *, sha256: str | None = None) -> Script:
        """The script in ``path``; ScriptError if it is not one, or (given ``sha256``) not
        the file that was registered."""
        try:
            with path.open("rb") as f:
                data = f.read(MAX_SCRIPT_BYTES + 1)
        except OSError as err:
            raise ScriptError(f"{path}: {err.strerror or err}") from err
        if len(data) > MAX_SCRIPT_BYTES:
            raise ScriptError(f"{path}: a model script is at most {MAX_SCRIPT_BYTES} bytes")
        if sha256 is not None and (digest := hashlib.sha256(data).hexdigest()) != sha256:
            raise ScriptError(f"model script {path} has sha256 {digest}, registered {sha256}")
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ScriptError(f"{path}: not JSON ({err})") from err
        return cls.parse(raw, str(path))

    @classmethod
    def parse(cls, raw: object, where: str) -> Script:
        if not isinstance(raw, dict) or raw.get(MARKER) != 1:
            raise ScriptError(f"{where}: not a model script (no `{MARKER}: 1`)")
        unknown = set(raw) - {MARKER, "reply", "rules", "step_s", "chat_template"}
        if unknown:
            raise ScriptError(f"{where}: unknown keys {sorted(unknown)}")
        reply, rules, step_s = raw.get("reply"), raw.get("rules", []), raw.get("step_s", 0.0)
        template = raw.get("chat_template")
        if not isinstance(reply, str):
            raise ScriptError(f"{where}: `reply` must be a string")
        if not isinstance(step_s, int | float) or isinstance(step_s, bool) or not 0 <= step_s <= 10:
            raise ScriptError(f"{where}: `step_s` must be a number of seconds from 0 to 10")
        if template is not None and not isinstance(template, str):
            raise ScriptError(f"{where}: `chat_template` must be a string")
        if not isinstance(rules, list) or not all(
            isinstance(r, dict)
            and set(r) == {"contains", "reply"}
            and isinstance(r["contains"], str)
            and isinstance(r["reply"], str)
            for r in rules
        ):
            raise ScriptError(f"{where}: `rules` must be a list of {{contains, reply}} strings")
        return cls(
            reply, tuple(Rule(r["contains"], r["reply"]) for r in rules), float(step_s), template
        )


def is_script(path: Path) -> bool:
    """Whether the file starts like a model script (JSON), not like GGUF."""
    return model_format(path) == FORMAT


class ByteVocabulary:
    """A scripted model's vocabulary: the 256 byte values, then BOS and EOS."""

    n_vocab = N_VOCAB

    def __init__(self, chat_template: str | None) -> None:
        self.chat_template: ChatTemplate = select_template(chat_template, None, "<bos>", "<eos>")

    @classmethod
    def load(cls, record: ModelRecord) -> ByteVocabulary:
        return cls(Script.read(Path(record.path)).chat_template)

    def tokenize(self, text: str, *, chat: bool) -> list[int]:
        tokens = list(text.encode("utf-8"))
        return tokens if chat else [BOS, *tokens]

    def is_eog(self, token: int) -> bool:
        return token == EOS

    def piece(self, token: int, *, special: bool = False) -> bytes:
        if token in _SPECIAL:
            return _SPECIAL[token] if special else b""
        return bytes((token,))

    def piece_text(self, token: int, *, special: bool) -> str:
        return self.piece(token, special=special).decode("utf-8", errors="replace")

    def close(self) -> None:
        """Nothing is held."""


@dataclass
class _Sequence:
    request: GenerationRequest
    emit: Emit
    cancel: threading.Event
    started: float
    answer: bytes  # the reply, then EOS
    assembler: TextAssembler
    admitted: float | None = None
    produced: int = 0
    ttft: float | None = None
    pending: list[TokenLogprob] = field(default_factory=list)  # of text held back


def _nothing() -> None:
    pass


class ScriptedEngine:
    """The worker's engine for a scripted model: :class:`~appliance.serving.batching.BatchEngine`'s
    interface (a job queue, a loop, the heartbeat's counters), with the script in place of
    llama.cpp's decode and sampling."""

    def __init__(self, record: ModelRecord, options: EngineOptions) -> None:
        self.record = record
        self.options = options
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.vocab: ByteVocabulary | None = None
        self._script = Script(reply="")
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
        self.prefix_tokens_reused = 0
        self.tokens_generated = 0
        self.preemptions = 0
        self.steps: deque[tuple[int, float]] = deque(maxlen=100_000)  # (tokens, seconds)
        self.flush_events: Callable[[], None] = _nothing  # as BatchEngine's

    def load(self) -> None:
        # Checked against its registered sha256 at every load: a script is a few kilobytes
        # (catalog.verify's stamps spare gigabytes of weights that hashing).
        self._script = Script.read(Path(self.record.path), sha256=self.record.sha256)
        self.vocab = ByteVocabulary(self._script.chat_template)
        log.info("loaded the scripted model %s: %d slots", self.record.ref, self.options.n_slots)

    def close(self) -> None:
        self.vocab = None

    def layout(self) -> DeviceLayout:
        """On the CPU: there are no layers."""
        return DeviceLayout(gpu_offload=False, n_gpu_layers=0, devices=())

    @property
    def running(self) -> int:
        return len(self._seqs)

    @property
    def busy_slots(self) -> int:
        return len(self._state.running)

    def serve_forever(self) -> None:
        try:
            while self._turn():
                self.flush_events()
        finally:
            self.flush_events()

    def _turn(self) -> bool:
        arrived: list[Job | None] = []
        if self._state.idle:
            arrived.append(self.jobs.get())
        with contextlib.suppress(queue.Empty):
            while True:
                arrived.append(self.jobs.get_nowait())
        for job in arrived:
            if job is None:
                for seq in self._seqs.values():
                    seq.cancel.set()
                while self._seqs and not self._state.idle:
                    self._cancel_waiting()
                    self._step()
                return False
            self._admit(job)
        self._cancel_waiting()
        if not self._state.idle:
            self._step()
        return True

    def _admit(self, job: Job) -> None:
        request = job.request
        self._state, result = sched.submit(
            self._state, len(request.prompt_tokens), request.max_tokens, priority=request.priority
        )
        if isinstance(result, sched.Rejected):
            job.emit(Failed(ValueError(result.message)))
            return
        prompt = bytes(t for t in request.prompt_tokens if t < 256).decode("utf-8", "replace")
        self._seqs[result.seq_id] = _Sequence(
            request=request,
            emit=job.emit,
            cancel=job.cancel,
            started=time.perf_counter(),
            answer=self._script.answer(prompt).encode("utf-8"),
            assembler=TextAssembler(request.stop),
        )

    def _cancel_waiting(self) -> None:
        for seq_id, seq in list(self._seqs.items()):
            state = self._state.get(seq_id)
            if seq.cancel.is_set() and state is not None and state.slot is None:
                self._state, ended = sched.cancel(self._state, seq_id)
                if ended is not None:
                    self._end(ended)

    def _step(self) -> None:
        plan = sched.plan_step(self._state)
        for preemption in plan.preempted:
            self.preemptions += 1
            self._seqs[preemption.seq_id].emit(SlotChange(holds=False))
        for admission in plan.admitted:
            seq = self._seqs[admission.seq_id]
            seq.emit(SlotChange(holds=True))
            if seq.admitted is None:
                seq.admitted = time.perf_counter()
        if plan.preempted or plan.admitted:
            self.flush_events()  # the seats before the step (BatchEngine.flush_events)
        started = time.perf_counter()
        if self._script.step_s:
            time.sleep(self._script.step_s)
        self.steps.append((plan.n_tokens, time.perf_counter() - started))
        finished: dict[int, Literal["stop", "cancelled"]] = {}
        for entry in plan.entries:
            seq = self._seqs[entry.seq_id]
            if entry.wants_logits and (reason := self._sample(seq)) is not None:
                finished[entry.seq_id] = reason
            elif seq.cancel.is_set():
                finished[entry.seq_id] = "cancelled"
        self._state, ended = sched.apply_step(self._state, plan, sched.StepOutcome(finished))
        for end in ended:
            self._end(end)

    def _sample(self, seq: _Sequence) -> Literal["stop", "cancelled"] | None:
        token = seq.answer[seq.produced] if seq.produced < len(seq.answer) else EOS
        if seq.ttft is None:
            seq.ttft = time.perf_counter() - seq.started
        self.tokens_generated += 1
        if token == EOS:
            return "stop"
        seq.produced += 1
        if (k := seq.request.logprobs) is not None:
            top = tuple(((token + i) % 256, LOGPROB - 2.0 * i) for i in range(k))
            seq.pending.append(TokenLogprob(token, LOGPROB, top))
        # As BatchEngine: a token's logprob goes out with the delta that completes its text.
        if text := seq.assembler.feed(bytes((token,))):
            seq.emit(_delta(seq, text))
        if seq.assembler.stopped:
            return "stop"
        return "cancelled" if seq.cancel.is_set() else None

    def _end(self, ended: sched.Ended) -> None:
        seq = self._seqs.pop(ended.seq_id)
        rest = seq.assembler.flush()
        if rest or seq.pending:
            seq.emit(_delta(seq, rest))
        seq.emit(
            Finished(
                finish_reason=ended.reason,
                prompt_tokens=len(seq.request.prompt_tokens),
                completion_tokens=seq.produced,
                ttft_s=seq.ttft,
                duration_s=time.perf_counter() - seq.started,
                text=seq.assembler.text,
                queue_s=None if seq.admitted is None else seq.admitted - seq.started,
            )
        )


def _delta(seq: _Sequence, text: str) -> TextDelta:
    delta = TextDelta(text, tuple(seq.pending))
    seq.pending.clear()
    return delta
