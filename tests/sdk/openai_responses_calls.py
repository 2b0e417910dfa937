"""Every kind of Responses call, made with OpenAI's own Python SDK.

    python openai_responses_calls.py --base-url http://HOST:PORT [--model NAME]

Prints one JSON line per call (`call`, `ok`, then what came back: ids,
text, status, usage with the cached tokens, status codes) and exits
non-zero when any call failed in a way it should not have. The base URL is
a sim-engine's, a router's, or anything else that serves `/v1/responses`
(the SDK is given BASE/v1).
"""

import argparse

import openai

# The Responses API calls the system prompt `instructions`.
from calls import SYSTEM as INSTRUCTIONS
from calls import WEATHER, WEATHER_ARGS, emit, finish, run

WEATHER_TOOL = {"type": "function", **WEATHER, "parameters": WEATHER_ARGS}


def usage(u):
    if u is None:
        return None
    return {
        "input_tokens": u.input_tokens,
        "cached_tokens": u.input_tokens_details.cached_tokens,
        "output_tokens": u.output_tokens,
        "reasoning_tokens": u.output_tokens_details.reasoning_tokens,
        "total_tokens": u.total_tokens,
    }


def summary(r):
    return {
        "id": r.id,
        "status": r.status,
        "text": r.output_text,
        "previous_response_id": r.previous_response_id,
        "usage": usage(r.usage),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", default="sim-llama-8b")
    ap.add_argument(
        "--background-tokens",
        type=int,
        default=2000,
        help="max_output_tokens of the background response cancelled while it runs",
    )
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key="sim", max_retries=0, timeout=60)
    model = args.model
    kept = {}

    def create():
        r = client.responses.create(
            model=model,
            instructions=INSTRUCTIONS,
            input="Is the Louvre open on Tuesdays?",
            max_output_tokens=8,
            metadata={"suite": "sdk"},
        )
        kept["first"] = r
        emit("responses.create", object=r.object, model=r.model, store=r.store, **summary(r))

    def stream_helper():
        with client.responses.stream(
            model=model,
            instructions=INSTRUCTIONS,
            input="Which museums open late on Fridays?",
            max_output_tokens=8,
        ) as s:
            events = list(s)
            final = s.get_final_response()
        created = next(e for e in events if e.type == "response.created")
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        emit(
            "responses.stream",
            created_id=created.response.id,
            events=[e.type for e in events],
            sequence_numbers=[e.sequence_number for e in events],
            streamed_text=text,
            **summary(final),
        )

    def stream_raw():
        events = list(
            client.responses.create(model=model, input="Name one bridge in Paris.", max_output_tokens=6, stream=True)
        )
        done = events[-1]
        emit(
            "responses.create_stream",
            created_id=events[0].response.id,
            events=[e.type for e in events],
            **summary(done.response),
        )

    def chain():
        turns = []
        previous = None
        for q in ["Plan a day in Rome.", "Add a museum.", "And dinner?", "Summarise it."]:
            r = client.responses.create(
                model=model,
                instructions=INSTRUCTIONS,
                input=q,
                previous_response_id=previous,
                max_output_tokens=12,
            )
            turns.append(summary(r))
            previous = r.id
        kept["chain"] = turns
        emit("responses.chain", turns=turns)

    def tools():
        r = client.responses.create(
            model=model,
            instructions=INSTRUCTIONS,
            tools=[WEATHER_TOOL],
            input=[
                {"role": "user", "content": "What is the weather in Lyon?"},
                {"type": "function_call", "call_id": "call_01", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
                {"type": "function_call_output", "call_id": "call_01", "output": "18C, clear"},
            ],
            max_output_tokens=8,
        )
        emit("responses.tools", tools=[t.name for t in r.tools], **summary(r))

    def retrieve():
        first = kept["first"]
        r = client.responses.retrieve(first.id)
        emit("responses.retrieve", same_text=r.output_text == first.output_text, **summary(r))

    def cancel():
        bg = client.responses.create(
            model=model,
            input="Write a long travel guide.",
            background=True,
            max_output_tokens=args.background_tokens,
        )
        cancelled = client.responses.cancel(bg.id)
        after = client.responses.retrieve(bg.id)
        try:
            client.responses.cancel(kept["first"].id)
            finished_status = 200
        except openai.BadRequestError as e:
            finished_status = e.status_code
        emit(
            "responses.cancel",
            id=bg.id,
            created_status=bg.status,
            background=bg.background,
            cancelled_status=cancelled.status,
            retrieved_status=after.status,
            cancel_finished_status=finished_status,
        )

    def input_items():
        first = kept["first"]
        page = client.responses.input_items.list(first.id)
        items = [{"id": i.id, "type": i.type, "role": getattr(i, "role", None)} for i in page.data]
        emit("responses.input_items", id=first.id, items=items)

    def not_found():
        statuses = []
        for attempt in (
            lambda: client.responses.retrieve("resp_does_not_exist"),
            lambda: client.responses.create(
                model=model, input="hi", previous_response_id="resp_does_not_exist", max_output_tokens=4
            ),
        ):
            try:
                attempt()
                statuses.append(200)
            except openai.NotFoundError as e:
                statuses.append(e.status_code)
                error = (e.body or {}) if isinstance(e.body, dict) else {}
        if statuses != [404, 404]:
            raise AssertionError(f"unknown ids answered {statuses}")
        emit("responses.not_found", statuses=statuses, message=error.get("message"))

    run("responses.create", create)
    run("responses.stream", stream_helper)
    run("responses.create_stream", stream_raw)
    run("responses.chain", chain)
    run("responses.tools", tools)
    run("responses.retrieve", retrieve)
    run("responses.cancel", cancel)
    run("responses.input_items", input_items)
    run("responses.not_found", not_found)
    finish()


if __name__ == "__main__":
    main()
