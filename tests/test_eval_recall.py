"""The RULER-style recall suite: seeded generators, needles where stated, RULER's scorer."""

from __future__ import annotations

import math
import random
import re
import string
from collections import Counter

import pytest
import torch
from tiny_models import char_tokenizer

from eval.data import embedded_text, tokenize
from eval.dialogue import chat
from eval.key_words import ADJECTIVES, MINIMUM, NOUNS, absent_words
from eval.recall import SNAP, SPACING, TASKS, make_case, parse_task, score_answer

NEEDLE_TASKS = [task for task in TASKS if task != "cwe"]


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def haystack(tokenizer):
    return tokenize(tokenizer, embedded_text()[:40_000], start=False)


@pytest.mark.parametrize("task", TASKS)
def test_cases_are_deterministic_per_seed_and_exactly_as_long_as_asked(tokenizer, haystack, task):
    a, b = (make_case(tokenizer, haystack, task=task, length=1500, depth=0.4, seed=3) for _ in range(2))
    assert a.context_ids.equal(b.context_ids) and a.question_ids.equal(b.question_ids) and a.expected == b.expected
    assert a.context_ids.shape[1] + a.question_ids.shape[1] == 1500
    others = {make_case(tokenizer, haystack, task=task, length=1500, depth=0.4, seed=s).expected for s in range(4, 8)}
    assert len(others | {a.expected}) > 1  # the seed, not a constant, picks the answers


@pytest.mark.parametrize("task", NEEDLE_TASKS)
@pytest.mark.parametrize("depth", [0.0, 0.35, 1.0])
def test_needles_land_at_the_stated_depth_and_hold_the_expected_strings(tokenizer, haystack, task, depth):
    case = make_case(tokenizer, haystack, task=task, length=1200, depth=depth, seed=1)
    context = case.context_ids[0]
    text = tokenizer.decode(context)
    # the haystack's tokens: the context is the intro, then ``room`` haystack tokens and the needles;
    # the first needle starts after the intro and ``depth * room`` of them (all needles at the end: exact)
    first_placed = min(case.needles, key=lambda n: n.start)
    between = context.shape[0] - sum(n.end - n.start for n in case.needles) - first_placed.start
    room = between / (1 - first_placed.depth) if first_placed.depth < 1 else math.inf
    for needle in case.needles:
        assert tokenizer.decode(context[needle.start : needle.end]) == needle.text
        assert text.count(needle.text) == 1
    holding = [needle for needle in case.needles if any(item in needle.text for item in case.expected)]
    for item in case.expected:  # each expected string is in the needles, nowhere else in the context
        inside = sum(needle.text.count(item) for needle in case.needles)
        assert inside >= 1 and text.count(item) == inside, item
    first = holding[0] if task != "vt" else case.needles[0]  # vt: the chain starts at the depth
    assert abs(first.depth - depth) <= SNAP / room
    if task in ("niah_multivalue", "niah_multiquery"):  # every value asked for sits at the depth
        assert all(abs(needle.depth - depth) <= SNAP / room for needle in holding)
    if task == "vt":
        assert [n.depth for n in case.needles] == sorted(n.depth for n in case.needles)


def around(tokenizer, case, needle) -> tuple[str, str]:
    """The context's text before ``needle`` and after it."""
    return tokenizer.decode(case.context_ids[0, : needle.start]), tokenizer.decode(case.context_ids[0, needle.end :])


def test_needles_sit_on_sentence_boundaries_where_the_text_has_them(tokenizer, haystack):
    for seed in range(5):
        case = make_case(tokenizer, haystack, task="niah_single", length=1500, depth=0.5, seed=seed)
        before, after = around(tokenizer, case, case.needles[0])
        assert before.endswith((".", "!", "?")) or after.startswith("\n"), (before[-40:], after[:20])  # a line end where no sentence ends near


@pytest.mark.parametrize("task", ["niah_multikey", "vt", "passkey"])
def test_a_needle_is_set_off_by_whitespace_on_both_sides(tokenizer, haystack, task):
    """Never glued to the next word: at a line or paragraph end the needle closes the line, before its break."""
    for seed in range(6):
        case = make_case(tokenizer, haystack, task=task, length=1500, depth=seed / 5, seed=seed)
        for needle in case.needles:
            before, after = around(tokenizer, case, needle)
            after += tokenizer.decode(case.question_ids[0])
            assert needle.text.startswith(" ") and after[:1].isspace(), (before[-30:], needle.text, after[:30])
            assert not before[-1].isspace() or "\n" not in before[:-1], before[-30:]  # or it opens the haystack, after the intro


