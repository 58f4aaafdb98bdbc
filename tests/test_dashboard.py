"""End to end: prefix-break diagnostics and KV cost in ``usage``, their ``/metrics``, and the live
``/dashboard`` -- a real ``tinyvllm serve`` (SmolLM2-135M-Instruct, bfloat16), the ``openai`` client,
httpx, and the page in a real headless browser (Debian's chromium driven by playwright).

The browser test is skipped, saying why, where ``/usr/bin/chromium`` or the ``playwright`` package is
missing (``make install-browser`` installs chromium with apt where the machine allows it). Set
``TINYVLLM_UPDATE_SCREENSHOT=1`` to refresh ``docs/dashboard.png`` from the browser test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(shared_server):
    """The base URL of the session's shared server (tests/conftest.py): every test here salts or varies its
    prompts, and compares counters before and after, so other modules' requests change nothing it checks."""
    return shared_server.base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def tokenizer(server):
    from tinyvllm.engine.tokenizer import load_tokenizer
    from tinyvllm.model.loader import resolve_model

    return load_tokenizer(resolve_model(MODEL).model_dir)


def _metric(base: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m and m.group(1) == name and all(f'{k}="{v}"' in (m.group(2) or "") for k, v in labels.items()):
            total += float(m.group(3))
    return total


def _extra(usage) -> dict:
    return usage.model_dump()


TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a brass lantern, "
        "a notebook of tide tables and a thermos of strong black tea. From the gallery he watched the "
        "fishing boats return one by one, counting their lights against the darkening water, and wrote "
        "down the time each of them rounded the northern rocks before the fog came in from the sea.")


# ---------------------------------------------------------------------------- prefix-break diagnostics

def test_third_block_changed_reports_prefix_changed_with_text(client, tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) >= 72
    ids = ids[:72]
    # A salt of this test's own: another test of the module (any order) may have cached TEXT already.
    salted = {"prefix_cache_debug": True, "cache_salt": f"prefix-break-{uuid.uuid4().hex}"}
    first = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, extra_body=salted)
    pc = _extra(first.usage)["prefix_cache"]
    assert pc["reason"] == "cold" and pc["num_full_blocks"] == 72 // pc["block_size"]
    bs = pc["block_size"]
    k = 2 * bs + 5  # a token inside the third block
    changed = list(ids)
    changed[k] = tokenizer(" zebra", add_special_tokens=False)["input_ids"][0]
    assert changed[k] != ids[k]
    second = client.completions.create(model=MODEL, prompt=changed, max_tokens=2, temperature=0, extra_body=salted)
    usage = _extra(second.usage)
    pc = usage["prefix_cache"]
    assert pc["reason"] == "prefix_changed"
    assert pc["matched_blocks"] == 2 and pc["cached_tokens"] == {"pool": 2 * bs, "offload": 0}
    assert pc["diverged_at_token"] == k
    assert pc["text_before"] == tokenizer.decode(changed[k - 16:k])
    assert pc["text_after"] == tokenizer.decode(changed[k:k + 16])
    assert pc["previous_text_after"] == tokenizer.decode(ids[k:k + 16])
    assert "zebra" in pc["text_after"] and "zebra" not in pc["previous_text_after"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 2 * bs


def test_chat_repeat_is_partial_last_block_streaming_and_not(client):
    messages = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "Say hi."}]
    a = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                       extra_body={"prefix_cache_debug": True})
    assert _extra(a.usage)["prefix_cache"]["reason"] in ("cold", "prefix_changed", "partial_last_block")
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"prefix_cache_debug": True}))
    usage = _extra(chunks[-1].usage)
    pc = usage["prefix_cache"]
    assert pc["reason"] == "partial_last_block"
    assert pc["matched_blocks"] == (usage["prompt_tokens"] - 1) // pc["block_size"]
    assert usage["kv_cost"]["prefill_tokens_cached"] == pc["cached_tokens"]["pool"]


# ---------------------------------------------------------------------------- KV cost

