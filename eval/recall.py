"""A long-context recall suite modelled on RULER (Hsieh et al., 2024), generated offline and seeded.

Every case is a haystack of the dataset's own text (real prose, not a repeated sentence) with
needles inserted on sentence boundaries at a stated depth, followed by a question that ends
in an answer prefix (the model only has to continue it). Tasks:

- ``niah_single``: one needle ``One of the special magic numbers for {key} is: {value}.``;
  ``value=number`` (7 digits, default), ``word`` or ``uuid``;
- ``niah_multikey``: the same needle among ``keys - 1`` distractor needles with other keys;
- ``niah_multivalue``: ``values`` needles share one key; every value must be returned;
- ``niah_multiquery``: ``queries`` needles with different keys, all asked at once;
- ``niah_multiturn``: ``turns`` needles with different keys, one question per key, each a turn
  of its own (the shared-context protocols ask them in turn of one context; the others ask each
  on its own). The first needle sits at the depth, the others spread evenly after it, wrapping
  round to the haystack's start, each with a stretch of text of its own (:data:`SPACING`);
- ``vt``: variable tracking, a chain ``VAR A = 12345``, ``VAR B = A`` ... of ``hops`` links,
  starting at the depth and spread evenly over the rest of the haystack; every variable of
  the chain must be returned;
- ``cwe``: common-words extraction from a numbered list of the haystack's words in which
  ``words`` of them appear ``common_freq`` times and the rest ``rare_freq`` times (no depth);
- ``passkey``: the passkey test (Mohtashami & Jaggi, 2023) as one more needle task.

``length`` counts the tokens of the whole prompt (context plus question; the first question
where a case has several), as RULER does. The
needles asked for sit at ``depth`` (0 = start of the haystack, 1 = end); distractors sit at
seeded random depths. A seed picks the values, the keys and where in the text the haystack
starts, so seeds give independent samples for confidence intervals. Keys (and word values) are
RULER's ``adjective-noun`` pairs, drawn from a built-in list of words the haystack lacks
(:mod:`eval.key_words`), so no key is also quoted elsewhere in the text. Each question is a
:class:`~eval.dialogue.Question` (what is asked, then the answer prefix), framed as plain text or
in the tokenizer's chat template by a :class:`~eval.dialogue.Framing`.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from .dialogue import Framing, Question, Turn, plain
from .key_words import absent_words

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "niah_multiturn", "vt", "cwe", "passkey")
OPTIONS: dict[str, dict[str, object]] = {
    "niah_single": {"value": "number"},
    "niah_multikey": {"value": "number", "keys": 4},
    "niah_multivalue": {"value": "number", "values": 4},
    "niah_multiquery": {"value": "number", "queries": 4},
    "niah_multiturn": {"value": "number", "turns": 4},
    "vt": {"hops": 4},
    "cwe": {"words": 10, "common_freq": 10, "rare_freq": 3},
    "passkey": {},
}
"""Each task's options and their defaults: RULER's, except ``common_freq`` (RULER's 30 needs ~1,800
tokens for its 10 words alone; 10 keeps the common words 3x as frequent as the rare ones at 1K)."""
VALUE_TYPES = {"number": ("number", "numbers"), "word": ("word", "words"), "uuid": ("uuid", "uuids")}
SENTENCE_END = (".", "!", "?")
ABBREVIATION = re.compile(r"(?:\b(?:e\.g|i\.e|cf|vs)|\.\.)\.$")
"""A full stop that ends no sentence: "e.g.", "i.e.", "cf.", "vs." and an ellipsis."""
SNAP = 48
"""Farthest (tokens) a needle moves from its exact depth to reach a sentence boundary."""
SPACING = 2 * SNAP + 2
"""Haystack tokens each needle of ``niah_multiturn`` needs to itself: needles spread that far
apart stay apart however far each moves to a boundary (``SNAP``, plus rounding)."""

NIAH_INTRO = (
    "Some special magic {plural} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {plural} afterwards.\n"
)
NIAH_NEEDLE = " One of the special magic {plural} for {key} is: {value}."
NIAH_QUESTION_ONE = (
    "\nWhat is the special magic {singular} for {key} mentioned in the provided text?",
    " The special magic {singular} for {key} mentioned in the provided text is",
)
NIAH_QUESTION_ALL = (
    "\nWhat are all the special magic {plural} for {key} mentioned in the provided text?",
    " The special magic {plural} for {key} mentioned in the provided text are",
)
VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
VT_NEEDLE = " VAR {name} = {value}."
VT_QUESTION = (
    "\nQuestion: Find all variables that are assigned the value {value} in the text above.",
    " Answer: According to the chain(s) of variable assignment in the text above, {count} variables "
    "are assigned the value {value}, they are:",
)
CWE_INTRO = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
CWE_QUESTION = (
    "\nQuestion: What are the {count} most common words in the above list?",
    " Answer: The top {count} words that appear most often in the list are:",
)
PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will ask you about it afterwards.\n"
)
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = ("\nWhat is the pass key?", " The pass key is")
"""Each question is (what is asked, the answer prefix): plain text joins them as printed."""


@dataclass(frozen=True)
class Needle:
    """Where one inserted sentence lies in ``context_ids``: tokens ``[start, end)``."""

    text: str
    start: int
    end: int
    depth: float
    """The depth it landed at: its start's fraction of the haystack before it."""


