"""The SGLang emulator's constrained decoding (sglang_emulator/grammar.py) behaves as SGLang's with its
default backend, xgrammar (the real library): each test names the SGLang function it follows. The
output is checked against an independent teacher-forced reference (grammar_reference.py)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator

import httpx
import pytest
import xgrammar
from grammar_reference import masked_score, tokenizer_info
from rolloutfleet_testkit.processes import serve_app
from rolloutfleet_testkit.sglang_emulator.model import load_model, score
from rolloutfleet_testkit.sglang_emulator.protocol import BadRequest, constraint_of
from rolloutfleet_testkit.sglang_emulator.server import create_app
from transformers import AutoTokenizer

ANSWER = 'root ::= "The answer is " ( "yes" | "no" ) "."'


@pytest.fixture(scope="module")
def tokenizer(test_tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(test_tokenizer_dir))


@pytest.fixture(scope="module")
def engine(test_tokenizer_dir) -> Iterator[str]:
    with serve_app(create_app(str(test_tokenizer_dir), seed=0, deterministic_inference=True)) as url:
        yield url


@contextlib.contextmanager
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as http:
        yield http


def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": "Is the sky blue? Answer yes or no."}], add_generation_prompt=True
    )["input_ids"]


def generate(url: str, ids: list[int], **sampling) -> httpx.Response:
    with client() as http:
        return http.post(
            f"{url}/generate",
            json={"input_ids": ids, "sampling_params": sampling, "return_logprob": True},
        )


# --- SamplingParams.verify; Scheduler.handle_generate_request -------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        {"ebnf": ANSWER, "json_schema": "{}"},
        {"regex": "a+", "ebnf": ANSWER},
        {"regex": "a+", "json_schema": "{}", "structural_tag": "{}"},
    ],
)
def test_two_grammars_are_refused_with_sglangs_message(engine, tokenizer, params):
    refused = generate(engine, prompt_ids(tokenizer), max_new_tokens=8, **params)
    assert refused.status_code == 400
    assert refused.json() == {"error": {"message": "Only one of regex, json_schema, or ebnf can be set."}}


def test_the_scheduler_takes_the_first_grammar_field_set():
    assert constraint_of({"ebnf": ANSWER, "structural_tag": "{}"}) == ("ebnf", ANSWER)
    assert constraint_of({"structural_tag": "{}"}) == ("structural_tag", "{}")
    assert constraint_of({"max_new_tokens": 3}) is None
    with pytest.raises(BadRequest):
        constraint_of({"ebnf": 5})


def test_a_grammar_that_does_not_compile_is_a_400(engine, tokenizer):
    refused = generate(engine, prompt_ids(tokenizer), max_new_tokens=8, ebnf="root ::= undefined_rule")
    assert refused.status_code == 400
    assert refused.json()["error"]["message"].startswith("Invalid grammar request: ebnf:")


# --- XGrammarGrammarObject: the mask before each token; Req.check_finished --------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0])
def test_every_token_is_masked_to_the_grammar_and_the_grammars_end_finishes(
    engine, tokenizer, test_tokenizer_dir, temperature
):
    ids = prompt_ids(tokenizer)
    model = load_model(len(tokenizer), seed=0, eos_token_id=tokenizer.eos_token_id)
    info = tokenizer_info(tokenizer)
    for seed in range(5):
        answer = generate(
            engine, ids, max_new_tokens=64, temperature=temperature, sampling_seed=seed, ebnf=ANSWER
        ).json()
        output = answer["output_ids"]
        assert tokenizer.decode(output, skip_special_tokens=True) in (
            "The answer is yes.",
            "The answer is no.",
        )
        # The grammar ended on the stop token it allows last: a stop finish matching it.
        assert output[-1] == tokenizer.eos_token_id
        assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": tokenizer.eos_token_id}
        reference, ended = masked_score(model, info, ANSWER, ids, output, temperature)
        assert ended
        logprobs = [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]
        # The logprobs are of the masked distribution (apply_vocab_mask comes before the sampler).
        assert logprobs == pytest.approx(reference, abs=1e-4)
        if temperature:
            assert logprobs != pytest.approx(score(model, ids, output, temperature), abs=1e-3)


def test_without_a_grammar_the_same_model_writes_anything(engine, tokenizer):
    """What makes the tests above able to fail: the model alone does not answer in the grammar."""
    ids = prompt_ids(tokenizer)
    texts = {
        tokenizer.decode(
            generate(engine, ids, max_new_tokens=64, sampling_seed=seed).json()["output_ids"],
            skip_special_tokens=True,
        )
        for seed in range(5)
    }
    assert not texts & {"The answer is yes.", "The answer is no."}


def test_the_length_limit_comes_before_the_grammars_end(engine, tokenizer):
    answer = generate(engine, prompt_ids(tokenizer), max_new_tokens=3, ebnf=ANSWER, sampling_seed=1).json()
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_json_schema_regex_and_structural_tag_constrain_too(engine, tokenizer):
    """dispatch_json (any whitespace between tokens, SGLang's default), dispatch_regex,
    dispatch_structural_tag of XGrammarGrammarBackend."""
    ids = prompt_ids(tokenizer)
    schema = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    answer = generate(engine, ids, max_new_tokens=48, json_schema=schema, sampling_seed=3).json()
    text = tokenizer.decode(answer["output_ids"], skip_special_tokens=True)
    # Whitespace lets a random model run to the length limit; every token it wrote fits the schema.
    matcher = xgrammar.GrammarMatcher(
        xgrammar.GrammarCompiler(tokenizer_info(tokenizer)).compile_json_schema(schema)
    )
    assert text.lstrip().startswith("{") and matcher.accept_string(text)
    digits = generate(engine, ids, max_new_tokens=64, regex="[0-9]{3}", sampling_seed=3).json()
    assert re.fullmatch("[0-9]{3}", tokenizer.decode(digits["output_ids"], skip_special_tokens=True))
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "tagged"}}
    tagged = generate(engine, ids, max_new_tokens=64, structural_tag=json.dumps(tag), sampling_seed=3).json()
    assert tokenizer.decode(tagged["output_ids"], skip_special_tokens=True) == "tagged"


def test_each_sample_of_a_group_follows_the_grammar_on_its_own(engine, tokenizer):
    """_handle_batch_request: each of the n samples is its own request, with its own grammar state."""
    samples = generate(
        engine, prompt_ids(tokenizer), max_new_tokens=64, n=4, temperature=1.0, ebnf=ANSWER
    ).json()
    texts = [tokenizer.decode(s["output_ids"], skip_special_tokens=True) for s in samples]
    assert len(texts) == 4 and set(texts) <= {"The answer is yes.", "The answer is no."}
