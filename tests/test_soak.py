"""Soak test: many mixed requests against a real server whose KV pool is small enough to force preemption,
10% of the clients disconnecting at random points. 0 errors on the requests that stayed; at the end 0 requests
tracked and 0 KV blocks owned in either process; RSS of both processes flat between the first and the last
quarter of the run. A short variant runs in the default suite; the issue's full size is marked slow.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest

from server_utils import Server, rss_bytes

PROMPTS = ["Tell me a story about a dragon.", "List the planets of the solar system.",
           "Explain photosynthesis briefly.", "Write a poem about rain.", "What is 17 times 23?",
           "Describe the city of Paris.", "How do airplanes fly?", "Name five fruits."]


def _metric(base: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _one(client: httpx.AsyncClient, rng: random.Random, errors: list, stats: dict) -> None:
    kind = rng.choice(["stream", "full", "n2", "stop", "chat_stream"])
    disconnect = rng.random() < 0.10
    body: dict = {"max_tokens": rng.randint(4, 40), "temperature": rng.choice([0, 0.8]), "seed": rng.randint(0, 99)}
    path = "/v1/completions"
    if kind == "chat_stream":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": rng.choice(PROMPTS)}]
    else:
        body["prompt"] = rng.choice(PROMPTS)
    if kind == "n2":
        body["n"] = 2
    if kind == "stop":
        body["stop"] = [" the", "."]
    stream = kind in ("stream", "chat_stream") or (kind == "stop" and rng.random() < 0.5)
    body["stream"] = stream
    try:
        if stream:
            async with client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    errors.append((kind, r.status_code, (await r.aread())[:300]))
                    return
                n_chunks, cut = 0, rng.randint(0, 6)
                done = False
                async for line in r.aiter_lines():
                    if disconnect and n_chunks >= cut:
                        stats["disconnected"] += 1
                        return  # leaving the block closes the connection mid-stream
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        obj = json.loads(line[6:])
                        if "error" in obj:
                            errors.append((kind, "error event", obj))
                        n_chunks += 1
                if not done:
                    errors.append((kind, "no [DONE]", n_chunks))
        else:
            task = asyncio.ensure_future(client.post(path, json=body))
            if disconnect:
                await asyncio.sleep(rng.random() * 0.5)
                task.cancel()
                stats["disconnected"] += 1
                try:
                    await task
                except BaseException:  # noqa: BLE001 - cancelled, as intended
                    pass
                return
            r = await task
            if r.status_code != 200:
                errors.append((kind, r.status_code, r.text[:300]))
                return
            choices = r.json()["choices"]
            if len(choices) != body.get("n", 1) or any(c["finish_reason"] is None for c in choices):
                errors.append((kind, "bad choices", choices))
        stats["ok"] += 1
    except httpx.HTTPError as e:
        errors.append((kind, "transport", repr(e)))


def run_soak(server: Server, num_requests: int, concurrency: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    errors: list = []
    stats = {"ok": 0, "disconnected": 0}
    rss: list[tuple[int, int]] = []
    stop = threading.Event()

    def sample_rss() -> None:
        while not stop.is_set():
            try:
                rss.append((rss_bytes(server.proc.pid), rss_bytes(server.core_pid)))
            except OSError:
                pass
            stop.wait(0.25)

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()

    async def main() -> None:
        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=server.base, timeout=300, limits=limits) as client:
            async def guarded(i: int) -> None:
                async with sem:
                    await _one(client, random.Random(rng.random()), errors, stats)

            await asyncio.gather(*(guarded(i) for i in range(num_requests)))

    t0 = time.monotonic()
    asyncio.run(main())
    stop.set()
    sampler.join()
    return {"errors": errors, "stats": stats, "rss": rss, "seconds": time.monotonic() - t0}


def _check(server: Server, result: dict, num_requests: int) -> None:
    assert result["errors"] == [], result["errors"][:10]
    assert result["stats"]["ok"] + result["stats"]["disconnected"] == num_requests
    assert result["stats"]["disconnected"] > 0
    state = server.wait_idle(timeout=60)
    assert not any(state.values()), state
    assert _metric(server.base, "tinyvllm:num_preemptions_total") > 0  # the small KV pool did force preemption
    rss = result["rss"]
    q = max(1, len(rss) // 4)
    for proc in (0, 1):  # API process, engine core process
        first = sum(r[proc] for r in rss[:q]) / q
        last = sum(r[proc] for r in rss[-q:]) / q
        assert last <= first * 1.10 + 32 * 2**20, (proc, first / 2**20, last / 2**20)
    r = httpx.post(server.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200


def _server(tmp_path_factory, name: str) -> Server:
    # 16 blocks x 16 tokens: three or four sequences at once, so a batch of 16 preempts
    return Server(tmp_path_factory.mktemp(name) / "server.log",
                  ["--max-model-len", "128", "--max-num-seqs", "16", "--num-kv-blocks", "16", "--block-size", "16"]
                  ).wait_healthy()


def test_soak_short(tmp_path_factory):
    srv = _server(tmp_path_factory, "soak")
    try:
        result = run_soak(srv, num_requests=48, concurrency=16)
        print(f"soak short: {result['stats']} in {result['seconds']:.1f}s")
        _check(srv, result, 48)
    finally:
        srv.stop()


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_soak_long(tmp_path_factory):
    srv = _server(tmp_path_factory, "soak_long")
    try:
        result = run_soak(srv, num_requests=2000, concurrency=64, seed=1)
        print(f"soak long: {result['stats']} in {result['seconds']:.1f}s")
        _check(srv, result, 2000)
    finally:
        srv.stop()
