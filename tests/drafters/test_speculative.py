"""The draft → verify loop: lossless at temperature 0, unbiased when sampling, caches cropped right, τ bounded."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eaglekit.drafters.eagle3.model import DrafterConfig, Eagle3Drafter
from eaglekit.drafters.eagle3.proposer import EagleProposer
from eaglekit.model.draft_vocab import build_d2t_t2d
from eaglekit.speculative.decode import accept_draft, generate
from eaglekit.speculative.ngram import NgramProposer, ngram_propose

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def drafter(target):
    torch.manual_seed(1)
    cfg = DrafterConfig.from_target_config(target.config, draft_vocab_size=64)
    model = Eagle3Drafter(cfg).eval()
    # a draft vocab that is not the first Vd ids, so d2t has non-zero offsets
    d2t, t2d = build_d2t_t2d(torch.randperm(VOCAB)[:64].sort().values, VOCAB)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    model.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight.data)
    return model


def prompts(n: int, length: int = 10) -> list[list[int]]:
    g = torch.Generator().manual_seed(123)
    out = []
    for _ in range(n):
        p = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        out.append(p + p[:6])  # a repeat, so the n-gram proposer finds matches
    return out


class Oracle:
    """Proposes the known greedy continuation, with the drafts at positions >= ``correct`` made wrong."""

    aux_layer_ids = None

    def __init__(self, reference: list[int], correct: int):
        self.reference, self.correct = reference, correct

    def reset(self, ids, aux):
        self.done = 1

    def propose(self, k, temperature, generator):
        truth = self.reference[self.done : self.done + k]
        return [t if i < self.correct else (t + 1) % VOCAB for i, t in enumerate(truth)], None

    def update(self, new_ids, aux):
        self.done += len(new_ids)


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_speculative_equals_plain_greedy(target, drafter, k):
    for prompt in prompts(4):
        plain = generate(target, prompt, 30)
        for proposer in (EagleProposer(drafter), NgramProposer(1, 3)):
            spec = generate(target, prompt, 30, proposer=proposer, k=k)
            assert spec.tokens == plain.tokens, type(proposer).__name__
            s = spec.stats
            assert 1.0 <= s.tau <= k + 1
            assert s.emitted == len(spec.tokens) - 1  # every token after the prefill's came from a verify pass
            assert all(0 <= a <= d for a, d in zip(s.accepted, s.drafted, strict=False))
            assert s.accepted == sorted(s.accepted, reverse=True)  # a chain: position i needs all before it


def test_all_rejected_drafts_leave_both_caches_consistent(target):
    prompt = prompts(1)[0]
    plain = generate(target, prompt, 25)
    spec = generate(target, prompt, 25, proposer=Oracle(plain.tokens, correct=0), k=4)
    assert spec.tokens == plain.tokens
    assert spec.stats.tau == 1.0 and sum(spec.stats.accepted) == 0
    assert spec.stats.rounds == len(plain.tokens) - 1


@pytest.mark.parametrize("k,correct", [(3, 3), (4, 2), (5, 1)])
def test_tau_counts_exactly_the_accepted_prefix(target, k, correct):
    prompt = prompts(1)[0]
    plain = generate(target, prompt, 40)
    spec = generate(target, prompt, 40, proposer=Oracle(plain.tokens, correct=correct), k=k)
    assert spec.tokens == plain.tokens
    s = spec.stats
    full_rounds = s.drafted[-1]  # rounds that drafted all k (the last one may draft fewer)
    assert full_rounds >= 2
    assert s.accepted[:correct] == s.drafted[:correct]  # right drafts are always accepted
    assert s.accepted[correct:] == [0] * (k - correct)
    assert s.tau == pytest.approx(s.emitted / s.rounds)
    assert s.tau <= correct + 1


def test_drafter_cache_matches_an_uncached_pass(target, drafter):
    """Every round's drafts equal what the drafter predicts from scratch over the whole sequence so far."""
    prompt, k = prompts(1)[0], 3

    class Checked(EagleProposer):
        def propose(self, k, temperature, generator):
            drafts, q = super().propose(k, temperature, generator)
            self.rounds.append((list(self.seq), drafts))
            return drafts, q

        def reset(self, ids, aux):
            super().reset(ids, aux)
            self.rounds, self.seq = [], list(ids)

        def update(self, new_ids, aux):
            self.seq += new_ids
            super().update(new_ids, aux)

    proposer = Checked(drafter)
    generate(target, prompt, 30, proposer=proposer, k=k)
    assert len(proposer.rounds) >= 5
    with torch.no_grad():
        for seq, drafts in proposer.rounds:
            hs = target(torch.tensor([seq]), output_hidden_states=True).hidden_states
            aux = torch.cat([hs[i] for i in proposer.aux_layer_ids], -1)[:, :-1]
            ids, hidden = torch.tensor([seq[1:]]), drafter.fuse(aux)
            expected = []
            for _ in drafts:  # uncached: re-run the whole chain each step
                logits, out = drafter(ids, hidden, torch.arange(ids.shape[1])[None])
                token = int(drafter.draft_to_target(logits[0, -1].argmax()))
                expected.append(token)
                ids = torch.cat([ids, torch.tensor([[token]])], 1)
                hidden = torch.cat([hidden, out[:, -1:]], 1)
            assert drafts == expected


