"""The step's logits rules (engine/rules_builder.py -> sampling/logits_rules.py) against the plain
PyTorch reference of vLLM's rules (tests/logits_refs.py), over steps driven as the engine drives
them: penalties' counts kept on the device, rows whose last token is still in flight (overlap
scheduling: bad words then match on the device), rows reordered, a released slot reused."""

from __future__ import annotations

import pytest
import torch

from checkpoints import make_sequence
from logits_refs import reference_row
from nanovllm import SamplingParams
from nanovllm.engine.request_rules import RequestRules
from nanovllm.engine.rules_builder import RulesBuilder
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling.logits_rules import HostRules

VOCAB = 50
EOS = {0}
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]
# float32 rules against the float64 reference of the same (float32-representable) logits
ATOL = 1e-5

MIXED = [
    SamplingParams(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=-0.4),
    SamplingParams(temperature=0),  # no rule: a row that pays nothing
    SamplingParams(logit_bias={3: 2.5, 7: -1.0}, min_tokens=3, stop_token_ids=[9]),
    SamplingParams(allowed_token_ids=[1, 2, 3, 5, 8, 13], repetition_penalty=0.8),
    SamplingParams(presence_penalty=1.5),
]
# Every row penalized and none biased: the logits are copied and penalized in one pass, masks after
ALL_PENALIZED = [
    MIXED[0],
    SamplingParams(temperature=0, repetition_penalty=1.2),
    SamplingParams(min_tokens=3, stop_token_ids=[9], frequency_penalty=0.3),
    MIXED[3],
    MIXED[4],
]
# Bad words as token sequences, by sequence (what RequestRules.of tokenizes words into)
BAD = {2: [[4], [5, 6], [6, 7, 8]], 4: [[10, 11], [12]]}
# Tokens forced at (step, sequence): bad-word prefixes, generated both with the host knowing them
# (steps 0-1 run without overlap) and with the last one in flight (steps 2 on)
FORCED = {(0, 4): 10, (2, 2): 5, (3, 2): 6, (4, 2): 7, (5, 4): 10}
OVERLAP_FROM = 2
STEPS = 8


def rules_of(params: SamplingParams, i: int) -> RequestRules | None:
    bad = BAD.get(i, [])
    rules = RequestRules.of(params, frozenset(EOS), None, VOCAB)
    if not bad:
        return rules
    base = rules or RequestRules(None, (), None, (), (), 0, tuple(sorted(EOS | set(params.stop_token_ids))))
    return RequestRules(base.penalties, base.bias, base.allowed, tuple(s[0] for s in bad if len(s) == 1),
                        tuple(tuple(s) for s in bad if len(s) > 1), base.min_tokens, base.stop_ids)


def check_rows(out: torch.Tensor, logits: torch.Tensor, seqs: list[Sequence], prompts, generated) -> None:
    for r, seq in enumerate(seqs):
        i = seq.seq_id
        want = reference_row(logits[r].cpu(), prompts[i], generated[i], seq.params, EOS, BAD.get(i, []))
        got = out[r].cpu().double()
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got)), (i, (~finite).nonzero().flatten(), (~torch.isfinite(got)).nonzero())
        torch.testing.assert_close(got[finite], want[finite], rtol=ATOL, atol=ATOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("params", [MIXED, ALL_PENALIZED], ids=["mixed", "all_penalized"])
def test_rules_over_steps_match_the_reference(device, dtype, params):
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (7, 3, 5, 9, 4)]
    seqs = [make_sequence(i, p, sp, rules=rules_of(sp, i)) for i, (p, sp) in enumerate(zip(prompts, params))]
    builder = RulesBuilder(VOCAB, dev)
    builder.admit(seqs)
    generated: list[list[int]] = [[] for _ in seqs]  # the truth: every sampled token, as the device has them
    previous: tuple[list[Sequence], torch.Tensor] | None = None  # last step's rows and samples, not on the host yet
    reorders = [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4, 1, 3]]
    conditional_steps = 0
    for step in range(STEPS):
        batch = [seqs[i] for i in reorders[step % len(reorders)]]
        overlap = step >= OVERLAP_FROM
        if previous is not None and not overlap:  # the host has the last step's tokens before planning
            _append(*previous)
            previous = None
        carried = [previous[0].index(s) for s in batch] if previous is not None else []
        positions = [len(s) + (1 if carried else 0) for s in batch]
        host = builder.build(batch, positions, carried)
        conditional_steps += bool(host.cond_rows)
        rules = host.to_device(dev, builder.counts, previous[1] if previous is not None else None)
        logits = (3 * torch.randn(len(batch), VOCAB, generator=g)).to(dtype).to(dev)
        check_rows(rules.apply(logits), logits, batch, prompts, generated)
        tokens = torch.randint(1, VOCAB, (len(batch),), generator=g)
        for (at, i), token in FORCED.items():
            if at == step:
                tokens[batch.index(seqs[i])] = token
        rules.record(tokens.to(dev))
        if previous is not None:  # postprocess of the step before, once this one is queued
            _append(*previous)
        for s, t in zip(batch, tokens.tolist()):
            generated[s.seq_id].append(t)
        previous = (batch, tokens.to(dev))
    assert conditional_steps >= 2  # bad words matched on the device

    # a released slot serves the next penalized sequence with fresh counts
    _append(*previous)
    old_slot = seqs[0].counts_slot
    builder.release([seqs[0]])
    fresh = make_sequence(0, [1, 2, 2], params[0], rules=rules_of(params[0], 0))
    builder.admit([fresh])
    prompts[0], generated[0] = [1, 2, 2], []
    host = builder.build([fresh], [3], [])
    assert fresh.counts_slot == old_slot
    logits = (3 * torch.randn(1, VOCAB, generator=g)).to(dtype).to(dev)
    check_rows(host.to_device(dev, builder.counts, None).apply(logits), logits, [fresh], prompts, generated)


