#!/usr/bin/env python3
"""Structured outputs end to end with the official `openai` client and the
default model: `client.chat.completions.parse(response_format=Model)` with
nested and Optional pydantic models (pydantic itself validates what comes
back: types, bounds, lengths, dates), vLLM's structured_outputs
{json, regex, choice, grammar, json_object} and the older guided_* fields on
chat and completions, streamed too, and the 400s for what cannot be honoured.

Prints one line per test and ends with "N passed, N failed".
"""
import datetime
import json
import os
import re
import sys
from typing import List, Literal, Optional

sys.path.insert(0, os.path.dirname(__file__))
import sluice_testlib as lib  # noqa: E402

NAME = "smol"


def client(port):
    from openai import OpenAI
    return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=900)


def models():
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        kind: Literal["cat", "dog", "fish"]
        name: str = Field(max_length=12)
        age: Optional[int] = Field(default=None, ge=0, le=30)

    class Person(BaseModel):
        name: str = Field(min_length=1, max_length=16)
        age: int = Field(ge=18, le=99)
        height_m: float = Field(gt=0.5, le=2.5)
        birthday: datetime.date
        pets: List[Pet] = Field(max_length=1)
        best_friend: Optional[Pet] = None
    return Pet, Person


def test_parse_nested_optional(c):
    """parse() builds a strict schema from the models ($defs/$ref, anyOf with
    null, minimum/maximum, maxLength, format date); pydantic then
    validates the reply, so any byte the guide let through wrongly fails here."""
    _, Person = models()
    msgs = [{"role": "system", "content": "You write JSON records."},
            {"role": "user", "content": "Invent a person with a pet."}]
    r = c.chat.completions.parse(model=NAME, messages=msgs, response_format=Person, max_tokens=400, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "stop", ch
    p = ch.message.parsed
    assert isinstance(p, Person), ch.message
    assert 18 <= p.age <= 99 and 0.5 < p.height_m <= 2.5 and 1 <= len(p.name) <= 16 and len(p.pets) <= 1, p
    # the text is the JSON the schema describes, and pydantic agrees with it field for field
    assert Person.model_validate_json(ch.message.content) == p


def test_structured_outputs_chat(c):
    """structured_outputs regex / choice / grammar / json / json_object through extra_body."""
    msgs = [{"role": "user", "content": "Give me a product code."}]
    rx = r"[A-Z]{3}-\d{2,4}(-[a-z]+)?"
    r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=30, temperature=0.8, seed=3,
                                  extra_body={"structured_outputs": {"regex": rx}})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(rx, r.choices[0].message.content), r.choices[0]
    colors = ["red", "green", "light blue"]
    r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Pick a color."}], max_tokens=10,
                                  extra_body={"structured_outputs": {"choice": colors}})
    assert r.choices[0].message.content in colors, r.choices[0]
    gbnf = 'root ::= "(" num ("," ws num)* ")"\nnum ::= "-"? [1-9] [0-9]{0,2}\nws ::= " "?\n'
    r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "A tuple of numbers?"}],
                                  max_tokens=40, temperature=0.7, seed=5,
                                  extra_body={"structured_outputs": {"grammar": gbnf}})
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    assert re.fullmatch(r"\(-?[1-9][0-9]{0,2}(, ?-?[1-9][0-9]{0,2})*\)", r.choices[0].message.content), r.choices[0]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "maxItems": 3}},
              "required": ["n", "tags"]}
    for body in ({"structured_outputs": {"json": schema}}, {"guided_json": json.dumps(schema)}):
        r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=120, temperature=0, extra_body=body)
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        obj = json.loads(r.choices[0].message.content)
        assert 1 <= obj["n"] <= 9 and set(obj["tags"]) <= {"a", "b", 3} and len(obj["tags"]) <= 3, obj
    r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=120, temperature=0,
                                  extra_body={"structured_outputs": {"json_object": True}})
    assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0]


def test_guided_completions_and_stream(c):
    """The older guided_* names on /v1/completions (guided_decoding_backend
    accepted), and a streamed regex whose deltas add up to a match."""
    r = c.completions.create(model=NAME, prompt="The date today is", max_tokens=20, temperature=0.9, seed=2,
                             extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}", "guided_decoding_backend": "xgrammar"})
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.choices[0].text) and r.choices[0].finish_reason == "stop", r.choices[0]
    r = c.completions.create(model=NAME, prompt="Is the sky blue? Answer:", max_tokens=5,
                             extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no"), r.choices[0]
    r = c.completions.create(model=NAME, prompt="Numbers:", max_tokens=30,
                             extra_body={"guided_grammar": 'root ::= num (" " num){2}\nnum ::= [0-9]{1,3}'})
    assert re.fullmatch(r"[0-9]{1,3}( [0-9]{1,3}){2}", r.choices[0].text), r.choices[0]
    text, finish = "", None
    for chunk in c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "An IP address?"}],
                                           max_tokens=30, stream=True, temperature=0.5, seed=9,
                                           extra_body={"structured_outputs": {"regex": r"(\d{1,3}\.){3}\d{1,3}"}}):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert finish == "stop" and re.fullmatch(r"(\d{1,3}\.){3}\d{1,3}", text), (finish, text)


def test_refusals(c):
    """What cannot be honoured is a 400 naming the field, and the server keeps serving."""
    from openai import BadRequestError
    msgs = [{"role": "user", "content": "hi"}]
    bad = [
        ({"structured_outputs": {"grammar": 'root ::= "a" root | "b"'}}, "structured_outputs.grammar", "recursive"),
        ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs.regex", "lookaround"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "combined"),
        ({"guided_json": {"type": "object", "properties": {"a": {"not": {}}}}}, "guided_json", "'not'"),
        ({"guided_choice": "yes"}, "guided_choice", "array"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "combined"),
    ]
    for body, param, says in bad:
        try:
            c.chat.completions.create(model=NAME, messages=msgs, max_tokens=5, extra_body=body)
            raise AssertionError(f"accepted: {body}")
        except BadRequestError as e:
            err = e.body if isinstance(e.body, dict) else {}
            err = err.get("error", err)
            assert err.get("param") == param and says in err.get("message", ""), (body, e.body)
    r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=5)
    assert r.choices[0].message.content is not None


def main():
    if lib.missing_prereqs("test_structured"):
        return 1
    port = lib.free_port()
    log = lib.log_file("test_structured.log")
    proc = lib.start_server(["--port", str(port), "--served-model-name", NAME, "--max-model-len", "2048",
                             "--kv-cache-memory", "256M"], stdout=log)
    try:
        lib.wait_healthy(port, proc)
        c = client(port)
        passed, failed = lib.run_tests([test_parse_nested_optional, test_structured_outputs_chat,
                                        test_guided_completions_and_stream, test_refusals], c, proc=proc)
    finally:
        lib.stop_server(proc, timeout=30)
        log.close()
    return lib.summary(passed, failed)


if __name__ == "__main__":
    sys.exit(main())
