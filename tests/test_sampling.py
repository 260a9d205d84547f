"""Greedy sampling takes numpy's argmax (the decode step's serial path): the oracle is torch.argmax,
whose first-maximum rule the product relied on before, on the tensors a step hands it."""
import torch

from ternlm.engine.sampling import Sampler, SamplingParams


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


# ---- the filtered draw (kernels/sample.c) against the torch path it replaced ----------------------------------

import itertools
import math

import numpy as np
import pytest

from ternlm.kernels.build import Kernels, load
from ternlm.engine.sampling import Penalties, PenaltyState, draw_uniform, reference_probs


def _torch_path(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The distribution ternlm sampled from before issue 59 (Sampler.filtered_logprobs, its code as it was), in
    float64, the nucleus's sort made stable (ties at its edge: the lower index first)."""
    x = x.double() / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    logp = torch.log_softmax(x, dim=-1)
    if min_p > 0.0:
        logp = logp.masked_fill(logp < logp.max() + math.log(min_p), float("-inf"))
    if top_p < 1.0:
        sorted_lp, order = torch.sort(logp, descending=True, stable=True)
        cum = sorted_lp.exp().cumsum(-1)
        drop = cum - sorted_lp.exp() >= top_p
        logp = logp.scatter(0, order[drop], float("-inf"))
    return torch.log_softmax(logp, dim=-1).exp()


def _rows() -> list[torch.Tensor]:
    """Rows as decoding meets them: peaked and flat, large vocabularies, ties, -inf logits (grammar masks), a
    row with one finite logit (a one-token nucleus)."""
    g = torch.Generator().manual_seed(59)
    rows = [torch.randn(50, generator=g) * 3, torch.randn(1000, generator=g), torch.randn(151936, generator=g) * 4,
            torch.randn(262144, generator=g) * 2, torch.randn(49152, generator=g) * 12]
    t = torch.randn(333, generator=g).round()               # many exact ties
    rows.append(t)
    m = torch.randn(4099, generator=g) * 5
    m[torch.randperm(4099, generator=g)[:3000]] = -float("inf")
    rows.append(m)
    one = torch.full((777,), -float("inf"))
    one[123] = 0.5
    rows.append(one)
    peaked = torch.randn(32000, generator=g)
    peaked[7] = 40.0
    rows.append(peaked)
    return rows


_COMBOS = [(t, k, p, mp) for t, k, p, mp in itertools.product((0.3, 0.7, 1.0, 1.7), (0, 1, 40), (1.0, 0.95, 0.5, 0.1),
                                                               (0.0, 0.05)) if not (k == 0 and p == 1.0 and mp == 0.0)
           ] + [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0)]


@pytest.fixture(scope="module")
def kernels() -> Kernels:
    k = load()
    assert isinstance(k, Kernels), k      # the suite needs a C compiler (README): no silent fallback here
    return k


def _native_probs(x: torch.Tensor, t: float, k: int, p: float, mp: float) -> np.ndarray:
    from ternlm.engine.sampling import Sampler, SamplingParams
    return Sampler(SamplingParams(t, k, p, mp, seed=1)).probs(x.numpy()).astype(np.float64)


def test_native_distribution_is_the_torch_paths_for_every_combination(kernels):
    """Every (temperature, top_k, top_p, min_p) on every row: the same kept set and the same probabilities up to
    float rounding (fp32 exp in the kernel, float64 in the oracle)."""
    for x in _rows():
        for t, k, p, mp in _COMBOS:
            want = _torch_path(x, t, k, p, mp).numpy()
            got = _native_probs(x, t, k, p, mp)
            ref = reference_probs(x.numpy(), t, k, p, mp)       # the no-compiler fallback's distribution
            for have in (got, ref):
                # a token exactly at the nucleus's edge may fall either side by rounding: at most one, tiny;
                # probabilities below fp32's normal range (e^-87 of the max) are 0 in the kernel's fp32 exp
                differ = ((have > 0) != (want > 0)) & (np.maximum(have, want) > 1e-30)
                assert differ.sum() <= 1, (len(x), t, k, p, mp, np.flatnonzero(differ)[:5])
                # rtol from the arithmetic, not this host: expn's relative error ~2e-7 a term; the normalizer sums
                # <= 1,024 fp32 terms a block in VN lanes (<= 1,024 * 6e-8 ~ 6e-5 relative, worst case), then in
                # float64; 2e-4 covers that on any vector width. atol: probabilities below 1e-7 carry no weight
                # a draw could feel (1e-6 where one edge token fell the other way and renormalized the rest)
                np.testing.assert_allclose(have, want, rtol=2e-4, atol=1e-6 if differ.sum() else 1e-7)
            assert abs(got.sum() - 1) < 1e-5