@dataclass(frozen=True)
class RecallCase:
    task: str
    length: int
    depth: float
    seed: int
    options: dict
    context_ids: torch.Tensor
    """``[1, n]``: the intro, then the haystack with the needles inserted."""
    question_ids: torch.Tensor
    """``[1, m]``: the (first) question and the answer prefix."""
    expected: tuple[str, ...]
    """What the (first) answer is scored against."""
    needles: tuple[Needle, ...]
    answer_tokens: int
    """Tokens to decode: enough for every expected string, separators and a little slack."""
    later: tuple[Turn, ...] = ()
    """The questions after the first (``niah_multiturn``), in the order they are asked."""

    @property
    def turns(self) -> tuple[Turn, ...]:
        """Every question of the case with what its answer is scored against, first to last."""
        return (Turn(self.question_ids, self.expected), *self.later)


def task_options(task: str, options: dict) -> dict:
    """``options`` over the task's defaults; an unknown task or option is a ``ValueError``."""
    if task not in OPTIONS:
        raise ValueError(f"unknown recall task {task!r}: choose one of {', '.join(TASKS)}")
    unknown = set(options) - set(OPTIONS[task])
    if unknown:
        valid = ", ".join(OPTIONS[task]) or "(none)"
        raise ValueError(f"recall task {task!r} has no option {', '.join(sorted(unknown))}: valid options are {valid}")
    merged = {**OPTIONS[task], **options}
    if "value" in merged and merged["value"] not in VALUE_TYPES:
        raise ValueError(f"recall task {task!r}: value={merged['value']!r} must be one of {', '.join(VALUE_TYPES)}")
    for name, value in merged.items():
        if name != "value" and (not isinstance(value, int) or value < 1):
            raise ValueError(f"recall task {task!r}: {name}={value!r} must be an integer >= 1")
    return merged


def parse_task(text: str) -> tuple[str, dict]:
    """``TASK[:key=value,...]`` (e.g. ``niah_single:value=uuid``) to ``(task, options)``."""
    name, _, rest = text.strip().partition(":")
    options: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, equals, raw = item.partition("=")
        if not equals or not key.strip() or not raw.strip():
            raise ValueError(f"malformed option {item!r} in recall task {text!r}: write key=value")
        raw = raw.strip()
        options[key.strip()] = int(raw) if raw.isdigit() else raw
    return name, task_options(name, options)


def score_answer(answer: str, expected: tuple[str, ...] | list[str]) -> float:
    """RULER's string match: the fraction of expected strings the answer contains (case-insensitive)."""
    lowered = answer.lower()
    return sum(item.lower() in lowered for item in expected) / len(expected)


