"""examples/deepseek_mla.py: a DeepSeek-V2/V3-style decoder whose attention
runs locally in the plain form (c_kv up-projected to every head's K and V)
and on a real CPU MLA server in the absorbed form (q_nope @ W_UK, the output
latent @ W_UV), through attnserve.flashinfer's MLA wrapper (gRPC and a
request channel), KvManager and ping-pong micro-batches; logits
agree within bf16 tolerance at every step (prefill and decode) and the
greedy tokens are identical. The absorbed form itself is checked against the
plain one in float64 without a server, and the rope part of the latent is
shown to matter."""

import json

import pytest
import torch

import attnserve
import decoder
import deepseek_mla
from server import TestServer

STEPS = 8
CFG = deepseek_mla.PRESETS["small"]["config"]


@pytest.fixture(scope="module")
def server():
    with TestServer(attention="mla", num_layers=CFG.layers, num_qo_heads=CFG.qo_heads,
                    kv_lora_rank=CFG.kv_lora_rank, qk_rope_head_dim=CFG.qk_rope_head_dim,
                    extra_flags=["--allow_shared_memory"]) as s:
        yield s


class LatentLocal(decoder.LocalAttention):
    """Local attention in the absorbed form: the latent rows are the keys and
    their first kv_lora_rank values the values."""

    def attention(self, layer, q, k, v):
        assert v is None and k.shape[1] == 1
        return super().attention(layer, q, k, k[..., :CFG.kv_lora_rank])


def _prompts(n=3, seed=4):
    return decoder.random_prompts(CFG.vocab, n, *deepseek_mla.PRESETS["small"]["prompt_len"],
                                  seed=seed)


def test_absorbed_form_is_the_plain_form():
    """In float64 (no bf16 rounding on the wire) the absorbed attention gives
    the plain form's logits to float32 precision."""
    model = deepseek_mla.Model(CFG, seed=3)
    wire = torch.float64
    plain = decoder.generate(model, decoder.LocalAttention(CFG, "cpu", wire,
                                                           model.attention_probs),
                             _prompts(), 5, wire, "plain")
    absorbed = decoder.generate(model.absorbed_view(),
                                LatentLocal(CFG, "cpu", wire, model.attention_probs), _prompts(),
                                5, wire, "absorbed", follow=plain.tokens)
    c = decoder.compare_runs(absorbed, plain, 1e-5)
    assert c["ok"] and c["tokens_identical"], c


def test_server_matches_local(server, tmp_path):
    out = tmp_path / "report.json"
    code = deepseek_mla.main(["--target", server.address, "--steps", str(STEPS), "--json",
                              str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["runs"]] == ["local", "server", "kvmanager", "pingpong"]
    assert len(report["comparisons"]) == 3
    for c in report["comparisons"].values():
        assert c["ok"] and c["tokens_identical"] and c["max_logits_rel_error"] < 2e-2, c
        assert c["tokens_compared"] == report["batch"] * (STEPS + 1)


def test_flashinfer_wrapper_over_a_channel(server, tmp_path):
    out = tmp_path / "report.json"
    code = deepseek_mla.main(["--target", server.address, "--steps", "4", "--attention",
                              "local,server", "--transport", "channel", "--json", str(out)])
    assert code == 0
    c = json.loads(out.read_text())["comparisons"]["server_vs_local"]
    assert c["ok"] and c["tokens_identical"], c


def test_without_server_plans(server):
    model = deepseek_mla.Model(CFG, seed=5)
    wire = torch.bfloat16
    prompts = _prompts(seed=6)
    local = decoder.generate(model, decoder.LocalAttention(CFG, "cpu", wire,
                                                           model.attention_probs),
                             prompts, 4, wire, "local")
    with attnserve.Client(server.address, timeout=120) as client:
        remote = decoder.generate(model.absorbed_view(),
                                  decoder.ServerAttention(client, False, model), prompts, 4,
                                  wire, "server", follow=local.tokens)
    c = decoder.compare_runs(remote, local, 2e-2)
    assert c["ok"] and c["tokens_identical"], c


def test_the_geometry_is_checked(server):
    other = deepseek_mla.PRESETS["v3"]["config"]
    with attnserve.Client(server.address, timeout=60) as client:
        with pytest.raises(decoder.GeometryMismatch, match="kv_lora_rank: server 64, model 512"):
            deepseek_mla.check_geometry(other, client.server_info, "bf16")


def _logits(model):
    wire = torch.bfloat16
    return decoder.generate(model, decoder.LocalAttention(CFG, "cpu", wire,
                                                          model.attention_probs),
                            _prompts(2, 8), 1, wire, "local").logits[0]


def test_the_rope_key_and_the_scale_matter():
    """Without k_pe's rope part, or with the server's default scale
    1/sqrt(kv_lora_rank + qk_rope_head_dim) instead of the model's, the logits
    move well past the comparisons' tolerance: identical tokens are not luck."""
    base_model = deepseek_mla.Model(CFG, seed=7)
    base = _logits(base_model)
    no_rope = deepseek_mla.Model(CFG, seed=7)
    for p in no_rope.layers:
        p["kv_a"][:, CFG.kv_lora_rank:] = 0.0          # k_pe = 0
    moved = float((_logits(no_rope) - base).norm() / base.norm())
    assert moved > 5e-2, moved
    wrong_scale = deepseek_mla.Model(CFG, seed=7)
    wrong_scale.softmax_scale = 1.0 / (CFG.kv_lora_rank + CFG.qk_rope_head_dim) ** 0.5
    moved = float((_logits(wrong_scale) - base).norm() / base.norm())
    assert moved > 5e-2, moved
