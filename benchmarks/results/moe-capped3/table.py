"""Rows of TABLE.md from the run JSONs here: table.py TAG-CONTENDER=label ..."""
import json, sys, re
from pathlib import Path
D = Path(__file__).resolve().parent
def row(tag, label):
    d = json.loads((D / f"{tag}.json").read_text())
    t = d["turns"]
    plan = re.search(r"> ([\d.]+ [MG]iB) left", d.get("expert_plan") or "")
    la = [d["loadavg_before"][0]] + [x["loadavg"][0] for x in t]
    ex = lambda x: (x.get("timings") or {}).get("experts") or {}
    e2 = ex(t[1]) if len(t) > 1 else {}
    peak = max([x["cgroup_after"]["peak"] for x in t] + [d["cgroup_end"]["peak"]]) / 1e9
    status = "died" if d["died"] else "ok"
    f = lambda v: f"{v:.2f}"
    gets2 = e2.get("hits", 0) + e2.get("misses", 0)
    cells = [label, plan.group(1) if plan else "-", f(t[0]["ttft_s"]), "**" + f(t[1]["ttft_s"]) + "**",
             f"{t[1]['decode_tok_s']:.2f} / {t[0]['decode_tok_s']:.2f}"[::-1][::-1],
             f"{t[0]['read_bytes']/1e9:.2f} / {t[1]['read_bytes']/1e9:.2f}",
             f"{e2['misses']:,} of {gets2:,}" if e2 else "-", f"{peak:.2f}", f"{d['proc_end']['VmHWM']/1e9:.2f}",
             f"{min(la):.1f}-{max(la):.1f}", status]
    # decode t1 / t2 in order
    cells[4] = f"{t[0]['decode_tok_s']:.2f} / {t[1]['decode_tok_s']:.2f}"
    return "| " + " | ".join(cells) + " |"
print("| run | expert cache (auto) | turn-1 TTFT s | turn-2 TTFT s | decode tok/s t1 / t2 | disk read GB t1 / t2 | experts missed t2 | cgroup peak GB (cap 1.72) | VmHWM GB | load avg | status |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for a in sys.argv[1:]:
    tag, label = a.split("=", 1)
    print(row(tag, label))
