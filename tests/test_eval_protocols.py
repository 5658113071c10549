"""Protocols: equal for the full cache; ``context`` against a naive masked reference; budgets."""

from __future__ import annotations

import inspect

import pytest
import torch
from tiny_models import char_tokenizer, random_ids, tiny_llama
from transformers import DynamicCache

from eval.budgets import PolicyRun, expand, sweeps_budget
from eval.protocols import PROTOCOLS, answer, protocol_independent
from hf_kvpolicies import available_policies, from_spec
from hf_kvpolicies.specs import parse_spec, policy_constructor

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 6


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def greedy_ids(answers, tokenizer):
    return [tokenizer(text, add_special_tokens=False).input_ids for text in answers.texts]


def test_every_protocol_gives_the_full_cache_the_same_answers(model, tokenizer):
    context, question = random_ids(2, 40, seed=1), random_ids(2, 9, seed=2)
    reference = model.generate(torch.cat([context, question], 1), max_new_tokens=NEW, do_sample=False, cache=DynamicCache())
    expected = tokenizer.batch_decode(reference[:, -NEW:], skip_special_tokens=True)
    for protocol in [name for name, known in PROTOCOLS.items() if known.lossless_same]:  # the others: test_eval_shared_context.py
        for chunk in (1, 16):
            whole = (torch.cat([context, question], 1), question[:, :0]) if PROTOCOLS[protocol].whole_prompt else (context, question)
            out = answer(model, tokenizer, *whole, lambda: from_spec(model, "full"), protocol, NEW, chunk)
            assert out.texts == [text.lstrip("\n").split("\n", 1)[0] for text in expected], (protocol, chunk)
            fed = whole[0].shape[1] - (protocol == "last-token-kept")  # its last token is decoded, after the trim
            assert out.kept_tokens == out.fed_tokens == fed and out.governed_layers == 2


@torch.no_grad()
def naive_context_protocol(model, context, question, window, steps):
    """kvpress's pipeline from its definition: the context attends causally to itself; every later
    token attends to the last ``window`` context tokens and to the question and answer so far.
    One full-sequence forward per token under that explicit mask (no cache)."""
    ids = torch.cat([context, question], 1)
    n = context.shape[1]
    out = []
    for _ in range(steps):
        length = ids.shape[1]
        allowed = torch.tril(torch.ones(length, length, dtype=torch.bool))
        allowed[n:, : n - window] = False
        logits = model(ids, attention_mask=allowed[None, None].expand(ids.shape[0], 1, -1, -1)).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(token)
        ids = torch.cat([ids, token], 1)
    return torch.cat(out, 1)


def test_the_context_protocol_keeps_the_question_and_answer_outside_the_budget(model, tokenizer):
    context, question = random_ids(1, 60, seed=3), random_ids(1, 12, seed=4)
    reference = naive_context_protocol(model, context, question, window=10, steps=NEW)
    out = answer(model, tokenizer, context, question, lambda: from_spec(model, "window:window=10"), "context", NEW)
    assert out.texts == [tokenizer.decode(reference[0], skip_special_tokens=True).lstrip("\n").split("\n", 1)[0]]
    assert (out.fed_tokens, out.kept_tokens) == (60, 10)
    streamed = answer(model, tokenizer, torch.cat([context, question], 1), question[:, :0], lambda: from_spec(model, "window:window=10"), "streamed", NEW)
    assert streamed.kept_tokens == 10 and streamed.fed_tokens == 72  # the question counts against the budget there


def test_last_token_kept_decodes_the_prompts_last_token_from_what_was_kept(model, tokenizer):
    """kvpress's needle protocol: with every token kept it answers as a prefill does (the test
    above); with a window the last prompt token no longer sees what the prefill evicted, and the
    answer is what doing it by hand gives."""
    ids = random_ids(1, 48)
    cache = from_spec(model, "window:window=8")
    with torch.no_grad():
        model(ids[:, :-1], cache=cache)
        last = model(ids[:, -1:], cache=cache).logits[0, -1]
        assert not torch.allclose(last, model(ids).logits[0, -1], atol=1e-4)  # the window changed what it saw
        by_hand = [last.argmax()]
        for _ in range(NEW - 1):
            by_hand.append(model(by_hand[-1].view(1, 1), cache=cache).logits[0, -1].argmax())
    out = answer(model, tokenizer, ids, ids[:, :0], lambda: from_spec(model, "window:window=8"), "last-token-kept", NEW)
    assert out.texts == [tokenizer.decode(torch.stack(by_hand), skip_special_tokens=True).lstrip("\n").split("\n", 1)[0]]
    assert (out.fed_tokens, out.kept_tokens) == (47, 8)