def make_case(
    tokenizer: PreTrainedTokenizerBase,
    haystack_ids: torch.Tensor,
    task: str = "niah_single",
    length: int = 1024,
    depth: float = 0.5,
    seed: int = 0,
    framing: Framing | None = None,
    **options,
) -> RecallCase:
    """One seeded case of ``task`` whose prompt is ``length`` tokens (see the module docstring),
    framed by ``framing`` (plain text if not given)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"recall depth must be in [0, 1], got {depth}")
    options = task_options(task, options)
    framing = framing or plain(tokenizer)
    haystack = haystack_ids.reshape(-1).tolist()

    def make(length: int, options: dict) -> RecallCase:
        rng = random.Random(f"recall:{task}:{sorted(options.items())}:{seed}:{length}:{depth:.6f}")
        if task == "cwe":
            return _cwe(tokenizer, framing, haystack, _words(tokenizer, haystack), length, depth, seed, options, rng)
        key_words = absent_words(tokenizer.decode(haystack)) if task.startswith("niah") else ([], [])
        intro, needles, questions = _needle_task(task, options, key_words, rng)
        return _assemble(tokenizer, framing, haystack, task, length, depth, seed, options, rng, intro, needles, questions)

    try:
        return make(length, options)
    except Crowded as crowded:
        raise ValueError(crowded.fixed(make, length, options)) from None


def _question(template: tuple[str, str], **fields: object) -> Question:
    ask, prefix = template
    return Question(ask.format(**fields), prefix.format(**fields))


def _needle_task(task: str, options: dict, key_words: tuple[list[str], list[str]], rng: random.Random):
    """``(intro, [(sentence, where)], [(question, expected)])`` of a needle task (``where``: a
    needle asked for, at the depth; ``None``, at random; a chain link or one of needles spread
    apart: a tuple); niah keys (and word values) are ``adjective-noun`` pairs of ``key_words``,
    as RULER's are."""
    if task == "passkey":
        key = str(rng.randrange(10_000, 100_000))
        return PASSKEY_INTRO, [(PASSKEY_NEEDLE.format(key=key), "asked")], [(_question(PASSKEY_QUESTION), (key,))]
    if task == "vt":
        names = _distinct(rng, lambda: "".join(rng.choices(string.ascii_uppercase, k=5)), options["hops"] + 1)
        value = str(rng.randrange(10_000, 100_000))
        chain = [VT_NEEDLE.format(name=names[0], value=value)]
        chain += [VT_NEEDLE.format(name=name, value=before) for before, name in zip(names, names[1:])]
        question = _question(VT_QUESTION, value=value, count=len(names))
        return VT_INTRO, [(sentence, ("chain", i, len(chain))) for i, sentence in enumerate(chain)], [(question, tuple(names))]
    singular, plural = VALUE_TYPES[options["value"]]
    needles = options.get("keys") or options.get("values") or options.get("queries") or options.get("turns") or 1
    adjectives, nouns = key_words
    pairs = _distinct(rng, lambda: f"{rng.choice(adjectives)}-{rng.choice(nouns)}", 2 * needles)
    keys = pairs[:needles]
    values = pairs[needles:] if options["value"] == "word" else _distinct(rng, lambda: _value(options["value"], rng), needles)
    if task == "niah_multivalue":
        keys = [keys[0]] * needles
    if task == "niah_multiturn":
        sentences = [(NIAH_NEEDLE.format(plural=plural, key=k, value=v), ("spread", i, needles)) for i, (k, v) in enumerate(zip(keys, values))]
        questions = [(_question(NIAH_QUESTION_ONE, singular=singular, key=k), (v,)) for k, v in zip(keys, values)]
        return NIAH_INTRO.format(plural=plural), sentences, questions
    asked = {"niah_single": 1, "niah_multikey": 1}.get(task, needles)
    sentences = [(NIAH_NEEDLE.format(plural=plural, key=k, value=v), "asked" if i < asked else None) for i, (k, v) in enumerate(zip(keys, values))]
    if task == "niah_multiquery":
        key_text = ", ".join(keys[:-1]) + " and " + keys[-1]
    else:
        key_text = keys[0]
    template = NIAH_QUESTION_ONE if asked == 1 and task != "niah_multivalue" else NIAH_QUESTION_ALL
    question = _question(template, singular=singular, plural=plural, key=key_text)
    return NIAH_INTRO.format(plural=plural), sentences, [(question, tuple(values[:asked]))]


def _value(kind: str, rng: random.Random) -> str:
    if kind == "number":
        return str(rng.randrange(1_000_000, 10_000_000))
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _distinct(rng: random.Random, draw, count: int) -> list[str]:
    found: list[str] = []
    for _ in range(1000 * count):
        if len(found) == count:
            break
        item = draw()
        if item not in found:
            found.append(item)
    if len(found) < count:
        raise ValueError(f"cannot draw {count} distinct items: ask for fewer needles")
    return found