def test_stop_token_ends_generation_and_is_kept(target):
    prompt = prompts(1)[0]
    plain = generate(target, prompt, 30)
    stop = plain.tokens[7]
    first = plain.tokens.index(stop)
    for proposer in (None, Oracle(plain.tokens, correct=4)):
        out = generate(target, prompt, 30, proposer=proposer, k=4, stop_ids={stop})
        assert out.tokens == plain.tokens[: first + 1]


def test_max_new_tokens_is_never_exceeded(target, drafter):
    prompt = prompts(1)[0]
    for n in (1, 2, 5, 9):
        plain = generate(target, prompt, n)
        spec = generate(target, prompt, n, proposer=EagleProposer(drafter), k=7)
        assert spec.tokens == plain.tokens and len(spec.tokens) == n


def test_engine_accounting_counts_like_vllms_scheduler(target):
    """Always K drafts, accepted counted before the length limit or the stop token cut the output
    (vLLM: num_accepted = len(sampled) - 1 per verify pass); the tokens emitted are unchanged."""
    prompt = prompts(1)[0]
    plain = generate(target, prompt, 40)
    # passes of 4 right drafts emit tokens 1-5, 6-10, ...: end both runs inside a pass, not on its bonus token
    stop = next(t for i, t in enumerate(plain.tokens) if i % 5 and plain.tokens.index(t) == i)
    for limit, stop_ids in ((13, set()), (40, {stop})):
        reference = generate(target, prompt, limit, stop_ids=stop_ids)
        mine = generate(target, prompt, limit, proposer=Oracle(plain.tokens, correct=4), k=4, stop_ids=stop_ids)
        engine = generate(
            target,
            prompt,
            limit,
            proposer=Oracle(plain.tokens, correct=4),
            k=4,
            stop_ids=stop_ids,
            engine_accounting=True,
        )
        assert engine.tokens == mine.tokens == reference.tokens
        # every pass drafted 4 (rounds = 1 + 4 accepted + bonus per pass until the end) and accepted all 4
        assert engine.stats.drafted == [engine.stats.rounds] * 4
        assert engine.accepted_per_round == [4] * engine.stats.rounds
        assert sum(engine.stats.accepted) > sum(mine.stats.accepted)  # the last pass ran past the end
        assert mine.accepted_per_round[-1] < 4


@pytest.mark.parametrize("point_mass", [False, True])
def test_speculative_sampling_is_unbiased(point_mass):
    """The emitted token (the draft if accepted, else the residual sample) is distributed as p, whatever q is."""
    g = torch.Generator().manual_seed(7)
    vocab, trials = 6, 20000
    p = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    counts = torch.zeros(vocab)
    for _ in range(trials):
        if point_mass:  # a deterministic proposer (n-gram, greedy EAGLE): q is one-hot on the draft
            draft, dist = 2, None
        else:
            draft, dist = int(torch.multinomial(q, 1, generator=g)), q
        accepted, resampled = accept_draft(p, draft, dist, g)
        counts[draft if accepted else resampled] += 1
    freq = counts / trials
    assert torch.allclose(freq, p, atol=0.015), (freq, p)


def test_sampling_runs_with_sampled_drafts(target, drafter):
    g = torch.Generator().manual_seed(0)
    for k in (1, 3):
        for proposer in (EagleProposer(drafter, sample_drafts=True), EagleProposer(drafter), NgramProposer(1, 2)):
            out = generate(target, prompts(1)[0], 20, proposer=proposer, k=k, temperature=0.8, generator=g)
            assert len(out.tokens) == 20 and 1 <= out.stats.tau <= k + 1


def test_sampling_is_reproducible_from_the_seed(target, drafter):
    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return generate(
            target,
            prompts(1)[0],
            20,
            proposer=EagleProposer(drafter, sample_drafts=True),
            k=3,
            temperature=1.0,
            generator=g,
        ).tokens

    assert run(3) == run(3)


