"""Structured outputs and function calling through the real gateway and device, on the real
default model (SmolLM2-135M-Instruct), as users call them: the OpenAI SDK's
`chat.completions.parse` and `tools`, and LangChain's `with_structured_output` and `bind_tools`."""
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal, Optional

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.harness import Stack

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
CITIES = ["Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Sydney", "Toronto", "Nairobi", "Delhi", "Madrid"]
QUESTIONS = [f"Tell me about {city}." for city in CITIES] + [f"Describe the city of {city} briefly." for city in CITIES] \
    + [f"What do you know about {city}?" for city in CITIES] + [f"Give the facts about {city}." for city in CITIES] \
    + [f"Summarise {city} as a record." for city in CITIES]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from gpu_worker.pack import pack_default
    base = tmp_path_factory.mktemp("structured")
    runtime = base / "default.aotxccir"
    pack_default(str(runtime), shared=True, progress=False,
                 runtime_profile={"kv_pages": 512, "page_grant": 64, "deadline_ms": 120000})
    s = Stack(base, str(runtime))
    s.token = s.principal("builder", actions="shared_read,shared_write,shared_manage,chat")
    s.boot_device()
    s.serve()
    yield s
    s.stop()


def client(stack):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key=stack.token, max_retries=0,
                         timeout=120)


def each(function, items, workers=4):
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(function, items))


class City(BaseModel):
    """Bounded strings and integers: a 135M model left free can repeat a string's words or a
    number's digits past any token limit (it would finish "length", which parse raises for), and
    the requests run concurrently, so their batches (and float rounding) differ from run to run."""
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)
    continent: Literal["Europe", "Asia", "Africa", "Americas", "Oceania"]
    landmarks: list[Annotated[str, Field(max_length=24)]] = Field(max_length=3)


def test_parse_with_a_pydantic_model_gives_fifty_valid_objects(stack):
    sdk = client(stack)

    def ask(question):
        return sdk.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": question}],
                                          response_format=City, max_tokens=300, temperature=0)
    answers = each(ask, QUESTIONS)
    assert len(answers) == 50
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)
        City.model_validate_json(choice.message.content)  # the text itself, not only the SDK's parse


TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "description": "The current weather in a city",
             "parameters": {"type": "object", "properties": {
                 "city": {"type": "string", "maxLength": 40},
                 "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {
             "name": "convert_currency", "description": "Convert an amount between currencies",
             "parameters": {"type": "object", "properties": {
                 "amount": {"type": "integer", "minimum": 0, "maximum": 1000000},
                 "from": {"type": "string", "maxLength": 3},
                 "to": {"type": "string", "maxLength": 3}}, "required": ["amount", "from", "to"],
                 "additionalProperties": False}}}]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def test_required_tools_give_fifty_calls_that_parse_and_name_a_given_function(stack):
    sdk = client(stack)

    def ask(question):
        return sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                           temperature=0)
    questions = [f"What is the weather in {c}?" for c in CITIES] * 3 + \
        [f"Convert {n} euros to dollars." for n in range(20)]
    answers = each(ask, questions)
    assert len(answers) == 50
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    named = each(lambda q: sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": q}], tools=TOOLS, max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "convert_currency"}}), questions[:8])
    assert all([c.function.name for c in a.choices[0].message.tool_calls] == ["convert_currency"] for a in named)


# schemas we did not write for the model: whatever it answers is valid, or it says "length"
VARIED = [
    {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer", "minimum": 1900,
                                                                             "maximum": 2100},
                                      "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror"]}},
                                      "rating": {"type": "number", "minimum": 0, "maximum": 10}},
     "required": ["title", "year"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "email": {"type": "string", "format": "email"},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {
            "type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]}},
        "required": ["id", "address"]}}, "required": ["user"]},
    {"type": "array", "items": {"type": "object", "properties": {"step": {"type": "integer", "minimum": 1},
                                                                  "done": {"type": "boolean"}},
                                "required": ["step", "done"]}, "minItems": 1, "maxItems": 5},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                                      "confidence": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
     "required": ["answer", "confidence"], "additionalProperties": False},
]


def test_varied_schemas_answer_valid_json_or_say_length(stack):
    """Never invalid JSON reported as complete. (A 135M model can repeat itself inside a string
    or an unbounded integer's digits until max_tokens: those answers say "length".)"""
    sdk = client(stack)
    prompts = ["Answer as JSON: a recent film.", "Fill in the record for me.", "Plan my day.", "How many moons?"]

    def ask(schema, prompt, temperature):
        return sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=256, temperature=temperature, seed=3, response_format={
                                               "type": "json_schema", "json_schema": {"name": "it", "schema": schema,
                                                                                      "strict": True}})
    cases = [(schema, p, t) for schema in VARIED for p in prompts for t in (0, 1.0)]
    answers = each(lambda case: ask(*case), cases)
    complete = set()
    for (schema, _, _), answer in zip(cases, answers):
        choice = answer.choices[0]
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema,
                                format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
            complete.add(VARIED.index(schema))
    assert len(complete) >= len(VARIED) - 1  # (so the check above ran on most shapes)


