"""Chat completions over HTTPS with OpenAI's own Python SDK, as a user
whose router terminates TLS and checks API keys would make them.

    python openai_tls_calls.py --base-url https://HOST:PORT --model NAME \
        --ca CA.pem --api-key KEY [--wrong-key KEY] [--client-cert C --client-key K]

Prints one JSON line per call (`call`, `ok`, then what came back) and exits
non-zero when any call failed in a way it should not have: a chat, a
streamed chat, the model list, and (with --wrong-key) a call that must be
refused with 401 (the SDK's AuthenticationError).
"""

import argparse
import ssl

import openai

try:  # the HTTP client this openai release is built on
    import httpx2 as httpx
except ImportError:
    import httpx

from calls import emit, finish, run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--ca", required=True)
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--wrong-key")
    ap.add_argument("--client-cert")
    ap.add_argument("--client-key")
    a = ap.parse_args()

    # Only the test's CA is trusted; the certificate must name the host.
    tls = ssl.create_default_context(cafile=a.ca)
    if a.client_cert:
        tls.load_cert_chain(a.client_cert, a.client_key)

    def client(key):
        http = httpx.Client(verify=tls, timeout=30)
        return openai.OpenAI(
            base_url=a.base_url + "/v1", api_key=key, http_client=http, max_retries=0
        )

    c = client(a.api_key)
    messages = [{"role": "user", "content": "Say hello over TLS."}]

    def chat():
        r = c.chat.completions.create(model=a.model, messages=messages, max_tokens=8)
        emit("chat.completions.create", id=r.id, text=r.choices[0].message.content,
             prompt_tokens=r.usage.prompt_tokens)

    def stream():
        chunks = 0
        text = ""
        for ev in c.chat.completions.create(
            model=a.model, messages=messages, max_tokens=8, stream=True
        ):
            chunks += 1
            if ev.choices and ev.choices[0].delta.content:
                text += ev.choices[0].delta.content
        emit("chat.completions.stream", chunks=chunks, text=text)

    def models():
        emit("models.list", ids=[m.id for m in c.models.list()])

    run("chat.completions.create", chat)
    run("chat.completions.stream", stream)
    run("models.list", models)

    if a.wrong_key:
        def refused():
            try:
                client(a.wrong_key).chat.completions.create(
                    model=a.model, messages=messages, max_tokens=8
                )
            except openai.AuthenticationError as e:
                emit("wrong_key", status=e.status_code, code=(e.body or {}).get("code"))
                return
            raise AssertionError("a wrong key was served")

        run("wrong_key", refused)

    finish()


if __name__ == "__main__":
    main()