def test_ngram_matches_vllm_rule():
    # vLLM's docstring example: [4,2,3] has no earlier match, [2,3] has; what followed it is proposed
    assert ngram_propose([1, 2, 3, 4, 2, 3], k=4, n_min=2, n_max=3) == [4, 2, 3]
    # the longest matching suffix wins over a shorter one that occurs earlier
    assert ngram_propose([1, 9, 2, 8, 9, 3, 5, 8, 9], k=2, n_min=1, n_max=3) == [3, 5]
    # among equally long matches the earliest one
    assert ngram_propose([1, 5, 1, 6, 1], k=1, n_min=1, n_max=1) == [5]
    assert ngram_propose([1, 2, 3], k=3, n_min=1, n_max=3) == []  # no earlier occurrence
    assert ngram_propose([4, 4, 4, 4], k=3, n_min=1, n_max=2) == [4, 4]  # overlapping matches count
    assert ngram_propose([9], k=3, n_min=1, n_max=4) == []


class SelfDrafter:
    """Drafts from the target itself — its argmax (a point mass), or a sample from a flatter copy of its
    distribution (returned as q) — and records for each round's first draft the acceptance probability the theory
    gives: p(d) for a point mass, Σ_x min(p(x), q(x)) = E_{d~q}[min(1, p(d)/q(d))] for a sampled draft."""

    aux_layer_ids = None

    def __init__(self, model, sample: bool):
        self.model, self.sample = model, sample
        self.expected: list[float] = []

    def reset(self, ids, aux):
        self.ids = list(ids)

    @torch.no_grad()
    def propose(self, k, temperature, generator):
        ids, drafts, qs = list(self.ids), [], []
        for i in range(k):
            logits = self.model(torch.tensor([ids])).logits[0, -1].float()
            p = torch.softmax(logits / temperature, -1) if temperature > 0 else None
            if self.sample and temperature > 0:
                q = torch.softmax(logits / (2 * temperature), -1)
                draft = int(torch.multinomial(q, 1, generator=generator))
            else:
                q, draft = None, int(logits.argmax())
            if i == 0 and p is not None:
                self.expected.append(float(torch.minimum(p, q).sum()) if q is not None else float(p[draft]))
            drafts.append(draft)
            qs.append(q)
            ids.append(draft)
        return drafts, (torch.stack(qs) if qs[0] is not None else None)

    def update(self, new_ids, aux):
        self.ids += list(new_ids)


@pytest.fixture(scope="module")
def entropic_target(target):
    """The random target with its output layer scaled so that its next-token distributions have real entropy:
    neither uniform (the raw random model) nor one-hot (the tiny target, on its own replies, is almost greedy)."""
    torch.manual_seed(0)
    sharper = LlamaForCausalLM(target.config).eval()
    sharper.load_state_dict(target.state_dict())
    with torch.no_grad():
        sharper.lm_head.weight.mul_(30.0)
    return sharper


@pytest.mark.slow
@pytest.mark.parametrize("sample", [False, True], ids=["point-mass drafts", "sampled drafts"])
def test_sampling_acceptance_differs_from_greedy_and_matches_theory(entropic_target, sample):
    k, rounds_by_t = 3, {}
    for temperature in (0.0, 1.0):
        total, proposer = None, SelfDrafter(entropic_target, sample)
        for i, prompt in enumerate(prompts(16)):
            g = torch.Generator().manual_seed(i)
            out = generate(entropic_target, prompt, 40, proposer=proposer, k=k, temperature=temperature, generator=g)
            total = out.stats if total is None else total + out.stats
        rounds_by_t[temperature] = (total, proposer.expected)

    greedy, _ = rounds_by_t[0.0]
    sampled, expected = rounds_by_t[1.0]
    top = sum(expected) / len(expected)
    assert 0.2 < top < 0.9, f"the target must have real entropy (mean acceptance probability {top:.2f})"
    # At T=0 the target's own argmax is always accepted; at T=1 it is accepted with probability p(d) (or min(1, p/q)).
    assert greedy.acceptance_by_position() == [1.0] * k
    measured = sampled.accepted[0] / sampled.drafted[0]
    assert len(expected) == sampled.drafted[0]
    sigma = (sum(e * (1 - e) for e in expected) ** 0.5) / len(expected)
    print(
        f"T=1 first-draft acceptance: measured {measured:.3f}, theory {top:.3f} ± {sigma:.3f}; tau T=0 {greedy.tau:.2f}, T=1 {sampled.tau:.2f}"
    )
    assert abs(measured - top) < 4 * sigma + 0.01, (measured, top, sigma)
    assert sampled.tau < greedy.tau - 0.5