def test_the_context_protocol_is_refused_on_sliding_window_models(tokenizer):
    from tiny_models import tiny_gemma3

    model = tiny_gemma3()
    ids = random_ids(1, 20)
    with pytest.raises(ValueError, match="sliding-window layers .* use --protocol streamed or prefill"):
        answer(model, tokenizer, ids, ids[:, :4], lambda: from_spec(model, "full"), "context", 2)
    assert len(answer(model, tokenizer, ids, ids[:, :0], lambda: from_spec(model, "window:window=6"), "prefill", 2).texts) == 1


def test_which_policies_the_protocol_cannot_change():
    assert protocol_independent("full")
    assert not protocol_independent("fp8")  # fp8 storage: a prefill attends to native keys, a stream to its own
    assert not protocol_independent("window:window=8") and not protocol_independent("h2o:heavy=2,recent=2")


def test_budgets_map_onto_each_policy_and_explicit_parameters_are_kept():
    runs = expand(["full", "fp8", "window", "sink:positions=absolute", "h2o", "window:window=7"], budgets=(64, 6))
    assert [(run.label, run.spec(1000)) for run in runs] == [
        ("full", "full"),
        ("fp8", "fp8"),
        ("window @64", "window:window=64"),
        ("window @6", "window:window=6"),
        ("sink:positions=absolute @64", "sink:sink_tokens=4,window=60,positions=absolute"),
        ("sink:positions=absolute @6", "sink:sink_tokens=3,window=3,positions=absolute"),
        ("h2o @64", "h2o:heavy=32,recent=32"),
        ("h2o @6", "h2o:heavy=3,recent=3"),
        ("window:window=7", "window:window=7"),
    ]
    ratio = PolicyRun("h2o:storage=fp8", ratio=0.25)
    assert ratio.spec(200) == "h2o:heavy=25,recent=25,storage=fp8" and ratio.budget_for(200) == 50
    assert sweeps_budget("h2o:storage=fp8") and not sweeps_budget("h2o:heavy=4") and not sweeps_budget("full")
    assert sweeps_budget("snapkv:kernel=7") and not sweeps_budget("snapkv:budget=64")  # a shaping key keeps the sweep
    assert PolicyRun("snapkv:kernel=7", budget=64).spec(64) == "snapkv:budget=64,window=16,kernel=7"


@pytest.mark.parametrize("name", [n for n in available_policies() if policy_constructor(n).budget_parameters(16) is not None])
def test_every_registered_bounded_policy_keeps_its_budget(model, name):
    """Whatever the library registers: a class that maps budgets keeps exactly that many tokens."""
    spec = PolicyRun(name, budget=16).spec(100)
    if "tokenizer" in inspect.signature(policy_constructor(name)).parameters:  # KVzip: no tokenizer beside a tiny model
        cache = policy_constructor(name)(model, **parse_spec(spec)[1], tokenizer=char_tokenizer())
    else:
        cache = from_spec(model, spec)
    with torch.no_grad():
        model(random_ids(1, 100), cache=cache)
        model(random_ids(1, 1), cache=cache)
    governed = [i for i, decides in enumerate(cache.governed) if decides]
    assert sum(cache.kept_tokens(i) for i in governed) == 16 * len(governed)  # adaptive budgets share the total


def test_a_retention_in_another_storage_is_a_family_of_its_own():
    """Families give each figure its looks and lines: a window in int4 must not share the native
    window's line, nor the full cache in int2 the full cache's marker."""
    from eval.budgets import PolicyRun

    assert [PolicyRun(spec).family for spec in ("full", "full:storage=native", "full:storage=int4", "window:window=8,storage=int2:residual=64", "fp8")] == [
        "full", "full", "full int4", "window int2", "fp8",
    ]
