"""Every kind of Messages call, made with Anthropic's own Python SDK.

    python anthropic_calls.py --base-url http://HOST:PORT [--model NAME]

Prints one JSON line per call (`call`, `ok`, then what came back: ids,
text, stop reason, usage with the cached tokens, status codes) and exits
non-zero when any call failed in a way it should not have. The base URL is
a sim-engine's, a router's, or anything else that serves `/v1/messages`.
"""

import argparse

import anthropic

from calls import SYSTEM, WEATHER, WEATHER_ARGS, emit, finish, run

WEATHER_TOOL = {**WEATHER, "input_schema": WEATHER_ARGS}


def usage(u):
    return {
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "cache_read_input_tokens": u.cache_read_input_tokens,
        "cache_creation_input_tokens": u.cache_creation_input_tokens,
    }


def text_of(message):
    return "".join(b.text for b in message.content if b.type == "text")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", default="sim-llama-8b")
    args = ap.parse_args()
    client = anthropic.Anthropic(base_url=args.base_url, api_key="sim", max_retries=0, timeout=60)
    model = args.model

    def create():
        m = client.messages.create(
            model=model,
            max_tokens=8,
            system=SYSTEM,
            messages=[{"role": "user", "content": "Is the Louvre open on Tuesdays?"}],
            stop_sequences=["\n\n"],
            metadata={"user_id": "sdk-test"},
        )
        emit(
            "messages.create",
            id=m.id,
            type=m.type,
            role=m.role,
            model=m.model,
            text=text_of(m),
            stop_reason=m.stop_reason,
            usage=usage(m.usage),
        )

    def stream_helper():
        with client.messages.stream(
            model=model,
            max_tokens=8,
            system=SYSTEM,
            messages=[{"role": "user", "content": "Which museums open late on Fridays?"}],
        ) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        emit(
            "messages.stream",
            id=final.id,
            text=text,
            final_text=text_of(final),
            stop_reason=final.stop_reason,
            usage=usage(final.usage),
        )

    def stream_raw():
        events = list(
            client.messages.create(
                model=model,
                max_tokens=6,
                messages=[{"role": "user", "content": "Name one bridge in Paris."}],
                stream=True,
            )
        )
        kinds = [e.type for e in events]
        text = "".join(
            e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"
        )
        start = next(e for e in events if e.type == "message_start")
        delta = next(e for e in events if e.type == "message_delta")
        emit(
            "messages.create_stream",
            id=start.message.id,
            events=kinds,
            text=text,
            stop_reason=delta.delta.stop_reason,
            usage=usage(delta.usage),
        )

    def tools():
        first = [{"role": "user", "content": "What is the weather in Lyon?"}]
        m1 = client.messages.create(
            model=model, max_tokens=8, system=SYSTEM, tools=[WEATHER_TOOL], messages=first
        )
        # The model asked for the tool (as a real one would); its result goes back.
        history = first + [
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Lyon"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "18C, clear"}]}
                ],
            },
        ]
        m2 = client.messages.create(
            model=model, max_tokens=8, system=SYSTEM, tools=[WEATHER_TOOL], messages=history
        )
        emit(
            "messages.tools",
            ids=[m1.id, m2.id],
            texts=[text_of(m1), text_of(m2)],
            usages=[usage(m1.usage), usage(m2.usage)],
        )

    def multi_turn():
        history = []
        turns = []
        for q in ["Plan a day in Rome.", "Add a museum.", "And dinner?"]:
            history.append({"role": "user", "content": q})
            m = client.messages.create(model=model, max_tokens=12, system=SYSTEM, messages=history)
            history.append({"role": "assistant", "content": text_of(m)})
            turns.append({"id": m.id, "text": text_of(m), "usage": usage(m.usage)})
        emit("messages.multi_turn", turns=turns)

    def unknown_model():
        try:
            client.messages.create(
                model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
        except anthropic.NotFoundError as e:
            emit(
                "messages.unknown_model",
                status=e.status_code,
                error_type=(e.body or {}).get("error", {}).get("type"),
            )
            return
        raise AssertionError("an unknown model was served")

    run("messages.create", create)
    run("messages.stream", stream_helper)
    run("messages.create_stream", stream_raw)
    run("messages.tools", tools)
    run("messages.multi_turn", multi_turn)
    run("messages.unknown_model", unknown_model)
    finish()


if __name__ == "__main__":
    main()
