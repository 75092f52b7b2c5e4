"""Does vLLM 0.34.0 share the prefix cache between copies in one request, or only stop counting it?
Reads /metrics (vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total) around each request
and the request's own usage.prompt_tokens_details.cached_tokens. Usage: cache34.py PORT OUTFILE"""
import json, sys, time, urllib.request, uuid

port, outfile = sys.argv[1], sys.argv[2]
base = "http://localhost:%s" % port
def get(path):
    with urllib.request.urlopen(base + path, timeout=60) as r:
        return r.read().decode()
def post(path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())
def counters():
    found = {}
    for line in get("/metrics").splitlines():
        if line.startswith("#"):
            continue
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            if line.startswith(name):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found
model = json.loads(get("/v1/models"))["data"][0]["id"]
prompt = " ".join("the quick brown fox jumps over a lazy dog number %d" % i for i in range(40))
records = []
def one(label, prompts, salt):
    before = counters()
    body = {"model": model, "prompt": prompts, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    if salt:
        body["cache_salt"] = salt
    answer = post("/v1/completions", body)
    time.sleep(1.5)  # the counters are logged by the engine core a step later
    after = counters()
    rec = {"label": label, "prompts": len(prompts), "salt": bool(salt),
           "usage": answer.get("usage"),
           "delta": {k: after.get(k, 0) - before.get(k, 0) for k in after}}
    records.append(rec)
    print(json.dumps(rec), flush=True)
for n in (1, 2, 8, 32):
    one("copies-fresh-salt", [prompt + " %s" % uuid.uuid4().hex[:0]] * n, uuid.uuid4().hex)
for n in (2, 8):
    one("copies-no-salt-new-prompt-%d" % n, [prompt + " variant %s" % uuid.uuid4().hex] * n, None)
salt = uuid.uuid4().hex
one("repeat-same-salt-first", [prompt], salt)
one("repeat-same-salt-second", [prompt], salt)
distinct = [prompt + " tail %d %s" % (i, uuid.uuid4().hex) for i in range(8)]
one("distinct-prompts-one-request-8", distinct, uuid.uuid4().hex)
json.dump({"port": port, "model": model, "records": records}, open(outfile, "w"), indent=1)