def _words(tokenizer: PreTrainedTokenizerBase, haystack: list[int]) -> list[str]:
    """The distinct lowercase words (4 to 10 letters) of the haystack's first 20,000 tokens, sorted."""
    text = tokenizer.decode(haystack[:20_000])
    words = sorted(set(re.findall(r"\b[a-z]{4,10}\b", text)))
    if len(words) < 50:
        raise ValueError(f"the haystack has {len(words)} distinct words, a recall case needs 50: use a longer text")
    return words


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def _boundaries(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Where a needle may go, best first (each tier with 0, where the text opens with a line
    break): where a sentence ends a line or a paragraph ends, where a sentence ends within a line,
    and where a line ends. The text's end is none: it is cut at an arbitrary token.

    Every place lies between a token that ends in a visible character and whitespace, so the
    needle (which opens with a space) is set off on both sides: at a line end it closes the line
    before the line break instead of opening the next line glued to its first word. A sentence
    ends at ``.``, ``!`` or ``?`` (not "e.g." and the like, not "3.10"), within a line only where
    one or two spaces follow and no "|" (not in a table cell); a paragraph at a blank line. A line
    break alone is no sentence end: the haystack's prose is wrapped, and a needle at a wrapped
    line's end makes the rest of the sentence read as its continuation. Line ends serve only where
    a table or code holds no sentence end nearby.
    """
    distinct = sorted(set(ids))
    decoded = dict(zip(distinct, tokenizer.batch_decode([[i] for i in distinct])))
    texts = [decoded[i] for i in ids]
    # the whitespace that opens the text from each token on (the question, after the end, opens with some)
    # and the first visible character after it
    opening, visible = [""] * len(ids) + [" "], [""] * (len(ids) + 1)
    for p in range(len(ids) - 1, -1, -1):
        text = texts[p]
        body = text.lstrip()
        lead = text[: len(text) - len(body)]
        opening[p] = lead + opening[p + 1] if not body else lead
        visible[p] = body[:1] or visible[p + 1]
    tiers: tuple[set[int], ...] = ({0}, {0}, {0})
    tail = ""  # the text's last characters
    for p, text in enumerate(texts):
        tail = (tail + text)[-8:]
        gap = opening[p + 1]
        if not text or text[-1].isspace() or not gap:
            continue
        sentence = tail.endswith(SENTENCE_END) and not ABBREVIATION.search(tail)
        lines = gap.count("\n")
        if (sentence and lines) or lines >= 2:
            tiers[0].add(p + 1)
        elif sentence and len(gap) <= 2 and visible[p + 1] != "|":  # prose's spaces, not a table cell's
            tiers[1].add(p + 1)
        if lines:
            tiers[2].add(p + 1)
    return tuple(sorted(tier) for tier in tiers)


def _snap(target: int, tiers: tuple[list[int], ...]) -> int:
    """The nearest position of the first tier that has one within ``SNAP`` tokens, else ``target``."""
    for boundaries in tiers:
        nearest = min(boundaries, key=lambda b: (abs(b - target), b))
        if abs(nearest - target) <= SNAP:
            return nearest
    return target


def _assemble(tokenizer, framing, haystack, task, length, depth, seed, options, rng, intro, needles, questions) -> RecallCase:
    intro_ids, after = list(framing.opening) + _encode(tokenizer, intro), list(framing.after_context)
    turns = [(framing.question_ids(question), expected) for question, expected in questions]
    question_ids = turns[0][0]
    needle_ids = [_encode(tokenizer, sentence) for sentence, _ in needles]
    room = length - len(intro_ids) - len(question_ids) - len(after) - sum(map(len, needle_ids))
    spread = sum(isinstance(where, tuple) and where[0] == "spread" for _, where in needles)
    if spread and room < spread * SPACING:
        raise Crowded(task, spread, length - room + spread * SPACING)
    if room < 1:
        raise ValueError(f"recall task {task!r}: length {length} is too short for the prompt: use at least {length - room + 1} tokens")
    if len(haystack) < room:
        raise ValueError(f"the haystack has {len(haystack)} tokens, a {length}-token {task} case needs {room}: use a longer text")
    starts = _boundaries(tokenizer, haystack[: len(haystack) - room + 1])[0]  # it opens with a line break
    offset = rng.choice(starts) if len(starts) > 1 else 0
    offset = min(offset, len(haystack) - room)
    text = haystack[offset : offset + room]
    boundaries = _boundaries(tokenizer, text)
    places = []
    for _, where in needles:
        if where is None:
            target = rng.randrange(room + 1)
        elif where == "asked":
            target = round(room * depth)
        elif where[0] == "spread":  # one of needles spread evenly from the depth, wrapping round
            _, index, count = where
            target = round(room * (depth if index == 0 else (depth + index / count) % 1.0))
        else:  # a chain link: from the depth to the end, evenly
            _, index, links = where
            target = round(room * (depth + (1 - depth) * index / links))
        places.append(_snap(target, boundaries))
    order = sorted(range(len(needles)), key=lambda i: (places[i], i))
    ids, placed, cursor = list(intro_ids), [None] * len(needles), 0
    for i in order:
        ids += text[cursor : places[i]]
        cursor = places[i]
        placed[i] = Needle(needles[i][0], len(ids), len(ids) + len(needle_ids[i]), places[i] / room)
        ids += needle_ids[i]
    ids += text[cursor:] + after
    answer = max(len(_encode(tokenizer, " " + ", ".join(expected) + ".")) for _, expected in turns) + 4
    later = tuple(Turn(torch.tensor([ids_]), tuple(expected)) for ids_, expected in turns[1:])
    return RecallCase(
        task, length, depth, seed, options, torch.tensor([ids]), torch.tensor([question_ids]), tuple(turns[0][1]), tuple(placed), answer, later
    )


class Crowded(ValueError):
    """Needles spread apart (``niah_multiturn``) that do not each get :data:`SPACING` tokens of the
    haystack at this length."""

    def __init__(self, task: str, turns: int, estimate: int) -> None:
        super().__init__(f"recall task {task!r}: turns={turns} do not fit")
        self.task, self.turns, self.estimate = task, turns, estimate

    def fixed(self, make, length: int, options: dict) -> str:
        """The message naming both fixes, each found by trying it (keys, and so needles, are drawn
        anew at another length or count): the most turns this length holds, the least length
        that holds these turns (from the estimate up)."""

        def fits(length: int, turns: int) -> bool:
            try:
                make(length, {**options, "turns": turns})
            except ValueError:
                return False
            return True

        fewer = next((turns for turns in range(self.turns - 1, 0, -1) if fits(length, turns)), 0)
        longer = next((n for n in range(self.estimate, 2 * self.estimate, 8) if fits(n, self.turns)), 2 * self.estimate)
        ask = f"ask for turns={fewer} or fewer, or " if fewer else ""
        return (
            f"recall task {self.task!r}: turns={self.turns} needs {self.turns} needles with {SPACING} tokens of text each, "
            f"more than a {length}-token prompt holds: {ask}use a length of at least {longer} tokens"
        )


def _cwe(tokenizer, framing, haystack, words, length, depth, seed, options, rng) -> RecallCase:
    """A numbered list: ``words`` common words ``common_freq`` times each, then rare words
    ``rare_freq`` times each while they fit, the last few tokens filled with haystack prose.

    Each entry is encoded as the pieces ``"{n}."``, ``" {word}"`` and ``"\n"``, so the list's
    length in tokens is the sum of its pieces' and the prompt comes out at exactly ``length``.
    """
    count = options["words"]
    question_ids, after = framing.question_ids(_question(CWE_QUESTION, count=count)), list(framing.after_context)
    intro_ids = list(framing.opening) + _encode(tokenizer, CWE_INTRO)
    drawn = rng.sample(words, len(words))
    common, rare = drawn[:count], drawn[count:]
    room = length - len(intro_ids) - len(question_ids) - len(after)
    pieces: dict[str, list[int]] = {}

    def piece(text: str) -> list[int]:
        if text not in pieces:
            pieces[text] = _encode(tokenizer, text)
        return pieces[text]

    def cost(entries: int, word: str) -> int:  # the tokens of entry number ``entries + 1``
        return len(piece(f"{entries + 1}.")) + len(piece(f" {word}")) + len(piece("\n"))

    items = [word for word in common for _ in range(options["common_freq"])]
    # the numbers' lengths do not depend on the order, the words' do not depend on the numbers
    numbers = sum(len(piece(f"{n + 1}.")) + len(piece("\n")) for n in range(len(items)))
    used = numbers + sum(len(piece(f" {word}")) for word in items)
    if used > room:
        raise ValueError(
            f"recall task 'cwe': length {length} cannot hold {count} words x {options['common_freq']}: "
            f"use at least {length - room + used} tokens, or lower common_freq / words"
        )
    for word in rare:  # rare words join rare_freq at a time while they fit
        extra = sum(cost(len(items) + k, word) for k in range(options["rare_freq"]))
        if used + extra > room:
            break
        items += [word] * options["rare_freq"]
        used += extra
    rng.shuffle(items)
    ids = list(intro_ids)
    for n, word in enumerate(items):
        ids += piece(f"{n + 1}.") + piece(f" {word}") + piece("\n")
    ids += haystack[: length - len(question_ids) - len(after) - len(ids)] + after
    answer = len(_encode(tokenizer, " " + ", ".join(common) + ".")) + 4
    return RecallCase(
        "cwe", length, depth, seed, options, torch.tensor([ids]), torch.tensor([question_ids]), tuple(common), (), answer
    )
