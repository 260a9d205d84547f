"""`ternlm bench grammar`: what constrained decoding costs per token.

Same chat prompt, greedy, decoded with and without a `json_schema` grammar, interleaved A B A B,
medians and the ratio. The schema is an array of exactly 200 short strings, so the constrained answer
runs to --decode-tokens like the free one (ignore_eos) and both decode the same number of tokens.
Separately, the mask alone (llguidance's compute + unpack + masked_fill on one logits row) is timed
over the tokens of the constrained answer, replayed through a fresh matcher. Then 40 records whose keys the
grammar forces, decoded with speculation off and on ([FORCED-DRAFT]: the keys are drafted): tok/s of each, the
ratio, and whether the text was the same every time.
"""
from __future__ import annotations

import json
import time

import torch

from pathlib import Path

from ..text.grammar import GrammarSpec
from .common import command_line, median, write_json

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 200, "maxItems": 200}
PROMPT = "List as many animals as you can, as a JSON array of strings."
# [FORCED-DRAFT] (drafter.py): records whose keys the grammar forces: speculation on vs off under it
RECORDS = {"type": "array", "minItems": 40, "maxItems": 40, "items": {
    "type": "object", "additionalProperties": False, "required": ["animal_name", "natural_habitat", "is_endangered"],
    "properties": {"animal_name": {"type": "string", "maxLength": 16},
                   "natural_habitat": {"type": "string", "maxLength": 16}, "is_endangered": {"type": "boolean"}}}}
RECORDS_PROMPT = "List animals as JSON records: name, natural habitat, whether endangered."


def run(args, load_engine) -> dict:
    torch.set_num_threads(args.threads)
    engine = load_engine(args)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    ids = engine.apply_chat_template([{"role": "user", "content": PROMPT}])
    n = args.decode_tokens
    free_tps, json_tps, mask_us = [], [], []
    engine.generate(ids, max_tokens=8)                                  # warm-up, untimed
    for _ in range(args.repeats):      # speculation off: what the mask costs a one-token step
        c = engine.generate(ids, max_tokens=n, ignore_eos=True, speculative=False)
        free_tps.append(c.timings.decode_tokens / c.timings.decode_s)
        c = engine.generate(ids, max_tokens=n, grammar=spec, speculative=False)
        json_tps.append(c.timings.decode_tokens / c.timings.decode_s)
        got = c.token_ids
        con = engine.grammars.constraint(spec)
        row = torch.randn(engine.config.vocab_size)
        t = time.perf_counter()
        for tok in got:
            con.mask(row)
            con.advance(tok)
        mask_us.append((time.perf_counter() - t) / max(len(got), 1) * 1e6)
    rec = GrammarSpec("json_schema", json.dumps(RECORDS))
    rids = engine.apply_chat_template([{"role": "user", "content": RECORDS_PROMPT}])
    spec_tps: dict[bool, list[float]] = {False: [], True: []}
    texts, drafted = set(), (0, 0)
    for _ in range(args.repeats):      # the same grammar, speculation off then on: the same text, faster
        for on in (False, True):
            c = engine.generate(rids, max_tokens=n, grammar=rec, speculative=on)
            spec_tps[on].append(c.timings.decode_tokens / c.timings.decode_s)
            texts.add(tuple(c.token_ids))
            if on:
                drafted = (c.timings.drafted, c.timings.accepted)
    out = {"command": command_line(), "decode_tokens": n, "threads": args.threads,
           "constrained_tokens": len(got), "free_tok_s": median(free_tps), "json_schema_tok_s": median(json_tps),
           "slowdown": 1 - median(json_tps) / median(free_tps),
           # each B against the A beside it: a shared host's drift cancels within a pair
           "slowdown_paired": 1 - median([j / f for j, f in zip(json_tps, free_tps)]),
           "mask_us_per_token": median(mask_us),
           "records_tok_s": {"speculation_off": median(spec_tps[False]), "speculation_on": median(spec_tps[True])},
           "records_speedup": median(spec_tps[True]) / median(spec_tps[False]),
           "records_drafted_accepted": list(drafted), "records_same_text": len(texts) == 1,
           "runs": {"free": free_tps, "json_schema": json_tps, "mask_us": mask_us,
                    "records_off": spec_tps[False], "records_on": spec_tps[True]}}
    print(f"decode {n} tokens, {args.threads} threads, {args.repeats} repeats (A B A B), medians:")
    print(f"  free        {out['free_tok_s']:.1f} tok/s")
    print(f"  json_schema {out['json_schema_tok_s']:.1f} tok/s ({len(got)} tokens)  "
          f"slowdown {out['slowdown'] * 100:.1f}% (paired A/B median {out['slowdown_paired'] * 100:.1f}%)")
    print(f"  mask alone  {out['mask_us_per_token']:.0f} us/token (compute + apply, one row)")
    print(f"  records (keys forced), speculation off / on: {out['records_tok_s']['speculation_off']:.1f} / "
          f"{out['records_tok_s']['speculation_on']:.1f} tok/s (x{out['records_speedup']:.2f}; last run "
          f"{drafted[1]} of {drafted[0]} drafted taken; same text: {out['records_same_text']})")
    write_json(Path(args.out), f"grammar-{Path(args.model).stem}-{args.dtype}.json", out)
    return out
