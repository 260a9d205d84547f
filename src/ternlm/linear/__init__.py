"""A model's matrices as held and multiplied: dense.py (torch/oneDNN, bf16 or fp32), ggml_blocks.py
(GGML quantized blocks -> values), qweight.py (the int layouts the native kernels read), qconvert.py
(GGML blocks -> those layouts, natively), qlinear.py (the quantized linear layer).
May import: kernels.build, invariants. Never models (the models import it)."""
