"""The worker protocol carries every field of a request and of its events, both ways."""

from __future__ import annotations

from dataclasses import fields

from appliance.serving import ipc
from appliance.serving.engine import Finished, GenerationRequest, TextDelta, TokenLogprob
from appliance.serving.sampling_options import Sampling


def through_the_pipe(message: dict[str, object]) -> dict[str, object]:
    line = ipc.encode(message)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    return ipc.decode(line)


def test_a_request_with_every_field_set_comes_back_equal() -> None:
    sampling = Sampling(
        temperature=0.7,
        top_p=0.9,
        seed=42,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        top_k=40,
        min_p=0.05,
        repeat_penalty=1.1,
        repeat_last_n=-1,
        logit_bias=((17, -100.0), (30077, 100.0), (5, 2.5)),
    )
    request = GenerationRequest(
        prompt_tokens=(2, 818, 5279),
        max_tokens=64,
        sampling=sampling,
        stop=("\n\n", "END"),
        grammar='root ::= "yes" | "no"',
        priority=2,
        logprobs=5,
        share_prompt=True,
    )
    # Every field differs from its default, so none can be dropped unnoticed.
    for obj in (request, sampling):
        for f in fields(obj):
            assert getattr(obj, f.name) != f.default, f.name
    back = ipc.request_from(through_the_pipe(ipc.generate_message("r1", request)))
    assert back == request
    assert isinstance(back.sampling.logit_bias, tuple)
    assert all(isinstance(pair, tuple) for pair in back.sampling.logit_bias)


def test_a_default_request_comes_back_equal_and_old_messages_still_read() -> None:
    request = GenerationRequest(prompt_tokens=(2,), max_tokens=1)
    assert ipc.request_from(through_the_pipe(ipc.generate_message("r", request))) == request
    # A message from a worker protocol without the new fields (a rolling restart).
    old = ipc.generate_message("r", request)
    for key in ("logprobs", "share_prompt"):
        del old[key]
    sampling = old["sampling"]
    assert isinstance(sampling, dict)
    for key in ("top_k", "min_p", "repeat_penalty", "repeat_last_n", "logit_bias"):
        del sampling[key]
    assert ipc.request_from(through_the_pipe(old)) == request


def test_deltas_carry_logprobs_and_a_delta_without_them_has_no_key() -> None:
    delta = TextDelta(
        " Paris",
        (
            TokenLogprob(7001, -0.25, ((7001, -0.25), (506, -1.75))),
            TokenLogprob(236761, -0.0, ()),
        ),
    )
    message = through_the_pipe(ipc.event_message("r", delta))
    back = ipc.event_from(message)
    assert back == delta
    assert isinstance(back, TextDelta)
    assert all(isinstance(entry.top, tuple) for entry in back.logprobs)
    plain = ipc.event_message("r", TextDelta(" Paris"))
    assert plain == {"type": "delta", "id": "r", "text": " Paris"}  # the per-token hot path
    assert ipc.event_from(through_the_pipe(plain)) == TextDelta(" Paris")
    # The last delta of a generation may have logprobs and no text.
    tail = TextDelta("", (TokenLogprob(3, -2.0, ((9, -1.0), (3, -2.0))),))
    assert ipc.event_from(through_the_pipe(ipc.event_message("r", tail))) == tail


def test_finished_carries_every_field() -> None:
    done = Finished(
        finish_reason="length",
        prompt_tokens=12,
        completion_tokens=30,
        ttft_s=0.125,
        duration_s=1.5,
        text="forty-two",
        queue_s=0.25,
        cached_tokens=11,
    )
    assert ipc.event_from(through_the_pipe(ipc.event_message("r", done))) == done
