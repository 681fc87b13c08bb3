"""common.nesting: the depth of JSON text (brackets outside strings) and of values, read
without recursion, and the standard library's reader that refuses past a depth before it
parses anything."""

from __future__ import annotations

import json
import random

import pytest

from omnifabric.common import nesting

#: String contents that look like structure (json.dumps escapes the quotes and backslashes).
TRICKY = ["[", "]", "{", "}", '"', "\\", '\\"', "a", " "]


def depth(value) -> int:
    """The reference: containers count one level each, however empty."""
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


def random_value(rng: random.Random, levels: int):
    kind = rng.choice(["list", "dict", "str", "num"] if levels else ["str", "num", "null"])
    if kind == "list":
        return [random_value(rng, levels - 1) for _ in range(rng.randint(0, 3))]
    if kind == "dict":
        keys = (rng.choice(TRICKY) + str(i) for i in range(rng.randint(0, 3)))
        return {key: random_value(rng, levels - 1) for key in keys}
    if kind == "str":
        return "".join(rng.choice(TRICKY) for _ in range(rng.randint(0, 6)))
    return None if kind == "null" else rng.randint(-5, 5)


def test_the_text_count_equals_the_values_depth_strings_skipped():
    rng = random.Random(7)
    deepest = 0
    for _ in range(400):
        value = random_value(rng, rng.randint(0, 12))
        text = json.dumps(value)
        d = depth(value)
        deepest = max(deepest, d)
        assert not nesting.text_deeper_than(text, d), text
        assert not nesting.value_deeper_than(value, d), text
        if d:
            assert nesting.text_deeper_than(text, d - 1), text
            assert nesting.value_deeper_than(value, d - 1), text
    assert deepest >= 8


def test_an_unterminated_string_runs_to_the_end():
    assert not nesting.text_deeper_than('["' + "[" * 1000, 1)
    assert nesting.text_deeper_than('[[["' + "[" * 1000, 2)


def test_deep_text_is_refused_before_the_standard_library_reads_it(monkeypatch):
    def recursive(*args, **kwargs):
        raise AssertionError("the standard library's parser ran")

    monkeypatch.setattr(json, "loads", recursive)
    with pytest.raises(nesting.TooDeep, match="deeper than 512 levels"):
        nesting.loads("[" * 100_000 + "]" * 100_000)
    with pytest.raises(nesting.TooDeep, match="deeper than 3 levels"):
        nesting.loads('{"a": [[[1]]]}', 3)


def test_within_the_limit_it_is_the_standard_librarys_reading():
    text = "[" * nesting.MAX_PARSE_DEPTH + '"\\ud800"' + "]" * nesting.MAX_PARSE_DEPTH
    value = nesting.loads(text)
    for _ in range(nesting.MAX_PARSE_DEPTH):
        assert isinstance(value, list) and len(value) == 1
        value = value[0]
    assert value == "\ud800"
    value = nesting.loads(text)
    seen = []
    assert nesting.loads("[NaN]", 1, parse_constant=seen.append) == [None]
    assert seen == ["NaN"]
    assert not nesting.value_deeper_than(value, nesting.MAX_PARSE_DEPTH)
    assert nesting.value_deeper_than((([],),), 2)


def test_raw_decode_reads_a_value_where_more_follows():
    text = 'said: {"a": [1, 2]} and more [[['
    assert nesting.raw_decode(text, 6) == ({"a": [1, 2]}, 19)
    with pytest.raises(nesting.TooDeep):
        nesting.raw_decode('{"a": 1} ' + "[" * 600, 0)
    with pytest.raises(ValueError):
        nesting.raw_decode("nothing", 0)