def wrapped_prose(sentence: str, count: int = 700) -> torch.Tensor:
    """``count`` sentences of random words, ``sentence`` formatted with five of them."""
    rng = random.Random(0)
    words = sorted({"".join(rng.choices(string.ascii_lowercase, k=rng.randrange(4, 9))) for _ in range(300)})
    return tokenize(char_tokenizer(), "".join(sentence.format(*rng.sample(words, 5)) for _ in range(count)))


def test_a_wrapped_line_or_an_abbreviation_is_no_sentence_end(tokenizer):
    """Prose wrapped mid-sentence: a needle at a line end would split its sentence in two."""
    haystack = wrapped_prose("{} {}, e.g. {}\n{} {}. ")
    for seed in range(4):
        for depth in (0.2, 0.5, 0.8):
            case = make_case(tokenizer, haystack, task="niah_single", length=1200, depth=depth, seed=seed)
            needle = case.needles[0]
            before, after = around(tokenizer, case, needle)
            assert before.rstrip().endswith(".") and not before.rstrip().endswith("e.g."), before[-30:]
            assert re.match(r" ?[a-z]+ [a-z]+, e\.g\.", after), after[:30]


def test_without_sentence_ends_a_needle_still_splits_no_line(tokenizer):
    haystack = wrapped_prose("{} = {}({}, {}) + {}\n")
    for depth in (0.3, 0.7):
        case = make_case(tokenizer, haystack, task="niah_single", length=1200, depth=depth, seed=1)
        before, after = around(tokenizer, case, case.needles[0])
        assert re.search(r"\+ [a-z]+$", before) and after.startswith("\n"), (before[-30:], after[:30])


def test_a_sentence_in_a_table_cell_is_no_place_for_a_needle(tokenizer):
    """Inside a cell the needle would push the row's "|" out of line: it closes the row instead."""
    haystack = wrapped_prose("| {} {}.      | {} {}. | {}. |\n")
    for depth in (0.3, 0.7):
        case = make_case(tokenizer, haystack, task="niah_single", length=1200, depth=depth, seed=2)
        before, after = around(tokenizer, case, case.needles[0])
        assert before.endswith(". |") and after.startswith("\n| "), (before[-30:], after[:30])


