"""Hit rate of approximate vs precise routing: one router, 4 router replicas
behind a random spread (each request to a random replica), and one router
with 20% of the requests sent straight to a random engine (hit rate counted
over the routed requests). Zero-cost sim-engines publishing KV events, 4
engines of 160 blocks, 32 conversations in 8 system-prompt groups, 8 turns,
turns of all conversations interleaved: cache pressure, no load effects.

A one-off measurement until prefix-bench has a precise front:
    cargo build -p router-user --bin prefix-router -p router-tests --bin sim-engine
    python3 benches/scripts/precise_spread.py [BIN_DIR]
"""
import json, os, random, socket, subprocess, sys, tempfile, time, urllib.request
BIN = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "../../target/debug")
def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())
def wait_http(url):
    for _ in range(300):
        try:
            urllib.request.urlopen(url, timeout=1).read(); return
        except Exception:
            time.sleep(0.05)
    raise RuntimeError(url)
def run(mode, replicas, bypass, seed, kv_blocks=160, engines=4, convs=32, turns=8):
    procs = []
    try:
        eng = []
        for i in range(engines):
            hp, kp, rp = free_port(), free_port(), free_port()
            procs.append(subprocess.Popen([f"{BIN}/sim-engine", "--listen", f"127.0.0.1:{hp}", "--time-scale", "0",
                "--kv-blocks", str(kv_blocks), "--kv-events-port", str(kp), "--kv-events-replay-port", str(rp)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            eng.append((hp, kp, rp))
        for hp, _, _ in eng: wait_http(f"http://127.0.0.1:{hp}/health")
        backends = ", ".join(f'{{ url = "http://127.0.0.1:{hp}", kv_events = "tcp://127.0.0.1:{kp}", kv_events_replay = "tcp://127.0.0.1:{rp}" }}' for hp, kp, rp in eng)
        routers = []
        for r in range(replicas):
            lp, ap = free_port(), free_port()
            cfg = os.path.join(tempfile.gettempdir(), f"precise-spread-{os.getpid()}-{r}.toml")
            open(cfg, "w").write(f'listen = "127.0.0.1:{lp}"\nbackends = [{backends}]\n[admin]\nlisten = "127.0.0.1:{ap}"\n[ebpf]\nmode = "off"\n[precise]\nenabled = {"true" if mode == "precise" else "false"}\n')
            procs.append(subprocess.Popen([f"{BIN}/prefix-router", "--config", cfg, "--workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            routers.append((lp, ap))
        for lp, ap in routers: wait_http(f"http://127.0.0.1:{ap}/health")
        time.sleep(1.0)
        rnd = random.Random(seed)
        conv = [[{"role": "system", "content": f"System prompt {c % 8}: " + " ".join(f"rule{c % 8}x{j}" for j in range(120))}] for c in range(convs)]
        prompt = cached = 0
        for t in range(turns):
            order = list(range(convs)); rnd.shuffle(order)
            for c in order:
                conv[c].append({"role": "user", "content": f"turn {t} of conversation {c}: " + " ".join(f"w{rnd.randrange(1000)}" for _ in range(60))})
                body = {"model": "sim-llama-8b", "max_tokens": 24, "messages": conv[c]}
                routed = True
                if rnd.random() < bypass:
                    routed = False
                    url = f"http://127.0.0.1:{rnd.choice(eng)[0]}/v1/chat/completions"
                else:
                    url = f"http://127.0.0.1:{rnd.choice(routers)[0]}/v1/chat/completions"
                a = post(url, body)
                conv[c].append({"role": "assistant", "content": a["choices"][0]["message"]["content"]})
                u = a["usage"]
                if t > 0 and routed:
                    prompt += u["prompt_tokens"]; cached += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                time.sleep(0.002)
        stats = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{routers[0][1]}/admin/backends").read())
        if mode == "precise" and os.environ.get("DIAG"):
            for b in stats["backends"]:
                p = b["precise"]; print("   ", {k: p[k] for k in ("state","held_blocks","unknown_parents","gaps","unfilled_gaps","batches")}, "index_blocks", b["index_blocks"])
        return cached / max(prompt, 1)
    finally:
        for p in procs: p.terminate()
        for p in procs: p.wait()
        for r in range(replicas):
            try:
                os.remove(os.path.join(tempfile.gettempdir(), f"precise-spread-{os.getpid()}-{r}.toml"))
            except OSError:
                pass
ROWS = [("approximate", 1, 0.0), ("precise", 1, 0.0), ("approximate", 4, 0.0), ("precise", 4, 0.0), ("approximate", 1, 0.2), ("precise", 1, 0.2)]
if __name__ == "__main__":
  for seed in (1, 2, 3):
    for mode, rep, by in ROWS:
        print(f"seed {seed} {mode:11s} replicas={rep} bypass={by:.0%}: hit rate {run(mode, rep, by, seed):.3f}", flush=True)