def test_one_token_nucleus_and_top_k_1_always_draw_the_max(kernels):
    from ternlm.engine.sampling import Sampler, SamplingParams
    x = _rows()[2]
    best = int(x.argmax())
    for params in (SamplingParams(1.0, top_k=1, seed=3), SamplingParams(1.0, top_p=1e-6, seed=3),
                   SamplingParams(0.5, min_p=1.0, seed=3)):
        s = Sampler(params)
        assert {s.sample(x, i) for i in range(200)} == {best}


def test_draws_follow_the_probabilities_chi_square(kernels):
    """20,000 draws (u from draw_seed, a fixed seed) against the exact probabilities: Pearson's chi-square below
    its 0.1% critical value. Deterministic: the same seed gives the same counts on every host."""
    from ternlm.engine.sampling import Sampler, SamplingParams
    g = torch.Generator().manual_seed(7)
    for x, params in ((torch.randn(40, generator=g) * 1.5, SamplingParams(1.0, seed=2026)),
                      (torch.randn(3000, generator=g) * 3, SamplingParams(0.8, top_p=0.9, seed=5)),
                      (torch.randn(5000, generator=g) * 2, SamplingParams(1.2, top_k=30, min_p=0.02, seed=9))):
        s = Sampler(params)
        p = _torch_path(x, params.temperature, params.top_k, params.top_p, params.min_p).numpy()
        n = 20000
        counts = np.bincount([s.sample(x, i) for i in range(n)], minlength=len(x))
        assert counts[p == 0].sum() == 0               # nothing outside the kept set, ever
        # cells with expected count >= 5 (Pearson's rule); the rest pooled into one
        exp = p * n
        big = exp >= 5
        obs_c = np.append(counts[big], counts[~big].sum())
        exp_c = np.append(exp[big], exp[~big].sum())
        keep = exp_c > 0
        chi2 = float(((obs_c[keep] - exp_c[keep]) ** 2 / exp_c[keep]).sum())
        dof = int(keep.sum()) - 1
        crit = dof + 3.09 * math.sqrt(2 * dof) + 4.0      # the 0.1% point, Wilson-Hilferty, generously rounded
        assert chi2 < crit, (chi2, dof, crit)


def test_native_draw_is_the_inverse_cdf_of_the_reference(kernels):
    """The kernel's token for u is the reference's (index-order inverse CDF, float64) but where u lies within
    rounding of a boundary of the CDF."""
    from ternlm.engine.sampling import Sampler, SamplingParams, _reference_draw
    for x in _rows()[:5]:
        for t, k, p, mp in ((1.0, 0, 1.0, 0.0), (0.7, 0, 0.95, 0.0), (1.0, 40, 1.0, 0.05)):
            s = Sampler(SamplingParams(t, k, p, mp, seed=77))
            probs = reference_probs(x.numpy(), t, k, p, mp)
            cum = np.cumsum(probs)
            for i in range(300):
                u = draw_uniform(77, i)
                want = _reference_draw(probs, u)
                got = s.sample(x, i)
                if got != want:
                    assert np.min(np.abs(cum - u)) < 1e-5, (len(x), t, k, p, mp, u, got, want)


def test_draws_are_position_keyed_not_stateful(kernels):
    from ternlm.engine.sampling import Sampler, SamplingParams
    x = _rows()[1]
    a, b = Sampler(SamplingParams(1.0, seed=4)), Sampler(SamplingParams(1.0, seed=4))
    seq = [a.sample(x, i) for i in range(50)]
    assert [b.sample(x, i) for i in reversed(range(50))] == seq[::-1]
    assert len(set(seq)) > 10


def test_the_row_is_left_as_it_came():
    """Bias and penalties are written into the row for the choice and restored (logprobs read it after)."""
    from ternlm.engine.sampling import Sampler, SamplingParams
    x = _rows()[1]
    before = x.clone()
    s = Sampler(SamplingParams(0.9, top_p=0.9, seed=1, logit_bias=((3, 50.0), (9, -100.0)),
                               penalties=Penalties(1.3, 0.5, 0.5)), prompt=[1, 2, 3, 3, 800])
    for i in range(5):
        s.push(s.sample(x, i))
    assert torch.equal(x, before)


# ---- penalties against their definitions -------------------------------------------------------------------

def _penalized(pen: Penalties, prompt: list[int], out: list[int], x: torch.Tensor) -> np.ndarray:
    st = PenaltyState(pen, prompt)
    for t in out:
        st.push(t)
    y = x.numpy().copy()
    st.apply(y)
    return y


