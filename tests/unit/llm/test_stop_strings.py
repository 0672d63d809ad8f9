"""Stop strings: the stop text and anything after it never reach the client, even split across deltas."""

from __future__ import annotations

import pytest

from dynamo.llm.stop_strings import StopStringMatcher


def run(stops: list[str], deltas: list[str]) -> tuple[list[str], bool]:
    """Feed deltas until a match; return what was emitted per delta (plus the flush) and whether it stopped."""
    m = StopStringMatcher(stops)
    emitted: list[str] = []
    for d in deltas:
        out, matched = m.feed(d)
        emitted.append(out)
        if matched:
            return emitted, True
    emitted.append(m.flush())
    return emitted, False


def test_match_inside_one_delta_trims_it_and_what_follows():
    emitted, stopped = run(["STOP"], ["hello STOP world"])
    assert stopped
    assert "".join(emitted) == "hello "


@pytest.mark.parametrize(
    "deltas",
    [
        ["Hello wor", "ld! Bye"],  # split in the middle
        ["Hello w", "o", "r", "l", "d", "! Bye"],  # one character at a time
        ["Hello ", "world", "! Bye"],  # stop string is a whole delta
        ["Hello world", "! Bye"],  # ends exactly at a delta boundary
    ],
)
def test_stop_string_split_across_deltas_never_leaks(deltas):
    emitted, stopped = run(["world"], deltas)
    assert stopped
    assert "".join(emitted) == "Hello "
    # no delta, at any point, showed a prefix of the stop string beyond what was finally kept
    shown = ""
    for piece in emitted:
        shown += piece
        assert "w" not in shown


def test_held_back_false_partial_is_released_in_order():
    m = StopStringMatcher(["world"])
    out1, hit1 = m.feed("say wor")
    assert (out1, hit1) == ("say ", False)  # "wor" might start the stop string: held back
    out2, hit2 = m.feed("m and more")
    assert not hit2
    assert out1 + out2 == "say worm and more"


def test_partial_prefix_at_end_of_stream_is_flushed():
    emitted, stopped = run(["world"], ["hello wo"])
    assert not stopped
    assert emitted[0] == "hello "
    assert "".join(emitted) == "hello wo"


def test_earliest_of_several_stop_strings_wins():
    emitted, stopped = run(["B", "AB", "xyz"], ["12A", "B34"])
    assert stopped
    assert "".join(emitted) == "12"


def test_overlapping_partials_hold_back_longest_candidate():
    # "aab" is the stop; after "xaa" both "a" and "aa" are candidate prefixes
    m = StopStringMatcher(["aab"])
    out, hit = m.feed("xaa")
    assert (out, hit) == ("x", False)
    out, hit = m.feed("ab")  # "xaa"+"ab" = "xaaab": "aab" starts at index 2
    assert hit
    assert out == "a"


def test_multibyte_stop_string():
    emitted, stopped = run(["🙂"], ["smile ", "🙂 more"])
    assert stopped
    assert "".join(emitted) == "smile "


def test_empty_stop_strings_are_ignored():
    emitted, stopped = run(["", "x"], ["abc", "dex"])
    assert stopped
    assert "".join(emitted) == "abcde"