def _append(seqs: list[Sequence], tokens: torch.Tensor) -> None:
    for s, t in zip(seqs, tokens.tolist()):
        s.token_ids.append(t)


def test_rows_without_rules_build_nothing():
    builder = RulesBuilder(VOCAB, torch.device("cpu"))
    plain = [make_sequence(i, [1, 2, 3], SamplingParams(temperature=0.5, top_p=0.9)) for i in range(3)]
    builder.admit(plain)
    assert builder.build(plain, [3, 3, 3], []) is None  # no live sequence has rules: rows not even read
    ruled = make_sequence(3, [1, 2, 3], MIXED[2], rules=rules_of(MIXED[2], 2))
    builder.admit([ruled])
    assert builder.build(plain, [3, 3, 3], []) is None  # one has, but not in this step
    host = builder.build(plain + [ruled], [3, 3, 3, 3], [])
    assert (host.ban_rows, sorted(host.ban_tokens)) == ([3] * 3, [0, 4, 9])  # bad word 4; min_tokens: EOS, 9
    builder.release(plain + [ruled])
    assert builder.build(plain + [ruled], [3, 3, 3, 3], []) is None  # released: nothing live


def test_a_penalized_row_first_seen_in_flight_is_refused():
    seq = make_sequence(0, [1, 2], MIXED[0], rules=rules_of(MIXED[0], 0))
    builder = RulesBuilder(VOCAB, torch.device("cpu"))
    builder.admit([seq])
    with pytest.raises(RuntimeError, match="in flight"):
        builder.build([seq], [3], [0])


@pytest.mark.parametrize("device", DEVICES)
def test_steps_with_integer_parts_only(device):
    """A step whose only rules are bans (min_tokens, one-token bad words) or allowed ids packs no
    floats: its rules still reach the device."""
    dev = torch.device(device)
    seqs = [make_sequence(0, [1, 2], SamplingParams(min_tokens=2)), make_sequence(1, [3], SamplingParams(allowed_token_ids=[4, 5]))]
    for i, seq in enumerate(seqs):
        seq.rules = RequestRules.of(seq.params, frozenset(EOS), None, VOCAB)
    builder = RulesBuilder(VOCAB, dev)
    builder.admit(seqs)
    logits = torch.randn(2, VOCAB)
    out = builder.upload(builder.build(seqs, [2, 1], []), None).apply(logits.to(dev)).cpu()
    assert out[0, 0] == -torch.inf and torch.equal(out[0, 1:], logits[0, 1:])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [4, 5]


@pytest.mark.parametrize("device", DEVICES)
def test_bans_hold_over_logits_a_rule_made_infinite(device):
    """A banned logit is -inf whatever it was: adding -inf to a logit a penalty had made +inf gave NaN,
    which the sampler then picked (the banned token generated). Pairs may repeat; a conditional pair
    listed twice is banned when either entry's condition holds."""
    dev = torch.device(device)
    logits = torch.randn(3, VOCAB)
    logits[0, 4] = logits[1, 6] = logits[2, 6] = torch.inf
    host = HostRules(ban_rows=[0, 0], ban_tokens=[4, 4],
                     cond_rows=[1, 1, 2], cond_tokens=[6, 6, 6], cond_sources=[0, 1, 2], cond_required=[9, 5, 7])
    previous = torch.tensor([1, 5, 3], device=dev)  # row 1's second entry holds, row 2's does not
    out = host.to_device(dev, None, previous).apply(logits.to(dev)).cpu()
    assert out[0, 4] == out[1, 6] == -torch.inf and out[2, 6] == torch.inf
    assert not out.isnan().any()
    untouched = torch.ones_like(out, dtype=torch.bool)
    untouched[0, 4] = untouched[1, 6] = False
    assert torch.equal(out[untouched], logits[untouched])
