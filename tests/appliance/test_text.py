from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from appliance.serving.text import TextAssembler


def feed_all(assembler: TextAssembler, pieces: list[bytes]) -> str:
    out = "".join(assembler.feed(p) for p in pieces)
    return out + assembler.flush()


def test_split_utf8_is_held_until_complete() -> None:
    data = "né€😀".encode()
    assembler = TextAssembler()
    outputs = [assembler.feed(data[i : i + 1]) for i in range(len(data))]
    assert "".join(outputs) + assembler.flush() == "né€😀"
    assert all("\ufffd" not in o for o in outputs)


def test_stop_string_across_pieces_is_cut_and_not_emitted() -> None:
    assembler = TextAssembler(stop=("\n\n", "END"))
    assert feed_all(assembler, [b"Hello E", b"N", b"D and more"]) == "Hello "
    assert assembler.stopped
    assert assembler.text == "Hello "


def test_earliest_stop_wins() -> None:
    assembler = TextAssembler(stop=("b", "a"))
    assert feed_all(assembler, [b"xxab"]) == "xx"


def test_partial_stop_prefix_is_released_at_the_end() -> None:
    assembler = TextAssembler(stop=("STOP",))
    assert feed_all(assembler, [b"ST", b"O"]) == "STO"
    assert not assembler.stopped


@given(st.text(max_size=200), st.lists(st.integers(min_value=1, max_value=7), max_size=60))
def test_without_stops_output_equals_input(text: str, cuts: list[int]) -> None:
    data = text.encode()
    pieces, i = [], 0
    for cut in cuts:
        pieces.append(data[i : i + cut])
        i += cut
    pieces.append(data[i:])
    assert feed_all(TextAssembler(), pieces) == text


@given(st.text(alphabet="abc", max_size=50), st.text(alphabet="abc", min_size=1, max_size=3))
def test_output_never_contains_the_stop_string(text: str, stop: str) -> None:
    assembler = TextAssembler(stop=(stop,))
    out = feed_all(assembler, [c.encode() for c in text])
    assert stop not in out
    assert text.startswith(out)
    assert assembler.stopped == (stop in text)
