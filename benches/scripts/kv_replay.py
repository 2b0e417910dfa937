"""Replays a quality-bench record (PREFIX_BENCH_RECORDS=<dir>) through a
model of the sim-engine's KV cache, to ask what a placement could have hit
on the same traffic without running the bench again.

The model follows tests/src/engine/kv_cache.rs and core.rs: 16-token blocks;
a request reserves its prompt plus max_tokens at admission and waits FIFO on
its engine until they fit; free blocks are evicted least recently used
first; a finished request's output blocks stay cached. A request arrives at
its recorded start and holds its blocks for its recorded duration, so the
timing is the recorded run's. On the records of the named scenarios it
reproduces the engines' reported hit rates within about one point.

    python3 benches/scripts/kv_replay.py RECORD.jsonl --kv-blocks 1151
        [--engines 3] [--partitions]

prints the recorded placement's replayed hit rate and, when the records
name the engines (debug headers on), the same with no conversation moved
and with each prompt's conversations where its first went; then these
placements of the same requests:
  strict   each request to the engine holding its longest prefix, ties and
           cold prompts to the fewest in flight, never moved (what
           sglang-router and vllm-router do at this load);
  pooled   one engine with the whole fleet's blocks (no placement at all);
  --partitions  every assignment of whole system prompts to engines, each
           conversation staying where it started: the best, median, worst.
  --online two families of rules that place new conversations as they
           come, never moving one: by the engines' live demand (the
           prompt's holder unless it is GAP live conversations over the
           least busy engine), and by prompt owner (each prompt's new
           conversations to one engine, the owner handed to the least busy
           engine once the owner is GAP over it).
"""
import argparse, collections, heapq, itertools, json

BS = 16
MAX_TOKENS = 150


