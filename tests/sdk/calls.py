"""What the call scripts of this folder share: how each call is reported,
and the system prompt and tool their requests carry.

A script imports it as `calls`; Python finds it because a script run as
`python path/to/script.py` has its own folder on `sys.path`.
"""

import json
import sys
import traceback

# Long enough (over 100 tokens of 4 bytes) that every turn after the first
# finds whole cached blocks.
SYSTEM = (
    "You are a careful assistant for a travel agency. Answer in short "
    "sentences, name the sources you rely on, and never invent a price, a "
    "timetable or an opening hour: when you do not know, say so and point "
    "the traveller to the official site. Keep every answer under fifty "
    "words unless the traveller asks for detail. "
) * 2

# The weather tool, as each API's tool wraps it: its name and description,
# and the JSON schema of its arguments.
WEATHER = {"name": "get_weather", "description": "The current weather of a city."}
WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}

failed = False


def emit(call, **fields):
    """Prints what `call` got back as one JSON line with `ok: true`."""
    print(json.dumps({"call": call, "ok": True, **fields}), flush=True)


def run(call, fn):
    """Runs one call; a failure is printed as a line with `ok: false`."""
    global failed
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - every failure is reported
        failed = True
        print(
            json.dumps({"call": call, "ok": False, "error": f"{type(e).__name__}: {e}"}),
            flush=True,
        )
        traceback.print_exc(file=sys.stderr)


def finish():
    """Exits non-zero when any call run by `run` failed."""
    sys.exit(1 if failed else 0)