def test_every_request_reports_its_kv_cost(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time, in a small village", max_tokens=5,
                                  temperature=0, extra_body={"ignore_eos": True})
    usage = _extra(r.usage)
    assert "prefix_cache" not in usage  # only with prefix_cache_debug
    kv = usage["kv_cost"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert kv["prefill_tokens_cached"] == cached
    assert kv["prefill_tokens_computed"] == usage["prompt_tokens"] - cached
    # the last sampled token is never computed: prompt + 5 - 1 tokens of KV, 16-token blocks
    assert kv["peak_kv_blocks"] == -(-(usage["prompt_tokens"] + 5 - 1) // 16)
    assert kv["kv_block_seconds"] > 0


def test_metrics_count_miss_reasons_and_per_user_kv(server, client):
    before = _metric(server, "tinyvllm:user_requests_total", user="alice")
    client.completions.create(model=MODEL, prompt="A fresh prompt about the alice user %d" % time.time_ns(),
                              max_tokens=2, temperature=0, user="alice")
    deadline = time.monotonic() + 10
    while _metric(server, "tinyvllm:user_requests_total", user="alice") < before + 1:
        assert time.monotonic() < deadline, "per-user counter never moved"
        time.sleep(0.1)
    assert _metric(server, "tinyvllm:user_kv_block_seconds_total", user="alice") > 0
    assert _metric(server, "tinyvllm:user_prefill_tokens_computed_total", user="alice") > 0
    assert _metric(server, "tinyvllm:prefix_cache_miss_reason_total", reason="cold") >= 1
    assert _metric(server, "tinyvllm:kv_block_seconds_total") > 0


def test_bad_prefix_cache_debug_is_a_400_naming_the_field(server):
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "hi", "prefix_cache_debug": [1]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prefix_cache_debug"


def test_bench_serve_prints_the_miss_reason_summary(server, capsys):
    from tinyvllm.benchmarks import serve as bench

    result = bench.main(["--base-url", server, "--model", MODEL, "--dataset", "shared-prefix", "--num-groups", "1",
                         "--prefix-len", "64", "--suffix-len", "8", "--num-prompts", "4", "--output-len", "2",
                         "--max-concurrency", "1", "--disable-tqdm", "--no-plot"])
    out = capsys.readouterr().out
    assert result["completed"] == 4
    reasons = result["prefix_cache_miss_reasons"]
    assert sum(reasons.values()) == 4 and reasons.get("partial_last_block", 0) >= 3  # one shared prefix
    assert re.search(r"prefix-cache miss reasons \(4 prompts\): .*partial_last_block [34]", out), out


# ---------------------------------------------------------------------------- dashboard over HTTP

def test_dashboard_page_is_self_contained(server):
    r = httpx.get(server + "/dashboard", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    assert "EventSource" in html and 'id="blockmap"' in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "the page must not load external assets"


def test_dashboard_events_carry_the_engine_stats(server, client):
    client.completions.create(model=MODEL, prompt="Count to three:", max_tokens=3, temperature=0)
    with httpx.stream("GET", server + "/dashboard/events", timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                break
    assert ev["engine"]["running"] is True
    assert ev["kv"]["total"] > 0 and "map" in ev["kv"] and len(ev["kv"]["map"]) > 0
    assert ev["steps"] and all(len(s) == 8 for s in ev["steps"])
    assert ev["steps"][-1][4] > 0  # token budget
    assert any(r["status"] == "finished" and "kv_block_seconds" in r for r in ev["requests"])
    assert set(ev["queues"]) == {"running", "waiting", "preempted"}


# ---------------------------------------------------------------------------- dashboard in a browser

def _playwright():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no browser: {CHROMIUM} is missing (apt-get install -y chromium, or `make install-browser`)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is not installed (pip install playwright==1.65.2; never `playwright install`)")
    return sync_playwright


def test_dashboard_updates_in_a_real_browser(server, client, tmp_path):
    sync_playwright = _playwright()
    errors: list[str] = []
    stop = threading.Event()

    def workload() -> None:
        def one(i: int) -> None:
            while not stop.is_set():
                client.completions.create(model=MODEL, prompt=f"{TEXT} Request {i}:", max_tokens=24,
                                          temperature=0, extra_body={"ignore_eos": True})
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(8)))

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server + "/dashboard")
            page.wait_for_function("document.getElementById('status').textContent !== 'connecting'", timeout=30000)
            assert page.locator("#spec").is_hidden()  # no --speculative-config: no speculative-decoding panel
            steps0 = int(page.get_attribute("#batch", "data-steps"))
            maps0 = int(page.get_attribute("#blockmap", "data-updates"))
            t = threading.Thread(target=workload, daemon=True)
            t.start()
            try:
                # the batch chart and the block map move while the workload runs
                page.wait_for_function(f"Number(document.getElementById('batch').dataset.steps) > {steps0} + 10",
                                       timeout=120000)
                page.wait_for_function("Number(document.getElementById('blockmap').dataset.maxOwned) > 0",
                                       timeout=120000)
                page.wait_for_function(f"Number(document.getElementById('blockmap').dataset.updates) >= {maps0} + 2",
                                       timeout=120000)
                page.wait_for_function("[...document.querySelectorAll('#reqs td:nth-child(2)')]"
                                       ".some((td) => td.textContent === 'finished')", timeout=180000)
                assert page.text_content("#ttft") != "- / - s"  # latency figures from finished requests
                if os.environ.get("TINYVLLM_UPDATE_SCREENSHOT"):
                    page.wait_for_timeout(1500)  # the docs' picture: let the charts settle (a test needs no wait)
                shot = tmp_path / "dashboard.png"
                page.screenshot(path=str(shot), full_page=True)
            finally:
                stop.set()
                t.join(180)
            # idle again: the page keeps receiving events and says so
            page.wait_for_function("document.getElementById('status').textContent === 'idle'", timeout=60000)
            assert int(page.get_attribute("#blockmap", "data-owned")) == 0
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    if os.environ.get("TINYVLLM_UPDATE_SCREENSHOT"):
        shutil.copy(shot, ROOT / "docs" / "dashboard.png")
    assert not errors, errors


# ---------------------------------------------------------------------------- speculative decoding on the dashboard

@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    """A tiny random Llama (dummy weights, word-level tokenizer: starts in seconds) served with ngram
    speculation, every draft verified: the dashboard's speculative-decoding panel has figures to show."""
    from server_utils import running_server

    from tinyvllm.model.dummy import write_dummy_model_dir

    tmp = tmp_path_factory.mktemp("spec_dashboard")
    model = write_dummy_model_dir(tmp / "model", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2})
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "cost_model": False})
    yield from running_server(tmp / "server.log", ["--model", str(model), "--load-format", "dummy",
                                                   "--kv-cache-memory", "8MiB", "--speculative-config", spec])


