"""`ternlm bench spec`: mechanics only, never timings. The code-editing conversation is pure data checked
here (every edit applies, every file parses, the history's assistant turns are the fixed files); the
identical-text check fails when it should; the bench runs end to end on smollm2-135m with tiny sizes: both
ternlm contenders (speculation off really off), JSON and markdown written, the command printed first, every
server it started gone; and with llama.cpp's own llama-server where scripts/build-llamacpp built one (skips
otherwise), one n-gram --spec-type beside no speculation."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ternlm.bench import llamacpp, spec, spec_edits
from ternlm.bench.sampling_settings import Sampling
from ternlm.bench.spec_stream import LLAMA_SERVER, TERNLM, Answer, Target, request_body
from ternlm.bench.spec_summary import TERNLM_DRAFT, TERNLM_OFF, TERNLM_ON, identity, markdown, part, ratios

ROOT = Path(__file__).resolve().parents[1]
REAL = llamacpp.find_llama_server(ROOT)


def test_edits_apply_and_the_history_is_fixed():
    src = spec_edits.SOURCE.read_text()
    fs = spec_edits.files(src, spec_edits.MAX_TURNS)
    assert len(fs) == spec_edits.MAX_TURNS + 1 and len(set(fs)) == len(fs)     # every edit changed something
    for f in fs:
        ast.parse(f)
    turns = spec_edits.conversation(src, 3)
    assert [sum(m["role"] == "user" for m in t) for t in turns] == [1, 2, 3]
    assert [m["content"] for m in turns[2] if m["role"] == "assistant"] == [spec_edits.fenced(f) for f in fs[1:3]]
    assert turns[1][:2] == turns[0][:2] and turns[2][:4] == turns[1]             # each turn extends the last
    assert spec_edits.answered_file("Sure:\n" + spec_edits.fenced(fs[1]) + "\nDone.") == fs[1]
    assert spec_edits.answered_file("no code") is None
    with pytest.raises(ValueError):
        spec_edits.files(src, spec_edits.MAX_TURNS + 1)


def test_mt_bench_questions_one_per_category_in_turn():
    qs = spec.pick_questions(4)
    cats = {json.loads(line)["question_id"]: json.loads(line)["category"]
            for line in spec.MT_BENCH.read_text().splitlines()}
    assert len(qs) == 4 and len({cats[int(q.id)] for q in qs}) == 4 and all(len(q.user_turns) == 2 for q in qs)


def _answer(text: str, tokens=(1, 2), drafted=None) -> Answer:
    return Answer(text, tuple(tokens), 10, 0, 1.0, len(tokens), 100.0, drafted, drafted, 0.2, 0.05, 0.1, "stop")


def test_the_identity_check_fails_on_a_difference():
    same = {TERNLM_OFF: [[_answer("a"), _answer("b")]], TERNLM_ON: [[_answer("a", drafted=3), _answer("b", drafted=1)]]}
    assert identity(same, TERNLM_ON, TERNLM_OFF, True).identical
    diff = {TERNLM_OFF: [[_answer("a"), _answer("abc")]], TERNLM_ON: [[_answer("a"), _answer("abd")]]}
    i = identity(diff, TERNLM_ON, TERNLM_OFF, True)
    assert not i.identical and i.equal == 1 and i.first_mismatch["turn"] == 2 and i.first_mismatch["char"] == 2
    tokens = {TERNLM_OFF: [[_answer("a", (1, 2))]], TERNLM_ON: [[_answer("a", (1, 3))]]}   # same text, other ids
    assert not identity(tokens, TERNLM_ON, TERNLM_OFF, True).identical
    p = part(diff, [(TERNLM_ON, TERNLM_OFF, True)])
    result = {"model": "m", "command": "c", "settings": {"threads": 1, "repeats": 1, "mt_questions": 1,
                                                         "mt_max_tokens": 8}, "parts": {"mtbench": p | {"ratios": ratios(p, 0.95)}}}
    md = markdown(result)
    assert "**MISMATCH**" in md and "a required pair answered differently" in md


def test_a_draft_model_is_a_third_ternlm_contender_held_to_the_same_text():
    field = spec.contenders(None, [], "qwen2.5-coder-0.5b")
    assert [(c.label, c.spec, c.extra) for c in field][2] == (TERNLM_DRAFT, "auto", ("--draft-model", "qwen2.5-coder-0.5b"))
    assert len(spec.contenders(None, [])) == 2
    runs = {TERNLM_OFF: [[_answer("a")]], TERNLM_ON: [[_answer("a", drafted=3)]], TERNLM_DRAFT: [[_answer("b", drafted=2)]]}
    p = part(runs, [(TERNLM_ON, TERNLM_OFF, True), (TERNLM_DRAFT, TERNLM_OFF, True)])
    p["ratios"] = ratios(p, 2.5)
    assert p["ratios"]["draft_over_off_server_tok_s"] == 1.0
    md = markdown({"model": "m", "command": "c", "settings": {"threads": 1, "repeats": 1, "mt_questions": 1,
                                                              "mt_max_tokens": 8}, "parts": {"mtbench": p}})
    assert "ternlm draft model / off, decode tok/s: **x1.00**" in md and "**MISMATCH**: ternlm draft model" in md


def test_llama_spec_types_are_read_from_its_help(tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho '--spec-type none,draft-simple,ngram-simple,ngram-mod,ngram-cache'\n"
                    "echo '   comma-separated list of types'\n")
    fake.chmod(0o755)
    assert llamacpp.llama_spec_types(str(fake)) == ["ngram-simple", "ngram-mod", "ngram-cache"]


def _bench(tmp_path: Path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ternlm.cli.main", "bench", "spec", "-m", "smollm2-135m", "--dtype", "float32",
           "--threads", "1", "--repeats", "1", "--out", str(out), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert p.stdout.startswith("command: ") and "bench spec -m smollm2-135m" in p.stdout.splitlines()[0]
    res = json.loads((out / "spec-smollm2-135m.json").read_text())
    assert (out / "spec-smollm2-135m.md").read_text().startswith("# ternlm bench spec")
    for s in res["servers"]:                       # every server the bench started is gone
        with pytest.raises(ProcessLookupError):
            os.kill(s["pid"], 0)
    return res, p.stdout


def _check_ternlm(res: dict, part_name: str, answers: int) -> None:
    p = res["parts"][part_name]
    c = p["contenders"]
    assert {TERNLM_OFF, TERNLM_ON} <= set(c)
    for name in (TERNLM_OFF, TERNLM_ON):
        assert len(c[name]["answers"]) == 1 and len(c[name]["answers"][0]) == answers
        assert c[name]["median"]["tokens"] > 0 and c[name]["median"]["server_tok_s"] > 0
    assert c[TERNLM_OFF]["median"]["drafted"] == 0            # `--speculative off` honoured over HTTP
    req = [i for i in p["identity"] if i["required"]]
    assert req and req[0]["a"] == TERNLM_ON and req[0]["b"] == TERNLM_OFF and req[0]["identical"]
    assert isinstance(p["ratios"]["target"]["met"], bool)


def test_bench_spec_ternlm_end_to_end(tmp_path):
    res, out = _bench(tmp_path, "--llama-server", "none", "--turns", "2", "--max-tokens", "32",
                      "--mt-questions", "1", "--mt-max-tokens", "8")
    _check_ternlm(res, "edit", 2)
    _check_ternlm(res, "mtbench", 2)                          # one question, two turns
    assert res["parts"]["edit"]["contenders"][TERNLM_ON]["median"]["drafted"] > 0   # the pasted file is looked up
    assert res["all_required_identical"] and res["ternlm_off_drafted"] == 0
    assert res["llama_server"] is None and "not run (--llama-server none)" in out
    assert len(res["servers"]) == 2


def test_request_bodies_greedy_by_default_and_sampled_when_asked():
    ternlm, llama = Target(TERNLM, "http://x", "m"), Target(LLAMA_SERVER, "http://y")
    path, body = request_body(ternlm, [1, 2], 8)
    assert path == "/v1/completions" and body["temperature"] == 0.0 and "seed" not in body
    assert request_body(llama, [1, 2], 8)[1] == {"prompt": [1, 2], "n_predict": 8, "temperature": 0.0, "top_k": 1,
                                                "cache_prompt": True, "return_tokens": True, "stream": True}
    chat = Sampling(temperature=0.7, top_p=0.95, presence=0.5)
    _, body = request_body(ternlm, [1, 2], 8, chat, seed=9)
    assert (body["temperature"], body["top_p"], body["presence_penalty"], body["seed"]) == (0.7, 0.95, 0.5, 9)
    _, body = request_body(llama, [1, 2], 8, chat, seed=9)
    assert (body["temperature"], body["top_p"], body["presence_penalty"], body["seed"]) == (0.7, 0.95, 0.5, 9)
    assert (body["top_k"], body["min_p"]) == (0, 0.0)              # llama-server's own 40 / 0.05 turned off


def test_bench_spec_sampled_keeps_speculation_lossless(tmp_path):
    """Seeded sampling through both ternlm servers: the draw is keyed by (seed, position), so on == off."""
    res, out = _bench(tmp_path, "--llama-server", "none", "--parts", "mtbench", "--mt-questions", "1",
                      "--mt-max-tokens", "8", "--temperature", "0.7", "--top-p", "0.95", "--seed", "4")
    _check_ternlm(res, "mtbench", 2)
    assert res["settings"]["sampling"] == "t0.7-p0.95" and res["settings"]["seed"] == 4
    assert res["settings"]["sampling_fields"] == {"temperature": 0.7, "top_p": 0.95}
    assert "max 8 tokens, t0.7-p0.95" in out


@pytest.mark.skipif(REAL is None, reason="no llama-server built (scripts/build-llamacpp)")
def test_bench_spec_beside_the_real_llama_server(tmp_path):
    res, _ = _bench(tmp_path, "--parts", "edit", "--turns", "1", "--max-tokens", "24",
                    "--llama-spec-types", "ngram-simple")
    assert res["llama_server"] == {"binary": REAL, "spec_types": ["ngram-simple"]}
    c = res["parts"]["edit"]["contenders"]
    assert list(c) == [TERNLM_OFF, TERNLM_ON, "llama-server none", "llama-server ngram-simple"]
    _check_ternlm(res, "edit", 1)
    for name in ("llama-server none", "llama-server ngram-simple"):
        a = c[name]["answers"][0][0]
        assert a["prompt_tokens"] == c[TERNLM_OFF]["answers"][0][0]["prompt_tokens"]    # the same ids
        assert a["decode_tokens"] > 0 and a["cached_tokens"] + 0 <= a["prompt_tokens"]
    assert c["llama-server none"]["median"]["drafted"] is None                # no speculation: no counts
    pairs = {(i["a"], i["b"]) for i in res["parts"]["edit"]["identity"]}
    assert ("llama-server ngram-simple", "llama-server none") in pairs and len(res["servers"]) == 4
