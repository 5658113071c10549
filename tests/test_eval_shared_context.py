"""The shared-context protocols: ``multiturn`` answers as ``generate()`` over the conversation so
far, ``multiquery`` as ``generate()`` over the context and each question; a bounded cache after
each turn is the one a chat client builds by feeding the same tokens; the copy each question gets;
where answers end; the chat template's pieces."""

from __future__ import annotations

import inspect

import pytest
import torch
from tiny_models import char_tokenizer, random_ids, tiny_llama
from torch import nn
from transformers import DynamicCache

from eval.cache_copy import copy_cache
from eval.dialogue import Framing, Question, chat, plain
from eval.protocols import PROTOCOLS, first_line
from hf_kvpolicies import from_spec
from hf_kvpolicies.specs import parse_spec, policy_constructor

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 6
BOUNDED = ["window:window=16", "sink:sink_tokens=2,window=14", "h2o:heavy=8,recent=8", "snapkv:budget=16,window=4,kernel=3", "kvzip:budget=16,recent=4,sinks=2"]


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def build(model, spec):
    """A cache of ``spec`` (KVzip with the character tokenizer: the tiny model has none saved)."""
    constructor = policy_constructor(parse_spec(spec)[0])
    if "tokenizer" in inspect.signature(constructor).parameters:
        return constructor(model, **parse_spec(spec)[1], tokenizer=char_tokenizer())
    return from_spec(model, spec)


def recording(model, spec):
    """A cache factory that keeps the caches it made."""
    made = []

    def make():
        made.append(build(model, spec))
        return made[-1]

    return make, made


def cut(tokens, framing):
    """An answer by its definition: greedy tokens up to the first that ends it."""
    answer = []
    for token in tokens:
        if framing.ends(answer, token):
            break
        answer.append(token)
    return answer


def stop_framing(model, tokenizer, prompt):
    """A chat-like framing whose stop token is one the model writes third after ``prompt`` (so
    that answers do end early) and whose turns are joined by two tokens."""
    third = model.generate(prompt, max_new_tokens=3, do_sample=False)[0, -1].item()
    return Framing(tokenizer, (), between=(5, 6), stops=frozenset({third}), chat=True)


def case(seed=0, rows=1):
    """A context and three questions of different lengths."""
    return random_ids(rows, 40, seed=seed), [random_ids(rows, length, seed=seed + length) for length in (7, 9, 5)]


@pytest.mark.parametrize("framed", ["plain", "stops"])
def test_multiturn_with_the_full_cache_answers_as_generate_over_the_conversation_so_far(model, tokenizer, framed):
    context, questions = case()
    framing = plain(tokenizer) if framed == "plain" else stop_framing(model, tokenizer, torch.cat([context, questions[0]], 1))
    out = PROTOCOLS["multiturn"].answer(model, tokenizer, context, questions, lambda: from_spec(model, "full"), NEW, framing=framing)
    conversation = context
    for turn, question in enumerate(questions):
        between = torch.tensor([framing.between], dtype=torch.long).reshape(1, -1)
        conversation = torch.cat([conversation, *([between] if turn else []), question], 1)
        reference = model.generate(conversation, max_new_tokens=NEW, do_sample=False, cache=DynamicCache())
        answer = cut(reference[0, conversation.shape[1] :].tolist(), framing)
        assert out[turn].texts == [first_line(tokenizer.decode(answer, skip_special_tokens=True))], turn
        assert out[turn].fed_tokens == conversation.shape[1] == out[turn].kept_tokens
        conversation = torch.cat([conversation, torch.tensor([answer], dtype=torch.long)], 1)
    if framed == "stops":
        assert any(len(text) < NEW for answers in out for text in answers.texts)  # the stop did end answers early


def test_multiquery_with_the_full_cache_answers_as_generate_for_the_context_and_each_question(model, tokenizer):
    context, questions = case(seed=3, rows=2)  # two rows share every forward
    framing = stop_framing(model, tokenizer, torch.cat([context[:1], questions[0][:1]], 1))
    out = PROTOCOLS["multiquery"].answer(model, tokenizer, context, questions, lambda: from_spec(model, "full"), NEW, framing=framing)
    for turn, question in enumerate(questions):
        for row in range(2):
            prompt = torch.cat([context[row : row + 1], question[row : row + 1]], 1)
            reference = model.generate(prompt, max_new_tokens=NEW, do_sample=False, cache=DynamicCache())
            answer = cut(reference[0, prompt.shape[1] :].tolist(), framing)
            assert out[turn].texts[row] == first_line(tokenizer.decode(answer, skip_special_tokens=True)), (turn, row)
        assert out[turn].fed_tokens == 40 + question.shape[1]


@torch.no_grad()
def chat_client(model, context, questions, cache, framing, new_tokens):
    """A conversation driven by hand: the context in one forward, then each turn's question (after
    ``between``) in one forward and its answer greedily, one token per forward, until it ends."""
    model(context, cache=cache)
    answers = []
    for turn, question in enumerate(questions):
        ids = torch.cat([torch.tensor([framing.between], dtype=torch.long), question], 1) if turn else question
        logits = model(ids, cache=cache).logits[0, -1]
        answer = []
        while len(answer) < new_tokens:
            token = logits.argmax().item()
            if framing.ends(answer, token):
                break
            answer.append(token)
            logits = model(torch.tensor([[token]]), cache=cache).logits[0, -1]
        answers.append(answer)
    return answers


def kept(cache) -> int:
    """Tokens kept over the layers (adaptive layer budgets share the layers' total)."""
    return sum(cache.kept_tokens(i) for i in range(len(cache.layers)))


