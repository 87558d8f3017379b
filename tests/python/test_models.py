"""examples/gpt_oss.py and examples/gemma2.py: each decoder with its attention
local (PyTorch, from the model's published definition), on a real CPU server
(attnserve.AttentionOptions per layer through KvManager's plans and, without
them, per Prefill) and in ping-pong micro-batches; logits agree within bf16
tolerance at every step and the greedy tokens are identical. The variants
matter: without its window, sinks or soft-cap a model's logits move."""

import dataclasses
import json

import pytest
import torch

import attnserve
import decoder
import gemma2
import gpt_oss

STEPS = 8
MODELS = {"gpt_oss": gpt_oss, "gemma2": gemma2}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_server_matches_local(server, name, tmp_path):
    module = MODELS[name]
    out = tmp_path / "report.json"
    code = module.main(["--target", server.address, "--steps", str(STEPS), "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["runs"]] == ["local", "server", "pingpong"]
    for c in report["comparisons"].values():
        assert c["ok"] and c["tokens_identical"] and c["max_logits_rel_error"] < 2e-2, c
        assert c["tokens_compared"] == report["batch"] * (STEPS + 1)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_layouts_without_server_plans_carry_the_options(server, name):
    """KvManager without server plans sends each layer's options with its Prefill."""
    module = MODELS[name]
    preset = module.PRESETS["small"]
    cfg = preset["config"]
    model = module.Model(cfg, seed=5)
    prompts = decoder.random_prompts(cfg.vocab, 3, *preset["prompt_len"], seed=6)
    wire = torch.bfloat16
    local = decoder.generate(model, decoder.LocalAttention(cfg, "cpu", wire,
                                                           model.attention_probs),
                             prompts, 4, wire, "local")
    with attnserve.Client(server.address, timeout=120) as client:
        remote = decoder.generate(model, decoder.ServerAttention(client, False, model), prompts,
                                  4, wire, "server", follow=local.tokens)
    c = decoder.compare_runs(remote, local, 2e-2)
    assert c["ok"] and c["tokens_identical"], c


def _local_logits(module, cfg, model=None):
    model = model or module.Model(cfg, seed=7)
    prompts = decoder.random_prompts(cfg.vocab, 2, *module.PRESETS["small"]["prompt_len"],
                                     seed=8)
    wire = torch.bfloat16
    run = decoder.generate(model, decoder.LocalAttention(cfg, "cpu", wire,
                                                         model.attention_probs),
                           prompts, 1, wire, "local")
    return run.logits[0]


def _moved(a, b):
    return float((a - b).norm() / b.norm())


def test_the_variants_matter():
    """Each model's window, sinks and soft-cap change its logits well past the
    tolerance the comparisons use, so identical tokens are not luck."""
    cfg = gpt_oss.PRESETS["small"]["config"]
    base = _local_logits(gpt_oss, cfg)
    no_window = dataclasses.replace(cfg, sliding_window=10**6)
    assert _moved(_local_logits(gpt_oss, no_window), base) > 5e-2
    no_sinks = gpt_oss.Model(cfg, seed=7)
    for p in no_sinks.layers:
        p["sinks"] = torch.full_like(p["sinks"], float("-inf"))
    assert _moved(_local_logits(gpt_oss, cfg, no_sinks), base) > 5e-2

    cfg = gemma2.PRESETS["small"]["config"]
    base = _local_logits(gemma2, cfg)
    assert _moved(_local_logits(gemma2, dataclasses.replace(cfg, sliding_window=10**6)),
                  base) > 5e-2
    assert _moved(_local_logits(gemma2, dataclasses.replace(cfg, attn_logit_softcapping=1e6)),
                  base) > 5e-2
    assert _moved(_local_logits(gemma2, dataclasses.replace(cfg, query_pre_attn_scalar=64.0)),
                  base) > 5e-2
