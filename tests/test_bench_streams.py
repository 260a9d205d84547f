"""`ternlm bench streams`: the steady-window figure (pure) and the command end to end on fake servers
(fast): N streams released together, the aggregate counted only while all N stream, ratios N vs 1 and
between contenders."""
from __future__ import annotations

import json

import pytest

from fake_openai import FakeOpenAI
from ternlm.bench.latency import steady_decode_tok_s, steady_window
from ternlm.cli.main import main


def test_steady_window_counts_only_while_all_stream():
    a = [0.0, 1.0, 2.0, 3.0, 4.0]                 # 1 tok/s from t=0 to 4
    b = [2.0, 2.5, 3.0, 3.5, 6.0]                 # starts late, ends late
    assert steady_window([a, b]) == (2.0, 4.0)
    # inside (2, 4]: a at 3, 4; b at 2.5, 3, 3.5 -> 5 tokens in 2 s
    assert steady_decode_tok_s([a, b]) == pytest.approx(2.5)
    assert steady_decode_tok_s([a]) == pytest.approx(1.0)          # one stream: its own rate after the first
    assert steady_window([a, [5.0, 6.0]]) is None                   # never all at once
    assert steady_decode_tok_s([a, []]) is None                     # a stream that sent nothing
    assert steady_decode_tok_s([]) is None


def long_answer(messages: list[dict]) -> str:
    return " ".join(["word"] * 30)


def test_streams_end_to_end_on_two_fake_servers(tmp_path, capsys):
    out = tmp_path / "out"
    with FakeOpenAI(long_answer, delay_s=0.002) as fast, FakeOpenAI(long_answer, delay_s=0.006) as slow:
        rc = main(["bench", "streams", "--no-ternlm", "--url", fast.url, slow.url, "--label", "fast", "slow",
                   "--concurrency", "1", "3", "--max-tokens", "30", "--repeats", "2", "--out", str(out)])
        sent = [len(fast.requests), len(slow.requests)]
    assert rc == 0
    assert sent == [1 + 2 * (1 + 3)] * 2                       # warm-up + 2 repeats x (1 + 3 streams)
    res = json.loads((out / "results.json").read_text())
    assert res["concurrency"] == [1, 3] and len(res["rounds"]) == 2 * 2 * 2
    med = res["median"]
    for lb in ("fast", "slow"):
        for n in ("1", "3"):
            assert med[lb][n]["steady_tok_s"] > 0 and med[lb][n]["itl_p50_s"] > 0 and med[lb][n]["ttft_p50_s"] > 0
    # a fake that sleeps between pieces of every stream independently: 3 streams ~3x one
    assert res["ratios"]["vs_lowest"]["fast"]["3"] > 1.5
    assert med["fast"]["1"]["steady_tok_s"] > med["slow"]["1"]["steady_tok_s"]
    assert all(r["pieces"] == r["concurrency"] * 30 for r in res["rounds"])
    assert (out / "streams.png").stat().st_size > 0
    assert "steady decode of N concurrent streams" in capsys.readouterr().out


def test_streams_refuses_bad_options(tmp_path, capsys):
    with FakeOpenAI() as fake:
        rc = main(["bench", "streams", "--no-ternlm", "--url", fake.url, "--concurrency", "0", "--out", str(tmp_path)])
        assert rc != 0 and "--concurrency >= 1" in capsys.readouterr().err
        rc = main(["bench", "streams", "--no-ternlm", "--url", fake.url, "--label", "a", "b", "--out", str(tmp_path)])
        assert rc != 0 and "2 --label for 1 --url" in capsys.readouterr().err
        assert fake.requests == []                      # refused before anything was sent
