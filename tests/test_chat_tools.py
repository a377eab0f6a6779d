#!/usr/bin/env python3
"""Reasoning and tool calls end to end through the official `openai` client:
`sluice serve --reasoning-parser qwen3 --enable-auto-tool-choice
--tool-call-parser hermes` with the default model. A few-shot conversation
makes the small model (greedy) answer in the <think>/<tool_call> formats, so
the parsers see real model output, whole and streamed token by token.

Prints one line per test and ends with "N passed, N failed".
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import sluice_testlib as lib  # noqa: E402

NAME = "smol"

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
THINK = "<think>The sky is clear today.</think>It is sunny."


def few_shot(system, user, answer):
    msgs = [{"role": "system", "content": system}]
    for _ in range(4):
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return msgs + [{"role": "user", "content": user}]


def client(port):
    from openai import OpenAI
    return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=300)


def test_tool_call(c):
    msgs = few_shot("You call tools.", "Weather in Paris?", CALL)
    r = c.chat.completions.create(model=NAME, messages=msgs, tools=TOOLS, temperature=0, max_tokens=40)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    assert ch.message.content is None, ch.message
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # streamed: the same call arrives in delta.tool_calls, finish_reason tool_calls
    calls, finish, content = [], None, ""
    for chunk in c.chat.completions.create(model=NAME, messages=msgs, tools=TOOLS, temperature=0, max_tokens=40,
                                           stream=True):
        for chc in chunk.choices:
            calls += chc.delta.tool_calls or []
            content += chc.delta.content or ""
            finish = chc.finish_reason or finish
    assert finish == "tool_calls" and content == "", (finish, content)
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}


def test_tool_choice_none_keeps_text(c):
    msgs = few_shot("You call tools.", "Weather in Paris?", CALL)
    r = c.chat.completions.create(model=NAME, messages=msgs, tools=TOOLS, tool_choice="none", temperature=0,
                                  max_tokens=40)
    ch = r.choices[0]
    assert not ch.message.tool_calls and "<tool_call>" in ch.message.content, ch


def test_named_tool_choice(c):
    """tool_choice naming a function (or "required" with one tool): the reply is
    that call, its arguments generated under the parameters' schema, whole and
    streamed argument piece by piece; "required" with several tools: calls of
    listed tools only; unknown names and unsupported schemas are a 400 naming
    tool_choice."""
    import openai
    msgs = [{"role": "user", "content": "What is the weather like in Rome today?"}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        r = c.chat.completions.create(model=NAME, messages=msgs, tools=TOOLS, tool_choice=choice, temperature=0,
                                      max_tokens=40)
        ch = r.choices[0]
        # vLLM's finish reasons: "stop" for a named function, "tool_calls" for "required"
        assert ch.finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls"), ch
        assert ch.message.content is None, ch
        (call,) = ch.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and call.id.startswith("call_"), call
        assert list(args) == ["city"] and isinstance(args["city"], str), args
    pieces, ids, names = [], set(), set()
    for chunk in c.chat.completions.create(model=NAME, messages=msgs, tools=TOOLS, temperature=0, max_tokens=40,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           stream=True):
        for chc in chunk.choices:
            assert not chc.delta.content, chc
            for tc in chc.delta.tool_calls or []:
                if tc.id:
                    ids.add(tc.id)
                if tc.function and tc.function.name:
                    names.add(tc.function.name)
                if tc.function and tc.function.arguments:
                    pieces.append(tc.function.arguments)
    assert names == {"get_weather"} and len(ids) == 1 and len(pieces) > 1, (names, ids, pieces)
    assert json.loads("".join(pieces)) == args, pieces
    two = TOOLS + [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    r = c.chat.completions.create(model=NAME, messages=msgs, tools=two, temperature=0, max_tokens=20,
                                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {}, r
    # "required" with several tools: one or more calls, each of a listed tool, arguments under its schema
    for stream in (False, True):
        if not stream:
            r = c.chat.completions.create(model=NAME, messages=msgs, tools=two, tool_choice="required",
                                          temperature=0, max_tokens=60)
            ch = r.choices[0]
            calls, finish = ch.message.tool_calls, ch.finish_reason
            assert ch.message.content is None, ch
        else:
            calls, finish = [], None
            for chunk in c.chat.completions.create(model=NAME, messages=msgs, tools=two, tool_choice="required",
                                                   temperature=0, max_tokens=60, stream=True):
                for chc in chunk.choices:
                    calls += chc.delta.tool_calls or []
                    finish = chc.finish_reason or finish
        assert finish == "tool_calls" and len(calls) >= 1, (finish, calls)
        for call in calls:
            args = json.loads(call.function.arguments)
            assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_"), call
            assert list(args) == (["city"] if call.function.name == "get_weather" else []), args
        if not stream:
            whole = [(x.function.name, x.function.arguments) for x in calls]
        else:
            assert [(x.function.name, x.function.arguments) for x in calls] == whole
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}]  # "not": a keyword guides refuse
    for tools, choice in ((TOOLS, {"type": "function", "function": {"name": "nope"}}), (bad_schema, "required"),
                          (bad_schema + two, "required")):
        try:
            c.chat.completions.create(model=NAME, messages=msgs, tools=tools, tool_choice=choice, max_tokens=5)
            raise AssertionError(f"accepted {choice}")
        except openai.BadRequestError as e:
            assert e.body["param"] == "tool_choice", e.body


def test_responses_tools(c):
    """The Responses API with function tools: a call comes back as a
    function_call item (auto via the hermes parser, and a named tool_choice),
    whole and streamed; the call and its output go back in as input items."""
    rtools = [{"type": "function", "name": "get_weather", "description": "Get the weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    msgs = few_shot("You call tools.", "Weather in Paris?", CALL)
    r = c.responses.create(model=NAME, input=msgs, tools=rtools, temperature=0, max_output_tokens=40)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id, r.output
    forced = c.responses.create(model=NAME, input="What is the weather like in Rome today?", tools=rtools,
                                tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                max_output_tokens=40)
    (fc,) = forced.output
    assert fc.type == "function_call" and list(json.loads(fc.arguments)) == ["city"], forced.output
    types, final = [], None
    for ev in c.responses.create(model=NAME, input=msgs, tools=rtools, temperature=0, max_output_tokens=40,
                                 stream=True):
        types.append(ev.type)
        if ev.type == "response.completed":
            final = ev.response
    assert "response.function_call_arguments.done" in types and "response.output_text.delta" not in types, types
    assert [o.type for o in final.output] == ["function_call"] and final.output[0].arguments == call.arguments
    follow = msgs + [{"type": "function_call", "call_id": call.call_id, "name": "get_weather",
                      "arguments": call.arguments},
                     {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}]
    r2 = c.responses.create(model=NAME, input=follow, tools=rtools, temperature=0, max_output_tokens=20)
    assert r2.status in ("completed", "incomplete") and r2.output, r2


def test_reasoning(c):
    """The thinking in "reasoning" (vLLM's name now) and "reasoning_content"
    (older clients), whole and in stream deltas."""
    msgs = few_shot("You think first.", "Weather?", THINK)
    r = c.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=30)
    m = r.choices[0].message
    assert m.reasoning_content == "The sky is clear today." and m.content == "It is sunny.", m
    assert m.reasoning == m.reasoning_content, m
    rs, rs2, cs = "", "", ""
    for chunk in c.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=30, stream=True):
        for ch in chunk.choices:
            rs += getattr(ch.delta, "reasoning_content", None) or ""
            rs2 += getattr(ch.delta, "reasoning", None) or ""
            cs += ch.delta.content or ""
    assert (rs, rs2, cs) == (m.reasoning_content, m.reasoning, m.content), (rs, rs2, cs)


def test_reasoning_then_schema(c):
    """With --reasoning-parser the schema applies once the reasoning ends
    (vLLM's behaviour): the thinking stays free text in "reasoning" and the
    content is the JSON. Guided from the first token, the reasoning would be
    empty and the JSON would begin at once."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "sunny": {"type": "boolean"}}, "required": ["city", "sunny"]}
    msgs = few_shot("You think first, then answer in JSON.", "Weather in Paris?",
                    '<think>The user asks about Paris.</think>{"city": "Paris", "sunny": true}')
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    for extra in ({"response_format": rf}, {"extra_body": {"structured_outputs": {"json": schema}}}):
        r = c.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=60, **extra)
        m = r.choices[0].message
        assert m.reasoning and m.reasoning == m.reasoning_content, m
        obj = json.loads(m.content)
        assert set(obj) == {"city", "sunny"} and isinstance(obj["sunny"], bool) and len(obj["city"]) <= 20, m


def main():
    if lib.missing_prereqs("test_chat_tools"):
        return 1
    port = lib.free_port()
    log = lib.log_file("test_chat_tools.log")
    proc = lib.start_server(["--port", str(port), "--served-model-name", NAME,
                             "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser",
                             "hermes", "--max-model-len", "2048", "--kv-cache-memory", "256M"], stdout=log)
    try:
        lib.wait_healthy(port, proc)
        c = client(port)
        passed, failed = lib.run_tests([test_tool_call, test_tool_choice_none_keeps_text, test_named_tool_choice,
                                        test_responses_tools, test_reasoning, test_reasoning_then_schema], c, proc=proc)
    finally:
        lib.stop_server(proc, timeout=30)
        log.close()
    return lib.summary(passed, failed)


if __name__ == "__main__":
    sys.exit(main())
