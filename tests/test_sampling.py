"""Greedy sampling takes numpy's argmax (the decode step's serial path): the oracle is torch.argmax,
whose first-maximum rule the product relied on before, on the tensors a step hands it."""
import torch

from ternlm.sampling import Sampler, SamplingParams


def test_greedy_is_torch_argmax_ties_views_and_inference_tensors():
    g = torch.Generator().manual_seed(0)
    s = Sampler(SamplingParams())
    cases = []
    for vocab in (7, 49152, 151936):
        x = torch.randn(vocab, generator=g)
        cases.append(x)
        t = x.clone()
        t[vocab // 3] = t[vocab // 2] = t[-1] = t.max() + 1    # ties: the first one wins
        cases.append(t)
    rows = torch.randn(3, 1000, generator=g)
    cases += [rows[1], rows[:, 5], torch.full((10,), -float("inf"))]   # a row view, a strided column, all -inf
    with torch.inference_mode():                   # how the runner returns its logits
        cases.append(torch.randn(4096, generator=g) * 30)
    for x in cases:
        assert s.sample(x, 0) == int(torch.argmax(x))