@pytest.mark.parametrize("value, pattern", [("number", r"\d{7}"), ("word", r"[a-z]+-[a-z]+"), ("uuid", r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")])
def test_value_types(tokenizer, haystack, value, pattern):
    case = make_case(tokenizer, haystack, task="niah_single", length=1200, seed=0, value=value)
    assert re.fullmatch(pattern, case.expected[0])
    assert f"special magic {value} for" in tokenizer.decode(case.question_ids[0])


def test_multi_needle_tasks_have_their_counts(tokenizer, haystack):
    multikey = make_case(tokenizer, haystack, task="niah_multikey", length=1500, seed=0, keys=5)
    assert len(multikey.needles) == 5 and len(multikey.expected) == 1
    keys = {re.search(r"for (\S+) is", n.text).group(1) for n in multikey.needles}
    assert len(keys) == 5
    multivalue = make_case(tokenizer, haystack, task="niah_multivalue", length=1500, seed=0, values=3)
    assert len(multivalue.expected) == 3 and len({re.search(r"for (\S+) is", n.text).group(1) for n in multivalue.needles}) == 1
    multiquery = make_case(tokenizer, haystack, task="niah_multiquery", length=1500, seed=0, queries=3)
    question = tokenizer.decode(multiquery.question_ids[0])
    assert len(multiquery.expected) == 3 and all(re.search(r"for (\S+) is", n.text).group(1) in question for n in multiquery.needles)
    vt = make_case(tokenizer, haystack, task="vt", length=1500, seed=0, hops=3)
    assert len(vt.expected) == 4 and vt.needles[0].text.endswith(tokenizer.decode(vt.question_ids[0]).split("value ")[1].split(" ")[0] + ".")
    for before, after in zip(vt.needles, vt.needles[1:]):  # each link assigns the variable before it
        assert after.text.endswith(re.search(r"VAR (\w+) =", before.text).group(1) + ".")


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "niah_multiquery"])
def test_keys_are_adjective_noun_pairs_of_words_the_haystack_lacks(tokenizer, task):
    planted = "An Eager otter met a golden penguin. "  # key words in the text are never drawn
    haystack = tokenize(tokenizer, planted * 3 + embedded_text()[:40_000], start=False)
    text = tokenizer.decode(haystack[0]).lower()
    adjectives = [word for word in ADJECTIVES if re.search(rf"\b{word}\b", text) is None]
    nouns = [word for word in NOUNS if re.search(rf"\b{word}\b", text) is None]
    assert {"eager", "golden"}.isdisjoint(adjectives) and {"otter", "penguin"}.isdisjoint(nouns)
    assert absent_words(text) == (adjectives, nouns)
    keys = set()
    for seed in range(6):
        case = make_case(tokenizer, haystack, task=task, length=1200, seed=seed, value="word")
        for needle in case.needles:
            key, value = re.search(r"for (\S+) is: (\S+)\.", needle.text).groups()
            for pair in (key, value):
                adjective, noun = pair.split("-")
                assert adjective in adjectives and noun in nouns, pair
            assert key != value
            keys.add(key)
    assert len(keys) >= 6  # drawn, not fixed


def test_a_text_holding_the_key_words_is_refused_by_name(tokenizer):
    text = " ".join(ADJECTIVES[: len(ADJECTIVES) - MINIMUM + 1] + NOUNS) + ". Plain prose follows here. " * 400
    assert absent_words(" ".join(ADJECTIVES[:-MINIMUM] + NOUNS[:-MINIMUM])) == (list(ADJECTIVES[-MINIMUM:]), list(NOUNS[-MINIMUM:]))
    with pytest.raises(ValueError, match="key adjectives .* use another text"):
        make_case(tokenizer, tokenize(tokenizer, text, start=False), task="niah_single", length=600)


def test_common_words_are_exactly_the_most_frequent(tokenizer, haystack):
    case = make_case(tokenizer, haystack, task="cwe", length=2000, seed=0, words=5, common_freq=8, rare_freq=2)
    entries = Counter(re.findall(r"^\d+\. (\w+)$", tokenizer.decode(case.context_ids[0]), flags=re.MULTILINE))
    assert len(case.expected) == 5 and all(entries[word] == 8 for word in case.expected)
    assert set(entries.values()) == {8, 2} and len(entries) > 20
    with pytest.raises(ValueError, match="at least .* tokens"):
        make_case(tokenizer, haystack, task="cwe", length=300, seed=0)


@pytest.mark.parametrize(
    "answer, expected, score",
    [
        (" 1234567.", ("1234567",), 1.0),
        (" 123456", ("1234567",), 0.0),
        (" 1234567, 7654321 and more", ("7654321", "1234567", "1111111"), 2 / 3),
        ("Answer: ALPHA BETA", ("alpha", "beta"), 1.0),
        ("", ("x",), 0.0),
    ],
)
def test_scorer_is_rulers_fraction_of_expected_strings(answer, expected, score):
    assert score_answer(answer, expected) == pytest.approx(score)


def test_bad_tasks_options_and_lengths_say_what_to_do(tokenizer, haystack):
    assert parse_task("niah_single:value=uuid") == ("niah_single", {"value": "uuid"})
    assert parse_task("vt:hops=2") == ("vt", {"hops": 2})
    with pytest.raises(ValueError, match="choose one of"):
        parse_task("ruler")
    with pytest.raises(ValueError, match="valid options are value, keys"):
        make_case(tokenizer, haystack, task="niah_multikey", hops=2)
    with pytest.raises(ValueError, match="must be one of number, word, uuid"):
        parse_task("niah_single:value=date")
    with pytest.raises(ValueError, match="at least"):
        make_case(tokenizer, haystack, task="niah_single", length=100)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        make_case(tokenizer, haystack, depth=1.5)


@pytest.mark.parametrize("task", ["niah_single", "cwe"])
def test_prompts_open_with_the_tokenizers_bos_within_the_length(haystack, task):
    with_bos = char_tokenizer(bos=True)
    case = make_case(with_bos, haystack, task=task, length=1500, depth=0.4, seed=3)
    assert case.context_ids[0, 0] == with_bos.bos_token_id and (case.context_ids[0, 1:] != with_bos.bos_token_id).all()
    assert case.context_ids.shape[1] + case.question_ids.shape[1] == 1500
    for needle in case.needles:  # positions count the BOS
        assert with_bos.decode(case.context_ids[0, needle.start : needle.end]) == needle.text


@pytest.mark.parametrize("depth", [0.0, 0.6, 1.0])
def test_multiturn_needles_spread_from_the_depth_one_key_asked_a_turn(tokenizer, haystack, depth):
    case = make_case(tokenizer, haystack, task="niah_multiturn", length=2000, depth=depth, seed=1, turns=4)
    assert case.context_ids.shape[1] + case.question_ids.shape[1] == 2000 and len(case.turns) == len(case.needles) == 4
    text = tokenizer.decode(case.context_ids[0])
    keys = [re.search(r"for (\S+) is", needle.text).group(1) for needle in case.needles]
    assert len(set(keys)) == 4
    for needle, key, turn in zip(case.needles, keys, case.turns):  # turn k asks needle k's key, and only it
        question = tokenizer.decode(turn.question_ids[0])
        assert f"for {key} mentioned" in question and sum(other in question for other in keys) == 1
        [value] = turn.expected
        assert needle.text.endswith(f"is: {value}.") and text.count(value) == 1
    for index, needle in enumerate(case.needles):  # the first at the depth, then a quarter apart, wrapping round
        target = depth if index == 0 else (depth + index / 4) % 1.0
        assert abs(needle.depth - target) <= SNAP / 1400, (index, needle.depth, target)  # the haystack holds over 1,400 tokens
    starts = sorted(needle.start for needle in case.needles)
    assert all(b - a > SPACING - 2 * SNAP for a, b in zip(starts, starts[1:]))  # each at a place of its own


def test_multiturn_turns_below_one_or_beyond_the_needles_that_fit_say_what_to_do(tokenizer, haystack):
    with pytest.raises(ValueError, match="turns=0 must be an integer >= 1"):
        parse_task("niah_multiturn:turns=0")
    with pytest.raises(ValueError, match=r"turns=12 needs 12 needles .* ask for turns=\d+ or fewer, or use a length of at least \d+ tokens") as refused:
        make_case(tokenizer, haystack, task="niah_multiturn", length=1200, turns=12)
    fewer, longer = map(int, re.search(r"turns=(\d+) or fewer, or use a length of at least (\d+)", str(refused.value)).groups())
    assert 1 <= fewer < 12
    assert len(make_case(tokenizer, haystack, task="niah_multiturn", length=1200, turns=fewer).turns) == fewer  # the fixes hold
    assert len(make_case(tokenizer, haystack, task="niah_multiturn", length=longer, turns=12).turns) == 12
    with pytest.raises(ValueError, match="use a length of at least") as none_fit:
        make_case(tokenizer, haystack, task="niah_multiturn", length=400, turns=3)
    assert "or fewer" not in str(none_fit.value)  # not even one needle fits: only a longer prompt helps


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize("task", ["niah_multiturn", "cwe", "vt"])
def test_a_chat_template_frames_each_question_within_the_length(haystack, task):
    templated = char_tokenizer()
    templated.chat_template = CHATML
    case = make_case(templated, haystack, task=task, length=1500, depth=0.4, seed=3, framing=chat(templated))
    assert case.context_ids.shape[1] + case.question_ids.shape[1] == 1500
    context = templated.decode(case.context_ids[0])
    assert context.startswith("<|im_start|>user\n") and context.endswith("\n\n")
    for turn in case.turns:
        question = templated.decode(turn.question_ids[0])
        assert re.fullmatch(r"\S[^\n]*[?.]<\|im_end\|>\n<\|im_start\|>assistant\n\S[^\n]*(is|are|:)", question), question
    for needle in case.needles:
        assert templated.decode(case.context_ids[0, needle.start : needle.end]) == needle.text
