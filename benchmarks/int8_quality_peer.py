"""Issue 46's quality figures beside llama.cpp's own (benchmarks/RESULTS.md, "Quality of int8 activations"):
llama.cpp's top-token agreement and perplexity of the quantized file against the same weights as F32
(llama-perplexity --kl-divergence-base / --kl-divergence: "Same top p"), then ternlm's agreement on the same
tokens and scored positions and on bench quality's stream, with lm_head and layers int8|fp32 (int8_agreement.py).

    python benchmarks/int8_quality_peer.py OUT_DIR TMP_DIR [--llama-perplexity BIN] [--llama-src DIR] [--models DIR]

TMP_DIR holds the F32 files (up to 6.6 GiB, each deleted after use) and the base logits (up to 0.5 GiB).
llama-perplexity runs through ternlm.bench.llamacpp (default: the scripts/build-llamacpp build); its output
goes to OUT_DIR/<model>-base.log and -kld.log, its parsed figures to OUT_DIR/llama-<model>.json.
Side effects: those files, and the child processes (dequant_gguf.py, llama-perplexity, int8_agreement.py)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from ternlm.bench.llamacpp import LLAMA_PERPLEXITY, llama_perplexity, resolve_bin

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3-270m": "gemma-3-270m-q4_k_m.gguf",
          "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
          "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"}
# llama-perplexity's protocol as issue 46 ran it: chunks of 512, 4 of them, one thread
N_CTX, CHUNKS, THREADS = 512, 4, 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("tmp", type=Path)
    ap.add_argument("--llama-perplexity", default="auto", metavar="BIN|auto")
    ap.add_argument("--llama-src", type=Path, default=None, help="llama.cpp's source (default: build-llamacpp --src's)")
    ap.add_argument("--models", type=Path, default=Path.home() / ".cache" / "ternlm" / "models")
    ap.add_argument("--only", default=",".join(MODELS), help="comma list of the models to run")
    a = ap.parse_args()
    out, tmp = a.out.resolve(), a.tmp.resolve()
    out.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    binary = resolve_bin(LLAMA_PERPLEXITY, a.llama_perplexity)
    py = os.environ.get("PYTHON", sys.executable)
    text = tmp / "text.txt"
    subprocess.run([py, str(ROOT / "benchmarks/int8_agreement.py"), "--write-text", str(text)], check=True)
    for name in a.only.split(","):
        file = a.models / MODELS[name]
        f32, kld = tmp / f"{name}-f32.gguf", tmp / f"{name}.kld"
        subprocess.run([py, str(ROOT / "benchmarks/dequant_gguf.py"), str(file), str(f32),
                        *(["--llama-src", str(a.llama_src)] if a.llama_src else [])], check=True)
        extra = ["--chunks", str(CHUNKS), "--kl-divergence-base", str(kld)]
        base = llama_perplexity(binary, f32, text, N_CTX, THREADS, N_CTX, extra, out / f"{name}-base.log")
        quant = llama_perplexity(binary, file, text, N_CTX, THREADS, N_CTX, [*extra, "--kl-divergence"],
                                 out / f"{name}-kld.log")
        f32.unlink(missing_ok=True)
        (out / f"llama-{name}.json").write_text(json.dumps({"base": base, "kld": quant}, indent=1) + "\n")
        print(f"{name}: llama.cpp {quant.get('kld') or quant.get('error')}", flush=True)
        with open(out / f"agreement-{name}.log", "wb") as log:
            subprocess.run([py, str(ROOT / "benchmarks/int8_agreement.py"), "-m", name, "--kld-base", str(kld),
                            "--threads", str(THREADS), "--out", str(out / f"agreement-{name}.json")],
                           stdout=log, stderr=subprocess.STDOUT, check=True,
                           env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(ROOT / "src")))


if __name__ == "__main__":
    main()