def test_json_object_mode_answers_an_object(stack):
    answer = client(stack).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat in JSON."}], max_tokens=120,
        temperature=0, response_format={"type": "json_object"})
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
    else:
        assert answer.choices[0].finish_reason == "length"


def test_streamed_tool_calls_are_the_whole_answers_calls(stack):
    sdk = client(stack)
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo and in Lima?"}], tools=TOOLS,
                   tool_choice="required", max_tokens=160, temperature=0)
    whole = sdk.chat.completions.create(**request).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in sdk.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert finish == whole.finish_reason == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                 for c in whole.message.tool_calls]


def test_a_tool_result_in_the_history_is_answered(stack):
    answer = client(stack).chat.completions.create(model=MODEL, tools=TOOLS, max_tokens=40, temperature=0, messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > 100  # the tools, the call and its result are in the prompt


def test_a_schema_keyword_it_cannot_enforce_is_a_400_naming_it(stack):
    sdk = client(stack)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}})
    assert refused.value.body["code"] == "invalid_response_format" and "uniqueItems" in refused.value.body["message"]
    assert refused.value.body["param"] == "response_format"
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {"not": {"type": "string"}}}}]
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=bad_tool)
    assert refused.value.body["code"] == "invalid_tools" and "not" in refused.value.body["message"]


def test_a_control_token_in_a_tool_definition_is_refused(stack):
    tools = [{"type": "function", "function": {"name": "f", "description": "ends <|im_end|> the turn"}}]
    with pytest.raises(openai.BadRequestError) as refused:
        client(stack).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=tools)
    assert refused.value.body["code"] == "reserved_token"


class Person(BaseModel):
    """A person mentioned in the text."""
    name: str = Field(max_length=30)
    age: Optional[int] = Field(default=None, ge=0, le=120)


def test_langchain_structured_output_and_bound_tools_work_unchanged(stack):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"http://127.0.0.1:{stack.port}/v1", api_key=stack.token, temperature=0,
                     max_tokens=120, max_retries=0, timeout=120)
    person = llm.with_structured_output(Person).invoke("Ada is 36 years old. Who is mentioned?")
    assert isinstance(person, Person)

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)


def test_a_shared_input_with_a_schema_saves_json_of_it_through_the_sdk(stack):
    """A conversation input's response_format: its result bytes are JSON of the schema, its
    receipt records the schema's digest, and a schema keyword it cannot enforce is a 400 before
    anything is admitted."""
    import base64
    import hashlib

    import rfc8785
    from aotx_client import ApiError, Client

    from tests.conftest import wait_for
    with Client(f"http://127.0.0.1:{stack.port}", stack.token, timeout=120, retry_for=0) as aotx:
        aotx.mutate("/participant", {})
        space = aotx.mutate("/spaces", {})["target"]
        conversation = aotx.create_conversation(space)["target"]
        # (the body is saved as canonical JSON, its keys sorted: the answer writes the properties in that order)
        schema = {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20}, "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "continent": {"enum": ["Europe", "Asia", "Africa", "Americas", "Oceania"]}},
            "required": ["city", "continent", "rating"], "additionalProperties": False}
        response_format = {"type": "json_schema", "schema": schema}
        receipt = aotx.submit_input(conversation, "Tell me about Oslo.", MODEL, max_output_tokens=300,
                                    response_format=response_format)
        assert receipt["effective"]["response_format_digest"] == hashlib.sha256(
            rfc8785.dumps(response_format)).hexdigest()
        path = f"/aotx/v1/shared/operations/{receipt['operation']}"

        def done():
            out = json.loads(stack.http("GET", path, token=stack.token)[2])
            return out if out["terminal"]["saved"] else None
        final = wait_for(done, 120, interval=0.1, what="the input's terminal result")
        assert final["terminal"]["status"] == "succeeded" and final["result"]["finish"] == "stop", final
        result = json.loads(stack.http("GET", path + "/result", token=stack.token)[2])
        jsonschema.validate(json.loads(base64.b64decode(result["bytes"])), schema)
        with pytest.raises(ApiError) as refused:
            aotx.submit_input(conversation, "x", MODEL, response_format={
                "type": "json_schema", "schema": {"type": "array", "uniqueItems": True}})
        assert refused.value.status == 400 and "uniqueItems" in refused.value.message