def same_cache(a, b) -> bool:
    return a.get_seq_length() == b.get_seq_length() and all(
        torch.equal(ka, kb) and torch.equal(va, vb) for (ka, va, _), (kb, vb, _) in zip(a, b)
    )


@pytest.mark.parametrize("spec", BOUNDED)
def test_a_bounded_cache_after_each_turn_is_the_one_feeding_the_same_tokens_gives(model, tokenizer, spec):
    context, questions = case(seed=5)
    framing = stop_framing(model, tokenizer, torch.cat([context, questions[0]], 1))
    for turns in range(1, len(questions) + 1):
        make, made = recording(model, spec)
        out = PROTOCOLS["multiturn"].answer(model, tokenizer, context, questions[:turns], make, NEW, framing=framing)
        reference = build(model, spec)
        answers = chat_client(model, context, questions[:turns], reference, framing, NEW)
        assert [a.texts[0] for a in out] == [first_line(tokenizer.decode(a, skip_special_tokens=True)) for a in answers]
        assert same_cache(made[0], reference), (spec, turns)
        assert kept(made[0]) == 16 * len(made[0].layers) < made[0].get_seq_length() * len(made[0].layers)


@pytest.mark.parametrize("spec", BOUNDED)
def test_multiquery_answers_each_question_as_a_cache_of_its_own_would(model, tokenizer, spec):
    context, questions = case(seed=7)
    framing = stop_framing(model, tokenizer, torch.cat([context, questions[0]], 1))
    make, made = recording(model, spec)
    out = PROTOCOLS["multiquery"].answer(model, tokenizer, context, questions, make, NEW, framing=framing)
    assert len(made) == 1  # the context was prefilled once
    for turn, question in enumerate(questions):
        alone = build(model, spec)
        [answer] = chat_client(model, context, [question], alone, framing, NEW)
        assert out[turn].texts == [first_line(tokenizer.decode(answer, skip_special_tokens=True))], (spec, turn)
    assert kept(made[0]) == 16 * len(made[0].layers)


def test_a_copied_cache_holds_its_own_state_and_the_model_itself(model):
    cache = build(model, "kvzip:budget=16,recent=4,sinks=2")
    with torch.no_grad():
        model(random_ids(1, 40), cache=cache)
        copied = copy_cache(cache, model)
        before = [(k.clone(), v.clone()) for k, v, _ in cache]
        assert same_cache(copied, cache)
        for _ in range(3):
            model(random_ids(1, 1, seed=9), cache=copied)
    assert copied.get_seq_length() == 43 and cache.get_seq_length() == 40
    assert all(torch.equal(k, kb) and torch.equal(v, vb) for (k, v, _), (kb, vb) in zip(cache, before))  # untouched
    for original, copy in zip(cache.layers, copied.layers):
        assert copy.storage is not original.storage and copy.retention is not original.retention
    assert modules_of(copied) == modules_of(cache) and id(model) in modules_of(copied)  # the same modules: none copied


def modules_of(root) -> set[int]:
    """The ids of the modules reachable from ``root`` through attributes and containers."""
    found, seen, stack = set(), set(), [root]
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, (str, bytes, int, float, torch.Tensor)):
            continue
        seen.add(id(item))
        if isinstance(item, nn.Module):
            found.add(id(item))
            continue
        if isinstance(item, dict):
            stack += item.values()
        elif isinstance(item, (list, tuple, set)):
            stack += item
        else:
            stack += getattr(item, "__dict__", {}).values()
    return found


def test_a_plain_answer_ends_with_its_first_line_and_at_the_end_of_sequence(tokenizer):
    framing = plain(tokenizer)
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    newline = ids("\n")[0]
    assert not framing.ends([], newline) and not framing.ends(ids("\n"), newline)  # line breaks the answer opens with
    assert framing.ends(ids(" 42"), newline) and framing.ends([], tokenizer.eos_token_id)
    assert not framing.ends(ids(" 4"), ids("2")[0])


def test_the_chat_template_frames_a_conversation_as_the_template_renders_it(embedded):
    _, tokenizer = embedded
    framing = chat(tokenizer)
    questions = [Question("\nWhat is the colour?", " The colour is"), Question("\nAnd the size?", " The size is")]
    answer = tokenizer(" blue.", add_special_tokens=False).input_ids
    ids = [*framing.opening, *framing.encode("Some document."), *framing.after_context, *framing.question_ids(questions[0]),
           *answer, *framing.between, *framing.question_ids(questions[1])]
    messages = [
        {"role": "user", "content": "Some document.\n\nWhat is the colour?"}, {"role": "assistant", "content": "The colour is blue."},
        {"role": "user", "content": "And the size?"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + "The size is"
    assert tokenizer.decode(ids) == rendered
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in framing.stops and framing.ends(answer, tokenizer.eos_token_id)
    assert not framing.ends([], tokenizer("\n", add_special_tokens=False).input_ids[0])  # a chat answer may hold line breaks


def test_a_template_that_rewrites_earlier_turns_or_none_is_refused_with_the_fix(tokenizer):
    with pytest.raises(ValueError, match="has no chat template: evaluate without --chat-template"):
        chat(tokenizer)
    rewriting = char_tokenizer()
    rewriting.chat_template = (  # earlier answers are dropped once a question follows them
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<a></a>{% else %}"
        "<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    with pytest.raises(ValueError, match="renders a turn differently once another follows .*: evaluate without --chat-template"):
        chat(rewriting)
