"""``tinyvllm bench agent`` (tinyvllm/benchmarks/agent.py): the in-process agent workload on the real
model, 2 sessions x 2 turns; the prefix-cache hits it reports are checked against block arithmetic
on the token ids, recomputed here from the workload's text and the model's answers."""

from __future__ import annotations

from tinyvllm.benchmarks import datasets as ds
from tinyvllm.benchmarks.agent import block_ideal_cached, common_prefix_len, format_agent_table, run_agent
from tinyvllm.entrypoints.cli import build_parser


def test_block_ideal_cached_rounds_down_to_blocks_and_leaves_one_token():
    assert common_prefix_len([1, 2, 3, 4], [1, 2, 9]) == 2
    seen = [[1] * 40, [1] * 20 + [2] * 20]
    assert block_ideal_cached([1] * 35 + [3], seen, 16) == 32  # lcp 35 -> 2 blocks
    assert block_ideal_cached([1] * 32, seen, 16) == 16  # whole prompt seen: the last token is computed
    assert block_ideal_cached([1] * 20 + [2] * 15, seen, 16) == 32  # the second sequence matches longer
    assert block_ideal_cached([5] * 40, seen, 16) == 0
    assert block_ideal_cached([1] * 40, [], 16) == 0


def test_bench_agent_parser():
    argv = ["bench", "agent", "--sessions", "4", "--turns", "8", "--block-size", "32"]
    args = build_parser(argv).parse_args(argv)
    assert (args.bench_command, args.sessions, args.turns, args.block_size) == ("agent", 4, 8, 32)
    assert args.prefix_len == 2200 and args.tool_result_len == 500 and args.ignore_eos


def test_agent_workload_cache_hits_follow_block_arithmetic(make_smol_llm):
    block_size = 16
    llm = make_smol_llm(block_size=block_size)  # a fresh engine: empty prefix cache
    wl = ds.agent_dataset(sessions=2, turns=2, prefix_len=70, user_len=6, output_len=5, tool_result_len=40,
                          think_time=0.0, seed=3)
    res = run_agent(llm, wl)
    recs = {(r["session"], r["turn"]): r for r in res["requests"]}
    assert sorted(recs) == [(0, 0), (0, 1), (1, 0), (1, 1)] and res["num_requests"] == 4

    tok = llm.get_tokenizer()
    s0, s1 = wl.sessions
    prompt = {}
    for s in (s0, s1):  # the prompts as the workload defines them, tokenized here
        p0 = s.prefix + s.user_block(0)
        p1 = p0 + recs[(s.session_id, 0)]["generated_text"] + s.tool_block(0) + s.user_block(1)
        prompt[(s.session_id, 0)], prompt[(s.session_id, 1)] = tok(p0)["input_ids"], tok(p1)["input_ids"]

    def known(key):  # tokens with KV once the request finished: prompt + answer but its last token
        return prompt[key] + recs[key]["output_token_ids"][:-1]

    def blocks(lcp, n):
        return min(lcp, n - 1) // block_size * block_size

    # Both first turns fit one step's budget: session 1 is scheduled after session 0's blocks are
    # allocated (and registered) in the same step, so it hits the shared system prompt's full blocks.
    lcp_prefix = common_prefix_len(prompt[(0, 0)], prompt[(1, 0)])
    assert lcp_prefix >= 70 - 2  # the shared system prompt + tools (~1 token per word)
    expected = {
        (0, 0): 0,
        (1, 0): blocks(lcp_prefix, len(prompt[(1, 0)])),
        # Second turns: the session's own first turn (prompt + answer) is the longest match.
        (0, 1): blocks(common_prefix_len(prompt[(0, 1)], known((0, 0))), len(prompt[(0, 1)])),
        (1, 1): blocks(common_prefix_len(prompt[(1, 1)], known((1, 0))), len(prompt[(1, 1)])),
    }
    for key, r in recs.items():
        assert r["prompt_tokens"] == len(prompt[key]), key
        assert r["output_tokens"] == 5 and len(r["output_token_ids"]) == 5  # ignore_eos
        assert r["prefill_tokens_cached"] == expected[key] == r["block_ideal_cached"], key
        assert r["prefill_tokens_computed"] == r["prompt_tokens"] - r["prefill_tokens_cached"], key
        assert r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] and r["tpot_s"] > 0
    assert expected[(0, 1)] >= len(prompt[(0, 0)]) // block_size * block_size  # the history is reused
    total = sum(expected.values())
    prompts = sum(len(p) for p in prompt.values())
    assert res["prefill_tokens_cached"] == total and res["prompt_tokens"] == prompts
    assert res["prefix_cache_hit_pct"] == 100.0 * total / prompts == res["block_ideal_hit_pct"]
    assert [t["turn"] for t in res["per_turn"]] == [0, 1]
    assert res["per_turn"][1]["mean_cached_tokens"] == (expected[(0, 1)] + expected[(1, 1)]) / 2
    assert res["wall_s"] >= max(r["e2e_s"] for r in recs.values())
    assert llm.llm_engine.core.scheduler.kv.num_owned_blocks() == 0  # nothing leaked
    table = format_agent_table(res)
    assert "2 sessions x 2 turns" in table and f"cached {total}" in table
