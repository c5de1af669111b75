"""The recipe levers around the loss: hidden-state noise, TTT step weights, Muon, and a real run with all of them."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from pydantic import ValidationError
from test_extract import prepared_run
from test_train import QUICK, metrics, train
from test_train_ddp import batch, drafter

from eaglekit.config import TrainConfig, TTTConfig
from eaglekit.drafters.eagle3.objective import TTT, feature_noise
from eaglekit.errors import UsageError
from eaglekit.training.optim import Together, build_optimizer, is_muon_weight


def test_noise_is_added_in_training_only():
    inputs = batch()
    clean = TTT(drafter(), TTTConfig(steps=3, decay=0.8))
    noisy = TTT(drafter(), TTTConfig(steps=3, decay=0.8, noise="uniform", noise_scale=0.5))
    clean.eval()
    noisy.eval()
    assert torch.equal(noisy(*inputs)[0], clean(*inputs)[0])  # held-out figures see clean features
    noisy.train()
    clean.train()
    torch.manual_seed(3)
    a = noisy(*inputs)[0]
    torch.manual_seed(3)
    assert torch.equal(noisy(*inputs)[0], a)  # the noise comes from the seeded global RNG
    assert not torch.allclose(a, clean(*inputs)[0])


@pytest.mark.parametrize("kind", ["uniform", "gaussian"])
def test_noise_has_the_configured_scale(kind):
    torch.manual_seed(0)
    aux = torch.zeros(200_000, dtype=torch.float64)
    noise = feature_noise(aux, kind, 0.05)
    assert abs(noise.mean().item()) < 1e-3
    if kind == "uniform":
        assert noise.abs().max().item() <= 0.05
        assert noise.std().item() == pytest.approx(0.05 / math.sqrt(3), rel=0.02)
    else:
        assert noise.std().item() == pytest.approx(0.05, rel=0.02)


def test_step_weights_replace_the_decay():
    inputs = batch()
    decayed = TTT(drafter(), TTTConfig(steps=3, decay=0.8))(*inputs)[0]
    explicit = TTT(drafter(), TTTConfig(steps=3, decay=0.5, step_weights=[1.0, 0.8, 0.64]))(*inputs)[0]
    equal = TTT(drafter(), TTTConfig(steps=3, decay=0.8, step_weights=[1.0, 1.0, 1.0]))
    torch.testing.assert_close(explicit, decayed)
    out = equal(*inputs)[1]
    torch.testing.assert_close(equal(*inputs)[0].item(), sum(out.loss_k))
    with pytest.raises(ValidationError, match="step_weights has 2 weights for steps 3"):
        TTTConfig(steps=3, step_weights=[1.0, 1.0])


def grads_for(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def test_muon_takes_the_2d_weights_and_steps_like_torch_muon():
    tc = TrainConfig(optimizer="muon", lr=1e-2)
    model = drafter()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optim = build_optimizer(tc, named)
    assert isinstance(optim, Together)
    muon_names = {n for n, p in named if is_muon_weight(n, p)}
    assert "fc.weight" in muon_names and "midlayer.self_attn.q_proj.weight" in muon_names
    assert not any("lm_head" in n or "embed_tokens" in n or "norm" in n for n in muon_names)

    # the same step as torch.optim.Muon alone on a copy of the 2-D weights
    reference = drafter()
    ref_params = [p for n, p in reference.named_parameters() if n in muon_names]
    ref = torch.optim.Muon(ref_params, lr=1e-2, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    for step in range(2):
        grads_for(model, step)
        grads_for(reference, step)
        optim.step()
        ref.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if name in muon_names:
            torch.testing.assert_close(p, q, rtol=0, atol=0)

    # a resumed optimizer takes the next step the uninterrupted one does
    resumed_model = drafter()
    resumed_model.load_state_dict(model.state_dict())
    resumed = build_optimizer(tc, [(n, p) for n, p in resumed_model.named_parameters() if p.requires_grad])
    resumed.load_state_dict(copy.deepcopy(optim.state_dict()))  # as through torch.save: no shared buffers
    grads_for(model, 9)
    grads_for(resumed_model, 9)
    optim.step()
    resumed.step()
    assert all(a is b for a, b in zip(resumed.param_groups, resumed.parts[0].param_groups, strict=False))
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)

    adamw = build_optimizer(TrainConfig(), named)
    with pytest.raises(UsageError, match="not this run's train.optimizer"):
        resumed.load_state_dict(adamw.state_dict())


def test_a_run_with_every_lever_trains(tmp_path, tiny_target):
    ttt = {"steps": 3, "loss": "lk_hybrid", "noise": "uniform", "noise_scale": 0.05, "step_weights": [1.0, 1.0, 1.0]}
    levers = {"optimizer": "muon", "ttt": ttt}
    cfg = prepared_run(
        tmp_path, tiny_target, n=24, train={**QUICK, "max_steps": 8, "eval_every": 4, "log_every": 1, **levers}
    )
    row = train(cfg)
    assert row["counts"]["steps"] == 8
    losses = [r["loss"] for r in metrics(cfg) if r["kind"] == "train"]
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0]


def test_tau_watch_warns_then_stops_on_falling_tau_under_falling_loss():
    from eaglekit.training.early_stop import WARN_AFTER, TauWatch

    # τ rises with the loss falling, then falls three times while the loss still falls
    evals = [(3.0, 2.0), (3.2, 1.8), (3.1, 1.7), (3.0, 1.6), (2.9, 1.5), (2.8, 1.4)]
    watch = TauWatch(patience=3)
    decisions = [watch.update(tau, loss) for tau, loss in evals]
    assert [stop for _, stop in decisions] == [False, False, False, False, True, True]
    assert "stopping" in (decisions[4][0] or "")

    warn_only = TauWatch(patience=None)
    decisions = [warn_only.update(tau, loss) for tau, loss in evals]
    assert not any(stop for _, stop in decisions)
    warnings = [message for message, _ in decisions if message]
    assert len(warnings) == 1 and "early_stop_patience" in warnings[0] and WARN_AFTER == 3

    # τ falling because the loss rose too (a bad stretch, not overfitting) never counts
    diverging = TauWatch(patience=1)
    assert [diverging.update(t, loss)[1] for t, loss in [(3.0, 1.0), (2.9, 1.1), (2.8, 1.2)]] == [False] * 3


def test_sequence_normalization_is_the_mean_of_each_sequences_mean():
    # rows of different lengths (rows 2 and 3 are padded): per token the long rows weigh more, per sequence not
    aux, ids, logits, loss_mask, attention, _ = batch()
    model = TTT(drafter(), TTTConfig(steps=3, decay=0.8, loss_normalization="sequence"))
    together = model(aux, ids, logits, loss_mask, attention, None)[0]
    alone = [
        TTT(drafter(), TTTConfig(steps=3, decay=0.8))(aux[i : i + 1], ids[i : i + 1], logits[i : i + 1], loss_mask[i : i + 1],
                                           attention[i : i + 1], None)[0]
        for i in range(4)
    ]  # fmt: skip
    torch.testing.assert_close(together, torch.stack(alone).mean())
    per_token = TTT(drafter(), TTTConfig(steps=3, decay=0.8))(aux, ids, logits, loss_mask, attention, None)[0]
    assert not torch.allclose(per_token, together)


def sequence_halves_worker(rank: int, world: int, port: int, out: str) -> None:
    from test_train_ddp import end_ranks, torchrun_env, unequal_batch

    from eaglekit.training import distributed as dist
    from eaglekit.training.data import rank_share
    from eaglekit.training.distributed import wrap

    torch.set_num_threads(1)
    torchrun_env(rank, world, port)
    dist.init()
    model = wrap(
        TTT(drafter(), TTTConfig(steps=3, decay=0.8, loss_normalization="sequence")), "ddp", torch.device("cpu")
    )
    rows = rank_share(list(range(4)), dist.rank(), dist.world_size())
    loss, _ = model(*[t[rows] if t is not None else None for t in unequal_batch()])
    loss.backward()
    grads = {
        n.removeprefix("module.drafter."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }
    torch.save({"loss": loss.detach(), "grads": grads}, f"{out}/rank{rank}.pt")
    del model
    end_ranks()


def test_sequence_normalization_under_ddp_equals_one_process(tmp_path):
    # the ranks hold sequences of very different lengths; each sequence still weighs the same in the total
    import torch.multiprocessing as mp
    from test_train_ddp import free_port, unequal_batch

    mp.spawn(sequence_halves_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    single = TTT(drafter(), TTTConfig(steps=3, decay=0.8, loss_normalization="sequence"))
    loss, _ = single(*unequal_batch())
    loss.backward()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    torch.testing.assert_close((ranks[0]["loss"] + ranks[1]["loss"]) / 2, loss.detach(), rtol=1e-10, atol=1e-12)
    for name, p in single.named_parameters():
        if p.grad is not None:
            for r in ranks:
                torch.testing.assert_close(r["grads"][name.removeprefix("drafter.")], p.grad, rtol=1e-9, atol=1e-12)


def test_a_fresh_llama_drafter_has_the_eagle31_flags_unless_set(tiny_target):
    """The race picked EAGLE 3.1's fc_norm and norm_output for the default Llama drafter; a setting given is kept,
    norm_before_fc (exclusive with fc_norm) keeps fc_norm off, and the MLA drafter (not raced) keeps both off."""
    from eaglekit.config import parse_config
    from eaglekit.drafters.registry import fresh_drafter_config

    def built(**draft):
        cfg = parse_config(
            {
                "run_dir": "/tmp/unused",
                "target": {"model": str(tiny_target)},
                "data": {"prompts": "p.jsonl"},
                "vocab": {"draft_vocab_size": 200},
                "train": {"draft": draft},
            }
        )
        c = fresh_drafter_config(cfg)
        return c.fc_norm, c.norm_output, c.norm_before_fc

    assert built() == (True, True, False)
    assert built(fc_norm=False, norm_output=False) == (False, False, False)
    assert built(norm_before_fc=True) == (False, True, True)
    assert built(architecture="mla")[:2] == (False, False)