def test_repetition_penalty_is_transformers_processor():
    """transformers' RepetitionPenaltyLogitsProcessor over prompt + generated ids (its input_ids), fp32: bit for
    bit."""
    from transformers import RepetitionPenaltyLogitsProcessor
    g = torch.Generator().manual_seed(3)
    for penalty, n_prompt in ((1.3, 60), (0.8, 300), (2.0, 900)):   # > 64 distinct ids: the counts' arrays grow
        x = torch.randn(1000, generator=g) * 5
        prompt = torch.randint(0, 1000, (n_prompt,), generator=g).tolist()
        out = torch.randint(0, 1000, (25,), generator=g).tolist()
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + out]), x.clone()[None])[0]
        got = _penalized(Penalties(repetition=penalty), prompt, out, x)
        assert np.array_equal(got, want.numpy())


def test_frequency_and_presence_are_openais_formula_in_float64():
    """OpenAI's documented rule, mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence over the tokens
    generated so far (not the prompt), in float64: equal up to fp32 rounding."""
    g = torch.Generator().manual_seed(4)
    for fr, pr in ((0.5, 0.0), (0.0, 0.7), (1.2, -0.4), (-2.0, 2.0)):
        x = torch.randn(500, generator=g) * 3
        prompt = torch.randint(0, 500, (40,), generator=g).tolist()
        out = torch.randint(0, 50, (80,), generator=g).tolist()
        c = np.bincount(out, minlength=500).astype(np.float64)
        want = x.numpy().astype(np.float64) - c * fr - (c > 0) * pr
        got = _penalized(Penalties(frequency=fr, presence=pr), prompt, out, x)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
        untouched = c == 0
        assert np.array_equal(got[untouched], x.numpy()[untouched])   # prompt-only tokens too


def test_llama_cpp_window_counts_the_last_n_of_prompt_and_answer():
    """llama.cpp's penalties sampler (repeat_penalty, repeat_last_n, frequency, presence) as its source
    documents it: the last n tokens of prompt + answer; repeat first (<= 0 multiplied, else divided), then
    count * frequency + (count > 0) * presence subtracted. A float64 rendering; -1: every token; 0: off."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, generator=g) * 4
    prompt = torch.randint(0, 300, (100,), generator=g).tolist()
    out = torch.randint(0, 300, (30,), generator=g).tolist()
    for n in (1, 64, 129, 130, 500, -1):
        window = (prompt + out)[-n:] if n > 0 else prompt + out
        c = np.bincount(window, minlength=300).astype(np.float64)
        v = x.numpy().astype(np.float64)
        v = np.where(c > 0, np.where(v <= 0, v * 1.1, v / 1.1), v) - c * 0.3 - (c > 0) * 0.2
        got = _penalized(Penalties(1.1, 0.3, 0.2, last_n=n), prompt, out, x)
        np.testing.assert_allclose(got, v, rtol=1e-6, atol=1e-5)
    assert not Penalties(1.1, 0.3, 0.2, last_n=0).active


def test_greedy_with_penalties_takes_the_penalized_argmax():
    from ternlm.engine.sampling import Sampler, SamplingParams
    x = torch.zeros(10)
    x[4], x[6] = 3.0, 2.9
    s = Sampler(SamplingParams(penalties=Penalties(repetition=1.2)), prompt=[4])
    assert s.sample(x, 0) == 6                        # 3.0 / 1.2 < 2.9
    assert Sampler(SamplingParams(), prompt=[4]).sample(x, 0) == 4


from lesser_isa import LESSER, run_built_for


@LESSER
def test_lesser_isa_builds_sample_the_same_distribution(march, isa, tmp_path):
    """The AVX2 and baseline x86-64 builds (other vector widths: other lane sums) keep the distribution and the
    inverse-CDF draw, as the host's build does."""
    out = run_built_for(march, (
        "import test_sampling as t\n"
        "from ternlm.kernels.build import load\n"
        "k = load()\n"
        "t.test_native_distribution_is_the_torch_paths_for_every_combination(k)\n"
        "t.test_native_draw_is_the_inverse_cdf_of_the_reference(k)\n"
        "t.test_one_token_nucleus_and_top_k_1_always_draw_the_max(k)\n"
        "print(k.isa, 'ok')\n"), tmp_path)
    assert out[-2:] == [isa, "ok"]


def test_without_native_kernels_the_float64_rule_draws(monkeypatch):
    """No C compiler (or TERNLM_NATIVE=0): the sampler draws by reference_probs + the index-order inverse CDF, the
    rule the kernel is tested against above."""
    import ternlm.engine.sampling as sampling
    from ternlm.engine.sampling import Sampler, SamplingParams, _reference_draw
    monkeypatch.setattr(sampling, "_native", lambda: None)
    x = _rows()[1]
    s = Sampler(SamplingParams(0.8, top_p=0.9, seed=12))
    assert s._kernels is None
    probs = reference_probs(x.numpy(), 0.8, 0, 0.9, 0.0)
    assert [s.sample(x, i) for i in range(50)] == [_reference_draw(probs, draw_uniform(12, i)) for i in range(50)]