class Engine:
    def __init__(self, cap):
        self.cap = cap
        self.free_keyed = collections.OrderedDict()  # LRU first
        self.held = {}  # key -> references
        self.held_unkeyed = 0
        self.free_unkeyed = cap
        self.in_flight = 0
        self.waiting = collections.deque()
        self.prompt_tok = self.cached_tok = self.n = 0

    def has(self, k):
        return k in self.held or k in self.free_keyed

    def lead(self, keys):
        n = 0
        for k in keys:
            if not self.has(k):
                break
            n += 1
        return n

    def fits(self, keys, P):
        hit = min(self.lead(keys), (P - 1) // BS)
        need = -(-(P + MAX_TOKENS) // BS) - hit
        free = self.cap - len(self.held) - self.held_unkeyed
        free -= sum(1 for k in keys[:hit] if k in self.free_keyed)
        return need <= free or self.in_flight == 0

    def admit(self, keys, P):
        hit = min(self.lead(keys), (P - 1) // BS)
        total = -(-(P + MAX_TOKENS) // BS)
        for k in keys[:hit]:
            if k in self.free_keyed:
                del self.free_keyed[k]
                self.held[k] = 1
            else:
                self.held[k] += 1
        n = total - hit
        u = min(n, self.free_unkeyed)
        self.free_unkeyed -= u
        for _ in range(n - u):
            if self.free_keyed:
                self.free_keyed.popitem(last=False)
        new = []
        for k in keys[hit:]:
            if not self.has(k):
                self.held[k] = 1
                new.append(k)
        unk = total - hit - len(new)
        self.held_unkeyed += unk
        self.in_flight += 1
        self.n += 1
        self.prompt_tok += P
        self.cached_tok += hit * BS
        return keys[:hit] + new, unk

    def release(self, held, unk, out):
        held = list(held)
        left = unk
        for k in out:
            if left == 0:
                break
            if not self.has(k):
                self.held[k] = 1
                held.append(k)
                left -= 1
        self.held_unkeyed -= unk
        for k in reversed(held):
            r = self.held[k] - 1
            if r == 0:
                del self.held[k]
                self.free_keyed[k] = None
            else:
                self.held[k] = r
        self.free_unkeyed += left
        self.in_flight -= 1


def load(path):
    """Requests in start order, each with its prompt's and output's block keys:
    a system prompt's blocks are shared by its conversations, the rest are
    the conversation's own and carry over to its next turn as far as the
    record's ceiling (what an unbounded cache would hit) says."""
    recs = [json.loads(l) for l in open(path)]
    recs = sorted((r for r in recs if r['status'] == 200), key=lambda r: r['start_ms'])
    sysb = {}
    for r in recs:
        if r['turn'] == 1 and r['ceiling_cached_tokens'] > 0:
            b = r['ceiling_cached_tokens'] // BS
            sysb[r['prefix_id']] = min(sysb.get(r['prefix_id'], b), b)
    chains, out = {}, []
    for r in recs:
        P, C, s = r['prompt_tokens'], r['completion_tokens'], r['session']
        sb = sysb.get(r['prefix_id'], 0)
        keep = r['ceiling_cached_tokens'] // BS if r['turn'] > 1 else 0
        old = chains.get(s, [])[:keep]
        full = (P + C - 1) // BS
        keys = [('p', r['prefix_id'], i) if i < sb else ('s', s, i, r['turn']) for i in range(full)]
        keys[:len(old)] = old[:full]
        chains[s] = keys
        out.append(dict(r=r, keys=keys[:P // BS], out=keys[P // BS:], P=P))
    return out


def replay(reqs, cap, n, route):
    engines = [Engine(cap) for _ in range(n)]
    ev = [(q['r']['start_ms'], 1, i) for i, q in enumerate(reqs)]
    heapq.heapify(ev)
    held = {}

    def admit(e, t):
        eng = engines[e]
        while eng.waiting and eng.fits(reqs[eng.waiting[0]]['keys'], reqs[eng.waiting[0]]['P']):
            i = eng.waiting.popleft()
            q = reqs[i]
            held[i] = (e,) + eng.admit(q['keys'], q['P'])
            heapq.heappush(ev, (t + q['r']['end_ms'] - q['r']['start_ms'], 0, i))

    while ev:
        t, arrival, i = heapq.heappop(ev)
        if arrival:
            e = route(reqs[i], engines)
            engines[e].waiting.append(i)
        else:
            e, h, unk = held.pop(i)
            engines[e].release(h, unk, reqs[i]['out'])
        admit(e, t)
    hit = sum(e.cached_tok for e in engines) / max(1, sum(e.prompt_tok for e in engines))
    per = ', '.join('%d req %.1f%%' % (e.n, 100 * e.cached_tok / max(1, e.prompt_tok)) for e in engines)
    return hit, per


def recorded(q, engines):
    return int(q['r']['instance'].split('|')[0].rsplit('-', 1)[1])


def strict():
    conv = {}

    def route(q, engines):
        s = q['r']['session']
        if s not in conv:
            m = [e.lead(q['keys']) for e in engines]
            conv[s] = max(range(len(engines)), key=lambda i: (m[i], -engines[i].in_flight, -i))
        return conv[s]
    return route


def recorded_first():
    """Each conversation where the record sent its first turn, never moved."""
    conv = {}

    def route(q, engines):
        return conv.setdefault(q['r']['session'], recorded(q, engines))
    return route


def prompt_home():
    """Each prompt's conversations where the record sent its first one."""
    conv, home = {}, {}

    def route(q, engines):
        p = q['r']['prefix_id']
        home.setdefault(p, recorded(q, engines))
        return conv.setdefault(q['r']['session'], home[p])
    return route


def live_demand(window_ms, gap, owner):
    """New conversations by live demand: the conversations with a request
    in the last `window_ms` on each engine. With `owner`, each prompt's
    new conversations go to its owner engine, handed to the least busy
    engine once the owner is over it by more than `gap`; without, to the
    least busy engine holding the prompt, or the least busy of all when
    that holder is over it by more than `gap`."""
    conv, owners, last = {}, {}, {}

    def route(q, engines):
        s, t, p = q['r']['session'], q['r']['start_ms'], q['r']['prefix_id']
        if s not in conv:
            d = [0] * len(engines)
            for e, ts in last.values():
                d[e] += t - ts <= window_ms
            least = min(range(len(engines)), key=lambda i: (d[i], engines[i].in_flight))
            if owner:
                o = owners.get(p)
                if o is None or d[o] - d[least] > gap:
                    owners[p] = o = least
                conv[s] = o
            else:
                sysb = sum(1 for k in q['keys'] if k[0] == 'p')
                holders = [i for i, e in enumerate(engines) if sysb and e.lead(q['keys']) >= sysb]
                h = min(holders, key=lambda i: (d[i], engines[i].in_flight), default=least)
                conv[s] = h if d[h] - d[least] <= gap else least
        last[s] = (conv[s], t)
        return conv[s]
    return route


def partition(assign):
    conv = {}

    def route(q, engines):
        return conv.setdefault(q['r']['session'], assign[q['r']['prefix_id']])
    return route


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('record')
    ap.add_argument('--kv-blocks', type=int, required=True)
    ap.add_argument('--engines', type=int, default=3)
    ap.add_argument('--partitions', action='store_true')
    ap.add_argument('--online', action='store_true')
    a = ap.parse_args()
    reqs = load(a.record)
    reported = sum(q['r']['cached_tokens'] for q in reqs) / sum(q['P'] for q in reqs)
    print('reported by the engines: %.1f%%' % (100 * reported))
    if all(q['r'].get('instance') for q in reqs):
        h, per = replay(reqs, a.kv_blocks, a.engines, recorded)
        print('recorded placement, replayed: %.1f%% (%s)' % (100 * h, per))
        h, per = replay(reqs, a.kv_blocks, a.engines, recorded_first())
        print('recorded first turns, never moved: %.1f%% (%s)' % (100 * h, per))
        h, per = replay(reqs, a.kv_blocks, a.engines, prompt_home())
        print("each prompt on its first turn's engine: %.1f%% (%s)" % (100 * h, per))
    h, per = replay(reqs, a.kv_blocks, a.engines, strict())
    print('strict affinity: %.1f%% (%s)' % (100 * h, per))
    h, _ = replay(reqs, a.kv_blocks * a.engines, 1, lambda q, e: 0)
    print('pooled (one engine of %d blocks): %.1f%%' % (a.kv_blocks * a.engines, 100 * h))
    if a.online:
        for owner in (False, True):
            for window in (8000, 20000):
                cells = []
                for gap in (2, 4, 8, 10**9):
                    h, _ = replay(reqs, a.kv_blocks, a.engines, live_demand(window, gap, owner))
                    cells.append('%s %.1f%%' % ('never' if gap == 10**9 else gap, 100 * h))
                print('%s, live within %d s, by gap: %s' % (
                    'prompt owner' if owner else 'live demand', window // 1000, ', '.join(cells)))
    if a.partitions:
        prompts = sorted({q['r']['prefix_id'] for q in reqs})
        res = []
        for combo in itertools.product(range(a.engines), repeat=len(prompts)):
            # one representative of each relabelling of the engines
            if [c for i, c in enumerate(combo) if c not in combo[:i]] != list(range(len(set(combo)))):
                continue
            res.append((replay(reqs, a.kv_blocks, a.engines, partition(dict(zip(prompts, combo))))[0], combo))
        res.sort()
        for name, (h, combo) in [('best', res[-1]), ('median', res[len(res) // 2]), ('worst', res[0])]:
            print('%s of %d prompt partitions: %.1f%% (engine per prompt %s)' % (name, len(res), 100 * h, combo))


if __name__ == '__main__':
    main()