@pytest.mark.slow  # a server of its own (~5 s quiet); the default tier checks the hidden panel and the hub's figures
def test_dashboard_shows_speculative_decoding_in_a_real_browser(spec_server):
    """With --speculative-config the page shows the panel (acceptance rate, mean accepted length, drafts/s,
    acceptance by position) with the server's /metrics counters."""
    sync_playwright = _playwright()
    base = spec_server.base
    prompt = " ".join(f"w{3 + i % 7}" for i in range(40))  # repeats itself: the n-gram proposer drafts
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(base + "/dashboard")
            page.wait_for_function("document.getElementById('status').textContent !== 'connecting'", timeout=30000)
            for _ in range(3):
                r = httpx.post(base + "/v1/completions", json={"model": "model", "prompt": prompt, "max_tokens": 24,
                                                               "temperature": 0, "ignore_eos": True}, timeout=60)
                assert r.status_code == 200, r.text
            drafts = _metric(base, "tinyvllm:spec_decode_num_drafts_total")
            draft_tokens = _metric(base, "tinyvllm:spec_decode_num_draft_tokens_total")
            accepted = _metric(base, "tinyvllm:spec_decode_num_accepted_tokens_total")
            assert drafts > 0
            page.wait_for_function(f"!document.getElementById('spec').hidden && "
                                   f"Number(document.getElementById('spec').dataset.drafts) >= {drafts}", timeout=30000)
            assert page.text_content("#specrate") == f"{100 * accepted / draft_tokens:.1f} %"
            assert page.text_content("#speclen") == f"{1 + accepted / drafts:.2f}"
            assert re.fullmatch(r"\d+\.\d", page.text_content("#specdps"))
            assert "ngram" in page.text_content("#specmethod")
        finally:
            browser.close()
    assert not errors, errors


def test_dashboard_events_carry_speculative_decoding_figures():
    """The hub sends the engine's spec_decode_* counters (None without --speculative-config). The engine
    here is a stand-in holding only what the hub reads: its config, stats and listener list."""
    from types import SimpleNamespace

    from tinyvllm.config import SpeculativeConfig
    from tinyvllm.entrypoints.dashboard.hub import DashboardHub
    from tinyvllm.metrics.stats import SchedulerStats

    stats = SchedulerStats(spec_decode_num_drafts=4, spec_decode_num_draft_tokens=10, spec_decode_num_accepted_tokens=7,
                           spec_decode_num_accepted_tokens_per_pos=[4, 2, 1], spec_decode_num_draft_tokens_per_pos=[4, 3, 3],
                           spec_decode_propose_seconds=0.25)
    events = []
    for spec in (None, SpeculativeConfig.parse('{"method": "suffix"}')):
        engine = SimpleNamespace(step_listeners=[], stats=stats, engine_info=None, is_running=True, engine_pid=1,
                                 model_name="m", config=SimpleNamespace(speculative_config=spec))
        events.append(DashboardHub(engine).snapshot({}))
    assert events[0]["spec_decode"] is None
    assert events[1]["spec_decode"] == {"method": "suffix", "k": 16, "drafts": 4, "draft_tokens": 10,
                                        "accepted_tokens": 7, "accepted_per_pos": [4, 2, 1],
                                        "draft_tokens_per_pos": [4, 3, 3], "propose_seconds": 0.25}
